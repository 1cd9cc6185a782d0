"""Steps the orchestrator gave up on: wait until they have ended, then read where the job is.

Used by `MemoryMoves` before any grant after a switch whose rollback could not finish
(`SwitchError.off_gpu`, the group's "unsure" jobs). A switch step that got no reply within its
deadline may still run on its node agent (a checkpoint that hangs in the backend), and the
rollback's own step queues behind it on the agent's per-job lock: both run after the
orchestrator moved on. Granting the next job at once let the late rollback restore (thaw) the
evicted job beside it: two jobs computing at once, or a restore into memory given to another
(issue 22: a checkpoint that hangs past its step deadline with a rollback that cannot finish).
The node agents name the jobs with a step running or queued (`MemoryReport.busy_jobs`); once
none of the unsure jobs is among them, their checkpoint records say where each one is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.group_model import Switcher
from timeslice.driver.errors import FailedPrecondition, Unavailable

log = logging.getLogger("timeslice.orchestrator")

IN_FLIGHT_POLL_SECONDS = 0.1
# How long one grant waits for the steps to end before its waiters are told to ask again
# (a backend that never returns must not wedge the group: its clients retry until their own
# acquire timeout, and each retry waits this long again).
IN_FLIGHT_WAIT_SECONDS = 10.0


async def on_gpus_after_steps(switcher: Switcher, spec: GroupSpec, jobs: Iterable[str]) -> set[str]:
    """Wait until no node agent of `spec` has a step of `jobs` running or queued (polled every
    `IN_FLIGHT_POLL_SECONDS` for at most `IN_FLIGHT_WAIT_SECONDS`), then return those of `jobs`
    that no agent holds a checkpoint record of: their state is on the GPUs (a late rollback put
    it back). Raises Unavailable (an agent did not answer), FailedPrecondition (a step still
    runs: nothing may be granted beside it)."""
    jobs = set(jobs)
    deadline = time.monotonic() + IN_FLIGHT_WAIT_SECONDS
    while True:
        snap = await switcher.memory(spec, [], for_plan=False)  # type: ignore[attr-defined]
        if snap.unanswered:
            raise Unavailable(f"node agent(s) {', '.join(sorted(snap.unanswered))} did not answer: whether a step "
                              f"of {', '.join(sorted(jobs))} still runs there is unknown")
        busy = snap.busy & jobs
        if not busy:
            break
        if time.monotonic() >= deadline:
            raise FailedPrecondition(f"a step of {', '.join(sorted(busy))} that got no reply in time still runs on "
                                     "its node agent: nothing is granted until it has ended")
        await asyncio.sleep(IN_FLIGHT_POLL_SECONDS)
    checkpointed = await switcher.checkpointed(spec, spec.agents)  # type: ignore[attr-defined]
    return jobs - checkpointed
