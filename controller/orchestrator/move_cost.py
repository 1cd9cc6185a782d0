"""What a switch costs, and how long a grant that would make one waits (residency `auto`).

Pure functions of what a group recorded (`CostInputs`, gathered by `MemoryMoves.costs`, which
decides with them; DESIGN.md, "Lock groups and the orchestrator"): the bytes per second its switches moved
(`switch_speed`, each way), the seconds the switch that grants a job would take (`move_seconds`),
whether it moves anything (`moves_nothing`), and how long resident waiters may pass that job
(`pass_remaining`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.group_model import SwitchRecord
from timeslice.controller.orchestrator.lock_queue import Waiter
from timeslice.controller.orchestrator.placement import NoRoom, plan_room
from timeslice.controller.orchestrator.residency import Residency
from timeslice.driver.headroom import parse_headroom

# A waiter whose grant moves memory is passed by resident waiters until they have held the
# GPUs for this many times the move's seconds (`pass_remaining`): the moves then cost at most a
# quarter of the GPUs' time, however much of it the residents leave idle between their phases.
SWITCH_COST_FACTOR = 3
# ... and for at most this many times that bound in wall-clock seconds (residents that hold
# less than half the time: RL jobs' GPU phases are 40-60% of their time).
PASS_WALL_FACTOR = 2
# A switch that moved less than this fraction of a GPU's memory measures its fixed costs (RPCs,
# signals, the node agent's memory check: tens of milliseconds), not a speed (`switch_speed`):
# one of 64 KiB made a 40 GB move look like 8300 s.
MIN_SPEED_SAMPLE_FRACTION = 0.01


@dataclass(frozen=True)
class CostInputs:
    """What the cost model reads of a group at clock() time `now` (read only): its spec
    (`resident_first_seconds`, `memory_headroom`), what it learned of its jobs' memory, its
    recent switches, the (granted, ended) clock() seconds of its last holds (`holds`, at most
    `holds_kept`), when the current hold began (None: nobody holds), and the switcher's
    `prior_speed` (bytes per second; None: none)."""

    spec: GroupSpec
    residency: Residency
    now: float
    recent: Sequence[SwitchRecord]
    holds: Sequence[tuple[float, float]]
    holds_kept: int | None
    holding_since: float | None
    prior_speed: float | None


def pass_remaining(g: CostInputs, head: Waiter) -> float:
    """Wall-clock seconds, at the least, during which resident waiters may still pass `head`
    when its grant would move memory; 0: no longer (or never: `resident_first_seconds` 0).
    They pass it for `resident_first_seconds`; when `SWITCH_COST_FACTOR` times the move's
    estimated seconds (`move_seconds`) is longer, until the group's holders have held that
    long since `head` queued (`held_since`), or `PASS_WALL_FACTOR` times that has passed;
    never for more than half of what `head`'s caller waits (`Waiter.timeout`), so that a
    short acquire timeout is not spent while residents pass it. Measured on the H200 with
    the driver's checkpoint (`cuda`, ~1.5 GB/s out): 2 jobs of 19 GB, unsettled, with a
    bound in wall-clock seconds, switched every 24 s of which the holder computed half:
    8 switches of 4-13 s, 0.77x of one after the other (bench/results/rl-grpo-a-serve-41317fd-h200.json)."""
    first = g.spec.resident_first_seconds
    if first <= 0:
        return 0.0
    waited = g.now - head.enqueued_at
    cap = float("inf") if head.timeout is None else head.timeout / 2 - waited
    seconds = move_seconds(g, head.job_id)
    if seconds is None or SWITCH_COST_FACTOR * seconds <= first:
        return max(0.0, min(cap, first - waited))
    bound = SWITCH_COST_FACTOR * seconds
    left = min(bound - held_since(g, head.enqueued_at), PASS_WALL_FACTOR * bound - waited, cap)
    return max(0.0, left)


def moves_nothing(g: CostInputs, job: str, unconfirmed: bool) -> bool:
    """Whether granting `job` now moves no memory by the last report: its need is known
    (declared or settled), none of its state is checkpointed, and it fits beside the
    residents with the headroom (`plan_room` checkpoints nobody). False without a report.
    Such a waiter is never passed by resident ones (`decisions.next_job`): on the H200 four jobs
    of 31.7 GB that declared it (they fit) had the last to start passed for 30 s at its
    first acquire and 21 s at its first train step, and it ended 25 s after the others
    (bench/results/rl-grpo-c-serve-cooperative-declared-h200.json, 1.95x)."""
    r = g.residency
    snap = r.snapshot
    if snap is None or not r.known(job) or job in r.checkpointed or unconfirmed:
        return False
    try:
        return not plan_room(job, r.lru(excluding=[job]), snap, r.peaks, parse_headroom(g.spec.memory_headroom),
                             host_checked=False, declared=r.declared)
    except NoRoom:
        return False


def held_since(g: CostInputs, since: float) -> float:
    """Seconds the group's holders held its GPUs since clock() time `since` (the current hold
    included); infinite when `since` is older than the holds the group remembers."""
    holds = g.holds
    if len(holds) == g.holds_kept and holds[0][0] > since:
        return float("inf")
    held = sum(max(0.0, end - max(start, since)) for start, end in holds if end > since)
    if g.holding_since is not None:
        held += max(0.0, g.now - max(g.holding_since, since))
    return held


def move_seconds(g: CostInputs, job: str) -> float | None:
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


def switch_speed(g: CostInputs) -> tuple[float, float] | None:
    """(out, in) bytes per second: the fastest of the group's recent switches in each
    direction that moved at least `MIN_SPEED_SAMPLE_FRACTION` of a GPU (by the last memory
    report; any without one: it only decides whether to ask for a report). A process's first
    cooperative checkpoint also pins the pool: on the H200 47 GB took 8-17 s once, then ~1 s
    (bench/results/rl-grpo-b-serve-cooperative-h200.json; an average of the two kept a
    waiter deferred for 37 s behind moves of 2 s). Where none was measured, the switcher's
    `prior_speed` (out and in together), else the other direction's; None: unknown."""
    snap = g.residency.snapshot
    least = MIN_SPEED_SAMPLE_FRACTION * min((d.total for d in snap.devices.values()), default=0) if snap else 0
    ok = [rec for rec in g.recent if rec.ok]
    out = max((rec.bytes_checkpointed / rec.checkpoint_seconds for rec in ok
               if rec.bytes_checkpointed >= least and rec.checkpoint_seconds > 0), default=None)
    in_ = max((rec.bytes_restored / rec.restore_seconds for rec in ok
               if rec.bytes_restored >= least and rec.restore_seconds > 0), default=None)
    prior = g.prior_speed
    out, in_ = out or prior or in_, in_ or prior or out
    return (out, in_) if out and in_ else None
