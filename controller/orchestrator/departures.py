"""A job leaving a lock group: dropped (its pods gone, its claim set dropped), found gone at a
restart, or done with the group (`Leave`). Functions of a `LockGroup` (group.py), which
calls them from its entry points of the same names."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator.group_model import ADOPTED
from timeslice.driver.errors import StaleLease

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")


def drop(g: LockGroup, job_id: str, reason: str, gone: bool = False) -> None:
    """Forget a job that is gone: its waiters fail, its hold ends, its records go. A holder
    dropped while its processes may still compute (a force-deleted pod, a dropped claim
    set) is fenced first: nobody is granted until a switch has checkpointed (or frozen, or
    found gone) its processes; then, like a job dropped while checkpointed, it is
    restored when the group is idle (and fits), then forgotten: none of its processes
    stays stopped without an owner. On backend `app` an engine outlives its client: unless
    `gone` (no process of the job is left), it stays where it is, awake or asleep
    (`MemoryMoves.dropped`)."""
    g.fail_job(job_id, StaleLease(f"group {g.id}: job {job_id} dropped: {reason}"))
    g.preemption.disarm_when_unwaited()
    held = g.holder is not None and g.holder.job_id == job_id
    if held:
        g.end_hold(g.holder, f"dropped: {reason}")  # type: ignore[arg-type]
    g.moves.dropped(job_id, held, gone)
    g.record_placement()
    g.idle.forget(job_id)
    g.failed_jobs.pop(job_id, None)
    g.job_counters.pop(job_id, None)
    g.dispatch()
    g.idle.refresh_memory()


def adopted_holder_gone(g: LockGroup, job_id: str) -> bool:
    """The adopted (presumptive) holder `job_id` has no process left (`timeslice serve`
    knows from the bindings it keeps in its state dir): dropped now (`drop`), rather
    than the next job waiting out its lease. Returns whether it was dropped: not when
    `job_id` is not the adopted holder (its client showed its lease since)."""
    h = g.holder
    if h is None or h.job_id != job_id or h.lease_id != ADOPTED:
        return False
    drop(g, job_id, "its processes are gone (found at restart)", gone=True)
    return True


def leave(g: LockGroup, job_id: str) -> str:
    """A process of `job_id` is done with the group (`Leave`). A job that neither holds
    nor waits is dropped (`drop`: if its state is off the GPUs, or being moved off,
    it is restored once the group is idle, then forgotten; if it is on them, it is never
    moved again). Returns "left", or "busy" when the job holds or waits (holding with no
    waiter: `AwakeEngines.left_holding`)."""
    waits = any(w.job_id == job_id for w in g.queue)
    if g.holder is not None and g.holder.job_id == job_id:
        if not waits:
            g.awake.left_holding(job_id)
        return "busy"
    if waits:
        return "busy"
    if job_id in g.residency.residents or job_id in g.residency.checkpointed:
        log.info("job left group=%s job=%s", g.id, job_id)
        drop(g, job_id, "its processes are done with the group")
    return "left"
