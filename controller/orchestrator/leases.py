"""Leases: the holder's lease timer and the leases a lock group granted.

Owned by `LockGroup` (one per group). The holder's lease lapses `lease_seconds` after
its grant or its last keep-alive: the hold ends, and with a backend that moves state the
holder, cut off but perhaps still computing, leaves the GPUs before anyone is granted.
A release or keep-alive must show the holder's job, lease id and epoch (or an earlier
epoch of the same lease: a preempted holder's); which lease a call matches and what it then
does is `lease_calls.lease_call` (pure), performed by `release` and `keep_alive` here. The
leases granted here are remembered (the last `KNOWN_LEASES`) to tell them from those an
earlier leader granted.

A late keep-alive is not a dead holder (its keep-alive thread was starved: a process
pinning tens of GB, a loaded node), so a lapse never costs a computing holder its phase:
- `cooperative`: its state moves only by its own process's hand, never mid-phase. A holder
  whose lease ran out while one of its processes keeps its memory command stream open is
  alive: it keeps the lock (*overdue*) until its streams close (`streams_closed`) or it
  releases; a keep-alive makes its lease current again.
- transparent backends (`cuda`, `freeze`, ...: the orchestrator stops the process itself):
  the lapsed holder leaves the GPUs before anyone is granted, and its lease is remembered
  (`lapsed`): its late keep-alive queues it again under that lease, like a preempted
  holder (restored in its turn, invisibly to its code), and its late release is accepted.
  Not a client's keep-alive that confirms a grant it saw late (`confirm`): refused, it asks anew.
  On `cuda`, a holder reported live that held no GPU memory at its last report has no CUDA
  context for a checkpoint to lock (`Residency.unfenceable`): it is kept as `vmm`'s below.
- `vmm`: nothing stops the holder's processes, and moving its memory under a process that
  computes kills it. A holder whose node agents report a process of it live keeps the lock
  past its lease (*overdue*, looked at again every `LIVE_SECONDS`) until it keeps alive,
  releases, or is no longer reported live; one that is not (its agent does not answer, a
  cluster's claims) has its lease revoked, and its memory moves only once its client
  released, as `app`'s below.
- `none`: nothing stops a lapsed holder, so the next job may overlap it: its late calls are
  refused (the client raises `LeaseLost`).
- `app`: the agent sleeps the job's engine but does not stop its client, whose requests a
  sleeping engine fails. Its late calls are refused as with `none`, and also those of a
  holder preempted at `maxHoldSeconds` or by a merge; its engine is
  slept only once its client released (its refused release is noted first), and nobody is
  granted in its place until then (`AwakeEngines`). Kept overdue while reported live, as `vmm`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator import takeover
from timeslice.controller.orchestrator.decisions import KeepOverdue, Lapse, LeaseFacts, Rearm, lease_timer
from timeslice.controller.orchestrator.group_model import ADOPTED, Hold
from timeslice.controller.orchestrator.lease_calls import (
    LAPSED,
    PARKED,
    REVOKED,
    Act,
    Lease,
    LeaseCall,
    LeaseCallFacts,
    Unreleased,
    lease_call,
)
from timeslice.controller.orchestrator.lock_queue import Waiter
from timeslice.driver import names
from timeslice.driver.errors import StaleLease

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")

KNOWN_LEASES = 1024  # leases granted by this orchestrator, remembered per group (most recent)
# A holder its node agents reported live this recently, seconds, is alive (`GoneHolders` asks
# every 0.5 s); an overdue one kept for it is looked at again this often.
LIVE_SECONDS = 2.0


class Leases:
    def __init__(self, group: LockGroup) -> None:
        self._g = group
        self._timer: asyncio.TimerHandle | None = None
        self._known: OrderedDict[str, None] = OrderedDict()  # granted here (vs. by an earlier leader)
        self._lapsed: OrderedDict[str, Hold] = OrderedDict()  # lease id -> a lapsed hold that may be queued again

    def remember(self, lease_id: str) -> None:
        self._known[lease_id] = None
        self._known.move_to_end(lease_id)
        while len(self._known) > KNOWN_LEASES:
            self._known.popitem(last=False)

    def known(self, lease_id: str) -> bool:
        return lease_id in self._known

    def renew(self, h: Hold) -> None:
        """`h`'s lease runs `lease_seconds` from now (a keep-alive, or a caller of its job joined)."""
        h.lease_deadline = self._g.clock() + self._g.spec.lease_seconds
        self.kept_alive(h)

    def kept_alive(self, h: Hold) -> None:
        """`h`'s lease was extended (its deadline moved): an overdue holder's timer runs again."""
        if h.kept:
            h.kept = ""
            self.stop()
            self.arm()

    def seen_live(self, job_id: str) -> None:
        """A node agent reported a process of `job_id` live (`GoneHolders`): if it holds, noted
        (`Hold.live_at`: on `names.UNRELEASED_KEPT_BACKENDS` such a holder is kept when late)."""
        h = self._g.holder
        if h is not None and h.job_id == job_id:
            h.live_at = self._g.clock()

    def arm(self) -> None:
        """Time the current holder's lease (from its deadline)."""
        if (h := self._g.holder) is not None:
            delay = max(0.0, h.lease_deadline - self._g.clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self.on_timer, h)

    def stop(self) -> None:  # (the timer, and with it any overdue holder's)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def on_timer(self, h: Hold) -> None:
        """`h`'s lease timer fired: what it does is `decisions.lease_timer` (it lapses unless
        extended since, or kept overdue: streaming cooperative holder, live vmm or app one)."""
        g = self._g
        self._timer = None
        streaming = g.holder is h and self._streaming(h.job_id)
        live = h.live_at is not None and g.clock() - h.live_at <= LIVE_SECONDS
        d = lease_timer(LeaseFacts(g.spec.backend, g.holder is h, g.clock(), h.lease_deadline, streaming,
                                   h.callers_unknown, bool(h.kept), live,
                                   g.residency.unfenceable(h.job_id, g.spec.backend)))
        if isinstance(d, Rearm):
            self.arm()
        elif isinstance(d, KeepOverdue):
            if d.first:
                log.warning("lease of holder past its deadline group=%s job=%s epoch=%d: it keeps the lock (its "
                            "keep-alives are late), %s, until %s or it releases", g.id, h.job_id, h.epoch, d.why,
                            d.until)
            h.kept = d.why  # (overdue: kept past its lease)
            if not streaming:  # looked at again: still reported live?
                self._timer = asyncio.get_running_loop().call_later(LIVE_SECONDS, self.on_timer, h)
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

    def streams_closed(self, job_id: str) -> None:
        """Every memory command stream of `job_id`'s processes closed: if it holds, that is
        noted (`Hold.streams_closed`); if it is the overdue holder, its lease lapses now."""
        h = self._g.holder
        if h is not None and h.job_id == job_id:
            h.streams_closed = True
            if h.kept:
                self.on_timer(h)

    def _streaming(self, job_id: str) -> bool:
        g = self._g
        streaming = getattr(g.switcher, "streaming", None)
        return g.spec.backend == names.BACKEND_COOPERATIVE and streaming is not None and streaming(g.spec, job_id)

    # -- a release or keep-alive: what it does is `lease_calls.lease_call` ------------------------
    def release(self, job_id: str, lease_id: str, epoch: int, request_id: str) -> tuple[int, bool]:
        """Perform a release (`LockGroup.release`): returns (waiters, switch started), (0, False)
        when other callers still share the hold. Raises StaleLease."""
        g = self._g
        d, on = self._decide(job_id, lease_id, epoch, request_id)
        if d.act in (Act.PARKED_PART, Act.HOLDER_PART):
            g.callers.released_part(on.held(), request_id)
            return 0, False
        if d.act is Act.PARKED_RELEASE:
            assert on.entry is not None
            g.preemption.forget(on.entry)
            g.queue.remove(on.entry)
            g.preemption.disarm_when_unwaited()
            log.info("preempted holder released group=%s job=%s", g.id, job_id)
            g.notify("released", job_id, epoch)
            g.dispatch()
        elif d.act is Act.LAPSED_RELEASE:
            log.info("late release of a holder whose lease lapsed group=%s job=%s epoch=%d: accepted", g.id,
                     job_id, epoch)
        elif d.act is Act.HOLDER_END:
            g.end_hold(on.held(), "released")
            waiters = len(g.queue)
            g.notify("released", job_id, epoch)
            g.dispatch()
            g.idle.refresh_memory()
            return waiters, g.switching is not None
        else:
            raise AssertionError(f"a release cannot {d.act.value}")
        return len(g.queue), g.switching is not None

    def keep_alive(self, job_id: str, lease_id: str, epoch: int, request_id: str = "", confirm: bool = False) -> None:
        """Perform a keep-alive (`LockGroup.keep_alive`). Raises StaleLease."""
        g = self._g
        d, on = self._decide(job_id, lease_id, epoch, None, confirm)
        if d.act is Act.PARKED_EXTEND:
            on.held().lease_deadline = g.clock() + g.spec.lease_seconds
        elif d.act is Act.REQUEUE_SWITCHED_OUT:
            takeover.requeue_switched_out(g, job_id, lease_id, epoch)
        elif d.act is Act.REQUEUE_LAPSED:
            log.warning("late keep-alive of a holder whose lease lapsed group=%s job=%s epoch=%d: queued again "
                        "under its lease (%s)", g.id, job_id, on.held().epoch,
                        "on the GPUs" if job_id in g.residency.residents else "checkpointed")
            g.preemption.park(on.held())
            g.dispatch()
            g.preemption.arm()
        elif d.act is Act.HOLDER_RENEW:
            h = on.held()
            self.renew(h)
            if request_id in h.request_ids:
                h.kept_alive[request_id] = g.clock()
        else:
            raise AssertionError(f"a keep-alive cannot {d.act.value}")

    def _decide(self, job_id: str, lease_id: str, epoch: int, request_id: str | None,
                confirm: bool = False) -> tuple[LeaseCall, _On]:
        """What the call does and what it acts on; performs its bookkeeping (an adopted lease, a
        lapsed one forgotten) and its refusal (a release under a revoked `app` lease noted
        first: `_note_revoked`). Raises StaleLease."""
        g = self._g
        parked = g.preemption.parked(lease_id)
        adopted = g.preemption.parked(ADOPTED)
        unreleased = g.awake.unreleased_hold(job_id)
        lapsed = self._lapsed.get(lease_id)
        d = lease_call(LeaseCallFacts(
            job=job_id, lease_id=lease_id, epoch=epoch, request_id=request_id, backend=g.spec.backend,
            group_epoch=g.epoch, known=self.known(lease_id), holder=_lease(g.holder),
            parked=_lease(parked[1] if parked else None), parked_adopted=_lease(adopted[1] if adopted else None),
            lapsed=_lease(lapsed), resident=job_id in g.residency.residents,
            checkpointed=job_id in g.residency.checkpointed,
            unreleased=None if unreleased is None else Unreleased(_lease(unreleased[0]), unreleased[1]),
            confirm=confirm))
        if d.forget_lapsed:
            del self._lapsed[lease_id]
        if d.act in PARKED:
            entry, hold = parked if parked is not None else adopted or (None, None)
            on = _On(hold, entry)
        elif d.act in LAPSED:
            on = _On(lapsed)
        elif d.act in REVOKED:
            on = _On(unreleased[0] if unreleased is not None else None)
        else:
            on = _On(g.holder)
        if d.adopt:  # a presumptive holder (holding or parked) shows its lease: from now on its only one
            on.held().lease_id, on.held().epoch = lease_id, epoch
            g.epoch = max(g.epoch, epoch)
            self.remember(lease_id)
        if d.act in (Act.REVOKED_PART, Act.REVOKED_NOTE):
            self._note_revoked(d, job_id, epoch, on.hold, request_id or "")
        if d.refused:
            raise StaleLease(f"group {g.id}: {d.refusal}")
        return d, on

    def _note_revoked(self, d: LeaseCall, job_id: str, epoch: int, h: Hold | None, request_id: str) -> None:
        """A release under a revoked `app` lease is noted before its refusal: its caller's part
        ends, and once no caller is left its engine may sleep (the group dispatches)."""
        g = self._g
        if d.act is Act.REVOKED_PART and h is not None:
            g.callers.released_part(h, request_id)
            return
        log.info("release of an unreleased hold noted group=%s job=%s epoch=%d: its engine may sleep", g.id,
                 job_id, epoch)
        g.awake.released(job_id)
        g.record_placement()
        g.dispatch()
        g.idle.refresh_memory()


@dataclass
class _On:
    """What a call acts on: a hold (parked, lapsed, revoked or holding), a parked hold's entry."""

    hold: Hold | None  # (None only where the act touches no hold: a refusal, a hold made anew)
    entry: Waiter | None = None

    def held(self) -> Hold:
        assert self.hold is not None, "the decision acts on a hold"
        return self.hold


def _lease(h: Hold | None) -> Lease | None:
    return None if h is None else Lease(h.job_id, h.lease_id, h.epoch, h.past_epochs, frozenset(h.request_ids))
