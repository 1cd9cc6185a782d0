"""What a holder's `maxHoldSeconds` clock does when it runs out (`hold_limit`). Pure: it reads
one immutable `LimitFacts` record and returns one decision; `Preemption` (preemption.py)
gathers the facts and performs it. Property-tested with the lease calls
(`tests/test_lease_calls.py`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from timeslice.controller.orchestrator.decisions import Nothing, Waiting
from timeslice.driver import names


@dataclass(frozen=True)
class LimitFacts:
    """What a holder's `maxHoldSeconds` clock decides on when it runs out (`Preemption`): whether
    the hold it was armed for still holds (`current`), whether a switch runs beside it (a
    staging), the holder's job and priority, the queue, and whether a checkpoint would leave
    the holder running (`unfenceable`: `Residency.unfenceable`)."""

    backend: str
    current: bool
    switching: bool
    holder: str
    priority: int
    queue: tuple[Waiting, ...] = ()
    unfenceable: bool = False


@dataclass(frozen=True)
class AfterSwitch:
    """A staging runs beside the holder: the limit takes effect once it ends."""


@dataclass(frozen=True)
class Later:
    """Nothing could stop the holder yet (no CUDA context to lock: its checkpoint would leave it
    computing beside the next holder): the limit is looked at again in a moment."""


@dataclass(frozen=True)
class Preempt:
    """The hold ends. `park`: on a backend that stops processes, the holder is switched out like
    a releasing one and queued again under its lease (its preemption is invisible to its code);
    `revoke_kept`: its lease is revoked, and its memory moves only once its client released,
    before anyone is granted (`app`: its engine sleeps then; `vmm`: moved under its computing
    process, it would die: `names.UNRELEASED_KEPT_BACKENDS`); neither (`none`, `cooperative`:
    nothing stops the holder): its lease is revoked like a lapsed one."""

    park: bool = False
    revoke_kept: bool = False


LimitDecision = Nothing | AfterSwitch | Later | Preempt


def contended(holder: str, priority: int, queue: Iterable[Waiting]) -> bool:
    """Another job than `holder` waits at its `priority` or above (only then does its clock run)."""
    return any(w.job != holder and w.priority >= priority for w in queue)


def hold_limit(f: LimitFacts) -> LimitDecision:
    """What a holder's clock does when `maxHoldSeconds` ran out: a holder is preempted only
    while another job waits at its priority or above (a lower one would only be passed over
    again: preempting for it would re-grant the holder at once). Pure: reads `f` only."""
    if not f.current:
        return Nothing()
    if f.switching:
        return AfterSwitch()
    if not contended(f.holder, f.priority, f.queue):
        return Nothing()
    if f.unfenceable:  # (a job that reads its data for maxHoldSeconds before its first CUDA call)
        return Later()
    return Preempt(park=f.backend in names.STOPPING_BACKENDS, revoke_kept=f.backend in names.UNRELEASED_KEPT_BACKENDS)
