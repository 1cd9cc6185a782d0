"""What an Acquire does (`acquire_calls.admit`) over random facts (hypothesis): a caller joins
only its own job's live hold, after waiting for exits where memory is planned; a failed job is
never joined or queued; a member queues at its configured priority; a request is never queued
twice; and each call ends in a join, a refusal or a place in the queue within three answers.
Pure: no loop, no group, except the last test (a real `LockGroup`).
`TIMESLICE_DECISION_EXAMPLES` sets the number of fact sets (default 10 000)."""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from timeslice.controller.orchestrator.acquire_calls import (
    AcquireFacts,
    AddCaller,
    Admission,
    EndHold,
    JoinHold,
    Moved,
    Queue,
    Refuse,
    WaitForExits,
    admit,
)
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.group import LockGroup
from timeslice.controller.orchestrator.group_model import SwitchRecord
from timeslice.driver.errors import JobFailed

EXAMPLES = int(os.environ.get("TIMESLICE_DECISION_EXAMPLES", "10000"))
JOBS = ("a", "b")
ENDS = (JoinHold, Refuse, Moved, AddCaller, Queue)  # answers that end the call

facts = st.builds(AcquireFacts, st.sampled_from(JOBS), st.integers(-2, 2), st.none() | st.integers(-2, 2),
                  st.none() | st.sampled_from(JOBS), st.booleans(), st.booleans(), st.booleans(), st.booleans(),
                  st.none() | st.just("its restore failed"), st.booleans())


def check(f: AcquireFacts, d: Admission) -> None:
    """The invariants of one answer (acquire_calls.py's docstring names them)."""
    if isinstance(d, Refuse):
        assert d.why == f.failed
    else:
        assert f.failed is None, "a failed job is neither joined nor queued"
    if isinstance(d, (JoinHold, EndHold, WaitForExits)):
        assert f.holder == f.job, "only the hold of the caller's own job"
    if isinstance(d, JoinHold):
        assert not f.processes_ended, "never a hold whose processes ended"
        assert f.exits_waited or not f.memory_aware, "on a memory-aware group, after the wait for exits"
    if isinstance(d, EndHold):
        assert f.processes_ended
    if isinstance(d, WaitForExits):
        assert f.memory_aware and not f.exits_waited
    if isinstance(d, Moved):
        assert f.moved and f.exits_waited
    if isinstance(d, AddCaller):
        assert f.queued and f.holder != f.job
    if isinstance(d, Queue):
        assert not f.queued, "a request is never queued twice"
        assert f.holder != f.job
        assert d.priority == (f.configured if f.configured is not None else f.priority), \
            "a member queues at its configured priority"


def after(f: AcquireFacts, d: Admission) -> AcquireFacts:
    """The facts once a step that does not end the call is performed."""
    if isinstance(d, WaitForExits):
        return dataclasses.replace(f, exits_waited=True)
    assert isinstance(d, EndHold)
    return dataclasses.replace(f, holder=None, processes_ended=False)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(facts)
def test_every_answer_keeps_the_invariants_and_each_call_ends_within_three(f: AcquireFacts) -> None:
    for _ in range(3):
        d = admit(f)
        check(f, d)
        if isinstance(d, ENDS):
            return
        f = after(f, d)
    pytest.fail(f"the call did not end: {f}")


def test_the_rules_on_named_cases() -> None:
    assert admit(AcquireFacts("a", 0, holder="a")) == JoinHold()
    assert admit(AcquireFacts("a", 0, holder="a", memory_aware=True)) == WaitForExits()
    assert admit(AcquireFacts("a", 0, holder="a", memory_aware=True, exits_waited=True)) == JoinHold()
    assert admit(AcquireFacts("a", 0, holder="a", memory_aware=True, exits_waited=True, moved=True)) == Moved()
    assert admit(AcquireFacts("a", 0, holder="a", processes_ended=True)) == EndHold()
    assert admit(AcquireFacts("a", 0, holder="a", failed="x")) == Refuse("x")
    assert admit(AcquireFacts("a", 0, holder="b", queued=True)) == AddCaller()
    assert admit(AcquireFacts("a", 5, configured=1, holder="b")) == Queue(1)
    assert admit(AcquireFacts("a", 5)) == Queue(5)


async def test_a_caller_of_a_job_that_failed_while_it_holds_is_refused_and_the_hold_goes_on() -> None:
    """The one answer that differs from before the core: a job failed for good while it holds (a
    cooperative checkpoint found unprovable for an adopted holder) had its next process join the
    hold; it is refused like every other acquire of a failed job, and the hold it has stays."""
    async def switcher(spec, evict, incoming, restore):  # type: ignore[no-untyped-def]
        return SwitchRecord(None, incoming)

    g = LockGroup(GroupSpec(id="g"), switcher)
    try:
        held = await g.acquire("a", 0, "a-1", None)
        g.failed_jobs["a"] = "its checkpoint cannot be proven intact"
        with pytest.raises(JobFailed, match="job a failed: its checkpoint cannot be proven intact"):
            await g.acquire("a", 0, "a-2", None)
        assert g.holder is not None and g.holder.job_id == "a" and g.holder.epoch == held.epoch
        g.release("a", held.lease_id, held.epoch, "a-1")
        assert g.holder is None
    finally:
        await g.close()
