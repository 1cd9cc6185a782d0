"""Steps the orchestrator gave up on: wait until they have ended, then read where the job is.

Used before any grant after a switch whose rollback could not finish (`SwitchError.off_gpu`,
the group's "unsure" jobs), by `Settling` (owned by `MemoryMoves`, one per group), which also
reads, before any grant, the checkpoint records a takeover could not read. A switch step that
got no reply within its deadline may still run on its node agent (a checkpoint that hangs in the backend), and the
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
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.group_model import Switcher
from timeslice.controller.orchestrator.memory_snapshot import MemorySnapshot
from timeslice.driver import names
from timeslice.driver.errors import FailedPrecondition, SwitchFailed, Unavailable

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

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


class Settling:
    """What `group` settles with its node agents before any grant: the node agents whose
    checkpoint records a takeover could not read (`records_unknown`), and the jobs a rollback
    could not put back (`unsure`)."""

    def __init__(self, group: LockGroup) -> None:
        self._g = group
        # jobs a rollback could not put back: on the GPUs or not (settled before a grant: `settle_unsure`;
        # else until the next answered memory report)
        self.unsure: set[str] = set()
        # node agents whose checkpoint records a takeover could not read: read before a grant (`records_unknown`)
        self.records_unknown: set[str] = set()
        self.records_task: asyncio.Task[None] | None = None
        self.settle_task: asyncio.Task[None] | None = None  # `settle_unsure`

    def read_records(self) -> None:
        """Before any grant after a takeover that could not read some node agents' checkpoint
        records (`records_unknown`): read them, and restore the jobs they hold checkpointed
        before their grants. Until they answer nothing is granted on a guess: the waiters get
        `SwitchFailed` and their clients ask again (app schedules seed 97: the orchestrator
        restarted while the agent was down, took a sleeping engine for awake, and granted its
        job with its state off the GPU)."""
        if self.records_task is None or self.records_task.done():
            self.records_task = asyncio.get_running_loop().create_task(self._records(), name=f"records-{self._g.id}")

    async def _records(self) -> None:
        g = self._g
        targets = sorted(self.records_unknown)
        try:
            found = await g.switcher.checkpointed(g.spec, targets)  # type: ignore[attr-defined]
        except Exception as err:  # still unreadable: nothing is granted on a guess
            log.warning("checkpoint records still unknown group=%s agents=%s: %s", g.id, targets, err)
            self._fail_waiters(f"the checkpoint records of node agent(s) {', '.join(targets)} cannot be read since "
                               f"this orchestrator took over ({err}); nothing is granted until they answer")
            return
        self.records_unknown.difference_update(targets)
        for job in sorted(found):
            if (g.holder is None or g.holder.job_id != job) and job not in g.residency.checkpointed:
                log.info("checkpoint record read group=%s job=%s: restored before its grant", g.id, job)
                g.residency.moved_out(job)
        g.dispatch()

    @property
    def settles_unsure(self) -> bool:
        """Whether the jobs a rollback could not put back (`unsure`) are settled with their node
        agents before any grant (`on_gpus_after_steps`): the agents step them (not `cooperative`, whose
        processes answer for themselves) and the switcher reads their records and memory."""
        g = self._g
        return g.spec.backend not in (names.BACKEND_COOPERATIVE, names.BACKEND_NONE) and \
            hasattr(g.switcher, "checkpointed") and hasattr(g.switcher, "memory")

    def reported(self, snap: MemorySnapshot) -> None:
        """A memory report came (`memory_plan.snapshot`): answered by every agent, it settles the
        unsure jobs of a group that does not settle them with their agents."""
        if snap.devices and not snap.unanswered and not self.settles_unsure:
            self.unsure.clear()

    def settle_unsure(self) -> None:
        if self.settle_task is None or self.settle_task.done():
            self.settle_task = asyncio.get_running_loop().create_task(self._settle(), name=f"settle-{self._g.id}")

    async def _settle(self) -> None:
        """Once no step of the unsure jobs runs on their node agents, each is where its records
        say; until then nothing is granted: the waiters get `SwitchFailed` and their clients ask
        again (`on_gpus_after_steps`)."""
        g = self._g
        jobs = set(self.unsure)
        try:
            on_gpus = await on_gpus_after_steps(g.switcher, g.spec, jobs)
        except Exception as err:  # a step still runs, or an agent does not answer: no grant on a guess
            log.warning("not settled group=%s jobs=%s: %s", g.id, sorted(jobs), err)
            self._fail_waiters(str(err))
            return
        for job in sorted(on_gpus & g.residency.checkpointed):
            log.warning("job %s is on the GPUs after all group=%s: a step of its rollback ended late", job, g.id)
            g.residency.moved_in(job)
        self.unsure -= jobs
        g.dispatch()

    def _fail_waiters(self, why: str) -> None:
        """Nothing is granted on a guess: every waiter gets `SwitchFailed` and its client asks again."""
        g = self._g
        for job in {w.job_id for w in g.queue}:
            g.fail_job(job, SwitchFailed(f"group {g.id}: {why}"))
