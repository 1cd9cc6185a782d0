"""What a switch costs, and how long a grant that would make one waits (residency `auto`).

Pure functions of a `LockGroup`'s records (owned by `MemoryMoves`, which decides with them;
DESIGN.md, "Lock groups and the orchestrator"): the bytes per second its switches moved
(`switch_speed`), the seconds the switch that grants a job would take (`move_seconds`), and
how long resident waiters may pass that job (`pass_bound`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from timeslice.controller.orchestrator.lock_queue import Waiter
from timeslice.controller.orchestrator.residency import NoRoom, parse_headroom, plan_room

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

# A waiter whose grant moves memory waits at most this many times the move's seconds while
# resident waiters pass it (`pass_bound`): the moves then cost at most a quarter of the GPU's time.
SWITCH_COST_FACTOR = 3


def pass_bound(g: LockGroup, head: Waiter) -> float:
    """Seconds resident waiters may pass `head` when its grant would move memory:
    `resident_first_seconds` (0: never), or `SWITCH_COST_FACTOR` times that move's estimated
    seconds (`move_seconds`) when that is longer (a backend that moves slowly switches at
    most once per that many seconds of the residents' phases); never more than half of
    what `head`'s caller waits (`Waiter.timeout`), so that a short acquire timeout is not
    spent while residents pass it."""
    bound = g.spec.resident_first_seconds
    seconds = move_seconds(g, head.job_id)
    if bound > 0 and seconds is not None:
        bound = max(bound, SWITCH_COST_FACTOR * seconds)
    return bound if head.timeout is None else min(bound, head.timeout / 2)


def move_seconds(g: LockGroup, job: str) -> float | None:
    """Estimated seconds of the switch that grants `job`: its checkpoint restored, and the
    idle residents its plan evicts (`plan_room`) checkpointed, at the bytes per second the
    group's recent switches moved (the driver's checkpoint on the H200: ~2 GB/s; a
    cooperative one: ~45 GB/s), before the first one the switcher's `prior_speed`. None: no
    estimate (no memory report yet, no speed, or no plan makes room)."""
    r = g.residency
    speed = switch_speed(g)
    if not speed or r.snapshot is None:
        return None
    try:
        evict = plan_room(job, r.lru(excluding=[job]), r.snapshot, r.peaks, parse_headroom(g.spec.memory_headroom),
                          host_checked=False, declared=r.declared, alone=not r.known(job))
    except NoRoom:
        return None
    snap = r.snapshot
    out = sum(sum(snap.movable_bytes.get(j, snap.on_device(j)).values()) for j in evict)
    return (out + sum(snap.checkpointed_bytes.get(job, {}).values())) / speed


def switch_speed(g: LockGroup) -> float | None:
    """Bytes per second (out and in together) the group's recent switches moved, before the
    first one its switcher's `prior_speed`; None: unknown."""
    moved = [rec for rec in g.recent if rec.ok and rec.seconds > 0 and rec.bytes_checkpointed + rec.bytes_restored]
    if moved:
        return sum(rec.bytes_checkpointed + rec.bytes_restored for rec in moved) / sum(rec.seconds for rec in moved)
    return g.switcher.prior_speed(g.spec) if hasattr(g.switcher, "prior_speed") else None
