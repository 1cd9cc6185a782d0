"""LockGroup: the lock of one group, its holder, lease, epoch and queue.

Owned by `Orchestrator`; called by the gRPC servicer. Single-threaded on the event
loop: every method runs to completion between awaits, so state changes are atomic.
The group's decisions of what to grant and move are `decisions.py` (pure), run by
`MemoryMoves` (moves.py); a hold's life is holds.py, a job's departure departures.py
(the whole map: `orchestrator/__init__.py`).

Rules (DESIGN.md, "Lock groups and the orchestrator"):
- One holding job at a time; every grant increments the fencing `epoch`.
- Waiters are granted by priority, then FIFO; all waiters of the granted job are
  granted together (a job's processes share its hold: one that asks while it is held
  joins at once, on memory-aware groups once ended processes' memory is freed: exits.py;
  the hold ends with the last caller's release). Under residency `auto` a waiter
  whose grant would move memory may be passed by resident waiters of its priority for
  at most `resident_first_seconds` (one switch per run of phases, not per phase).
- The holder's lease lapses `lease_seconds` after the grant or the last keep-alive;
  a lapsed holder loses the lock and the next waiter is granted once it left the GPUs.
  A late keep-alive is a starved holder, not a dead one: see leases.py.
- `maxHoldSeconds`: see preemption.py.
- In a cluster (members known) a job queues at its claim set's configured priority, not
  at the priority its client asks for: a pod cannot jump the queue.
- A waiter whose caller left (disconnect, timeout) is removed and never granted; a
  grant whose only caller left in the same instant is revoked at once.
- A release with nobody waiting moves nothing: the job stays resident and its next
  acquire is immediate.
- A failed switch is rolled back by the `Switcher`; the incoming job's waiters get
  `SwitchFailed` and the group serves the next waiter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from timeslice.controller.orchestrator import departures, holds, takeover
from timeslice.controller.orchestrator.awake_engines import AwakeEngines
from timeslice.controller.orchestrator.callers import Callers
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.group_model import (
    Counters,
    GrantInfo,
    GroupEvent,
    GroupView,
    Hold,
    JobCounters,
    Switcher,
    SwitchRecord,
    count_moves,
    group_view,
)
from timeslice.controller.orchestrator.idle_restores import IdleRestores
from timeslice.controller.orchestrator.leases import Leases
from timeslice.controller.orchestrator.lock_queue import LockQueue
from timeslice.controller.orchestrator.moves import MemoryMoves
from timeslice.controller.orchestrator.preemption import Preemption
from timeslice.controller.orchestrator.residency import Residency
from timeslice.controller.orchestrator.state_file import StateFile
from timeslice.driver.errors import AcquireTimeout, Unavailable

log = logging.getLogger("timeslice.orchestrator")

Observer = Callable[["LockGroup", GroupEvent], None]  # told every `GroupEvent`; must not raise

RECENT_SWITCHES = 16
RECENT_HOLDS = 512  # (granted, ended) clock() seconds of the last holds: `move_cost.held_since`


class LockGroup:
    def __init__(self, spec: GroupSpec, switcher: Switcher,
                 clock: Callable[[], float] = time.monotonic, observer: Observer | None = None,
                 state: StateFile | None = None) -> None:
        """`state`: where the epoch and placement are persisted before a grant (standalone)."""
        self.state = state
        self.spec = spec
        self._observer = observer
        self.switcher = switcher
        self.clock = clock
        self.queue = LockQueue()
        self.holder: Hold | None = None
        self.residency = Residency()
        self.epoch = 0
        self.counters = Counters()
        self.job_counters: dict[str, JobCounters] = {}  # job -> its totals (`JobCounters`)
        self.recent: deque[SwitchRecord] = deque(maxlen=RECENT_SWITCHES)
        self.recent_holds: deque[tuple[float, float]] = deque(maxlen=RECENT_HOLDS)
        self.failed_jobs: dict[str, str] = {}  # job -> why it failed (acquires refused until it is dropped)
        self.warnings: tuple[str, ...] = ()  # configuration conflicts among its claims (set by the reconciler)
        self.moves = MemoryMoves(self)
        self.awake = AwakeEngines(self)
        self.idle = IdleRestores(self)
        self.preemption = Preemption(self)
        self.leases = Leases(self)
        self.callers = Callers(self)

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def switching(self) -> tuple[str | None, str] | None:
        """(first evicted job or None, incoming job) while a switch runs."""
        return self.moves.runner.switching

    @property
    def phase(self) -> str:
        return "held" if self.holder else ("switching" if self.switching else "idle")

    @property
    def resident(self) -> str | None:
        """The most recently held resident job (None: none)."""
        return self.residency.most_recent

    @property
    def checkpointed(self) -> set[str]:
        return self.residency.checkpointed

    @property
    def memory_aware(self) -> bool:
        return self.moves.memory_aware

    # -- RPC entry points ------------------------------------------------------
    async def acquire(self, job_id: str, priority: int, request_id: str,
                      timeout: float | None, memory: int = 0) -> GrantInfo:
        """Wait for a grant; `timeout` seconds or None. `memory`: bytes per GPU the job
        declares it needs (0: none; a claim set's configured value wins). Raises
        AcquireTimeout, SwitchFailed, JobFailed (the job failed for good: see
        `MemoryMoves`), or CancelledError when the caller goes away (the entry is withdrawn
        first)."""
        member = self.spec.member(job_id)
        memory = member.memory if member is not None and member.memory else memory
        if memory:
            self.residency.declare(job_id, memory)
        w = await holds.admit(self, job_id, request_id, priority, timeout)
        if isinstance(w, GrantInfo):
            return w
        try:
            return await asyncio.wait_for(asyncio.shield(w.future), timeout)
        except TimeoutError:
            (w.owner or self).callers.left(w)  # its group now: it moves when groups re-form
            raise AcquireTimeout(f"group {self.id}: no grant within {timeout} s") from None
        except asyncio.CancelledError:
            (w.owner or self).callers.lost(w)
            raise
        except BaseException:
            (w.owner or self).callers.left(w)
            raise

    def release(self, job_id: str, lease_id: str, epoch: int, request_id: str = "") -> tuple[int, bool]:
        """End the hold (or, for a preempted holder, its place in the queue: it stays
        checkpointed). With `request_id` (the caller's Acquire), while other callers of the
        job share the hold (the pods of one unit), only that caller's part ends: the hold
        ends with the last one's release, or its lease. Which lease it shows and what that
        does (a lapsed one, a revoked `app` one) is `lease_calls.lease_call`. Returns
        (waiters, switch started); (0, False) when other callers still hold. Raises
        StaleLease."""
        return self.leases.release(job_id, lease_id, epoch, request_id)

    def cancel(self, job_id: str, request_id: str) -> str:
        """CancelAcquire of `job_id`'s request `request_id`: `Callers.gave_up`."""
        return self.callers.gave_up(job_id, request_id)

    def keep_alive(self, job_id: str, lease_id: str, epoch: int, request_id: str = "", confirm: bool = False,
                   lost: bool = False) -> float:
        """Extend the lease; returns the seconds it now has (a preempted holder's lease
        waits with it and does not lapse). A holder switched out mid-phase under an earlier
        leader, or whose lease lapsed here, on a backend that stops processes, is queued
        again under that lease; one under a revoked `app` lease is refused: the rules are
        `lease_calls.lease_call`. With `request_id` (the caller's Acquire), that caller's part of
        a shared hold is marked kept alive (`Callers.prune_parts`). `confirm`: the client saw its
        grant late; refused unless it renews the holder's lease. `lost`: the client lost the
        lease and only says that it lives (0.0). Any call notes that a client of the job lives
        (`AwakeEngines.heard`). Raises StaleLease."""
        self.awake.heard(job_id)
        if lost:
            return 0.0
        self.leases.keep_alive(job_id, lease_id, epoch, request_id, confirm)
        return self.spec.lease_seconds

    def drop_job(self, job_id: str, reason: str, gone: bool = False) -> None:
        """Forget a job that is gone (`gone`: no process of it is left, or its claim set was
        dropped, its pods gone or going): `departures.drop`."""
        departures.drop(self, job_id, reason, gone)

    def adopted_holder_gone(self, job_id: str) -> bool:
        """The adopted holder `job_id` has no process left: `departures.adopted_holder_gone`."""
        return departures.adopted_holder_gone(self, job_id)

    def seen_live(self, job_id: str) -> None:
        """A node agent reported a process of `job_id` live: `Leases.seen_live`."""
        self.leases.seen_live(job_id)

    def leave(self, job_id: str) -> str:
        """A process of `job_id` is done with the group (`Leave`): `departures.leave`."""
        return departures.leave(self, job_id)

    def adopt(self, resident: str | None, checkpointed: set[str], epoch: int,
              must_leave: set[str] | frozenset[str] = frozenset(),
              residents: set[str] | frozenset[str] = frozenset()) -> None:
        """Take over after a leader change or a restart: `takeover.adopt`."""
        takeover.adopt(self, resident, checkpointed, epoch, must_leave, residents)

    def record_placement(self, incoming: str | None = None) -> None:
        """Persist who may be computing or on the GPUs: `takeover.record_placement`."""
        takeover.record_placement(self, incoming)

    def view(self) -> GroupView:
        return group_view(self.spec, now=self.clock(), phase=self.phase, epoch=self.epoch, holder=self.holder,
                          queue=self.queue, residency=self.residency, memory_aware=self.memory_aware,
                          counters=self.counters, recent=self.recent, warnings=self.warnings,
                          job_counters=self.job_counters)

    async def close(self) -> None:
        """Stop the group (removed, or its orchestrator stops): its timers and tasks end, and
        whoever still waits gets Unavailable (retryable: the client asks again, where its claim
        set is now)."""
        for job in {w.job_id for w in self.queue}:
            self.fail_job(job, Unavailable(f"group {self.id} was removed while job {job} waited; ask again"))
        self.leases.stop()
        self.preemption.stop_clock()
        await self.moves.close()
        await self.awake.close()
        await self.idle.close()

    # -- internals -------------------------------------------------------------
    def job_started(self, job_id: str) -> None:
        """A new process of `job_id` connected, none of its earlier ones connected: `holds.started`."""
        holds.started(self, job_id)

    def end_hold(self, h: Hold, why: str) -> None:
        """The hold `h` ends (`why`: "released", or how else): `holds.end`."""
        holds.end(self, h, why)

    def fail_job(self, job_id: str, err: Exception) -> None:
        """Every waiter of `job_id` leaves the queue with `err` (a preempted holder's entry
        too: its client learns it on its next keep-alive)."""
        for w in self.queue.pop_job(job_id):
            self.preemption.forget(w)
            if not w.future.done():
                w.future.set_exception(err)
                w.future.exception()  # retrieved here: the caller may be gone already

    def notify(self, kind: str, job_id: str, epoch: int = 0, record: SwitchRecord | None = None,
                waited: float = 0.0) -> None:
        if kind == "switched" and record is not None:
            count_moves(self.job_counters, record)
        if self._observer is None:
            return
        try:
            self._observer(self, GroupEvent(kind, self.id, job_id, epoch, record, waited))
        except Exception:  # an observer must never break the lock
            log.exception("group observer failed group=%s event=%s", self.id, kind)

    def dispatch(self) -> None:
        """Do what the group's decision core says now (`decisions.decide`, run by
        `MemoryMoves.dispatch`): a grant, a switch, a staging, or nothing."""
        self.moves.dispatch()

    def grant(self, job_id: str, restored: bool, switch_seconds: float) -> None:
        """Grant `job_id`'s waiters one hold (`holds.grant`)."""
        holds.grant(self, job_id, restored, switch_seconds)
