"""What a release or keep-alive does (`lease_calls.lease_call`) over random facts (hypothesis):
whatever leases a group knows, a call is accepted only for a lease it shows, ends only what it
may, and a refusal says who holds; and what a holder's `maxHoldSeconds` clock does
(`hold_limits.hold_limit`). Pure: no loop, no group. `TIMESLICE_DECISION_EXAMPLES` sets
the number of fact sets (default 10 000)."""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from timeslice.controller.orchestrator.decisions import Nothing, Waiting
from timeslice.controller.orchestrator.group_model import ADOPTED
from timeslice.controller.orchestrator.hold_limits import AfterSwitch, Later, LimitFacts, Preempt, hold_limit
from timeslice.controller.orchestrator.lease_calls import (
    LAPSED,
    PARKED,
    REVOKED,
    Act,
    Lease,
    LeaseCall,
    LeaseCallFacts,
    Unreleased,
    lease_call,
)
from timeslice.driver.names import STOPPING_BACKENDS, UNRELEASED_KEPT_BACKENDS

JOBS = ("a", "b")
LEASES = ("l1", "l2", ADOPTED, "")
REQUESTS = ("r1", "r2")
EXAMPLES = int(os.environ.get("TIMESLICE_DECISION_EXAMPLES", "10000"))

leases = st.builds(Lease, st.sampled_from(JOBS), st.sampled_from(LEASES), st.integers(0, 3),
                   st.frozensets(st.integers(0, 3), max_size=2), st.frozensets(st.sampled_from(REQUESTS), max_size=2))
facts = st.builds(
    LeaseCallFacts, st.sampled_from(JOBS), st.sampled_from(LEASES), st.integers(0, 4),
    st.none() | st.sampled_from(("", *REQUESTS)), st.sampled_from(["none", "freeze", "cuda", "cooperative", "app"]),
    st.integers(0, 3), st.booleans(), st.none() | leases, st.none() | leases, st.none() | leases, st.none() | leases,
    st.booleans(), st.booleans(), st.none() | st.builds(Unreleased, st.none() | leases, st.just("lapsed")),
    st.booleans())

RELEASE_ACTS = {Act.PARKED_PART, Act.PARKED_RELEASE, Act.LAPSED_RELEASE, Act.REVOKED_PART, Act.REVOKED_NOTE,
                Act.HOLDER_PART, Act.HOLDER_END}
KEEP_ALIVE_ACTS = {Act.PARKED_EXTEND, Act.REQUEUE_LAPSED, Act.REQUEUE_SWITCHED_OUT, Act.HOLDER_RENEW}


def shows(f: LeaseCallFacts, lease: Lease | None, adopt: bool) -> bool:
    """The call shows `lease` (or adopts it: a presumptive holder's, of its job)."""
    if lease is None or lease.job != f.job:
        return False
    return (adopt and lease.lease_id == ADOPTED) or lease.matches(f.job, f.lease_id, f.epoch)


def check(f: LeaseCallFacts, d: LeaseCall) -> None:
    """The invariants of one answer (lease_calls.py's docstring names them)."""
    release = f.request_id is not None
    assert d.act in (RELEASE_ACTS if release else KEEP_ALIVE_ACTS) | {Act.REVOKED, Act.STALE}, d
    assert d.refused == (d.act in REVOKED or d.act is Act.STALE), d
    if d.act in PARKED:  # the parked lease by this id, else the adopted one's: shown
        assert shows(f, f.parked if f.parked is not None else f.parked_adopted, d.adopt), d
        assert d.adopt == (f.parked is None and f.parked_adopted is not None and f.parked_adopted.lease_id == ADOPTED)
    elif f.parked is not None and not (f.confirm and not release):
        assert not f.parked.matches(f.job, f.lease_id, f.epoch), d  # a matching parked lease always answers
    if d.act in LAPSED:  # a lapsed hold in force: its job does not hold again and is known here
        assert shows(f, f.lapsed, False) and (f.resident or f.checkpointed), d
        assert not (f.holder is not None and f.holder.job == f.job) and d.forget_lapsed, d
    if d.forget_lapsed:
        assert f.lapsed is not None and f.lapsed.job == f.job, d
    if d.act in REVOKED:
        assert f.unreleased is not None, d
        h = f.unreleased.hold
        if h is None or h.lease_id == ADOPTED:  # not known: a lease not granted here, of an epoch not past its own
            assert not f.known and 0 < f.epoch <= f.group_epoch, d
        else:
            assert h.matches(f.job, f.lease_id, f.epoch), d
        assert (d.act is Act.REVOKED) == (not release), d
        assert "revoked" in d.refusal, d
    if d.act is Act.REQUEUE_SWITCHED_OUT:  # a lease an earlier leader granted, to a job out and not holding
        assert f.backend in STOPPING_BACKENDS and not f.known and f.checkpointed, d
        assert f.lease_id not in ("", ADOPTED) and 0 < f.epoch <= f.group_epoch, d
        assert not (f.holder is not None and f.holder.job == f.job), d
        assert f.parked is None, d  # a lease parked here is never queued twice
    if d.act in (Act.HOLDER_PART, Act.HOLDER_END, Act.HOLDER_RENEW):
        assert shows(f, f.holder, d.adopt), d
        assert d.adopt == (f.holder is not None and f.holder.lease_id == ADOPTED), d
    elif d.act not in PARKED:
        assert not d.adopt, d
    if d.act in (Act.PARKED_PART, Act.HOLDER_PART, Act.REVOKED_PART):  # other callers hold on: only its part ends
        target = {Act.PARKED_PART: f.parked or f.parked_adopted, Act.HOLDER_PART: f.holder,
                  Act.REVOKED_PART: f.unreleased.hold if f.unreleased else None}[d.act]
        assert target is not None and f.request_id and target.callers - {f.request_id}, d
    if d.act in (Act.PARKED_RELEASE, Act.HOLDER_END):  # no other caller shares what ends
        target = f.holder if d.act is Act.HOLDER_END else (f.parked or f.parked_adopted)
        assert target is not None and not (f.request_id and target.callers - {f.request_id}), d
    if d.act is Act.STALE:
        h = f.holder
        assert (f"the holder is job {h.job} epoch {h.epoch}" if h else "the holder is nobody") in d.refusal, d
        if f.confirm and not release:  # refused for what the plain keep-alive would do, never for a renewal
            assert lease_call(dataclasses.replace(f, confirm=False)).act is not Act.HOLDER_RENEW, d
        else:
            assert not shows(f, h, True), d  # the holder's lease would have been accepted
    if f.confirm and not release:  # a grant confirmed late is never queued again nor extended while parked
        assert d.act in (Act.HOLDER_RENEW, Act.STALE) or d.act in REVOKED, d
        assert not d.forget_lapsed or d.act is not Act.STALE or "seen too late" not in d.refusal, d


@pytest.mark.slow  # (~20 s for 10 000 on an idle 2-core VM)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(facts)
def test_every_release_and_keep_alive_keeps_the_lease_invariants(f: LeaseCallFacts) -> None:
    check(f, lease_call(f))


def holder(callers: tuple[str, ...] = ("r1",), lease_id: str = "l1", epoch: int = 2) -> Lease:
    return Lease("a", lease_id, epoch, frozenset({1}), frozenset(callers))


def call(request_id: str | None, **kw) -> LeaseCall:
    base = {"job": "a", "lease_id": "l1", "epoch": 2, "request_id": request_id, "backend": "cuda",
            "group_epoch": 2, "known": True}
    return lease_call(LeaseCallFacts(**{**base, **kw}))


def test_the_holders_release_ends_its_hold_and_its_keep_alive_renews_it_also_under_a_past_epoch() -> None:
    assert call("r1", holder=holder()).act is Act.HOLDER_END
    assert call(None, holder=holder()).act is Act.HOLDER_RENEW
    assert call("", holder=holder(), epoch=1).act is Act.HOLDER_END  # restored after a preemption: its old epoch
    d = call("r1", holder=holder(), epoch=3)
    assert d.act is Act.STALE and d.refusal.endswith("the holder is job a epoch 2 (lease lapsed or superseded)")


def test_a_caller_that_shares_the_hold_ends_only_its_part() -> None:
    assert call("r1", holder=holder(("r1", "r2"))).act is Act.HOLDER_PART
    assert call("", holder=holder(("r1", "r2"))).act is Act.HOLDER_END  # an older client: the whole hold


def test_a_presumptive_holder_adopts_the_lease_its_first_call_shows() -> None:
    d = call(None, holder=holder((), lease_id=ADOPTED, epoch=1), lease_id="old", epoch=7, known=False)
    assert d.act is Act.HOLDER_RENEW and d.adopt
    d = call("", parked_adopted=holder((), lease_id=ADOPTED), lease_id="old", known=False)
    assert d.act is Act.PARKED_RELEASE and d.adopt
    assert call("", parked_adopted=Lease("b", ADOPTED, 1)).act is Act.STALE  # another job's


def test_a_late_call_of_a_lapsed_holder_is_accepted_only_while_its_job_is_here_and_does_not_hold() -> None:
    lapsed = holder()
    assert call("", lapsed=lapsed, checkpointed=True) == LeaseCall(Act.LAPSED_RELEASE, forget_lapsed=True)
    assert call(None, lapsed=lapsed, resident=True) == LeaseCall(Act.REQUEUE_LAPSED, forget_lapsed=True)
    d = call(None, lapsed=lapsed)  # dropped since: the lease is gone
    assert d.act is Act.STALE and d.forget_lapsed
    d = call(None, lapsed=lapsed, resident=True, holder=holder(lease_id="l2", epoch=3))  # holds again, anew
    assert d.act is Act.STALE and d.forget_lapsed


def test_a_grant_confirmed_late_is_accepted_only_while_it_is_the_holders() -> None:
    """A confirming keep-alive (its client saw the grant after its lease lapsed, the process was
    stopped while it waited) is refused where a plain late keep-alive would be queued again under
    the lapsed lease: nothing stopped a job that never computed under it (tester's input: a waiter
    SIGSTOPped through its grant on `cuda` then computed beside the next holder)."""
    lapsed = holder()
    d = call(None, lapsed=lapsed, resident=True, confirm=True)
    assert d.act is Act.STALE and "seen too late" in d.refusal and not d.forget_lapsed
    assert call(None, holder=holder(), confirm=True) == LeaseCall(Act.HOLDER_RENEW)
    d = call(None, parked=holder(), confirm=True)  # preempted before its client saw it
    assert d.act is Act.STALE


def test_a_holder_switched_out_under_an_earlier_leader_is_queued_again_only_where_the_backend_stopped_it() -> None:
    kw = {"known": False, "checkpointed": True, "group_epoch": 5}
    assert call(None, **kw).act is Act.REQUEUE_SWITCHED_OUT
    assert call(None, **{**kw, "backend": "cooperative"}).act is Act.STALE  # never stopped: its hold must end
    assert call(None, **{**kw, "known": True}).act is Act.STALE  # granted here: not an earlier leader's
    assert call(None, **{**kw, "epoch": 6}).act is Act.STALE  # an epoch past the group's own
    assert call("", **kw).act is Act.STALE  # a release is not queued again
    # review of the decision core: a lease parked here, shown with another epoch, was parked a second time
    # (two queue entries of one job; the grant then failed on the second) where the lease was not known
    assert call(None, **kw, parked=Lease("a", "l1", 1)).act is Act.STALE


def test_a_revoked_app_lease_is_refused_and_its_release_noted_once_no_caller_is_left() -> None:
    u = Unreleased(holder(("r1", "r2")), "maxHoldSeconds 5 exceeded while others waited")
    assert call(None, backend="app", unreleased=u).act is Act.REVOKED
    d = call("r1", backend="app", unreleased=u)
    assert d.act is Act.REVOKED_PART and d.refusal.endswith("until its other callers release (1)")
    d = call("r1", backend="app", unreleased=Unreleased(holder(), "lapsed"))
    assert d.act is Act.REVOKED_NOTE and "its lease is revoked (lapsed); noted" in d.refusal
    # a hold not known (adopted): any lease this group did not grant, of an epoch not past its own
    assert call(None, backend="app", unreleased=Unreleased(None, "x"), known=False).act is Act.REVOKED
    assert call(None, backend="app", unreleased=Unreleased(None, "x"), known=True).act is Act.STALE


limit_facts = st.builds(LimitFacts, st.sampled_from(["none", "freeze", "cuda", "cooperative", "app"]), st.booleans(),
                        st.booleans(), st.sampled_from(JOBS), st.integers(0, 2),
                        st.lists(st.builds(Waiting, st.sampled_from(JOBS), st.integers(0, 2)), max_size=4).map(tuple),
                        st.booleans())


@settings(max_examples=2000, deadline=None)
@given(limit_facts)
def test_a_holder_is_preempted_only_for_a_job_waiting_at_its_priority_and_parked_only_where_it_is_stopped(
        f: LimitFacts) -> None:
    d = hold_limit(f)
    contender = any(w.job != f.holder and w.priority >= f.priority for w in f.queue)
    if isinstance(d, Preempt):  # never one that nothing would stop (it would compute beside the next holder)
        assert f.current and not f.switching and contender and not f.unfenceable, (f, d)
        assert d.park == (f.backend in STOPPING_BACKENDS), (f, d)
        assert d.revoke_kept == (f.backend in UNRELEASED_KEPT_BACKENDS), (f, d)
    elif isinstance(d, Later):  # looked at again: it may have a CUDA context by then
        assert f.current and not f.switching and contender and f.unfenceable, (f, d)
    elif isinstance(d, AfterSwitch):  # a staging beside the holder runs; it takes effect after
        assert f.current and f.switching, (f, d)
    else:
        assert isinstance(d, Nothing) and (not f.current or (not f.switching and not contender)), (f, d)
