"""What a switch costs, and how long a grant that would make one waits (residency `auto`).

Pure functions of a `LockGroup`'s records (owned by `MemoryMoves`, which decides with them;
DESIGN.md, "Lock groups and the orchestrator"): the bytes per second its switches moved
(`switch_speed`, each way), the seconds the switch that grants a job would take (`move_seconds`), and
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
    idle residents its plan evicts (`plan_room`) checkpointed, at the speeds of
    `switch_speed` (the driver's checkpoint on the H200: ~1.5 GB/s out, ~4 GB/s in; a
    cooperative one: ~50 GB/s each way). None: no estimate (no memory report yet, no
    speed, or no plan makes room)."""
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
    return out / speed[0] + sum(snap.checkpointed_bytes.get(job, {}).values()) / speed[1]


def switch_speed(g: LockGroup) -> tuple[float, float] | None:
    """(out, in) bytes per second: the fastest of the group's recent switches in each
    direction (a process's first cooperative checkpoint also pins the pool: on the H200
    47 GB took 8-17 s once, then ~1 s, bench/results/rl-grpo-b-serve-cooperative-h200.json;
    an average of the two kept a waiter deferred for 37 s behind moves of 2 s), where none
    was measured the switcher's `prior_speed` (out and in together), else the other
    direction's; None: unknown."""
    ok = [rec for rec in g.recent if rec.ok]
    out = max((rec.bytes_checkpointed / rec.checkpoint_seconds for rec in ok
               if rec.bytes_checkpointed and rec.checkpoint_seconds > 0), default=None)
    in_ = max((rec.bytes_restored / rec.restore_seconds for rec in ok
               if rec.bytes_restored and rec.restore_seconds > 0), default=None)
    prior = g.switcher.prior_speed(g.spec) if hasattr(g.switcher, "prior_speed") else None
    out, in_ = out or prior or in_, in_ or prior or out
    return (out, in_) if out and in_ else None
