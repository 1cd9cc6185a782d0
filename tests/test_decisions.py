"""The decision core (`decisions.decide`, `decisions.lease_timer`) over random facts
(hypothesis): whatever a group knows, what it decides keeps the lock's invariants. Pure: no loop, no group, no agent.
`TIMESLICE_DECISION_EXAMPLES` sets the number of fact sets (default 10 000)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from timeslice.controller.orchestrator.decisions import (
    DispatchFacts,
    GrantBeside,
    GrantOnGpu,
    KeepOverdue,
    Lapse,
    LeaseFacts,
    Nothing,
    ReadRecords,
    Rearm,
    SettleUnsure,
    Stage,
    Switch,
    WaitForRelease,
    Waiting,
    decide,
    lease_timer,
    next_job,
)
from timeslice.driver.names import STOPPING_BACKENDS, UNRELEASED_KEPT_BACKENDS

JOBS = ("a", "b", "c", "d", "e")
EXAMPLES = int(os.environ.get("TIMESLICE_DECISION_EXAMPLES", "10000"))


def _subset(draw, pool, **kw):
    return draw(st.lists(st.sampled_from(sorted(pool)), unique=True, **kw)) if pool else []


@st.composite
def facts(draw) -> DispatchFacts:
    backend = draw(st.sampled_from(["none", "freeze", "cuda", "cooperative", "app"]))
    aware = backend != "none" and draw(st.booleans())
    residents = tuple(draw(st.permutations(JOBS))[: draw(st.integers(0, len(JOBS)))])  # least recently held first
    off = set(JOBS) - set(residents)
    checkpointed = set() if backend == "none" else set(_subset(draw, off))
    holder = draw(st.none() | st.sampled_from(residents)) if residents else None
    switching = draw(st.booleans())
    queue = tuple(draw(st.lists(st.builds(Waiting, st.sampled_from(JOBS), st.integers(0, 2)), max_size=6)))
    queue = tuple(sorted(queue, key=lambda w: -w.priority))  # (a stable sort: arrival within a priority)
    queued = {w.job for w in queue}
    return DispatchFacts(
        backend=backend, memory_aware=aware, holder=holder, holder_epoch=draw(st.integers(0, 3)),
        switching=switching, beside=draw(st.none() | st.sampled_from(residents)) if switching and residents else None,
        queue=queue, residents=residents, checkpointed=frozenset(checkpointed),
        unconfirmed=frozenset(_subset(draw, queued & (set(residents) | checkpointed), max_size=1)),
        known=frozenset(_subset(draw, set(JOBS))),
        roomy=frozenset(_subset(draw, queued & set(residents))) if aware else frozenset(),
        leaving=tuple(_subset(draw, set(residents) - {holder}, max_size=2)),
        unreleased=tuple(sorted(_subset(draw, set(residents), max_size=2))) if backend == "app" else (),
        failed=frozenset(_subset(draw, set(JOBS), max_size=1)),
        unstaged=draw(st.none() | st.tuples(st.integers(0, 3), st.sampled_from(JOBS))),
        records_unknown=draw(st.booleans()), unsure=draw(st.booleans()),
        pass_remaining=draw(st.sampled_from([0.0, 5.0])) if aware else 0.0,
        head_moves_nothing=aware and draw(st.booleans()))


def check(f: DispatchFacts, d: object) -> None:
    """The invariants of one decision (the module docstring of decisions.py names them). A job
    that must leave (`leaving`) keeps others from a grant, not itself: its client holds again."""
    granted = d.job if isinstance(d, (GrantOnGpu, Switch, GrantBeside)) else None
    if f.holder is not None:  # no job other than the holder is granted while one holds
        assert isinstance(d, (Nothing, Stage)), d
        if isinstance(d, Stage):  # a staging: a checkpointed job with a known need beside a holder with one
            assert d.beside == f.holder and d.job != f.holder and d.job in f.checkpointed, d
            assert d.job in f.known and f.holder in f.known and d.job not in f.failed, d
            assert not f.must_leave(d.job) and f.unstaged != (f.holder_epoch, d.job), d
            assert f.memory_aware and not f.switching, d
        return
    assert not isinstance(d, Stage), d
    if f.switching:  # only the job a staging keeps room beside, at the head's priority or above
        assert isinstance(d, (Nothing, GrantBeside)), d
        if isinstance(d, GrantBeside):
            assert d.job == f.beside and d.job in f.residents and not f.must_leave(d.job), d
            assert max(w.priority for w in f.queue if w.job == d.job) >= f.queue[0].priority, d
        return
    if not f.queue:
        assert isinstance(d, Nothing), d
        return
    if f.records_unknown:  # nothing is granted or moved on a guess
        assert isinstance(d, ReadRecords), d
        return
    if f.unsure:
        assert isinstance(d, SettleUnsure), d
        return
    assert not isinstance(d, (Nothing, GrantBeside)), d  # a free lock with waiters is never left alone
    if isinstance(d, WaitForRelease):
        assert d.jobs and set(d.jobs) <= set(f.unreleased), d
        return
    assert granted in {w.job for w in f.queue}, d
    off_gpu = granted in f.checkpointed or granted in f.unconfirmed
    if isinstance(d, GrantOnGpu):  # granted where it is: its state is there, nothing must leave first
        assert not off_gpu or f.backend == "none", d
        if f.memory_aware:
            assert granted in f.residents and granted in f.roomy and not f.must_leave(granted), d
        elif f.backend != "none":
            assert set(f.residents) <= {granted}, d
    else:
        assert d.restore == off_gpu, d  # a job whose state is off the GPUs is restored before its grant
        assert (d.evict is None) == f.memory_aware, d  # (None: a plan over fresh reports decides)
        if d.evict is not None:
            assert granted not in d.evict and set(d.evict) == set(f.residents) - {granted}, d
    # who goes first: the head, a resident with room of its priority passing it, or an awake engine's own job
    head = f.queue[0]
    passing = f.memory_aware and f.pass_remaining > 0 and not f.leaving and granted in f.roomy and \
        any(w.job == granted and w.priority == head.priority for w in f.queue)
    assert granted == head.job or passing or granted in f.unreleased, (d, head)


@pytest.mark.slow  # (~60 s for 10 000 on an idle 2-core VM)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(facts())
def test_every_decision_keeps_the_lock_invariants(f: DispatchFacts) -> None:
    check(f, decide(f))


def test_a_checkpointed_head_is_restored_before_its_grant() -> None:
    f = DispatchFacts(backend="cuda", memory_aware=False, queue=(Waiting("b", 0),), residents=("a",),
                      checkpointed=frozenset("b"))
    assert decide(f) == Switch(("a",), "b", restore=True)


def test_an_unconfirmed_resident_is_granted_through_a_restore_even_when_its_room_was_reported() -> None:
    """(Restarted orchestrator: the state file says checkpointed, its processes have not said.)"""
    f = DispatchFacts(backend="cooperative", memory_aware=True, queue=(Waiting("a", 0),), residents=("a",),
                      unconfirmed=frozenset("a"), roomy=frozenset("a"))
    assert decide(f) == Switch(None, "a", restore=True, may_defer=True)


def test_a_resident_waiter_with_room_passes_a_head_whose_grant_moves_memory_while_passing_lasts() -> None:
    base = dict(backend="cuda", memory_aware=True, queue=(Waiting("a", 0), Waiting("b", 0)), residents=("b",),
                checkpointed=frozenset("a"), roomy=frozenset("b"))
    assert next_job(DispatchFacts(**base, pass_remaining=3.0)) == "b"
    assert next_job(DispatchFacts(**base, pass_remaining=0.0)) == "a"
    assert next_job(DispatchFacts(**base, pass_remaining=3.0, head_moves_nothing=True)) == "a"
    assert next_job(DispatchFacts(**base, pass_remaining=3.0, leaving=("c",))) == "a"


def test_nothing_is_staged_beside_a_holder_whose_need_is_not_known() -> None:
    base = dict(backend="cooperative", memory_aware=True, holder="a", holder_epoch=4, queue=(Waiting("b", 0),),
                residents=("a",), checkpointed=frozenset("b"))
    assert decide(DispatchFacts(**base, known=frozenset("b"))) == Nothing()
    assert decide(DispatchFacts(**base, known=frozenset("ab"))) == Stage("b", "a")
    assert decide(DispatchFacts(**base, known=frozenset("ab"), unstaged=(4, "b"))) == Nothing()


def test_an_awake_engine_keeps_its_gpus_until_its_client_releases_unless_its_own_job_waits() -> None:
    base = dict(backend="app", memory_aware=False, residents=("a",), unreleased=("a",))
    assert decide(DispatchFacts(**base, queue=(Waiting("b", 0),))) == WaitForRelease(("a",))
    assert decide(DispatchFacts(**base, queue=(Waiting("b", 0), Waiting("a", 0)))) == GrantOnGpu("a")


lease_facts = st.builds(LeaseFacts, backend=st.sampled_from(["none", "freeze", "cuda", "cuda-checkpoint",
                                                             "cooperative", "app", "vmm"]),
                        current=st.booleans(), now=st.floats(0, 20), deadline=st.floats(0, 20),
                        streaming=st.booleans(), callers_unknown=st.booleans(), overdue=st.booleans(),
                        live=st.booleans(), unfenceable=st.booleans())


@settings(max_examples=2000, deadline=None)
@given(lease_facts)
def test_a_lease_lapses_only_past_its_deadline_and_never_under_a_computing_holder_nothing_stops(f: LeaseFacts) -> None:
    d = lease_timer(f)
    if isinstance(d, Lapse):  # past its deadline, and not a holder still computing that nothing would stop
        assert f.current and f.now >= f.deadline and not (f.streaming and not f.callers_unknown), (f, d)
        assert not (f.live and f.backend in UNRELEASED_KEPT_BACKENDS and not f.callers_unknown), (f, d)
        # nor one whose checkpoint would leave it running (`cuda`, no CUDA context to lock yet)
        assert not (f.live and f.unfenceable and not f.callers_unknown), (f, d)
        # its late keep-alive queues it again only where the orchestrator stopped its processes
        assert d.requeue == (f.backend in STOPPING_BACKENDS), (f, d)
    if not f.current:  # a timer armed for a hold that ended does nothing
        assert d == Nothing()
    elif f.now < f.deadline:  # extended since it was armed
        assert d == Rearm()
    else:  # a holder past its deadline lapses, or is kept overdue while it computes
        assert isinstance(d, (Lapse, KeepOverdue)), (f, d)
