"""Deferral: a grant that would move memory waits while the residents are between their phases.

Owned by `MemoryMoves` (one per group), which asks it before a `decisions.Switch` for the head
waiter (`may_defer`): one job after the other on purpose where moving would cost more than it
saves, by the cost model of move_cost.py.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator.lock_queue import Waiter
from timeslice.controller.orchestrator.memory_plan import snapshot
from timeslice.controller.orchestrator.move_cost import move_seconds, pass_remaining, switch_speed

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")


class Deferral:
    """When each job was last granted, the timer that dispatches again when a deferral ends,
    and the memory report a deferral asked for (once per epoch)."""

    def __init__(self, group: LockGroup) -> None:
        self._g = group
        self._granted_at: dict[str, float] = {}  # job -> clock() at its last grant
        self._deferred: asyncio.TimerHandle | None = None  # dispatches again when a deferral ends
        self.report_task: asyncio.Task[None] | None = None  # a deferral's memory report
        self._reported_at_epoch = -1  # the epoch a deferral last asked for a memory report at

    def granted(self, job: str) -> None:
        self._granted_at[job] = self._g.clock()

    def forget(self, job: str) -> None:
        self._granted_at.pop(job, None)

    def close(self) -> None:
        """Cancel the timer (`MemoryMoves.close` cancels `report_task`)."""
        if self._deferred is not None:
            self._deferred.cancel()

    def defer(self, head: Waiter) -> bool:
        """Whether `head`'s grant, which moves memory, waits (one job after the other on
        purpose): while resident waiters may pass `head` (`pass_remaining`) and an idle resident on
        its GPUs was granted more recently than the move would take (`move_seconds`): it is
        between its phases and will be back before moving it out pays. The lock stays free
        for the residents; a timer dispatches again when the deferral ends. Without a memory
        report yet, or with one older than a hold of a job whose need is not known (it may
        have grown since: on the H200 an undeclared job built 48 GB in its first hold after the
        report at its grant, the next job's move looked free, and three jobs of 57 GB moved
        22-29 s each at their first holds, 0.66x; bench/results/rl-grpo-b-serve-cuda-h200.json),
        one is asked for first (once per epoch). Measured on the H200 with the
        driver's checkpoint (`cuda`): 3 jobs of 57 GB (two fit) switched every phase at ~30 s
        a switch, 0.54x of one after the other (bench/results/rl-grpo-b-serve-cuda-h200.json),
        and 2 jobs of 19 GB that fit, while unsettled, every phase at 5-15 s, 0.67x (a run
        not kept); with the deferral 0.83x, now 1.05x (bench/results/rl-grpo-a-serve-h200.json)."""
        g = self._g
        r = g.residency
        costs = g.moves.costs()
        if (r.snapshot is None or r.unsettled_held_since_report(excluding=head.job_id)) and \
                switch_speed(costs) is not None:
            if self._reported_at_epoch != g.epoch:  # measure first, then decide
                self._reported_at_epoch = g.epoch
                self.report_task = asyncio.get_running_loop().create_task(self._report_then_dispatch())
                return True
            if r.snapshot is None:
                return False
        seconds = move_seconds(costs, head.job_id)
        now = costs.now
        left = pass_remaining(costs, head)
        if seconds is None or left <= 0:
            return False
        active = [now - self._granted_at[j] for j in g.residency.lru(excluding=[head.job_id])
                  if now - self._granted_at.get(j, -math.inf) < seconds]
        if not active:
            return False
        wait = min(left, seconds - max(active))
        if self._deferred is not None:
            self._deferred.cancel()
        self._deferred = asyncio.get_running_loop().call_later(wait, g.dispatch)
        log.info("deferred group=%s job=%s for %.1f s: its grant moves memory (about %.1f s) and the residents "
                 "are between phases", g.id, head.job_id, wait, seconds)
        return True

    async def _report_then_dispatch(self) -> None:
        try:
            await snapshot(self._g)
        except Exception as err:  # an agent that does not answer: decide without a report
            log.warning("no memory report group=%s: %s", self._g.id, err)
        self._g.dispatch()

