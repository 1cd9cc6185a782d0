"""A hold's life: an Acquire admitted (`acquire_calls.admit` performed: the caller joins its job's
hold, or queues), a grant, which reaches its callers once its fencing epoch is persisted
(standalone: the state file), and the hold's end.

Functions of a `LockGroup` (group.py), which calls them from `acquire`, `grant`, `end_hold` and `job_started`."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator import acquire_calls, takeover
from timeslice.controller.orchestrator.acquire_calls import (
    AcquireFacts,
    AddCaller,
    EndHold,
    JoinHold,
    Moved,
    Queue,
    Refuse,
    WaitForExits,
)
from timeslice.controller.orchestrator.exits import wait_for_exits
from timeslice.controller.orchestrator.group_model import GrantInfo, Hold, JobCounters
from timeslice.controller.orchestrator.lock_queue import Waiter
from timeslice.controller.orchestrator.preemption import PREEMPTED
from timeslice.driver.errors import JobFailed, SwitchFailed, Unavailable

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")


async def admit(g: LockGroup, job_id: str, request_id: str, priority: int,
                timeout: float | None) -> GrantInfo | Waiter:
    """Perform what `acquire_calls.admit` answers the Acquire of `job_id` (`request_id`, at
    `priority`), asking again after a wait for exits or a hold ended, until the caller joins its
    job's hold (returns its grant) or has its entry in the queue (returns the waiter, queued).
    Raises JobFailed (the job failed for good), Unavailable (its claim set moved to another group
    while it waited to join), SwitchFailed (the hold's epoch cannot be persisted)."""
    waited = False
    while True:
        h, member, w = g.holder, g.spec.member(job_id), g.queue.by_request(job_id, request_id)
        facts = AcquireFacts(job_id, priority, member.priority if member is not None else None,
                             h.job_id if h is not None else None, h is not None and h.processes_ended,
                             g.memory_aware, waited, bool(g.spec.members) and member is None,
                             g.failed_jobs.get(job_id), w is not None)
        match acquire_calls.admit(facts):
            case WaitForExits():
                assert h is not None
                g.leases.renew(h)  # (it shows the job alive meanwhile)
                await wait_for_exits(g.switcher, g.spec, job_id, g.residency.peaks, timeout)
                waited = True
            case Moved():
                raise Unavailable(f"group {g.id}: job {job_id}'s claim set moved to another group while it "
                                  "waited to join its hold; ask again")
            case EndHold():
                assert h is not None
                g.end_hold(h, "its processes ended, and a new one of the job asks")
                g.record_placement()
            case JoinHold():
                assert h is not None
                return await _join(g, h, request_id)
            case Refuse(why=why):
                raise JobFailed(f"group {g.id}: job {job_id} failed: {why} (it is not retried: restart the job, "
                                "which drops it)")
            case AddCaller():
                assert w is not None
                w.callers += 1
                return w
            case Queue(priority=at):
                w = g.queue.push(request_id, job_id, at, g.clock(), asyncio.get_running_loop().create_future(),
                                 timeout)
                w.owner = g
                log.debug("queued group=%s job=%s priority=%d position=%d", g.id, job_id, at, len(g.queue) - 1)
                g.dispatch()
                g.preemption.arm()
                return w


async def _join(g: LockGroup, h: Hold, request_id: str) -> GrantInfo:
    """Another caller (process, thread) of the holder joins its hold: granted once the hold's
    epoch is on disk. Raises SwitchFailed (it cannot be persisted)."""
    h.request_ids.add(request_id)
    # A joining caller shows the job alive: its lease runs again from now (none schedules seed
    # 896: a job's process was killed holding, its next process joined phase after phase, each
    # shorter than a keep-alive interval, and the lease lapsed under it); a killed caller's
    # part it shares ends once its keep-alives stopped for the lease's length (`prune_parts`)
    g.leases.renew(h)
    g.callers.prune_parts(h)
    if g.state is not None:  # the hold's epoch (a presumptive one's block) on disk first
        try:
            await g.state.durable()
        except BaseException as err:  # (its caller went away, or the write failed): not a caller of it
            h.request_ids.discard(request_id)
            if isinstance(err, OSError):
                raise SwitchFailed(f"group {g.id}: cannot persist the fencing epoch: {err}") from None
            raise
    return grant_info(g, h, waited=0.0)


def grant(g: LockGroup, job_id: str, restored: bool, switch_seconds: float) -> None:
    """Grant `job_id`'s waiters one hold. Never while another job holds: that is a bug of
    the caller (randomized schedules seed 252: a grant confirmed by the agents after
    another job's grant), logged, and the waiters stay queued."""
    if g.holder is not None and g.holder.job_id != job_id:
        log.error("grant of %s refused group=%s: job %s holds (epoch %d); it stays queued", job_id, g.id,
                  g.holder.job_id, g.holder.epoch)
        return
    g.residency.held(job_id)
    g.moves.granted(job_id)
    g.idle.granted(job_id)
    waiters = [w for w in g.queue.pop_job(job_id) if not w.future.done()]
    if not waiters:  # every caller of the job left during the switch
        g.dispatch()
        return
    now = g.clock()
    if g.state is not None:  # unwritten, a restart could repeat the epoch or forget the holder: delivered once on disk
        g.state.reserve(g.id, g.epoch + 1)
        takeover.persist_placement(g, job_id)
    g.epoch += 1
    g.counters.grants += 1
    jc = g.job_counters.setdefault(job_id, JobCounters())
    jc.grants += 1
    jc.waited_seconds += max(now - w.enqueued_at for w in waiters)
    restored = g.awake.woken(job_id) or restored  # an engine woken since its last grant: said so
    parked = next((g.preemption.forget(w) for w in waiters if w.request_id.startswith(PREEMPTED)), None)
    lease_id = parked.lease_id if parked else uuid.uuid4().hex  # a preempted holder keeps its lease
    g.leases.remember(lease_id)
    h = Hold(job_id, lease_id, g.epoch, now, now + g.spec.lease_seconds,
             # a parked entry's own id is no caller: its client releases under its first request id
             {w.request_id for w in waiters if not w.request_id.startswith(PREEMPTED)}
             | (parked.request_ids if parked else set()), restored,
             switch_seconds, max(w.priority for w in waiters),
             parked.past_epochs | {parked.epoch} if parked else frozenset())
    g.holder = h
    if g.state is None:
        _deliver(g, h, waiters, now)
    else:  # (at once when nothing was pending)
        g.state.when_written(lambda err: _persisted(g, h, waiters, now, err))
    log.info("granted group=%s job=%s epoch=%d restored=%s", g.id, job_id, h.epoch, restored)
    g.notify("granted", job_id, h.epoch, waited=max(now - w.enqueued_at for w in waiters))
    g.leases.arm()
    g.preemption.arm()
    g.moves.watch.start()
    g.moves.dispatch()  # (stages the next job)


def _deliver(g: LockGroup, h: Hold, waiters: list[Waiter], granted_at: float) -> None:
    for w in waiters:
        if not w.future.done():  # (a caller that left meanwhile)
            w.future.set_result(grant_info(g, h, waited=granted_at - w.enqueued_at))


def _persisted(g: LockGroup, h: Hold, waiters: list[Waiter], granted_at: float, err: OSError | None) -> None:
    """The state file answered for the grant of `h` (`err`: its write failed): deliver it,
    or (it failed, or the hold ended meanwhile) fail its waiters with SwitchFailed, their
    clients ask again, and end the hold: none is granted unpersisted."""
    if err is None and not h.ended:  # (held here, or in the group it was carried to)
        # the lease runs from the delivery: a slow write must not eat the client's lease
        h.lease_deadline = max(h.lease_deadline, g.clock() + g.spec.lease_seconds)
        _deliver(g, h, waiters, granted_at)
        return
    why = f"cannot persist the fencing epoch and holder: {err}" if err is not None else \
        "its hold ended before its fencing epoch and holder were persisted"
    # (a hold that ended meanwhile, its caller gone as a timeout fell on its grant, is no error: a helper's
    # 600 timed-out acquires logged 3 ERROR lines)
    (log.error if err is not None else log.info)("grant withdrawn group=%s job=%s epoch=%d: %s", g.id, h.job_id,
                                                 h.epoch, why)
    for w in waiters:
        g.preemption.forget(w)  # a preempted holder's entry too: its keep-alives now fail
        if not w.future.done():
            w.future.set_exception(SwitchFailed(f"group {g.id}: {why}"))
            w.future.exception()  # retrieved here: a preempted holder's entry has no caller
    if g.holder is h:
        g.end_hold(h, "not persisted")
        g.dispatch()  # the next job's grant meets the same refusal while the file cannot be written


def grant_info(g: LockGroup, h: Hold, waited: float) -> GrantInfo:
    return GrantInfo(h.lease_id, h.epoch, g.spec.lease_seconds, waited, h.restored, h.switch_seconds)


def end(g: LockGroup, h: Hold, why: str) -> None:
    """The hold `h` ends (`why`: "released", or how else it ended): its held seconds are
    counted, the lease timer and maxHoldSeconds clock stop. A hold that ended otherwise
    than by its release does not settle its job's memory (`Residency.hold_ended`)."""
    now = g.clock()
    held = max(0.0, now - h.granted_at)
    g.counters.held_seconds += held
    g.job_counters.setdefault(h.job_id, JobCounters()).held_seconds += held
    g.recent_holds.append((h.granted_at, now))
    log.info("hold ended group=%s job=%s epoch=%d held=%.3fs reason=%s", g.id, h.job_id,
             h.epoch, held, why)
    g.holder = None
    h.ended = True
    # a hold that ended otherwise than by its release (lease lapsed, preempted, its caller
    # left) may still compute and grow unwatched: it does not settle its job
    g.residency.hold_ended(h.job_id, observed=why == "released")
    g.leases.stop()
    g.preemption.stop_clock()


def started(g: LockGroup, job_id: str) -> None:
    """A new process of `job_id` connected with none of its earlier ones connected and no
    checkpoint of its own (cooperative): it settles its memory afresh
    (`Residency.started`), and a hold during which every stream of the job closed is its
    ended processes' (`Hold.processes_ended`; a job's first stream that opens in its first
    hold, or a stream that reconnects, ends nothing)."""
    g.residency.started(job_id)
    h = g.holder
    if h is not None and h.job_id == job_id and h.streams_closed:
        h.processes_ended = True
