"""LockGroup: the lock of one group, its holder, lease, epoch and resident job.

Owned by `Orchestrator`; called by the gRPC servicer. Single-threaded on the event
loop: every method runs to completion between awaits, so state changes are atomic.

Rules (DESIGN.md, "Lock groups and the orchestrator"):
- One holding job at a time; every grant increments the fencing `epoch`.
- Waiters are granted by priority, then FIFO; all waiters of the granted job are
  granted together (a job's processes share its hold). Under residency `auto` a waiter
  whose grant would move memory may be passed by resident waiters of its priority for
  at most `resident_first_seconds` (one switch per run of phases, not per phase).
- The holder's lease lapses `lease_seconds` after the grant or the last keep-alive;
  a lapsed holder loses the lock and the next waiter is granted.
- `maxHoldSeconds` (a member's, else the group's) counts from the moment another job
  waits at the holder's priority or above (no such waiter, no limit). Past it the
  holder is preempted: with a checkpointing backend it is switched out like a releasing
  holder and re-queued behind the jobs already waiting at its priority, keeping its
  lease (its keep-alives and release stay valid, the lease does not lapse while it
  waits), and restored when its turn comes, so the preemption is invisible to its code;
  with `none` (nothing to checkpoint) its lease is revoked like a lapsed one.
- In a cluster (members known) a job queues at its claim set's configured priority, not
  at the priority its client asks for: a pod cannot jump the queue.
- A waiter whose caller left (disconnect, timeout) is removed and never granted; a
  grant whose only caller left in the same instant is revoked at once.
- A release with nobody waiting moves nothing: the job stays resident and its next
  acquire is immediate.
- Residency (`residency.py`). Several jobs may be resident at once; the lock orders
  compute, memory moves only when needed. `auto` (the default, for the backends that
  move GPU memory): a resident waiter is granted at once; any other is granted after a
  plan over fresh node-agent memory reports checkpoints the least recently held idle
  residents it does not fit beside, then restores it when it is checkpointed. A plan
  without room fails the waiters with `SwitchFailed` (nothing attempted, not retried).
  When the group goes idle, checkpointed jobs that fit are restored in the background.
  `exclusive` (and the `freeze` backend, and agents that report no GPU memory): only
  one job is resident, as in a checkpoint at every hand-off.
- A failed switch is rolled back by the `Switcher`; the incoming job's waiters get
  `SwitchFailed` and the group serves the next waiter.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from timeslice.controller.orchestrator.config import MEMORY_BACKENDS, GroupSpec
from timeslice.controller.orchestrator.lock_queue import LockQueue, Waiter
from timeslice.controller.orchestrator.residency import (
    MemorySnapshot,
    NoRoom,
    Residency,
    lacking_room,
    parse_headroom,
    plan_room,
)
from timeslice.driver.errors import AcquireTimeout, StaleLease, SwitchFailed

log = logging.getLogger("timeslice.orchestrator")

RECENT_SWITCHES = 16
KNOWN_LEASES = 1024  # leases granted by this orchestrator, remembered per group (most recent)
ADOPTED = "*adopted*"  # lease id of a presumptive holder after a leader change
PREEMPTED = "*preempted*"  # request id prefix of a preempted holder's queue entry
# A job whose restore (or room for it) fails this many times in a row fails: its acquires are
# refused with the last cause until it is dropped (its pods restarted), and the group serves
# the others instead of repeating checkpoint(other) -> restore -> rollback at every acquire.
MAX_RESTORE_FAILURES = 3
# While a resident's processes are departing (see `SwitchCoordinator.departing`), a plan that
# finds no room asks for a fresh memory report this often, seconds.
DEPARTING_POLL_SECONDS = 0.25


@dataclass
class SwitchRecord:
    """One switch, as shown in status. Seconds and bytes summed over the group's nodes.
    `evicted`: every job checkpointed to make room (`from_job` is the first of them)."""

    from_job: str | None
    to_job: str
    ok: bool = True
    error: str = ""
    checkpoint_seconds: float = 0.0
    restore_seconds: float = 0.0
    bytes_checkpointed: int = 0
    bytes_restored: int = 0
    finished_at_unix: float = 0.0
    evicted: tuple[str, ...] = ()
    unreachable: bool = False  # failed only because agents did not answer: not the job's fault

    @property
    def seconds(self) -> float:
        return self.checkpoint_seconds + self.restore_seconds


class SwitchError(SwitchFailed):
    """Raised by a `Switcher`: the switch failed; `off_gpu` names the evicted jobs whose
    state the rollback could not put back on the GPUs (normally none)."""

    def __init__(self, message: str, record: SwitchRecord, off_gpu: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.record = record
        self.off_gpu = frozenset(off_gpu)


class Switcher(Protocol):
    """Moves GPU state for a group (`SwitchCoordinator`). `__call__(spec, evict, incoming,
    restore)`: checkpoint every job of `evict`, then restore `incoming` when `restore`;
    raises SwitchError. A switcher that can also report memory has `memory(spec, jobs) ->
    MemorySnapshot | None`; without it the group keeps one resident job. One that can tell
    residents whose memory is about to be freed has `departing(spec, jobs) -> list[str]`: a
    plan without room waits for them (bounded by their grace) instead of failing."""

    async def __call__(self, spec: GroupSpec, evict: Sequence[str], incoming: str,
                       restore: bool) -> SwitchRecord: ...


@dataclass(frozen=True)
class GroupEvent:
    """What happened in a group, for observers (claim status, Events, metrics): `kind` is
    "granted", "released", "switched", "switch-failed", "lease-expired", "preempted" or
    "job-failed" (its restore failed `MAX_RESTORE_FAILURES` times in a row).
    `waited_seconds` (a grant): the longest wait among the granted job's waiters, seconds."""

    kind: str
    group_id: str
    job_id: str
    epoch: int = 0
    record: SwitchRecord | None = None
    waited_seconds: float = 0.0


Observer = Callable[["LockGroup", GroupEvent], None]


@dataclass(frozen=True)
class GrantInfo:
    lease_id: str
    epoch: int
    lease_seconds: float
    waited_seconds: float
    restored: bool
    switch_seconds: float


@dataclass
class Hold:
    job_id: str
    lease_id: str
    epoch: int
    granted_at: float
    lease_deadline: float
    request_ids: set[str]
    restored: bool
    switch_seconds: float
    priority: int = 0
    past_epochs: frozenset[int] = frozenset()  # earlier grants of this lease (preempted, restored)
    # an adopted hold's callers are not known here (granted by an earlier leader): no caller
    # leaving ends it, only its release or its lease
    callers_unknown: bool = False


@dataclass
class Counters:
    """Totals since the group was created. `held_seconds`: seconds of ended holds (the
    current hold is `GroupView.held_seconds`)."""

    grants: int = 0
    switches: int = 0
    failed_switches: int = 0
    lease_expiries: int = 0
    preemptions: int = 0
    held_seconds: float = 0.0


@dataclass
class WaiterView:
    job_id: str
    priority: int
    waiting_seconds: float
    position: int


@dataclass
class GroupView:
    """A snapshot of a group for status output; times in seconds."""

    group_id: str
    backend: str
    phase: str
    epoch: int
    holder: Hold | None
    held_seconds: float
    lease_remaining_seconds: float
    waiters: list[WaiterView]
    resident_job: str | None
    checkpointed_jobs: list[str]
    counters: Counters
    recent_switches: list[SwitchRecord]
    agents: list[str]
    residency: str = "exclusive"
    resident_jobs: list[str] = field(default_factory=list)  # least recently held first
    peaks: dict[str, dict[str, int]] = field(default_factory=dict)  # job -> device -> bytes
    memory: MemorySnapshot | None = None


class LockGroup:
    def __init__(self, spec: GroupSpec, switcher: Switcher,
                 clock: Callable[[], float] = time.monotonic, observer: Observer | None = None,
                 reserve_epoch: Callable[[str, int], None] | None = None) -> None:
        """`reserve_epoch(group id, epoch)`: called before an epoch is granted (`EpochFloors`)."""
        self._reserve_epoch = reserve_epoch
        self.spec = spec
        self._observer = observer
        self._switcher = switcher
        self._clock = clock
        self.queue = LockQueue()
        self.holder: Hold | None = None
        self.residency = Residency()
        self.switching: tuple[str | None, str] | None = None
        self.epoch = 0
        self.counters = Counters()
        self.recent: deque[SwitchRecord] = deque(maxlen=RECENT_SWITCHES)
        self._switch_task: asyncio.Task[None] | None = None
        self._refresh_task: asyncio.Task[None] | None = None
        self._background_failed: set[str] = set()  # background restores that failed, until granted again
        self._restore_failures: dict[str, int] = {}  # job -> restores failed in a row
        self._fenced: set[str] = set()  # dropped holders to checkpoint before anyone is granted
        self._lapsed: set[str] = set()  # holders whose lease lapsed: checkpointed before anyone is granted
        self._orphans: set[str] = set()  # checkpointed jobs nobody will ask for: restored when idle, forgotten
        self.failed_jobs: dict[str, str] = {}  # job -> why it failed (acquires refused until it is dropped)
        self._lease_timer: asyncio.TimerHandle | None = None
        self._max_hold_timer: asyncio.TimerHandle | None = None
        self._preempted: dict[str, tuple[Waiter, Hold]] = {}  # lease id -> a preempted holder's entry, hold
        self._known_leases: OrderedDict[str, None] = OrderedDict()  # granted here (vs. by an earlier leader)

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def phase(self) -> str:
        return "switching" if self.switching else ("held" if self.holder else "idle")

    @property
    def resident(self) -> str | None:
        """The most recently held resident job (None: none)."""
        return self.residency.most_recent

    @property
    def checkpointed(self) -> set[str]:
        return self.residency.checkpointed

    @property
    def memory_aware(self) -> bool:
        """Residency `auto` on a backend that moves GPU memory, with a switcher that reports it."""
        return (self.spec.residency == "auto" and self.spec.backend in MEMORY_BACKENDS
                and hasattr(self._switcher, "memory"))

    # -- RPC entry points ------------------------------------------------------
    async def acquire(self, job_id: str, priority: int, request_id: str,
                      timeout: float | None) -> GrantInfo:
        """Wait for a grant; `timeout` seconds or None. Raises AcquireTimeout, SwitchFailed,
        or CancelledError when the caller goes away (the entry is withdrawn first)."""
        h = self.holder
        if h is not None and h.job_id == job_id:
            h.request_ids.add(request_id)
            return self._grant_info(h, waited=0.0)
        if job_id in self.failed_jobs:
            raise SwitchFailed(f"group {self.id}: job {job_id} failed: {self.failed_jobs[job_id]} (it is not "
                               "retried: restart the job, which drops it)")
        member = self.spec.member(job_id)
        if member is not None:
            priority = member.priority
        w = self.queue.by_request(job_id, request_id)
        if w is not None:
            w.callers += 1
        else:
            w = self.queue.push(request_id, job_id, priority, self._clock(),
                                asyncio.get_running_loop().create_future())
            log.debug("queued group=%s job=%s priority=%d position=%d", self.id, job_id, priority,
                      len(self.queue) - 1)
            self._dispatch()
            self._arm_max_hold_timer()
        try:
            return await asyncio.wait_for(asyncio.shield(w.future), timeout)
        except TimeoutError:
            self._withdraw(w)
            raise AcquireTimeout(f"group {self.id}: no grant within {timeout} s") from None
        except asyncio.CancelledError:
            if not self._keep_when_frozen(w):
                self._withdraw(w)
            raise
        except BaseException:
            self._withdraw(w)
            raise

    def _keep_when_frozen(self, w: Waiter) -> bool:
        """The last call waiting on `w` was cancelled (its connection was lost: the server's
        keep-alive pings went unanswered, `grpc_server.SERVER_OPTIONS`). When `w`'s job is
        checkpointed here, its processes are frozen or checkpointed by this group and cannot
        answer: `w` keeps its place with no caller, is granted in its turn (restoring the
        job), and its client, running again, asks with the same request id and receives that
        grant (or gives it up with CancelAcquire; a grant nobody takes lapses with its lease).
        Any other waiter whose connection is lost leaves the queue. True when kept."""
        if w.callers > 1 or w.job_id not in self.residency.checkpointed \
                or self.queue.by_request(w.job_id, w.request_id) is not w:
            return False
        w.callers = 0
        log.info("waiter kept group=%s job=%s request=%s: its connection was lost while its job is checkpointed "
                 "(frozen processes cannot answer); it keeps its place", self.id, w.job_id, w.request_id)
        return True

    def release(self, job_id: str, lease_id: str, epoch: int) -> tuple[int, bool]:
        """End the hold (or, for a preempted holder, its place in the queue: it stays
        checkpointed). Returns (waiters, switch started). Raises StaleLease."""
        parked = self._preempted_entry(job_id, lease_id, epoch)
        if parked is not None:
            self._forget_preempted(parked[0])
            self.queue.remove(parked[0])
            self._disarm_max_hold_when_unwaited()
            log.info("preempted holder released group=%s job=%s", self.id, job_id)
            self._notify("released", job_id, epoch)
            self._dispatch()
            return len(self.queue), self.switching is not None
        h = self._check_holder(job_id, lease_id, epoch, "release")
        self._end_hold(h, "released")
        waiters = len(self.queue)
        self._notify("released", job_id, epoch)
        self._dispatch()
        self._refresh_memory()
        return waiters, self.switching is not None

    def cancel(self, job_id: str, request_id: str) -> str:
        """The caller of `job_id`'s request `request_id` gave up: "queued" (the entry left the
        queue: the request is given up, whatever calls of it still wait), "granted" (its part
        of the hold ended, the hold with its last caller) or "unknown"."""
        w = self.queue.by_request(job_id, request_id)
        if w is not None:
            w.callers = 1  # every call of this request gave up
            self._withdraw(w)
            return "queued"
        h = self.holder
        if h is not None and h.job_id == job_id and request_id in h.request_ids:
            if self._caller_left_hold(h, request_id, "its caller gave up on the grant"):
                self._notify("released", job_id, h.epoch)
                self._dispatch()
            return "granted"
        return "unknown"

    def keep_alive(self, job_id: str, lease_id: str, epoch: int) -> float:
        """Extend the lease; returns the seconds it now has (a preempted holder's lease
        waits with it and does not lapse). A keep-alive for a lease this group does not
        know (granted by an earlier leader), from a job that is checkpointed here, comes
        from a holder switched out mid-phase under that leader (preempted, or lapsed while
        cut off): its process is stopped on the GPU, so it is queued again with that lease
        rather than left stopped for good. Raises StaleLease."""
        parked = self._preempted_entry(job_id, lease_id, epoch)
        if parked is not None:
            parked[1].lease_deadline = self._clock() + self.spec.lease_seconds
            return self.spec.lease_seconds
        h = self.holder
        if (h is None or h.job_id != job_id) and job_id in self.checkpointed and lease_id and lease_id != ADOPTED \
                and 0 < epoch <= self.epoch and lease_id not in self._known_leases:
            now = self._clock()
            member = self.spec.member(job_id)
            self._remember(lease_id)
            self._park(Hold(job_id, lease_id, epoch, now, now, set(), False, 0.0, member.priority if member else 0))
            log.warning("checkpointed holder queued again group=%s job=%s epoch=%d: it still keeps its lease alive",
                        self.id, job_id, epoch)
            self._dispatch()
            self._arm_max_hold_timer()
            return self.spec.lease_seconds
        h = self._check_holder(job_id, lease_id, epoch, "keep-alive")
        h.lease_deadline = self._clock() + self.spec.lease_seconds
        return self.spec.lease_seconds

    def drop_job(self, job_id: str, reason: str) -> None:
        """Forget a job that is gone: its waiters fail, its hold ends, its records go. A holder
        dropped while its processes may still compute (a force-deleted pod, a dropped claim
        set) is fenced first: nobody is granted until a switch has checkpointed (or frozen, or
        found gone) its processes; then it is forgotten. A job dropped while checkpointed is
        restored when the group is idle (and fits), then forgotten: none of its processes
        stays stopped without an owner."""
        self._fail_job(job_id, StaleLease(f"group {self.id}: job {job_id} dropped: {reason}"))
        self._disarm_max_hold_when_unwaited()
        held = self.holder is not None and self.holder.job_id == job_id
        if held:
            self._end_hold(self.holder, f"dropped: {reason}")  # type: ignore[arg-type]
        if (held or job_id in self._lapsed | self._fenced) and self.spec.backend != "none" \
                and job_id in self.residency.residents:  # dropped again while fenced: it stays fenced
            self._fenced.add(job_id)
        elif job_id in self.residency.checkpointed and self.spec.backend != "none":
            self._orphans.add(job_id)  # restored when the group is idle: no process stays stopped
        else:
            self.residency.forget(job_id)
        self._lapsed.discard(job_id)
        self._background_failed.discard(job_id)
        self._restore_failures.pop(job_id, None)
        self.failed_jobs.pop(job_id, None)
        self._dispatch()
        self._refresh_memory()

    def adopt(self, resident: str | None, checkpointed: set[str], epoch: int) -> None:
        """Take over after a leader change (only on an empty group). `resident` and
        `checkpointed` come from the node agents' records (the truth about GPU state);
        `epoch` is the last one recorded. The resident job becomes a *presumptive* holder:
        its next keep-alive or release with its old lease is accepted (and adopts that
        lease); if it was not holding, the hold lapses after one lease period."""
        if self.holder is not None or self.epoch or len(self.queue):
            return
        for job in checkpointed:
            self.residency.moved_out(job)
        if resident is not None:
            self.residency.held(resident)
        self.epoch = epoch
        if resident is not None:
            now = self._clock()
            member = self.spec.member(resident)
            self.holder = Hold(resident, ADOPTED, epoch, now, now + self.spec.lease_seconds, set(), False, 0.0,
                               member.priority if member is not None else 0, callers_unknown=True)
            self._arm_lease_timer()
        log.info("adopted group=%s resident=%s checkpointed=%s epoch=%d", self.id, resident, sorted(checkpointed),
                 epoch)

    def view(self) -> GroupView:
        now = self._clock()
        h = self.holder
        return GroupView(
            group_id=self.id, backend=self.spec.backend, phase=self.phase, epoch=self.epoch,
            holder=h, held_seconds=now - h.granted_at if h else 0.0,
            lease_remaining_seconds=max(0.0, h.lease_deadline - now) if h else 0.0,
            waiters=[WaiterView(w.job_id, w.priority, now - w.enqueued_at, i)
                     for i, w in enumerate(self.queue)],
            resident_job=self.resident, checkpointed_jobs=sorted(self.checkpointed),
            counters=Counters(**vars(self.counters)), recent_switches=list(self.recent),
            agents=list(self.spec.agents),
            residency=self.spec.residency if self.memory_aware else "exclusive",
            resident_jobs=list(self.residency.residents),
            peaks={j: dict(p) for j, p in self.residency.peaks.items()}, memory=self.residency.snapshot)

    async def close(self) -> None:
        for timer in (self._lease_timer, self._max_hold_timer):
            if timer is not None:
                timer.cancel()
        for task in (self._switch_task, self._refresh_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # -- internals -------------------------------------------------------------
    def _check_holder(self, job_id: str, lease_id: str, epoch: int, what: str) -> Hold:
        h = self.holder
        if h is not None and h.lease_id == ADOPTED and h.job_id == job_id:
            h.lease_id, h.epoch = lease_id, epoch  # the presumptive holder shows its lease
            self.epoch = max(self.epoch, epoch)
            self._remember(lease_id)
        if h is None or h.job_id != job_id or h.lease_id != lease_id or (h.epoch != epoch and
                                                                          epoch not in h.past_epochs):
            now = f"job {h.job_id} epoch {h.epoch}" if h else "nobody"
            raise StaleLease(f"group {self.id}: {what} by job {job_id} epoch {epoch} refused: "
                             f"the holder is {now} (lease lapsed or superseded)")
        return h

    def _end_hold(self, h: Hold, why: str) -> None:
        held = max(0.0, self._clock() - h.granted_at)
        self.counters.held_seconds += held
        log.info("hold ended group=%s job=%s epoch=%d held=%.3fs reason=%s", self.id, h.job_id,
                 h.epoch, held, why)
        self.holder = None
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None
        if self._max_hold_timer is not None:
            self._max_hold_timer.cancel()
            self._max_hold_timer = None

    def _fail_job(self, job_id: str, err: Exception) -> None:
        """Every waiter of `job_id` leaves the queue with `err` (a preempted holder's entry
        too: its client learns it on its next keep-alive)."""
        for w in self.queue.pop_job(job_id):
            self._forget_preempted(w)
            if not w.future.done():
                w.future.set_exception(err)
                w.future.exception()  # retrieved here: the caller may be gone already

    def _notify(self, kind: str, job_id: str, epoch: int = 0, record: SwitchRecord | None = None,
                waited: float = 0.0) -> None:
        if self._observer is None:
            return
        try:
            self._observer(self, GroupEvent(kind, self.id, job_id, epoch, record, waited))
        except Exception:  # an observer must never break the lock
            log.exception("group observer failed group=%s event=%s", self.id, kind)

    def _withdraw(self, w: Waiter) -> None:
        """A caller of `w` left. Once none is left, `w` is never (or no longer) granted."""
        w.callers -= 1
        if w.callers > 0:
            return
        if self.queue.remove(w):
            self._forget_preempted(w)
            self._disarm_max_hold_when_unwaited()
            log.info("withdrawn group=%s job=%s request=%s", self.id, w.job_id, w.request_id)
            self._dispatch()
            return
        h = self.holder
        if h is not None and w.request_id in h.request_ids:
            if self._caller_left_hold(h, w.request_id, "caller left before receiving the grant"):
                self._dispatch()

    def _caller_left_hold(self, h: Hold, request_id: str, why: str) -> bool:
        """The caller of `request_id` left the hold `h`; the hold ends with its last caller
        (never one whose callers are unknown: adopted). True when it ended."""
        h.request_ids.discard(request_id)
        if h.request_ids or h.callers_unknown:
            return False
        self._end_hold(h, why)
        return True

    def _dispatch(self) -> None:
        """Grant the head waiter if the lock is free, moving memory first when needed."""
        if self.holder is not None or self.switching is not None:
            return
        head = self.queue.head()
        if head is None:
            return
        incoming = self._next_job(head)
        r = self.residency
        restore = incoming in r.checkpointed
        if self.spec.backend == "none" or (self.memory_aware and incoming in r.residents
                                           and not self._must_leave(incoming) and self._roomy(incoming)):
            self._grant(incoming, restored=False, switch_seconds=0.0)
            return
        if self.memory_aware and not restore and not r.lru(excluding=[incoming]):
            self._grant(incoming, restored=False, switch_seconds=0.0)  # nobody to make room from
            return
        evict = None if self.memory_aware else r.lru(excluding=[incoming])
        if evict is not None and not evict and not restore:
            self._grant(incoming, restored=False, switch_seconds=0.0)
            return
        self._start_switch(evict, incoming, restore, grant=True)

    def _next_job(self, head: Waiter) -> str:
        """The job to grant next: the head waiter's, unless its grant would move memory and a
        waiter of its priority is resident and fits (residency `auto`): that one goes first,
        while the head has waited less than `resident_first_seconds`. Jobs that alternate on
        a GPU that holds only some of them then make one switch per run of phases instead of
        one per phase (measured on the H200: 3 jobs of 50.8 GB, 32 switches in strict order, 14 with
        this; bench/results/rl-grpo-b-h200.json)."""
        r = self.residency
        bound = self.spec.resident_first_seconds
        if not self.memory_aware or bound <= 0 or self._clock() - head.enqueued_at >= bound \
                or self._must_leave(""):  # a preempted or dropped holder leaves first anyway
            return head.job_id
        if head.job_id in r.residents and self._roomy(head.job_id):
            return head.job_id
        for w in self.queue:
            if w.priority == head.priority and w.job_id in r.residents and self._roomy(w.job_id):
                log.debug("resident first group=%s job=%s before=%s", self.id, w.job_id, head.job_id)
                return w.job_id
        return head.job_id

    def _start_switch(self, evict: list[str] | None, incoming: str, restore: bool, grant: bool) -> None:
        self.switching = (evict[0] if evict else None, incoming)
        self._switch_task = asyncio.get_running_loop().create_task(
            self._switch(evict, incoming, restore, grant), name=f"switch-{self.id}")

    async def _snapshot(self) -> MemorySnapshot | None:
        """Fresh memory reports of the group's jobs (None: the agents report no GPU memory)."""
        jobs = sorted({*self.residency.residents, *self.residency.checkpointed, *(w.job_id for w in self.queue)})
        snap = await self._switcher.memory(self.spec, jobs)  # type: ignore[attr-defined]
        if snap is None or not snap.devices:
            return None
        self.residency.observe(snap)
        return snap

    def _roomy(self, incoming: str) -> bool:
        """The last memory report leaves a resident `incoming` its growth plus twice the
        headroom (the holder that just released may have grown since that report): grant at
        once. Otherwise the grant waits for a fresh report and a plan."""
        snap = self.residency.snapshot
        if snap is None:
            return True
        fraction, fixed = parse_headroom(self.spec.memory_headroom)
        return not lacking_room(incoming, snap, self.residency.peaks, (2 * fraction, 2 * fixed))

    def _must_leave(self, incoming: str) -> list[str]:
        """Holders preempted mid-phase, dropped, or whose lease lapsed, that are still on the
        GPUs: they must leave whether or not the incoming job fits beside them (their
        processes may still be computing)."""
        jobs = [h.job_id for _, h in self._preempted.values()] + sorted(self._fenced | self._lapsed)
        return [j for j in dict.fromkeys(jobs) if j != incoming and j in self.residency.residents]

    async def _plan(self, incoming: str, allow_evictions: bool) -> list[str]:
        """Residents to checkpoint so that `incoming` fits (memory-aware groups), preempted
        holders first. Raises NoRoom."""
        forced = self._must_leave(incoming) if allow_evictions else []
        waited = False
        while True:
            snap = await self._snapshot()
            if snap is None:  # no memory information: one resident at a time
                return self.residency.lru(excluding=[incoming]) if allow_evictions else []
            residents = self.residency.lru(excluding=[incoming, *forced]) if allow_evictions else []
            if forced:
                snap = dataclasses.replace(snap, devices=dict(snap.devices))
            for job in forced:  # what they hold is free once they leave
                for dev, b in snap.on_device(job).items():
                    if dev in snap.devices:
                        m = snap.devices[dev]
                        snap.devices[dev] = type(m)(m.total, m.free + b)
            try:
                plan = plan_room(incoming, residents, snap, self.residency.peaks,
                                 parse_headroom(self.spec.memory_headroom),
                                 host_checked=self.spec.backend != "cooperative")
            except NoRoom:
                departing = self._switcher.departing(self.spec, self.residency.residents) \
                    if hasattr(self._switcher, "departing") else []
                if not departing or not allow_evictions:
                    raise
                if not waited:  # bounded: a job stops departing after the reconnect grace
                    log.info("no room for %s yet group=%s: waiting for departing %s to free the GPU memory",
                             incoming, self.id, departing)
                    waited = True
                await asyncio.sleep(DEPARTING_POLL_SECONDS)
                continue
            return [*forced, *plan]

    async def _switch(self, evict: list[str] | None, incoming: str, restore: bool, grant: bool) -> None:
        record: SwitchRecord | None = None
        r = self.residency
        try:
            if evict is None:
                evict = await self._plan(incoming, allow_evictions=True)
                self.switching = (evict[0] if evict else None, incoming)
            if not evict and not restore:
                record = None
            else:
                log.info("switch start group=%s evict=%s to=%s restore=%s", self.id, evict, incoming, restore)
                record = await self._switcher(self.spec, tuple(evict), incoming, restore)
        except NoRoom as err:
            record = SwitchRecord(None, incoming, ok=False, error=str(err))
            log.warning("no room group=%s job=%s: %s", self.id, incoming, err)
            self._fail_job(incoming, SwitchFailed(f"group {self.id}: {err}"))
        except SwitchError as err:
            record = err.record
            self.counters.failed_switches += 1
            for job in err.off_gpu:
                r.moved_out(job)
            log.warning("switch failed group=%s evict=%s to=%s: %s", self.id, evict, incoming, err)
            self._fail_job(incoming, SwitchFailed(f"group {self.id}: {err}"))
        except Exception as err:  # a Switcher bug: keep the group serving, say so loudly
            log.exception("switch crashed group=%s evict=%s to=%s", self.id, evict, incoming)
            record = SwitchRecord(None, incoming, ok=False, error=f"internal error: {err!r}")
            self.counters.failed_switches += 1
            self._fail_job(incoming, SwitchFailed(f"group {self.id}: internal error: {err!r}"))
        else:
            for job in evict:
                r.moved_out(job)
                self._lapsed.discard(job)
                if job in self._fenced:  # fenced: now it can be forgotten
                    self._fenced.discard(job)
                    r.forget(job)
            if record is not None:
                self.counters.switches += 1
                log.info("switch done group=%s evict=%s to=%s seconds=%.3f bytes_out=%d bytes_in=%d", self.id,
                         evict, incoming, record.seconds, record.bytes_checkpointed, record.bytes_restored)
            if grant:
                r.held(incoming)
            elif incoming in self._orphans:  # restored for nobody: its processes run on, unowned
                self._orphans.discard(incoming)
                r.forget(incoming)
            elif restore:
                r.moved_in(incoming)
        finally:
            self.switching = None
            self._switch_task = None
        if record is not None:
            record.finished_at_unix = time.time()
            self.recent.append(record)
            self._notify("switched" if record.ok else "switch-failed", incoming, record=record)
        if grant and (record is None or record.ok):
            self._grant(incoming, restored=restore, switch_seconds=record.seconds if record else 0.0)
        if not grant and (record is None or not record.ok):
            self._background_failed.add(incoming)  # not again in the background: only when it asks
        elif record is not None and not record.ok and not record.unreachable and \
                (restore or record.error.startswith("no room")):
            self._count_restore_failure(incoming, record)
        self._dispatch()
        if self.holder is None and self.switching is None and not len(self.queue) and (record is None or record.ok):
            self._refresh_memory()

    def _count_restore_failure(self, job: str, record: SwitchRecord) -> None:
        n = self._restore_failures[job] = self._restore_failures.get(job, 0) + 1
        if n < MAX_RESTORE_FAILURES:
            return
        self.failed_jobs[job] = f"{n} restores in a row failed, the last: {record.error}"
        log.error("job failed group=%s job=%s: %s", self.id, job, self.failed_jobs[job])
        self._fail_job(job, SwitchFailed(f"group {self.id}: job {job} failed: {self.failed_jobs[job]}"))
        self._notify("job-failed", job, record=record)

    def _refresh_memory(self) -> None:
        """In the background: take a memory snapshot (residents' peaks), and when the group
        is idle restore a checkpointed job that fits without moving anyone (a job may touch
        its GPU after its last hold). Tried once per trigger (a release, an idle group, a
        switch that succeeded); a job whose background restore failed is not tried in the
        background again until it is granted (its own acquire restores it, or says why not)."""
        if not self.memory_aware:
            self._restore_orphans()
            return
        if self._refresh_task is not None or self.switching is not None:
            return  # a switch plans from its own fresh report, and triggers this again once idle
        self._refresh_task = asyncio.get_running_loop().create_task(self._refresh(), name=f"memory-{self.id}")

    def _restore_orphans(self) -> None:
        """An idle group without memory reports restores a dropped or lapsed checkpointed job
        (one at a time; one that failed is not tried again in the background)."""
        if self.holder is not None or self.switching is not None or len(self.queue):
            return
        for job in sorted(self._orphans - self._background_failed):
            log.info("restoring a checkpointed job nobody owns any more group=%s job=%s", self.id, job)
            self._start_switch([], job, restore=True, grant=False)
            return

    async def _refresh(self) -> None:
        try:
            snap = await self._snapshot()
            if snap is None or self.holder is not None or self.switching is not None or len(self.queue):
                return
            for job in sorted(self.residency.checkpointed - self._background_failed):
                try:
                    if await self._plan(job, allow_evictions=False) == [] and self.switching is None \
                            and self.holder is None and not len(self.queue):
                        log.info("background restore group=%s job=%s: the group is idle and it fits", self.id, job)
                        self._start_switch([], job, restore=True, grant=False)
                        return
                except NoRoom as err:
                    log.info("no background restore group=%s job=%s: %s", self.id, job, err)
        except Exception as err:  # a report that fails changes nothing; the next switch asks again
            log.warning("memory report failed group=%s: %s", self.id, err)
        finally:
            self._refresh_task = None

    def _grant(self, job_id: str, restored: bool, switch_seconds: float) -> None:
        self.residency.held(job_id)
        self._background_failed.discard(job_id)
        self._restore_failures.pop(job_id, None)
        self._fenced.discard(job_id)
        self._lapsed.discard(job_id)
        self._orphans.discard(job_id)
        waiters = [w for w in self.queue.pop_job(job_id) if not w.future.done()]
        if not waiters:  # every caller of the job left during the switch
            self._dispatch()
            return
        now = self._clock()
        if self._reserve_epoch is not None:
            try:
                self._reserve_epoch(self.id, self.epoch + 1)
            except OSError as err:  # without a persisted epoch a restart could hand this one out again
                log.error("epoch not persisted group=%s: %s", self.id, err)
                for w in waiters:
                    self._forget_preempted(w)  # a preempted holder's entry too: its keep-alives now fail
                    w.future.set_exception(SwitchFailed(f"group {self.id}: cannot persist the fencing epoch: {err}"))
                    w.future.exception()  # retrieved here: a preempted holder's entry has no caller
                self._dispatch()  # the next job's grant meets the same refusal: none is granted unpersisted
                return
        self.epoch += 1
        self.counters.grants += 1
        parked = next((self._forget_preempted(w) for w in waiters if w.request_id.startswith(PREEMPTED)), None)
        lease_id = parked.lease_id if parked else uuid.uuid4().hex  # a preempted holder keeps its lease
        self._remember(lease_id)
        h = Hold(job_id, lease_id, self.epoch, now, now + self.spec.lease_seconds,
                 {w.request_id for w in waiters} | (parked.request_ids if parked else set()), restored,
                 switch_seconds, max(w.priority for w in waiters),
                 parked.past_epochs | {parked.epoch} if parked else frozenset())
        self.holder = h
        for w in waiters:
            w.future.set_result(self._grant_info(h, waited=now - w.enqueued_at))
        log.info("granted group=%s job=%s epoch=%d restored=%s", self.id, job_id, h.epoch, restored)
        self._notify("granted", job_id, h.epoch, waited=max(now - w.enqueued_at for w in waiters))
        self._arm_lease_timer()
        self._arm_max_hold_timer()

    def _grant_info(self, h: Hold, waited: float) -> GrantInfo:
        return GrantInfo(h.lease_id, h.epoch, self.spec.lease_seconds, waited, h.restored, h.switch_seconds)

    def _arm_lease_timer(self) -> None:
        h = self.holder
        if h is None:
            return
        delay = max(0.0, h.lease_deadline - self._clock())
        self._lease_timer = asyncio.get_running_loop().call_later(delay, self._on_lease_timer, h)

    def _on_lease_timer(self, h: Hold) -> None:
        if self.holder is not h:
            return
        if self._clock() < h.lease_deadline:  # extended by keep-alives since armed
            self._arm_lease_timer()
            return
        self.counters.lease_expiries += 1
        log.warning("lease expired group=%s job=%s epoch=%d", self.id, h.job_id, h.epoch)
        self._notify("lease-expired", h.job_id, h.epoch)
        self._end_hold(h, "lease expired")
        if self.spec.backend != "none":  # cut off, not gone: it may still compute, so it leaves first
            self._lapsed.add(h.job_id)
        self._dispatch()

    # -- maxHoldSeconds ----------------------------------------------------------
    def _max_hold_seconds(self, job_id: str) -> float | None:
        member = self.spec.member(job_id)
        return member.max_hold_seconds if member is not None else self.spec.max_hold_seconds

    def _arm_max_hold_timer(self) -> None:
        """Start the holder's maxHoldSeconds clock when a contender waits and no clock runs yet."""
        h = self.holder
        if h is None or self._max_hold_timer is not None or not self._contenders(h):
            return
        limit = self._max_hold_seconds(h.job_id)
        if limit is not None:
            self._max_hold_timer = asyncio.get_running_loop().call_later(limit, self._on_max_hold, h, limit)

    def _contenders(self, h: Hold) -> bool:
        """Another job waits at the holder's priority or above (a lower one would only be
        passed over again: preempting for it would re-grant the holder at once)."""
        return any(w.job_id != h.job_id and w.priority >= h.priority for w in self.queue)

    def _disarm_max_hold_when_unwaited(self) -> None:
        """No other job waits any more: the clock stops, and starts again at the next arrival."""
        h = self.holder
        if self._max_hold_timer is not None and (h is None or not self._contenders(h)):
            self._max_hold_timer.cancel()
            self._max_hold_timer = None

    def _on_max_hold(self, h: Hold, limit: float) -> None:
        self._max_hold_timer = None
        if self.holder is not h or self.switching is not None or not self._contenders(h):
            return
        self.counters.preemptions += 1
        log.info("preempted group=%s job=%s epoch=%d max_hold_seconds=%g waiters=%d", self.id, h.job_id,
                    h.epoch, limit, len(self.queue))
        self._notify("preempted", h.job_id, h.epoch)
        self._end_hold(h, f"maxHoldSeconds {limit:g} exceeded while others waited")
        if self.spec.backend not in ("none", "cooperative"):  # checkpointed by the switch, re-queued keeping its lease
            self._park(h)
        self._dispatch()

    def _remember(self, lease_id: str) -> None:
        self._known_leases[lease_id] = None
        self._known_leases.move_to_end(lease_id)
        while len(self._known_leases) > KNOWN_LEASES:
            self._known_leases.popitem(last=False)

    def _park(self, h: Hold) -> None:
        """Queue a switched-out holder again under its lease (no RPC waits on the entry). Its
        keep-alives keep the lease; without them it lapses like any lease (its client died
        while it was out of the GPU): the entry goes, and the job is restored when the group
        is idle, then forgotten."""
        w = self.queue.push(f"{PREEMPTED}{h.lease_id}", h.job_id, h.priority, self._clock(),
                            asyncio.get_running_loop().create_future())
        w.callers = 0  # nothing withdraws it
        self._preempted[h.lease_id] = (w, h)
        h.lease_deadline = self._clock() + self.spec.lease_seconds
        asyncio.get_running_loop().call_later(self.spec.lease_seconds, self._on_parked_lease, h)

    def _on_parked_lease(self, h: Hold) -> None:
        w = next((entry for entry, parked in self._preempted.values() if parked is h), None)
        if w is None:
            return  # granted, released or dropped since
        if self._clock() < h.lease_deadline:
            asyncio.get_running_loop().call_later(h.lease_deadline - self._clock(), self._on_parked_lease, h)
            return
        self._forget_preempted(w)
        self.queue.remove(w)
        self.counters.lease_expiries += 1
        log.warning("lease expired while preempted group=%s job=%s epoch=%d: restored when idle", self.id, h.job_id,
                    h.epoch)
        self._notify("lease-expired", h.job_id, h.epoch)
        if h.job_id in self.residency.checkpointed:
            self._orphans.add(h.job_id)
        self._disarm_max_hold_when_unwaited()
        self._dispatch()
        self._refresh_memory()

    def _preempted_entry(self, job_id: str, lease_id: str, epoch: int) -> tuple[Waiter, Hold] | None:
        """The queue entry and suspended hold of a preempted holder that shows this lease."""
        w, h = self._preempted.get(lease_id, (None, None))
        if h is None:  # a presumptive holder preempted before it showed its lease shows it now
            w, h = self._preempted.get(ADOPTED, (None, None))
            if h is None or h.job_id != job_id:
                return None
            if h.lease_id == ADOPTED:  # from now on it is the only lease (still keyed ADOPTED, like its entry)
                h.lease_id, h.epoch = lease_id, epoch
                self.epoch = max(self.epoch, epoch)
        if h.job_id != job_id or h.lease_id != lease_id or (epoch != h.epoch and epoch not in h.past_epochs):
            return None
        return w, h  # type: ignore[return-value]

    def _forget_preempted(self, w: Waiter) -> Hold | None:
        """The suspended hold of `w` when `w` is a preempted holder's entry (now forgotten)."""
        if not w.request_id.startswith(PREEMPTED):
            return None
        _, h = self._preempted.pop(w.request_id[len(PREEMPTED):], (None, None))
        return h
