"""ConfigWarnings: configuration problems the grouping found, as Warning Events on their claims.

Owned by the controller; fed every cluster snapshot (`grouping.Snapshot.warnings`: an
invalid TimeSliceConfig, claims of one claim set or one group that disagree, a device no
ResourceSlice publishes). Only the leader publishes. Each warning is recorded once while
it lasts; one that goes away and comes back is recorded again. Where users look:
`kubectl describe resourceclaim` (and `kubectl get events`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from timeslice.controller.grouping import GroupingWarning
from timeslice.driver.events import EventRecorder
from timeslice.driver.tasks import cancel_and_wait

log = logging.getLogger("timeslice.controller")


class ConfigWarnings:
    def __init__(self, events: EventRecorder) -> None:
        self._events = events
        self._published: set[GroupingWarning] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def publish(self, warnings: Iterable[GroupingWarning]) -> int:
        """Record, in the background, a Warning Event for each of `warnings` not recorded yet;
        returns how many that is."""
        current = set(warnings)
        new = sorted(current - self._published)
        self._published = current
        if not new:
            return 0
        task = asyncio.get_running_loop().create_task(self._record(new))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return len(new)

    async def _record(self, warnings: list[GroupingWarning]) -> None:
        for w in warnings:
            log.warning("claim %s: %s: %s", w.claim, w.reason, w.message)
            await self._events.claim_event(w.claim.namespace, w.claim.name, w.claim.uid, w.reason, w.message,
                                           warning=True)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            await cancel_and_wait(task)  # (a cancel swallowed by 3.11's wait_for is sent again)
