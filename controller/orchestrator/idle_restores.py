"""IdleRestores: what a lock group restores while nobody holds or waits.

Owned by `LockGroup` (one per group); starts its restores through the group's switch runner
(`MemoryMoves.runner`). Three kinds: *orphans*, checkpointed jobs nobody will ask for (dropped,
or whose lease lapsed while preempted), restored so that none of their processes stays
stopped, then forgotten; in memory-aware groups, checkpointed jobs that fit beside the
residents without moving anyone (a job may touch its GPU after its last hold); and on
`freeze`, every frozen job (freezing moves no memory: it only keeps a job from computing
while another holds, and nobody does; a job that finished while frozen would otherwise
stay stopped for good, and so would a process that waits for it).
A job whose background restore failed is not tried in the background again until it is
granted: its own acquire restores it, or says why not.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator.memory_plan import AgentsUnanswered, plan, snapshot
from timeslice.controller.orchestrator.placement import NoRoom
from timeslice.driver import names
from timeslice.driver.tasks import cancel_and_wait

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")

# An idle group whose background restore found no room (memory that processes which left still
# held, other processes', an agent that did not answer) looks again after RETRY_SECONDS, then
# twice as long each time up to RETRY_MAX_SECONDS while it stays idle: nothing else would (a job
# that closed while checkpointed waits in its CUDA teardown for its restore: a helper's attack,
# stuck for good once the last other jobs had left while their processes still exited).
RETRY_SECONDS = 0.5
RETRY_MAX_SECONDS = 30.0


class IdleRestores:
    def __init__(self, group: LockGroup) -> None:
        self._g = group
        self._task: asyncio.Task[None] | None = None
        self._failed: set[str] = set()  # background restores that failed, until granted again
        self._orphans: set[str] = set()  # checkpointed jobs nobody will ask for: restored when idle, forgotten
        self._retry: asyncio.TimerHandle | None = None  # the next look of an idle group that waits (see above)
        self._retry_seconds = RETRY_SECONDS

    @property
    def refreshing(self) -> bool:
        return self._task is not None

    def now(self) -> bool:
        """Nobody holds, waits or switches."""
        g = self._g
        return g.holder is None and g.switching is None and not len(g.queue)

    def unowned(self, job: str) -> None:
        """Nobody will ask for `job` any more: if checkpointed, restored when the group is idle.
        Not on backend `app`: a sleeping engine is no stopped process, and its wake beside the
        awake resident ran out of memory (`MemoryMoves.dropped`); it sleeps until its job asks again."""
        if job in self._g.residency.checkpointed and self._g.spec.backend != names.BACKEND_APP:
            self._orphans.add(job)

    def granted(self, job: str) -> None:
        self._failed.discard(job)
        self._orphans.discard(job)

    def forget(self, job: str) -> None:
        self._failed.discard(job)

    def failed(self, job: str) -> None:
        """A background restore of `job` failed (or found no room): not again in the background."""
        self._failed.add(job)

    def is_orphan(self, job: str) -> bool:
        """Whether `job` is checkpointed and nobody will ask for it (`unowned`)."""
        return job in self._orphans

    def restored_for_nobody(self, job: str) -> bool:
        """`job` was restored as an orphan (now forgotten here); its processes run on, unowned."""
        if job not in self._orphans:
            return False
        self._orphans.discard(job)
        return True

    def refresh_memory(self) -> None:
        """In the background: take a memory snapshot (residents' peaks), and when the group
        is idle restore a checkpointed job that fits without moving anyone. Tried once per
        trigger (a release, an idle group, a switch that succeeded), and again while the group
        stays idle and a job it found no room for is checkpointed (`RETRY_SECONDS`, backing off).
        Groups without memory reports restore orphans, and on `freeze` every frozen job."""
        self._retry_seconds = RETRY_SECONDS
        self._look()

    def _look(self) -> None:
        g = self._g
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if not g.moves.memory_aware:
            self._restore_unneeded_stops()
            return
        if self._task is not None or g.switching is not None:
            return  # a switch plans from its own fresh report, and triggers this again once idle
        self._task = asyncio.get_running_loop().create_task(self._refresh(), name=f"memory-{g.id}")

    def _restore_unneeded_stops(self) -> None:
        """Orphans, and on `freeze` every frozen job: one at a time (each restore that
        succeeds triggers the next); one that failed is not tried again in the background."""
        g = self._g
        if not self.now() or g.awake.unreleased():  # an engine whose client may still use it is not slept
            return
        frozen = g.residency.checkpointed if g.spec.backend == names.BACKEND_FREEZE else set()
        for job in sorted(self._orphans - self._failed) + sorted(frozen - self._orphans - self._failed):
            why = "nobody owns it any more" if job in self._orphans else "nobody holds the group"
            log.info("restoring a checkpointed job group=%s job=%s: %s", g.id, job, why)
            # a holder cut off by its lapsed lease may still compute: it is frozen first
            g.moves.runner.start(g.moves.must_leave(job), job, restore=True, grant=False)
            return

    async def _refresh(self) -> None:
        g = self._g
        again = False  # a job found no room: looked at again while the group stays idle
        try:
            snap = await snapshot(g)
            if snap is None:  # the agents report no GPU memory: as a group without memory reports
                self._restore_unneeded_stops()
                return
            if not self.now():
                return
            for job in sorted(g.residency.checkpointed - self._failed):
                try:
                    # beside the residents at their needs: each may grow to it at its next grant
                    if not (await plan(g, job, allow_evictions=False, residents_grow=True)).evict and self.now():
                        log.info("background restore group=%s job=%s: the group is idle and it fits", g.id, job)
                        g.moves.runner.start([], job, restore=True, grant=False)
                        return
                except NoRoom as err:
                    (log.debug if self._retry_seconds > RETRY_SECONDS else log.info)(
                        "no background restore group=%s job=%s: %s", g.id, job, err)
                    again = True
        except AgentsUnanswered as err:
            log.warning("memory report failed group=%s: %s", g.id, err)
            again = True
        except Exception as err:  # a report that fails changes nothing; the next switch asks again
            log.warning("memory report failed group=%s: %s", g.id, err)
        finally:
            self._task = None
            if again and self.now() and g.residency.checkpointed - self._failed:
                self._retry = asyncio.get_running_loop().call_later(self._retry_seconds, self._look)
                self._retry_seconds = min(2 * self._retry_seconds, RETRY_MAX_SECONDS)

    async def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        await cancel_and_wait(self._task)
