"""Leases: the holder's lease timer and the leases a lock group granted.

Owned by `LockGroup` (one per group). The holder's lease lapses `lease_seconds` after
its grant or its last keep-alive: the hold ends, and with a backend that moves state the
holder, cut off but perhaps still computing, leaves the GPUs before anyone is granted.
A release or keep-alive must show the holder's job, lease id and epoch (or an earlier
epoch of the same lease: a preempted holder's). The leases granted here are remembered
(the last `KNOWN_LEASES`) to tell them from those an earlier leader granted.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator.group_model import ADOPTED, Hold
from timeslice.driver.errors import StaleLease

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")

KNOWN_LEASES = 1024  # leases granted by this orchestrator, remembered per group (most recent)


class Leases:
    def __init__(self, group: LockGroup) -> None:
        self._g = group
        self._timer: asyncio.TimerHandle | None = None
        self._known: OrderedDict[str, None] = OrderedDict()  # granted here (vs. by an earlier leader)

    def remember(self, lease_id: str) -> None:
        self._known[lease_id] = None
        self._known.move_to_end(lease_id)
        while len(self._known) > KNOWN_LEASES:
            self._known.popitem(last=False)

    def known(self, lease_id: str) -> bool:
        return lease_id in self._known

    def check(self, job_id: str, lease_id: str, epoch: int, what: str) -> Hold:
        """The hold this lease shows; a presumptive (adopted) holder's first call adopts its
        lease. Raises StaleLease naming the actual holder."""
        g = self._g
        h = g.holder
        if h is not None and h.lease_id == ADOPTED and h.job_id == job_id:
            h.lease_id, h.epoch = lease_id, epoch  # the presumptive holder shows its lease
            g.epoch = max(g.epoch, epoch)
            self.remember(lease_id)
        if h is None or h.job_id != job_id or h.lease_id != lease_id or (h.epoch != epoch and
                                                                          epoch not in h.past_epochs):
            now = f"job {h.job_id} epoch {h.epoch}" if h else "nobody"
            raise StaleLease(f"group {g.id}: {what} by job {job_id} epoch {epoch} refused: "
                             f"the holder is {now} (lease lapsed or superseded)")
        return h

    def arm(self) -> None:
        """Time the current holder's lease (from its deadline)."""
        h = self._g.holder
        if h is None:
            return
        delay = max(0.0, h.lease_deadline - self._g.clock())
        self._timer = asyncio.get_running_loop().call_later(delay, self.on_timer, h)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def on_timer(self, h: Hold) -> None:
        """`h`'s lease timer fired: it lapses unless extended since."""
        g = self._g
        if g.holder is not h:
            return
        if g.clock() < h.lease_deadline:  # extended by keep-alives since armed
            self.arm()
            return
        g.counters.lease_expiries += 1
        log.warning("lease expired group=%s job=%s epoch=%d", g.id, h.job_id, h.epoch)
        g.notify("lease-expired", h.job_id, h.epoch)
        g.end_hold(h, "lease expired")
        g.moves.lapsed(h.job_id)
        g.record_placement()
        g.dispatch()
        g.idle.refresh_memory()  # nobody waits: an idle freeze group thaws the jobs it froze
