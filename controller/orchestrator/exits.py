"""Ended processes' memory: a process that joins its job's hold waits until it is freed.

Called by `LockGroup.acquire` before a caller joins the hold of its own job (memory-aware
groups only). A job's process killed while it holds keeps its GPU memory until the driver
has torn its CUDA contexts down (1.4-9.6 s after its last line on the H200,
reference/checkpoint-h200.md and bench/results/rl-grpo-b-serve-cooperative-declared-66b7230-h200.json).
The job's next process joins the hold it finds, with no plan: it grew beside those bytes and
ran out of memory (schedules seed 8, `cuda` and `cooperative`: the orchestrator paused while
the holder was killed; its next process joined before the first one's leaving was seen).
The node agents name those bytes (`GpuMemory.exiting_bytes`: held by processes gone, zombies
or exiting), so the join waits for them whatever order the orchestrator learns things in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.group_model import Switcher
from timeslice.controller.orchestrator.placement import devices_of

log = logging.getLogger("timeslice.orchestrator")

EXIT_POLL_SECONDS = 0.05
# A process that never finishes exiting (a driver bug, a stuck file close) must not wedge its
# job: after this long the join goes ahead, logged.
EXIT_WAIT_SECONDS = 15.0


async def wait_for_exits(switcher: Switcher, spec: GroupSpec, job: str,
                         peaks: Mapping[str, Mapping[str, int]], timeout: float | None = None) -> None:
    """Return once no device of `job` (`placement.devices_of`) holds memory of ended processes
    by its node agents' reports (`MemorySnapshot.exiting_bytes`), polled every
    `EXIT_POLL_SECONDS` for at most `EXIT_WAIT_SECONDS` (or `timeout` seconds, the caller's,
    when shorter). The reports name no job: each one would take the job's peak samples from
    the agents (`GetMemoryRequest`), which the plans learn from. An agent whose report fails
    may have GPUs that hold such memory: the join waits for its answer too, within the same
    bound (schedules seed 980003, `cuda`: the agent restarted as the holder's process was
    killed, the job's next process joined while the agent was down and ran out of memory beside
    the killed one's 41.5 GB). Raises nothing but CancelledError (the caller went away)."""
    deadline = time.monotonic() + (EXIT_WAIT_SECONDS if timeout is None else min(EXIT_WAIT_SECONDS, timeout))
    waited = False
    while True:
        snap = await switcher.memory(spec, [], for_plan=False)  # type: ignore[attr-defined]
        held: dict[str, object] = {dev: n for dev, n in snap.exiting_bytes.items()
                                   if dev in devices_of(job, snap, peaks)}
        held.update((agent, "not known: the node agent did not answer") for agent in sorted(snap.unanswered))
        if not held:
            if waited:
                log.info("join group=%s job=%s: the ended processes' memory is freed", spec.id, job)
            return
        if time.monotonic() >= deadline:
            log.warning("join group=%s job=%s goes ahead: ended processes still hold %s", spec.id, job, held)
            return
        if not waited:
            log.info("join group=%s job=%s waits: ended processes still hold %s (their memory is being freed)",
                     spec.id, job, held)
            waited = True
        await asyncio.sleep(EXIT_POLL_SECONDS)
