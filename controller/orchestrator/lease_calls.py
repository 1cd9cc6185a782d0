"""What a release or a keep-alive does: the lease it shows, matched against the leases a lock
group knows (`lease_call`). Pure: it reads one immutable `LeaseCallFacts` record and returns
one `LeaseCall`, touching nothing; `Leases.release` and `Leases.keep_alive` (leases.py) gather
the facts and perform the answer.

A call shows (job, lease id, epoch); it *matches* a lease when the job and the lease id are
the lease's and the epoch is its current one or a past one (a preempted and restored hold's).
The leases it is matched against, in order (leases.py has the why of each):

- release: the *parked* lease of a preempted holder (its place in the queue ends; with a
  `request_id` while other callers share it, only that caller's part) → the *lapsed* lease of a
  holder on a backend that stops processes (accepted, nothing moves) → the *revoked* lease of an
  `app` or `vmm` hold that ended unreleased (refused; noted first: its engine may sleep once no caller is
  left) → the *holder's* lease (its hold ends, or the caller's part of it) → refused.
- keep-alive: the parked lease (it is extended) → the revoked lease (refused) → a lease an
  earlier leader granted to a job checkpointed here, on a backend that stops processes
  (*switched out* mid-phase: queued again with that lease) → the lapsed lease (queued again)
  → the holder's lease (renewed) → refused.

A presumptive holder (adopted after a restart or a leader change: lease id `ADOPTED`, parked or
holding) takes the lease its job's first call shows (`adopt`). A lapsed lease whose job holds
again or is gone is forgotten on the way (`forget_lapsed`).

The invariants `tests/test_lease_calls.py` checks over random facts: a call is accepted only
for a lease it matches (or adopts); a release that ends a hold or a parked place ends only the
matched one, never while its other callers share it; a refusal names the holder; a job
switched out under an earlier leader is queued again only with a lease this group did not
grant, of an epoch not past its own, while it is checkpointed and does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from timeslice.controller.orchestrator.group_model import ADOPTED
from timeslice.driver import names


@dataclass(frozen=True)
class Lease:
    """A lease as a call is matched against it: its job, id, current epoch and past ones, and
    the request ids of its callers (the Acquires that share the hold; empty: not known)."""

    job: str
    lease_id: str
    epoch: int
    past_epochs: frozenset[int] = frozenset()
    callers: frozenset[str] = frozenset()

    def matches(self, job: str, lease_id: str, epoch: int) -> bool:
        return self.job == job and self.lease_id == lease_id and (epoch == self.epoch or epoch in self.past_epochs)

    def shared_beyond(self, request_id: str | None) -> bool:
        """Other callers share it beyond the one of `request_id` (empty or None: the whole hold)."""
        return bool(request_id) and bool(self.callers - {request_id})


@dataclass(frozen=True)
class Unreleased:
    """An `app` job whose hold ended without its release (`AwakeEngines`): that hold (None:
    not known, adopted or carried without it) and why it ended."""

    hold: Lease | None
    why: str


@dataclass(frozen=True)
class LeaseCallFacts:
    """A call and what the group knows of its job's leases (gathered by `Leases._decide`).

    `request_id`: a release's caller's Acquire ("" for the whole hold), None for a keep-alive;
    `known`: the lease id was granted by this orchestrator; `group_epoch`: the group's fencing
    epoch; `holder`: the holding lease; `parked`: the preempted hold keyed by this lease id,
    `parked_adopted`: the one keyed `ADOPTED` (a presumptive holder preempted before its first
    call); `lapsed`: the lapsed hold remembered under this lease id; `holds`: the job holds
    now; `resident` / `checkpointed`: its state is on the GPUs / off them; `unreleased`: its
    `app` hold that ended unreleased; `confirm`: a keep-alive that confirms a grant its client
    saw late (accepted only as the holder's renewal)."""

    job: str
    lease_id: str
    epoch: int
    request_id: str | None
    backend: str
    group_epoch: int
    known: bool = False
    holder: Lease | None = None
    parked: Lease | None = None
    parked_adopted: Lease | None = None
    lapsed: Lease | None = None
    resident: bool = False
    checkpointed: bool = False
    unreleased: Unreleased | None = None
    confirm: bool = False

    @property
    def call(self) -> str:
        return "keep-alive" if self.request_id is None else "release"


class Act(Enum):
    PARKED_PART = "the caller's part of a parked hold ends; its other callers hold on"
    PARKED_RELEASE = "a parked hold's place in the queue ends"
    PARKED_EXTEND = "a parked hold's lease is extended"
    LAPSED_RELEASE = "a late release of a lapsed hold is accepted"
    REQUEUE_LAPSED = "a lapsed holder is queued again under its lease"
    REQUEUE_SWITCHED_OUT = "a holder switched out under an earlier leader is queued again under its lease"
    REVOKED = "refused: the lease is revoked"
    REVOKED_PART = "refused: the lease is revoked; the caller's part of its hold ends"
    REVOKED_NOTE = "refused: the lease is revoked; its release is noted (its memory may move)"
    HOLDER_PART = "the caller's part of the hold ends; its other callers hold on"
    HOLDER_END = "the hold ends"
    HOLDER_RENEW = "the holder's lease is renewed"
    STALE = "refused: the lease is not the holder's"


PARKED = frozenset({Act.PARKED_PART, Act.PARKED_RELEASE, Act.PARKED_EXTEND})  # acts on the parked hold
LAPSED = frozenset({Act.LAPSED_RELEASE, Act.REQUEUE_LAPSED})  # on the lapsed one
REVOKED = frozenset({Act.REVOKED, Act.REVOKED_PART, Act.REVOKED_NOTE})  # on the unreleased `app` one
# the others on the holder's (a stale call: on nothing; a job switched out: on a hold made anew)


@dataclass(frozen=True)
class LeaseCall:
    """What the call does (`act`). `adopt`: the matched lease is a presumptive holder's, which
    takes the call's lease id and epoch (the group's epoch rises to it); `forget_lapsed`: the
    lapsed hold under this lease id is forgotten (accepted, queued again, or gone stale);
    `refusal`: the StaleLease message (without the group's name) when `act` refuses."""

    act: Act
    adopt: bool = False
    forget_lapsed: bool = False
    refusal: str = ""

    @property
    def refused(self) -> bool:
        return bool(self.refusal)


def lease_call(f: LeaseCallFacts) -> LeaseCall:
    """What the call `f` does (this module's rules). Pure: reads `f` only. A confirming
    keep-alive (`confirm`: its client saw the grant late, its process was stopped while it
    waited) is accepted only where it renews the holder's lease: a grant that lapsed or was
    preempted before its client saw it is refused, never queued again (nothing may have
    stopped a job that never computed under it), and the client asks anew."""
    d = _lease_call(f)
    if f.confirm and f.request_id is None and not d.refused and d.act is not Act.HOLDER_RENEW:
        h = f.holder
        holder = f"job {h.job} epoch {h.epoch}" if h else "nobody"
        return LeaseCall(Act.STALE, refusal=f"grant to job {f.job} epoch {f.epoch} seen too late ({d.act.value}); "
                                            f"the holder is {holder}: ask again")
    return d


def _lease_call(f: LeaseCallFacts) -> LeaseCall:
    release = f.request_id is not None
    parked, adopt = _parked(f)
    if parked is not None:
        if not release:
            return LeaseCall(Act.PARKED_EXTEND, adopt)
        return LeaseCall(Act.PARKED_PART if parked.shared_beyond(f.request_id) else Act.PARKED_RELEASE, adopt)
    lapsed, stale_lapsed = _lapsed(f)
    if release and lapsed:
        return LeaseCall(Act.LAPSED_RELEASE, forget_lapsed=True)
    revoked = _revoked(f)
    if revoked is not None:
        return replace(revoked, forget_lapsed=release and stale_lapsed)
    if not release and _switched_out(f):
        return LeaseCall(Act.REQUEUE_SWITCHED_OUT)
    if not release and lapsed:
        return LeaseCall(Act.REQUEUE_LAPSED, forget_lapsed=True)
    h = f.holder
    adopt = h is not None and h.lease_id == ADOPTED and h.job == f.job
    if not adopt and (h is None or not h.matches(f.job, f.lease_id, f.epoch)):
        holder = f"job {h.job} epoch {h.epoch}" if h else "nobody"
        return LeaseCall(Act.STALE, forget_lapsed=stale_lapsed,
                         refusal=f"{f.call} by job {f.job} epoch {f.epoch} refused: the holder is {holder} "
                                 "(lease lapsed or superseded)")
    if not release:
        act = Act.HOLDER_RENEW
    else:
        act = Act.HOLDER_PART if h.shared_beyond(f.request_id) else Act.HOLDER_END  # type: ignore[union-attr]
    return LeaseCall(act, adopt, forget_lapsed=stale_lapsed)


def _parked(f: LeaseCallFacts) -> tuple[Lease | None, bool]:
    """(the parked lease the call matches, whether it adopts it)."""
    p = f.parked
    if p is None:  # a presumptive holder preempted before it showed its lease shows it now
        p = f.parked_adopted
        if p is None or p.job != f.job:
            return None, False
        if p.lease_id == ADOPTED:
            return p, True
    return (p, False) if p.matches(f.job, f.lease_id, f.epoch) else (None, False)


def _lapsed(f: LeaseCallFacts) -> tuple[bool, bool]:
    """(the call matches a lapsed hold still in force, it matches one gone stale): a lapsed hold
    is in force while its job does not hold again and is still known here (resident or
    checkpointed)."""
    h = f.lapsed
    if h is None or not h.matches(f.job, f.lease_id, f.epoch):
        return False, False
    held_again = f.holder is not None and f.holder.job == f.job
    if held_again or not (f.resident or f.checkpointed):
        return False, True
    return True, False


def _revoked(f: LeaseCallFacts) -> LeaseCall | None:
    """The refusal of a call under the revoked lease of an `app` hold that ended unreleased
    (its hold not known: any lease this group did not grant, of an epoch not past its own)."""
    u = f.unreleased
    if u is None:
        return None
    h = u.hold
    if h is None or h.lease_id == ADOPTED:
        if f.known or not 0 < f.epoch <= f.group_epoch:
            return None
    elif not h.matches(f.job, f.lease_id, f.epoch):
        return None
    left = "its memory stays on the GPUs (an app engine awake) until its release"
    act = Act.REVOKED
    if f.request_id is not None:
        if h is not None and h.shared_beyond(f.request_id):
            act = Act.REVOKED_PART
            left = f"its memory stays on the GPUs until its other callers release ({len(h.callers - {f.request_id})})"
        else:
            act = Act.REVOKED_NOTE
            left = "noted: its memory may now move off the GPUs (an app engine sleep)"
    return LeaseCall(act, refusal=f"{f.call} by job {f.job} epoch {f.epoch} refused: its lease is revoked "
                                  f"({u.why}); {left}")


def _switched_out(f: LeaseCallFacts) -> bool:
    """A keep-alive under a lease an earlier leader granted, from a job checkpointed here that
    does not hold and is not parked under it, on a backend that stops processes: a holder
    switched out mid-phase under that leader (takeover.py). (A parked lease shown with another
    epoch was parked here: queued again, it was queued twice.)"""
    return f.backend in names.STOPPING_BACKENDS and not (f.holder is not None and f.holder.job == f.job) \
        and f.parked is None and f.checkpointed and bool(f.lease_id) and f.lease_id != ADOPTED \
        and 0 < f.epoch <= f.group_epoch and not f.known
