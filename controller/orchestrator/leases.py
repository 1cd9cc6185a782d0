"""Leases: the holder's lease timer and the leases a lock group granted.

Owned by `LockGroup` (one per group). The holder's lease lapses `lease_seconds` after
its grant or its last keep-alive: the hold ends, and with a backend that moves state the
holder, cut off but perhaps still computing, leaves the GPUs before anyone is granted.
A release or keep-alive must show the holder's job, lease id and epoch (or an earlier
epoch of the same lease: a preempted holder's). The leases granted here are remembered
(the last `KNOWN_LEASES`) to tell them from those an earlier leader granted.

A late keep-alive is not a dead holder (its keep-alive thread was starved: a process
pinning tens of GB, a loaded node), so a lapse never costs a computing holder its phase:
- `cooperative`: its state moves only by its own process's hand, never mid-phase. A holder
  whose lease ran out while one of its processes keeps its memory command stream open is
  alive: it keeps the lock (*overdue*) until its streams close (`streams_closed`) or it
  releases; a keep-alive makes its lease current again.
- transparent backends (`cuda`, `freeze`, ...: the orchestrator stops the process itself):
  the lapsed holder leaves the GPUs before anyone is granted, and its lease is remembered
  (`lapsed`): its late keep-alive queues it again under that lease, like a preempted
  holder (`requeue_lapsed`: restored in its turn, invisibly to its code), and its late
  release is accepted (`released_lapsed`).
- `none`: nothing stops a lapsed holder, so the next job may overlap it: its late calls are
  refused (the client raises `LeaseLost`).
- `app`: the agent sleeps the job's engine but does not stop its client, whose requests a
  sleeping engine fails. Its late calls are refused as with `none`, and also those of a
  holder preempted at `maxHoldSeconds` or by a merge (`refuse_revoked`); its engine is
  slept only once its client released (its refused release is noted first), and nobody is
  granted in its place until then (`AwakeEngines`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator.decisions import KeepOverdue, Lapse, LeaseFacts, Rearm, lease_timer
from timeslice.controller.orchestrator.group_model import ADOPTED, Hold
from timeslice.driver import names
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
        self._overdue: Hold | None = None  # a cooperative holder past its lease, kept while its streams are open
        self._lapsed: OrderedDict[str, Hold] = OrderedDict()  # lease id -> a lapsed hold that may be queued again

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

    def renew(self, h: Hold) -> None:
        """`h`'s lease runs `lease_seconds` from now (a keep-alive, or a caller of its job that
        joined it)."""
        h.lease_deadline = self._g.clock() + self._g.spec.lease_seconds
        self.kept_alive(h)

    def kept_alive(self, h: Hold) -> None:
        """`h`'s lease was extended (its deadline moved): an overdue holder's timer runs again."""
        if self._overdue is h:
            self._overdue = None
            self.arm()

    def arm(self) -> None:
        """Time the current holder's lease (from its deadline)."""
        h = self._g.holder
        if h is None:
            return
        delay = max(0.0, h.lease_deadline - self._g.clock())
        self._timer = asyncio.get_running_loop().call_later(delay, self.on_timer, h)

    def stop(self) -> None:
        self._overdue = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def on_timer(self, h: Hold) -> None:
        """`h`'s lease timer fired: what it does is `decisions.lease_timer` (it lapses unless
        extended since, or unless it is a cooperative holder whose processes keep their command
        streams open: overdue)."""
        g = self._g
        self._timer = None
        d = lease_timer(LeaseFacts(g.spec.backend, g.holder is h, g.clock(), h.lease_deadline,
                                   g.holder is h and self._streaming(h.job_id), h.callers_unknown,
                                   self._overdue is h))
        if isinstance(d, Rearm):
            self.arm()
        elif isinstance(d, KeepOverdue):
            if d.first:
                log.warning("lease of holder past its deadline group=%s job=%s epoch=%d: it keeps the lock, its "
                            "processes keep their memory command streams open (computing; its keep-alives are "
                            "late), until they close or it releases", g.id, h.job_id, h.epoch)
            self._overdue = h
        elif isinstance(d, Lapse):
            self._lapse(h, d.requeue)

    def _lapse(self, h: Hold, requeue: bool) -> None:
        g = self._g
        g.counters.lease_expiries += 1
        log.warning("lease expired group=%s job=%s epoch=%d", g.id, h.job_id, h.epoch)
        g.notify("lease-expired", h.job_id, h.epoch)
        g.end_hold(h, "lease expired")
        if g.moves.lapsed(h.job_id, h, f"no keep-alive within {g.spec.lease_seconds:g} s"):
            g.drop_job(h.job_id, "a process of it left while it held and its lease lapsed since")
        if requeue:
            self._lapsed[h.lease_id] = h  # its late keep-alive queues it again
            while len(self._lapsed) > KNOWN_LEASES:
                self._lapsed.popitem(last=False)
        g.record_placement()
        g.dispatch()
        g.idle.refresh_memory()  # nobody waits: an idle freeze group thaws the jobs it froze

    def refuse_revoked(self, job_id: str, lease_id: str, epoch: int, what: str,
                       request_id: str | None = None) -> None:
        """A keep-alive, or a release (`request_id`: its caller's Acquire, "" for the whole
        hold), under the lease of an `app` hold that ended unreleased (`AwakeEngines`;
        a hold whose lease is not known, adopted or carried without it: any lease this group
        did not grant, of an epoch not past its own). A release is noted first: its caller's
        part ends, and once no caller is left its engine may sleep (the group dispatches).
        Then raises StaleLease (the client raises `LeaseLost`: its hold ended). Returns for
        any other lease."""
        g = self._g
        found = g.awake.unreleased_hold(job_id)
        if found is None:
            return
        h, why = found
        if h is None or h.lease_id == ADOPTED:
            if self.known(lease_id) or not 0 < epoch <= g.epoch:
                return
        elif h.lease_id != lease_id or (epoch != h.epoch and epoch not in h.past_epochs):
            return
        left = "its engine stays awake until its release"
        if request_id is not None:
            if h is not None and g.callers.released_part(h, request_id):
                left = f"its engine stays awake until its other callers release ({len(h.request_ids)})"
            else:
                log.info("release of an unreleased hold noted group=%s job=%s epoch=%d: its engine may sleep", g.id,
                         job_id, epoch)
                g.awake.released(job_id)
                g.record_placement()
                g.dispatch()
                g.idle.refresh_memory()
                left = "noted: its engine may now sleep"
        raise StaleLease(f"group {g.id}: {what} by job {job_id} epoch {epoch} refused: its lease is revoked ({why}); "
                         f"{left}")

    def streams_closed(self, job_id: str) -> None:
        """Every memory command stream of `job_id`'s processes closed: if it holds, that is
        noted (`Hold.streams_closed`); if it is the overdue holder, its lease lapses now."""
        g = self._g
        if g.holder is not None and g.holder.job_id == job_id:
            g.holder.streams_closed = True
        h = self._overdue
        if h is not None and h.job_id == job_id and g.holder is h:
            self.on_timer(h)

    def _streaming(self, job_id: str) -> bool:
        g = self._g
        streaming = getattr(g.switcher, "streaming", None)
        return g.spec.backend == names.BACKEND_COOPERATIVE and streaming is not None and streaming(g.spec, job_id)

    def _lapsed_hold(self, job_id: str, lease_id: str, epoch: int) -> Hold | None:
        """The hold that lapsed under this lease (transparent backends) while its job is still
        known here (resident or checkpointed) and does not hold again; None otherwise."""
        g = self._g
        h = self._lapsed.get(lease_id)
        if h is None or h.job_id != job_id or (epoch != h.epoch and epoch not in h.past_epochs):
            return None
        if (g.holder is not None and g.holder.job_id == job_id) or \
                (job_id not in g.residency.residents and job_id not in g.residency.checkpointed):
            del self._lapsed[lease_id]  # held again under another lease, or dropped: the lease is gone
            return None
        return h

    def requeue_lapsed(self, job_id: str, lease_id: str, epoch: int) -> bool:
        """A keep-alive under a lease that lapsed here (transparent backends): the holder was
        starved, not gone. It is queued again under that lease (`Preemption.park`): if it is
        still on the GPUs and nobody waits it holds again at once; else it leaves the GPUs
        (if it has not) before the job ahead of it is granted, and is restored in its turn,
        as a preempted holder. True when queued."""
        g = self._g
        h = self._lapsed_hold(job_id, lease_id, epoch)
        if h is None:
            return False
        del self._lapsed[lease_id]
        log.warning("late keep-alive of a holder whose lease lapsed group=%s job=%s epoch=%d: queued again under "
                    "its lease (%s)", g.id, job_id, h.epoch,
                    "on the GPUs" if job_id in g.residency.residents else "checkpointed")
        g.preemption.park(h)
        g.dispatch()
        g.preemption.arm()
        return True

    def released_lapsed(self, job_id: str, lease_id: str, epoch: int) -> bool:
        """A release under a lease that lapsed here (transparent backends): its hold had
        already ended, and the job left the GPUs (or will) before anyone else computed, so
        the release is accepted; nothing moves. True when it was such a release."""
        if self._lapsed_hold(job_id, lease_id, epoch) is None:
            return False
        del self._lapsed[lease_id]
        log.info("late release of a holder whose lease lapsed group=%s job=%s epoch=%d: accepted", self._g.id,
                 job_id, epoch)
        return True
