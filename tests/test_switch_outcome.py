"""The decision core of a switch's outcome (`switch_outcome.outcome`) over random switches and
results (hypothesis): whatever happened, the job that fails is the one whose step failed, a
grant follows only a switch that succeeded, and no job is taken to be on the GPUs by a switch
that did not run. `TIMESLICE_DECISION_EXAMPLES` sets the number of cases (default 10 000)."""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from timeslice.controller.orchestrator.group_model import SwitchRecord
from timeslice.controller.orchestrator.switch_outcome import (
    MAX_RESTORE_FAILURES,
    RESTORE_FAILURE_SECONDS,
    CheckedOut,
    Counted,
    Dropped,
    FailWaiters,
    Grant,
    Held,
    IdleFailed,
    MovedIn,
    OffGpu,
    OutcomeFacts,
    Recorded,
    RestoredForNobody,
    RestoreFailed,
    SwitchResult,
    Unstaged,
    outcome,
)

JOBS = ("a", "b", "c", "d")
EXAMPLES = int(os.environ.get("TIMESLICE_DECISION_EXAMPLES", "10000"))


@st.composite
def cases(draw) -> tuple[OutcomeFacts, SwitchResult]:
    incoming = draw(st.sampled_from(JOBS))
    evict = tuple(draw(st.lists(st.sampled_from([j for j in JOBS if j != incoming]), unique=True)))
    grant = draw(st.booleans())
    dropped = draw(st.booleans())  # the incoming job was dropped while its switch ran
    others = [j for j in JOBS if j not in (incoming, *evict)]
    beside = None if grant or not others else draw(st.none() | st.sampled_from(others))
    backend = draw(st.sampled_from(["cuda", "cooperative", "freeze", "app"]))
    facts = OutcomeFacts("g", backend, evict, incoming,
                         restore=draw(st.booleans()), grant=grant, beside=beside,
                         queued=frozenset(draw(st.lists(st.sampled_from(JOBS), unique=True))),
                         orphan=(not grant or dropped) and draw(st.booleans()),
                         restore_failures=draw(st.integers(0, MAX_RESTORE_FAILURES)),
                         failing_seconds=draw(st.sampled_from([0.0, 3.0, RESTORE_FAILURE_SECONDS, 60.0])),
                         holder_epoch=draw(st.integers(0, 5)), dropped=dropped,
                         kept=draw(st.booleans()), restarted=draw(st.booleans()))
    kind = draw(st.sampled_from(["ran", "no-room", "failed", "crashed"]))
    record = None
    if kind in ("ran", "failed") and (kind == "failed" or draw(st.booleans())):
        ok = kind == "ran"
        record = SwitchRecord(evict[0] if evict else None, incoming, ok=ok, error="" if ok else "step failed",
                              restore_seconds=draw(st.sampled_from([0.0, 1.5])),
                              gone=tuple(draw(st.lists(st.sampled_from(evict), unique=True))) if evict else (),
                              failed_step="" if ok else draw(st.sampled_from(["", "checkpoint", "restore"])),
                              unreachable=not ok and draw(st.booleans()))
    failed = kind == "failed" and evict
    off_gpu = frozenset(draw(st.lists(st.sampled_from(evict), unique=True))) if failed else frozenset()
    return facts, SwitchResult(kind, record, off_gpu, "why")


def check(f: OutcomeFacts, r: SwitchResult, record: SwitchRecord | None, effects: list) -> None:
    kinds = [type(e) for e in effects]
    ok = r.kind == "ran" and (r.record is None or r.record.ok)
    # the job that fails for good is the incoming one, for a restore step of its own that ran and failed
    for e in effects:
        if isinstance(e, RestoreFailed):
            assert e.job == f.incoming and r.record is not None and r.record.failed_step == "restore"
            assert not r.record.unreachable
            assert e.fails == (f.restore_failures + 1 >= MAX_RESTORE_FAILURES
                               and f.failing_seconds >= RESTORE_FAILURE_SECONDS)
        if isinstance(e, FailWaiters):  # waiters fail only for the incoming job, only when its switch failed
            assert e.job == f.incoming and not ok and not (r.kind == "no-room" and f.beside is not None)
    # a job dropped or started again while its switch ran: its waiters now are a later incarnation's, which
    # nothing of the switch grants, fails or counts against; a dropped one is not taken to be on the GPUs,
    # but an `app` engine its drop kept, which the restore woke, is a resident (not next up)
    replaced = f.dropped or f.restarted
    if replaced:
        assert not {Grant, Held, FailWaiters, RestoreFailed, IdleFailed} & set(kinds), effects
    if f.dropped:
        assert all(f.kept and f.backend == "app" and not e.next_up for e in effects if isinstance(e, MovedIn)), effects
    assert kinds.count(RestoreFailed) <= 1
    # a grant follows only a switch that ran and succeeded, once, for the incoming job
    grants = [e for e in effects if isinstance(e, Grant)]
    assert len(grants) == (1 if f.grant and ok and not replaced else 0)
    assert all(e.job == f.incoming and e.restored == f.restore for e in grants)
    # no job is taken to be on the GPUs by a switch that did not run
    if not ok:
        assert not {Held, MovedIn, CheckedOut, RestoredForNobody, Dropped} & set(kinds), effects
    assert {e.job for e in effects if isinstance(e, OffGpu)} <= r.off_gpu
    # the evicted jobs of a switch that ran are off the GPUs, or gone everywhere (dropped after the grant)
    if ok:
        out = [e.job for e in effects if isinstance(e, CheckedOut)]
        dropped = [e.job for e in effects if isinstance(e, Dropped)]
        assert sorted(out + dropped) == sorted(f.evict)
        for job in dropped:
            assert job not in f.queued and r.record is not None and job in r.record.gone
        if grants and dropped:
            assert effects.index(grants[0]) < min(effects.index(Dropped(j)) for j in dropped)
        held = f.grant and not replaced
        assert kinds.count(Held) == (1 if held else 0)
        assert kinds.count(MovedIn) == (1 if not held and not f.orphan and f.restore and r.record
                                        and (not f.dropped or (f.kept and f.backend == "app")) else 0)
    # a staging without room is left to the hand-off, and nothing else happens
    if r.kind == "no-room" and f.beside is not None:
        assert effects == [Unstaged(f.holder_epoch, f.incoming)] and record is None
    if record is not None:
        assert Recorded(f.incoming, record) in effects
    if IdleFailed in kinds:
        assert not f.grant and f.beside is None and (record is None or not record.ok) and not replaced


@pytest.mark.slow  # (~30 s for 10 000 on an idle 2-core VM)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_outcome_keeps_the_invariants(case: tuple[OutcomeFacts, SwitchResult]) -> None:
    f, r = case
    record, effects = outcome(f, r)
    check(f, r, record, effects)


def test_a_job_dropped_while_its_switch_ran_is_not_granted_by_it() -> None:
    """cuda schedules seed 600008: a job SIGTERMed while it waited left (dropped) during the switch
    planned for it, its next process asked, and the switch's end granted that process in place
    while the old one still held 66 GB: it ran out of memory. Its waiters stay queued, failed by
    nothing of the switch, and the next dispatch plans on fresh reports."""
    f = OutcomeFacts("g", "cuda", ("b",), "a", restore=False, grant=True, queued=frozenset({"a"}), dropped=True)
    rec = SwitchRecord("b", "a", ok=True)
    _, effects = outcome(f, SwitchResult("ran", rec))
    assert effects == [CheckedOut("b"), Counted(True), Recorded("a", rec)]
    bad = SwitchRecord("b", "a", ok=False, error="restore failed", failed_step="restore")
    _, effects = outcome(dataclasses.replace(f, restore=True), SwitchResult("failed", bad, frozenset(), "x"))
    assert not any(isinstance(e, (FailWaiters, RestoreFailed, Grant)) for e in effects)
    # started again (a SIGKILLed process, no Leave: its next one connected, or a report named it): the
    # restore that ran leaves it resident and next up, ungranted
    again = dataclasses.replace(f, restore=True, dropped=False, restarted=True)
    _, effects = outcome(again, SwitchResult("ran", rec))
    assert effects == [CheckedOut("b"), Counted(True), MovedIn("a", next_up=True), Recorded("a", rec)]


def test_an_app_engine_woken_for_a_job_that_left_meanwhile_is_a_resident() -> None:
    """app schedules seed 3 (CI): a SIGTERMed job left while its engine's wake ran; the engine,
    awake and kept (`MemoryMoves.dropped`), was taken to be asleep, and the next job's wake ran out
    of memory beside it. It is resident, not next up; a gone one (not kept) is not."""
    f = OutcomeFacts("g", "app", ("b",), "a", restore=True, grant=True, dropped=True, kept=True)
    rec = SwitchRecord("b", "a", ok=True)
    _, effects = outcome(f, SwitchResult("ran", rec))
    assert effects == [CheckedOut("b"), Counted(True), MovedIn("a", next_up=False), Recorded("a", rec)]
    _, effects = outcome(dataclasses.replace(f, kept=False), SwitchResult("ran", rec))
    assert effects == [CheckedOut("b"), Counted(True), Recorded("a", rec)]


def test_an_evicted_jobs_failed_checkpoint_never_counts_against_the_incoming_job() -> None:
    """(issue 22: the wrong job was marked failed when the evicted job's checkpoint failed)"""
    f = OutcomeFacts("g", "cuda", ("a",), "b", restore=True, grant=True, restore_failures=MAX_RESTORE_FAILURES - 1)
    rec = SwitchRecord("a", "b", ok=False, error="checkpoint of a failed", failed_step="checkpoint")
    _, effects = outcome(f, SwitchResult("failed", rec, frozenset(), "checkpoint of a failed"))
    assert not any(isinstance(e, RestoreFailed) for e in effects)
    assert FailWaiters("b", "group g: checkpoint of a failed") in effects  # its waiters ask again


def test_the_third_failed_restore_in_a_row_fails_the_job_for_good_once_the_first_is_old_enough() -> None:
    """A fault that passes within RESTORE_FAILURE_SECONDS costs no job: the harness's
    driver faults that kept failing restores for 2.7 s failed 3 of 40 vmm jobs."""
    rec = SwitchRecord(None, "b", ok=False, error="restore failed", failed_step="restore")
    soon = OutcomeFacts("g", "cuda", (), "b", restore=True, grant=True, restore_failures=MAX_RESTORE_FAILURES - 1,
                        failing_seconds=RESTORE_FAILURE_SECONDS - 0.1)
    _, effects = outcome(soon, SwitchResult("failed", rec, frozenset(), "restore failed"))
    assert RestoreFailed("b", rec, fails=False) in effects
    f = OutcomeFacts("g", "cuda", (), "b", restore=True, grant=True, restore_failures=MAX_RESTORE_FAILURES - 1,
                     failing_seconds=RESTORE_FAILURE_SECONDS)
    _, effects = outcome(f, SwitchResult("failed", rec, frozenset(), "restore failed"))
    assert RestoreFailed("b", rec, fails=True) in effects
    unreachable = SwitchRecord(None, "b", ok=False, error="agent down", failed_step="restore", unreachable=True)
    _, effects = outcome(f, SwitchResult("failed", unreachable, frozenset(), "agent down"))
    assert not any(isinstance(e, RestoreFailed) for e in effects)
