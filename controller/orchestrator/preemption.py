"""Preemption: the `maxHoldSeconds` clock of a group's holder, and its preempted holders.

Owned by `LockGroup` (one per group). The clock counts from the moment another job waits
at the holder's priority or above (no such waiter, no limit); past it the holder is
preempted (not while a checkpoint would leave it running: on `cuda`, before its first CUDA
call; looked at again every `RECHECK_SECONDS`). With a checkpointing backend it is *parked*:
switched out like a releasing holder and queued again behind the jobs already waiting at
its priority under its own lease (its keep-alives and release stay valid, the lease does
not lapse while it waits), and restored when its turn comes, so the preemption is invisible to its code. With `none`
(nothing to checkpoint) or `cooperative` its lease is revoked like a lapsed one. With `app`
too: the agent puts the job's engine to sleep but does not stop its client, which may be
mid-phase, sending requests that a sleeping engine fails; and a wake under a hold its
client believes uninterrupted would not tell it that its engine reloaded (vLLM level 2
discards the weights). With `vmm` as well: its shim moves the memory of a process that
nothing stops, whose kernels would then find their memory unmapped. Its keep-alives and
release are refused (its client raises `LeaseLost`), and its memory moves (its engine
sleeps) only once its client released (`AwakeEngines`); its next grant is a new one,
restored.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator.decisions import Waiting
from timeslice.controller.orchestrator.group_model import Hold
from timeslice.controller.orchestrator.hold_limits import AfterSwitch, Later, LimitFacts, Preempt, contended, hold_limit
from timeslice.controller.orchestrator.lock_queue import Waiter

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")

PREEMPTED = "*preempted*"  # request id prefix of a preempted holder's queue entry
RECHECK_SECONDS = 0.5  # a holder nothing could stop yet (`hold_limits.Later`) is looked at again this often


class Preemption:
    """The clock (`arm`, `disarm_when_unwaited`, `stop_clock`) and the parked holders of
    `group`, by lease id (`park`, `parked`, `forget`)."""

    def __init__(self, group: LockGroup) -> None:
        self._g = group
        self._timer: asyncio.TimerHandle | None = None
        self._parked: dict[str, tuple[Waiter, Hold]] = {}  # lease id -> a preempted holder's entry, hold
        self._due: tuple[Hold, float] | None = None  # a limit reached while a staging switch ran

    def parked_jobs(self) -> list[str]:
        return [h.job_id for _, h in self._parked.values()]

    # -- the clock ---------------------------------------------------------------
    def _limit(self, job_id: str) -> float | None:
        """The job's maxHoldSeconds (its member's, else the group's; None: no limit)."""
        member = self._g.spec.member(job_id)
        return member.max_hold_seconds if member is not None else self._g.spec.max_hold_seconds

    def arm(self) -> None:
        """Start the holder's clock when a contender waits and no clock runs yet."""
        h = self._g.holder
        if h is None or self._timer is not None or not self._contenders(h):
            return
        limit = self._limit(h.job_id)
        if limit is not None:
            self._timer = asyncio.get_running_loop().call_later(limit, self._on_limit, h, limit)

    def disarm_when_unwaited(self) -> None:
        """No other job waits any more: the clock stops, and starts again at the next arrival."""
        h = self._g.holder
        if self._timer is not None and (h is None or not self._contenders(h)):
            self.stop_clock()

    def stop_clock(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _contenders(self, h: Hold) -> bool:
        """Another job waits at the holder's priority or above (a lower one would only be
        passed over again: preempting for it would re-grant the holder at once)."""
        return contended(h.job_id, h.priority, (Waiting(w.job_id, w.priority) for w in self._g.queue))

    def _on_limit(self, h: Hold, limit: float) -> None:
        """The holder's clock ran out: what it does is `hold_limits.hold_limit`."""
        self._timer = None
        g = self._g
        d = hold_limit(LimitFacts(g.spec.backend, g.holder is h, g.switching is not None, h.job_id, h.priority,
                                  tuple(Waiting(w.job_id, w.priority) for w in g.queue),
                                  g.residency.unfenceable(h.job_id, g.spec.backend)))
        if isinstance(d, AfterSwitch):
            self._due = (h, limit)
        elif isinstance(d, Later):
            self._timer = asyncio.get_running_loop().call_later(RECHECK_SECONDS, self._on_limit, h, limit)
        if not isinstance(d, Preempt):
            return
        g.counters.preemptions += 1
        log.info("preempted group=%s job=%s epoch=%d max_hold_seconds=%g waiters=%d", g.id, h.job_id,
                 h.epoch, limit, len(g.queue))
        g.notify("preempted", h.job_id, h.epoch)
        why = f"maxHoldSeconds {limit:g} exceeded while others waited"
        g.end_hold(h, why)
        if d.revoke_kept:  # its memory moves (an engine sleeps) once its client released
            g.moves.lapsed(h.job_id, h, why)
            g.record_placement()  # it must leave before anyone is granted, also after a restart
        elif d.park:  # checkpointed by the switch, re-queued keeping its lease
            self.park(h)
        g.dispatch()

    def switch_ended(self) -> None:
        """A switch ended: a limit reached while it ran takes effect now."""
        due, self._due = self._due, None
        if due is not None:
            self._on_limit(*due)

    # -- parked holders ------------------------------------------------------------
    def park(self, h: Hold) -> None:
        """Queue a switched-out holder again under its lease (no RPC waits on the entry). Its
        keep-alives keep the lease; without them it lapses like any lease (its client died
        while it was out of the GPU): the entry goes, and the job is restored when the group
        is idle, then forgotten."""
        g = self._g
        w = g.queue.push(f"{PREEMPTED}{h.lease_id}", h.job_id, h.priority, g.clock(),
                         asyncio.get_running_loop().create_future())
        w.callers = 0  # nothing withdraws it
        self._parked[h.lease_id] = (w, h)
        h.lease_deadline = g.clock() + g.spec.lease_seconds
        asyncio.get_running_loop().call_later(g.spec.lease_seconds, self._on_parked_lease, h)

    def _on_parked_lease(self, h: Hold) -> None:
        g = self._g
        w = next((entry for entry, parked in self._parked.values() if parked is h), None)
        if w is None:
            return  # granted, released or dropped since
        if g.clock() < h.lease_deadline:
            asyncio.get_running_loop().call_later(h.lease_deadline - g.clock(), self._on_parked_lease, h)
            return
        self.forget(w)
        g.queue.remove(w)
        g.counters.lease_expiries += 1
        log.warning("lease expired while preempted group=%s job=%s epoch=%d: restored when idle", g.id, h.job_id,
                    h.epoch)
        g.notify("lease-expired", h.job_id, h.epoch)
        g.idle.unowned(h.job_id)
        self.disarm_when_unwaited()
        g.dispatch()
        g.idle.refresh_memory()

    def parked(self, lease_id: str) -> tuple[Waiter, Hold] | None:
        """The queue entry and suspended hold of the preempted holder keyed by `lease_id`
        (`ADOPTED`: a presumptive holder preempted before it showed its lease)."""
        return self._parked.get(lease_id)

    def forget(self, w: Waiter) -> Hold | None:
        """The suspended hold of `w` when `w` is a preempted holder's entry (now forgotten)."""
        if not w.request_id.startswith(PREEMPTED):
            return None
        _, h = self._parked.pop(w.request_id[len(PREEMPTED):], (None, None))
        return h
