"""LockGroup: the lock of one group, its holder, lease, epoch and queue.

Owned by `Orchestrator`; called by the gRPC servicer. Single-threaded on the event
loop: every method runs to completion between awaits, so state changes are atomic.
Its collaborators, each owning its own state: `MemoryMoves` (moves.py: when and what to
checkpoint and restore, the switch in progress), `IdleRestores` (idle_restores.py),
`Preemption` (preemption.py: `maxHoldSeconds` and preempted holders), `Leases`
(leases.py); `takeover.py` adopts recorded state; types and views are in group_model.py.

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
import uuid
from collections import deque
from collections.abc import Callable

from timeslice.controller.orchestrator import takeover
from timeslice.controller.orchestrator.awake_engines import AwakeEngines
from timeslice.controller.orchestrator.callers import Callers
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.exits import wait_for_exits
from timeslice.controller.orchestrator.group_model import (
    ADOPTED,
    Counters,
    GrantInfo,
    GroupEvent,
    GroupView,
    Hold,
    JobCounters,
    Switcher,
    SwitchRecord,
    group_view,
)
from timeslice.controller.orchestrator.idle_restores import IdleRestores
from timeslice.controller.orchestrator.leases import Leases
from timeslice.controller.orchestrator.lock_queue import LockQueue, Waiter
from timeslice.controller.orchestrator.moves import MemoryMoves
from timeslice.controller.orchestrator.preemption import PREEMPTED, Preemption
from timeslice.controller.orchestrator.residency import Residency
from timeslice.controller.orchestrator.state_file import StateFile
from timeslice.driver.errors import AcquireTimeout, JobFailed, StaleLease, SwitchFailed, Unavailable

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
        return self.moves.switching

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
        h = self.holder
        if h is not None and h.job_id == job_id and self.memory_aware:
            # a process that joins may be the next one of a job whose holder was killed: it grows beside
            # what the ended one still holds (schedules seed 8): exits.py. It shows the job alive meanwhile.
            self.leases.renew(h)
            await wait_for_exits(self.switcher, self.spec, job_id, self.residency.peaks, timeout)
            if self.spec.members and self.spec.member(job_id) is None:
                raise Unavailable(f"group {self.id}: job {job_id}'s claim set moved to another group while it "
                                  "waited to join its hold; ask again")
            h = self.holder  # (it may have ended meanwhile: then the caller waits its turn below)
        if h is not None and h.job_id == job_id and h.processes_ended:
            # cooperative schedules seed 30009: the holder's process was killed holding, the job's next
            # process joined its hold at once and ran out of memory beside the ended one's bytes, which the
            # GPU still held: a new process waits its turn, planned on a fresh report
            self.end_hold(h, "its processes ended, and a new one of the job asks")
            self.record_placement()
            h = None
        if h is not None and h.job_id == job_id:  # another process (or thread) of the holder joins its hold
            h.request_ids.add(request_id)
            # A joining caller shows the job alive: its lease runs again from now (none schedules seed
            # 896: a job's process was killed holding, its next process joined phase after phase, each
            # shorter than a keep-alive interval, and the lease lapsed under it)
            self.leases.renew(h)
            if self.state is not None:  # the hold's epoch (a presumptive one's block) on disk first
                try:
                    await self.state.durable()
                except BaseException as err:  # (its caller went away, or the write failed): not a caller of it
                    h.request_ids.discard(request_id)
                    if isinstance(err, OSError):
                        raise SwitchFailed(f"group {self.id}: cannot persist the fencing epoch: {err}") from None
                    raise
            return self._grant_info(h, waited=0.0)
        if job_id in self.failed_jobs:
            raise JobFailed(f"group {self.id}: job {job_id} failed: {self.failed_jobs[job_id]} (it is not "
                               "retried: restart the job, which drops it)")
        if member is not None:
            priority = member.priority
        w = self.queue.by_request(job_id, request_id)
        if w is not None:
            w.callers += 1
        else:
            w = self.queue.push(request_id, job_id, priority, self.clock(),
                                asyncio.get_running_loop().create_future(), timeout)
            w.owner = self
            log.debug("queued group=%s job=%s priority=%d position=%d", self.id, job_id, priority,
                      len(self.queue) - 1)
            self.dispatch()
            self.preemption.arm()
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
        ends with the last one's release, or its lease. A late release under a lease that
        lapsed here on a backend that stops processes is accepted (`Leases.released_lapsed`);
        one under an `app` lease that was revoked or lapsed is noted, then refused
        (`Leases.refuse_revoked`). Returns (waiters, switch started); (0, False) when other
        callers still hold. Raises StaleLease."""
        parked = self.preemption.entry(job_id, lease_id, epoch)
        if parked is not None and self.callers.released_part(parked[1], request_id):
            return 0, False  # nothing is handed over: the job's other callers hold on
        if parked is not None:
            self.preemption.forget(parked[0])
            self.queue.remove(parked[0])
            self.preemption.disarm_when_unwaited()
            log.info("preempted holder released group=%s job=%s", self.id, job_id)
            self.notify("released", job_id, epoch)
            self.dispatch()
            return len(self.queue), self.switching is not None
        if self.leases.released_lapsed(job_id, lease_id, epoch):  # its hold ended with its lease: nothing to do
            return len(self.queue), self.switching is not None
        self.leases.refuse_revoked(job_id, lease_id, epoch, "release", request_id)
        h = self.leases.check(job_id, lease_id, epoch, "release")
        if self.callers.released_part(h, request_id):
            return 0, False
        self.end_hold(h, "released")
        waiters = len(self.queue)
        self.notify("released", job_id, epoch)
        self.dispatch()
        self.idle.refresh_memory()
        return waiters, self.switching is not None

    def cancel(self, job_id: str, request_id: str) -> str:
        """CancelAcquire of `job_id`'s request `request_id`: `Callers.gave_up`."""
        return self.callers.gave_up(job_id, request_id)

    def keep_alive(self, job_id: str, lease_id: str, epoch: int) -> float:
        """Extend the lease; returns the seconds it now has (a preempted holder's lease
        waits with it and does not lapse). A keep-alive for a lease this group does not
        know (granted by an earlier leader), from a job that is checkpointed here, comes
        from a holder switched out mid-phase under that leader (preempted, or lapsed while
        cut off): its process is stopped on the GPU, so it is queued again with that lease
        rather than left stopped for good (`takeover.requeue_switched_out`); so is a late
        keep-alive under a lease that lapsed here on a backend that stops processes
        (`Leases.requeue_lapsed`). One under an `app` lease that was revoked or lapsed is
        refused (`Leases.refuse_revoked`). Raises StaleLease."""
        parked = self.preemption.entry(job_id, lease_id, epoch)
        if parked is not None:
            parked[1].lease_deadline = self.clock() + self.spec.lease_seconds
            return self.spec.lease_seconds
        self.leases.refuse_revoked(job_id, lease_id, epoch, "keep-alive")
        if takeover.requeue_switched_out(self, job_id, lease_id, epoch) or \
                self.leases.requeue_lapsed(job_id, lease_id, epoch):
            return self.spec.lease_seconds
        self.leases.renew(self.leases.check(job_id, lease_id, epoch, "keep-alive"))
        return self.spec.lease_seconds

    def drop_job(self, job_id: str, reason: str) -> None:
        """Forget a job that is gone: its waiters fail, its hold ends, its records go. A holder
        dropped while its processes may still compute (a force-deleted pod, a dropped claim
        set) is fenced first: nobody is granted until a switch has checkpointed (or frozen, or
        found gone) its processes; then, like a job dropped while checkpointed, it is
        restored when the group is idle (and fits), then forgotten: none of its processes
        stays stopped without an owner."""
        self.fail_job(job_id, StaleLease(f"group {self.id}: job {job_id} dropped: {reason}"))
        self.preemption.disarm_when_unwaited()
        held = self.holder is not None and self.holder.job_id == job_id
        if held:
            self.end_hold(self.holder, f"dropped: {reason}")  # type: ignore[arg-type]
        self.moves.dropped(job_id, held)
        self.record_placement()
        self.idle.forget(job_id)
        self.failed_jobs.pop(job_id, None)
        self.job_counters.pop(job_id, None)
        self.dispatch()
        self.idle.refresh_memory()

    def adopted_holder_gone(self, job_id: str) -> bool:
        """The adopted (presumptive) holder `job_id` has no process left (`timeslice serve`
        knows from the bindings it keeps in its state dir): dropped now (`drop_job`), rather
        than the next job waiting out its lease. Returns whether it was dropped: not when
        `job_id` is not the adopted holder (its client showed its lease since)."""
        h = self.holder
        if h is None or h.job_id != job_id or h.lease_id != ADOPTED:
            return False
        self.drop_job(job_id, "its processes are gone (found at restart)")
        return True

    def leave(self, job_id: str) -> str:
        """A process of `job_id` is done with the group (`Leave`). A job that neither holds
        nor waits is dropped (`drop_job`: if its state is off the GPUs, or being moved off,
        it is restored once the group is idle, then forgotten; if it is on them, it is never
        moved again). Returns "left", or "busy" when the job holds or waits (holding with no
        waiter: `AwakeEngines.left_holding`)."""
        waits = any(w.job_id == job_id for w in self.queue)
        if self.holder is not None and self.holder.job_id == job_id:
            if not waits:
                self.awake.left_holding(job_id)
            return "busy"
        if waits:
            return "busy"
        if job_id in self.residency.residents or job_id in self.residency.checkpointed:
            log.info("job left group=%s job=%s", self.id, job_id)
            self.drop_job(job_id, "its processes are done with the group")
        return "left"

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
        self.leases.stop()
        self.preemption.stop_clock()
        await self.moves.close()
        await self.awake.close()
        await self.idle.close()

    # -- internals -------------------------------------------------------------
    def job_started(self, job_id: str) -> None:
        """A new process of `job_id` connected with none of its earlier ones connected and no
        checkpoint of its own (cooperative): it settles its memory afresh
        (`Residency.started`), and a hold during which every stream of the job closed is its
        ended processes' (`Hold.processes_ended`; a job's first stream that opens in its first
        hold, or a stream that reconnects, ends nothing)."""
        self.residency.started(job_id)
        h = self.holder
        if h is not None and h.job_id == job_id and h.streams_closed:
            h.processes_ended = True

    def end_hold(self, h: Hold, why: str) -> None:
        now = self.clock()
        held = max(0.0, now - h.granted_at)
        self.counters.held_seconds += held
        self.job_counters.setdefault(h.job_id, JobCounters()).held_seconds += held
        self.recent_holds.append((h.granted_at, now))
        log.info("hold ended group=%s job=%s epoch=%d held=%.3fs reason=%s", self.id, h.job_id,
                 h.epoch, held, why)
        self.holder = None
        h.ended = True
        # a hold that ended otherwise than by its release (lease lapsed, preempted, its caller
        # left) may still compute and grow unwatched: it does not settle its job
        self.residency.hold_ended(h.job_id, observed=why == "released")
        self.leases.stop()
        self.preemption.stop_clock()

    def fail_job(self, job_id: str, err: Exception) -> None:
        """Every waiter of `job_id` leaves the queue with `err` (a preempted holder's entry
        too: its client learns it on its next keep-alive)."""
        for w in self.queue.pop_job(job_id):
            self.preemption.forget(w)
            if not w.future.done():
                w.future.set_exception(err)
                w.future.exception()  # retrieved here: the caller may be gone already

    def _count_moves(self, record: SwitchRecord) -> None:
        """A switch that succeeded: what it moved, per job (`JobCounters`) of the jobs counted
        since their grant or hold (a dropped job moved off, or restored for nobody, is not)."""
        for job, n in record.checkpointed_by_job.items():
            if (jc := self.job_counters.get(job)) is not None and job not in record.gone:
                jc.checkpoints += 1
                jc.bytes_checkpointed += n
        if record.restore_seconds and (jc := self.job_counters.get(record.to_job)) is not None:
            jc.restores += 1
            jc.bytes_restored += record.bytes_restored

    def notify(self, kind: str, job_id: str, epoch: int = 0, record: SwitchRecord | None = None,
                waited: float = 0.0) -> None:
        if kind == "switched" and record is not None:
            self._count_moves(record)
        if self._observer is None:
            return
        try:
            self._observer(self, GroupEvent(kind, self.id, job_id, epoch, record, waited))
        except Exception:  # an observer must never break the lock
            log.exception("group observer failed group=%s event=%s", self.id, kind)

    def dispatch(self) -> None:
        """Do what the group's decision core says now (`decisions.decide`, run by
        `MemoryMoves.dispatch`): grant the head waiter (or the resident one that goes first)
        if the lock is free, moving memory first when needed; while a job holds, stage the
        next one; while a staging runs, grant the job it keeps room beside."""
        self.moves.dispatch()

    def grant(self, job_id: str, restored: bool, switch_seconds: float) -> None:
        """Grant `job_id`'s waiters one hold. Never while another job holds: that is a bug of
        the caller (randomized schedules seed 252: a grant confirmed by the agents after
        another job's grant), logged, and the waiters stay queued."""
        if self.holder is not None and self.holder.job_id != job_id:
            log.error("grant of %s refused group=%s: job %s holds (epoch %d); it stays queued", job_id, self.id,
                      self.holder.job_id, self.holder.epoch)
            return
        self.residency.held(job_id)
        self.moves.granted(job_id)
        self.idle.granted(job_id)
        waiters = [w for w in self.queue.pop_job(job_id) if not w.future.done()]
        if not waiters:  # every caller of the job left during the switch
            self.dispatch()
            return
        now = self.clock()
        durable = None  # unpersisted, a restart could repeat the epoch or forget the holder: delivered once written
        if self.state is not None:
            self.state.reserve(self.id, self.epoch + 1)
            takeover.persist_placement(self, job_id)
            durable = self.state.durable()
        self.epoch += 1
        self.counters.grants += 1
        jc = self.job_counters.setdefault(job_id, JobCounters())
        jc.grants += 1
        jc.waited_seconds += max(now - w.enqueued_at for w in waiters)
        restored = self.awake.woken(job_id) or restored  # an engine woken since its last grant: said so
        parked = next((self.preemption.forget(w) for w in waiters if w.request_id.startswith(PREEMPTED)), None)
        lease_id = parked.lease_id if parked else uuid.uuid4().hex  # a preempted holder keeps its lease
        self.leases.remember(lease_id)
        h = Hold(job_id, lease_id, self.epoch, now, now + self.spec.lease_seconds,
                 # a parked entry's own id is no caller: its client releases under its first request id
                 {w.request_id for w in waiters if not w.request_id.startswith(PREEMPTED)}
                 | (parked.request_ids if parked else set()), restored,
                 switch_seconds, max(w.priority for w in waiters),
                 parked.past_epochs | {parked.epoch} if parked else frozenset())
        self.holder = h
        if durable is None or durable.done():  # (done at once only when nothing was pending)
            self._deliver(h, waiters, now)
        else:
            durable.add_done_callback(lambda f: self._persisted(h, waiters, now, f))
        log.info("granted group=%s job=%s epoch=%d restored=%s", self.id, job_id, h.epoch, restored)
        self.notify("granted", job_id, h.epoch, waited=max(now - w.enqueued_at for w in waiters))
        self.leases.arm()
        self.preemption.arm()
        self.moves.watch_holder()
        self.moves.dispatch()  # (stages the next job)

    def _deliver(self, h: Hold, waiters: list[Waiter], granted_at: float) -> None:
        for w in waiters:
            if not w.future.done():  # (a caller that left meanwhile)
                w.future.set_result(self._grant_info(h, waited=granted_at - w.enqueued_at))

    def _persisted(self, h: Hold, waiters: list[Waiter], granted_at: float, written: asyncio.Future[None]) -> None:
        """The state file answered for the grant of `h`: deliver it, or (the write failed, or
        the hold ended meanwhile) fail its waiters with SwitchFailed, their clients ask again,
        and end the hold: none is granted unpersisted."""
        err = written.exception()
        if err is None and not h.ended:  # (held here, or in the group it was carried to)
            # the lease runs from the delivery: a slow write must not eat the client's lease
            h.lease_deadline = max(h.lease_deadline, self.clock() + self.spec.lease_seconds)
            self._deliver(h, waiters, granted_at)
            return
        why = f"cannot persist the fencing epoch and holder: {err}" if err is not None else \
            "its hold ended before its fencing epoch and holder were persisted"
        log.error("grant withdrawn group=%s job=%s epoch=%d: %s", self.id, h.job_id, h.epoch, why)
        for w in waiters:
            self.preemption.forget(w)  # a preempted holder's entry too: its keep-alives now fail
            if not w.future.done():
                w.future.set_exception(SwitchFailed(f"group {self.id}: {why}"))
                w.future.exception()  # retrieved here: a preempted holder's entry has no caller
        if self.holder is h:
            self.end_hold(h, "not persisted")
            self.dispatch()  # the next job's grant meets the same refusal while the file cannot be written

    def _grant_info(self, h: Hold, waited: float) -> GrantInfo:
        return GrantInfo(h.lease_id, h.epoch, self.spec.lease_seconds, waited, h.restored, h.switch_seconds)
