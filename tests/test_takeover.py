"""A new leader's takeover: the resident job is a presumptive holder (LockGroup.adopt); and
groups re-forming (`takeover.carrying`, `takeover.carry`). `TIMESLICE_DECISION_EXAMPLES` sets
the number of random records of the two property tests (default 2000)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from timeslice.controller.orchestrator import takeover
from timeslice.controller.orchestrator.config import AppEngine, GroupSpec
from timeslice.controller.orchestrator.group import LockGroup
from timeslice.driver.errors import StaleLease
from timeslice.v1 import orchestrator_pb2 as pb

from tests.conftest import eventually

# Random records per property test (each run through real lock groups too); `make stress-test`: 100 000
EXAMPLES = int(os.environ.get("TIMESLICE_DECISION_EXAMPLES", "2000"))


async def test_presumptive_holder_keeps_its_lock_with_its_old_lease(make_cluster) -> None:
    c = await make_cluster(backend="cuda", lease_seconds=0.5)
    group = c.orchestrator.group("g")
    group.adopt("a", {"b"}, epoch=7)
    status = await c.status()
    assert status.holder.job_id == "a" and status.resident_job_id == "a" and list(status.checkpointed_job_ids) == ["b"]
    with pytest.raises(StaleLease):  # another job cannot use it ...
        group.release("b", "whatever", 7)
    group.keep_alive("b", "whatever", 7)  # (b's lease from the earlier leader queues it: see test_max_hold)
    assert group.holder.job_id == "a" and [w.job_id for w in group.queue] == ["b"]
    assert group.keep_alive("a", "old-lease", 7) > 0  # the old lease is adopted ...
    with pytest.raises(StaleLease):
        group.release("a", "other-lease", 7)  # ... and from then on it is the only one
    waiter = asyncio.ensure_future(c.stub.Acquire(pb.AcquireRequest(job_id="b", group_id="g", request_id="r")))
    await eventually(lambda: len(group.queue) == 2)
    group.release("a", "old-lease", 7)
    grant = await waiter
    assert grant.epoch == 8 and grant.restored  # b was checkpointed: the switch restored it
    jobs = group.view().jobs  # the adopted jobs are counted from their adoption (metrics per job)
    assert jobs["b"].restores == 1 and jobs["b"].grants == 1 and jobs["a"].checkpoints == 1, jobs


async def test_presumptive_holder_that_was_idle_lapses_after_one_lease(make_cluster) -> None:
    c = await make_cluster(backend="cuda", lease_seconds=0.3)
    c.orchestrator.group("g").adopt("a", set(), epoch=3)
    grant = await asyncio.wait_for(c.stub.Acquire(pb.AcquireRequest(job_id="b", group_id="g", request_id="r")), 3)
    assert grant.epoch == 4 and (await c.status()).lease_expiries == 1


async def test_a_restarted_standalone_orchestrator_never_repeats_an_epoch_and_restores_before_granting(
        make_cluster, tmp_path) -> None:
    """Issue 10, item 2: after `timeslice orchestrator` restarted, epochs began again at 1 (the
    same fencing epoch handed out twice) and a job the agent had checkpointed was granted with
    its process still stopped. And the holder at the restart was forgotten: the next job was
    granted while it still computed. Now it is the presumptive holder: its lease is
    accepted, and it is checkpointed before the next job is granted."""
    from timeslice.controller.orchestrator.orchestrator import Orchestrator
    from timeslice.controller.orchestrator.state_file import StateFile

    c = await make_cluster(backend="freeze")
    spec = c.orchestrator.group("g").spec
    first = Orchestrator([spec], state=StateFile(tmp_path / "state.json"))
    a = first.group("g")
    ga = await a.acquire("a", 0, "a1", None)
    a.release("a", ga.lease_id, ga.epoch)
    gb = await a.acquire("b", 0, "b1", None)  # a checkpointed by the agent for b
    assert [step for _, step, _ in c.calls] == ["checkpoint"]
    await first.close()  # "SIGKILL": b still holds, a is still checkpointed on the node

    second = Orchestrator([spec], state=StateFile(tmp_path / "state.json"))
    await second.adopt_agents()
    b = second.group("g")
    assert b.checkpointed == {"a"} and b.epoch >= gb.epoch
    assert b.holder is not None and b.holder.job_id == "b"  # b may still compute: it holds, presumptively
    waiter = asyncio.ensure_future(b.acquire("a", 0, "a2", None))
    await eventually(lambda: len(b.queue) == 1)
    assert not waiter.done()
    b.release("b", gb.lease_id, gb.epoch)  # b's lease from before the restart is accepted
    g2 = await asyncio.wait_for(waiter, 10)
    assert g2.epoch > gb.epoch and g2.restored  # a fresh epoch, and a restored before its grant
    assert [step for _, step, _ in c.calls] == ["checkpoint", "checkpoint", "restore"]  # b out, then a in
    await second.close()


async def test_a_holder_whose_lease_lapsed_before_a_restart_still_leaves_before_the_next_grant(
        make_cluster, tmp_path) -> None:
    """Found by the schedule property run (tests/faults/test_group_schedules.py): a holder
    cut off (its lease lapsed) may still compute, so it must leave the GPU before anyone is
    granted; a standalone orchestrator that restarted in between forgot that and granted the
    next job beside it."""
    from timeslice.controller.orchestrator.orchestrator import Orchestrator
    from timeslice.controller.orchestrator.state_file import StateFile

    c = await make_cluster(backend="freeze", lease_seconds=0.2)
    spec = c.orchestrator.group("g").spec
    first = Orchestrator([spec], state=StateFile(tmp_path / "state.json"))
    await first.group("g").acquire("a", 0, "a1", None)  # a's client stops keeping its lease alive
    await eventually(lambda: first.group("g").counters.lease_expiries == 1)
    await first.close()  # restarted before anyone else asked: a was never checkpointed

    second = Orchestrator([spec], state=StateFile(tmp_path / "state.json"))
    await second.adopt_agents()
    gb = await asyncio.wait_for(second.group("g").acquire("b", 0, "b1", None), 10)
    assert [step for _, step, _ in c.calls] == ["checkpoint"] and "a" in second.group("g").checkpointed  # a left first
    assert not gb.restored
    await second.close()


@pytest.mark.parametrize("content, cause", [
    ("{not json", "the file: Invalid JSON"),
    ('{"apiVersion": "timeslice.dev/orchestrator-state/v2", "epochs": {}}', "apiVersion"),
    ('[]', "the file"),
    ('{"apiVersion": "timeslice.dev/orchestrator-state/v1", "epochs": {"g": -3}}', "epochs.g"),  # broke every grant
    ('{"apiVersion": "timeslice.dev/orchestrator-state/v1", "epochs": {"g": 5}, "groups": {"g": {"holder": 7}}}',
     "groups.g.holder"),  # wedged the group when its lease lapsed
])
def test_an_unreadable_state_file_is_refused_with_a_way_out(tmp_path, content, cause) -> None:
    from timeslice.controller.orchestrator.state_file import StateFile

    bad = tmp_path / "state.json"
    bad.write_text(content)
    with pytest.raises(ValueError, match=rf"unreadable \({cause}.*move it away to start afresh"):
        StateFile(bad)


def test_a_state_file_of_the_first_format_loads_and_one_that_cannot_be_written_is_refused_at_start(
        tmp_path) -> None:
    from timeslice.controller.orchestrator.state_file import StateFile

    old = tmp_path / "state.json"
    old.write_text('{"apiVersion": "timeslice.dev/orchestrator-state/v1", "epochs": {"g": 5}}')
    assert StateFile(old).start("g") == 5
    blocker = tmp_path / "a-file"  # the state file's folder cannot be made (root ignores permissions)
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"cannot be written .* give the orchestrator a writable path"):
        StateFile(blocker / "state.json")


async def test_a_grant_whose_epoch_cannot_be_persisted_is_refused(tmp_path) -> None:
    from timeslice.controller.orchestrator.config import GroupSpec
    from timeslice.controller.orchestrator.group import LockGroup
    from timeslice.controller.orchestrator.state_file import StateFile
    from timeslice.driver.errors import SwitchFailed

    folder = tmp_path / "state"
    folder.mkdir()
    state = StateFile(folder / "state.json")
    shutil.rmtree(folder)  # (the state file and its journal)
    folder.write_text("x")  # the disk "fails" after the start: the folder is now a file
    g = LockGroup(GroupSpec(id="g"), None, state=state)  # type: ignore[arg-type]
    with pytest.raises(SwitchFailed, match="cannot persist the fencing epoch"):
        await g.acquire("a", 0, "r", None)
    assert g.holder is None  # (its epoch was never delivered: the next grant's is past it)
    folder.unlink()
    folder.mkdir()  # the disk is back: the next grant is written, then delivered
    grant = await g.acquire("a", 0, "r2", None)
    assert grant.epoch == 2 and StateFile(folder / "state.json").placement("g").holder == "a"
    assert StateFile(folder / "state.json").start("g") > grant.epoch


async def test_a_restarted_orchestrator_adopts_only_its_groups_checkpoints_from_a_shared_agent(make_cluster) -> None:
    from timeslice.controller.orchestrator.config import GroupSpec
    from timeslice.controller.orchestrator.orchestrator import Orchestrator

    c = await make_cluster(backend="freeze", groups=("g1", "g2"))
    from timeslice.kubelet_plugin.agent.node_agent import JobRef, StepRequest

    await c.agents["node-0"].checkpoint(StepRequest(JobRef("a"), "freeze", "g2", 5))  # checkpointed for g2
    spec = c.orchestrator.group("g1").spec
    orch = Orchestrator([spec, GroupSpec(**{**spec.model_dump(), "id": "g2"})])
    await orch.adopt_agents()
    assert orch.group("g1").checkpointed == set() and orch.group("g2").checkpointed == {"a"}
    await orch.close()


async def test_a_rank_that_gives_up_does_not_end_an_adopted_hold_its_peers_use() -> None:
    """An adopted hold (granted by an earlier leader) knows none of its callers: a second rank
    that joined it and then gave up (CancelAcquire) ended the hold under the first rank."""
    from timeslice.controller.orchestrator.config import GroupSpec
    from timeslice.controller.orchestrator.group import LockGroup

    g = LockGroup(GroupSpec(id="g"), None)  # type: ignore[arg-type]
    g.adopt("a", set(), 5)
    await g.acquire("a", 0, "rank-1", None)  # joins the hold at once
    assert g.cancel("a", "rank-1") == "granted"
    assert g.holder is not None and g.holder.job_id == "a"
    await g.close()


async def test_a_job_whose_checkpoint_only_the_state_file_records_counts_as_resident_until_its_processes_say() -> None:
    """Seed 1247 of bench/schedules.py: the orchestrator died after a cooperative job's restore
    ran and before its answer was recorded; restarted, it took the job for checkpointed (its
    state file said so) and restored another job beside it. Now such a job is adopted as
    resident (`adopt_standalone`'s `unconfirmed`): placing another job moves it out first, and
    its own grant goes through a restore (refused while its processes have not reconnected,
    never granted on a guess). The process-level run: tests/test_pool_restart.py."""
    from timeslice.controller.orchestrator import takeover
    from timeslice.controller.orchestrator.config import GroupSpec
    from timeslice.controller.orchestrator.group import LockGroup
    from timeslice.controller.orchestrator.group_model import SwitchError, SwitchRecord
    from timeslice.controller.orchestrator.memory_snapshot import MemorySnapshot
    from timeslice.driver.errors import SwitchFailed

    class Switcher:
        """Cooperative processes: "a"'s has not reconnected since the restart."""

        def __init__(self) -> None:
            self.calls: list[tuple[tuple[str, ...], str, bool]] = []
            self.reconnecting = {"a"}

        async def __call__(self, spec, evict, incoming, restore) -> SwitchRecord:
            self.calls.append((tuple(evict), incoming, restore))
            rec = SwitchRecord(evict[0] if evict else None, incoming, evicted=tuple(evict))
            if restore and incoming in self.reconnecting:
                rec.ok, rec.error = False, f"restore of {incoming} cannot start: reconnecting; try again"
                raise SwitchError(rec.error, rec)
            return rec

        def unconfirmed(self, spec, job) -> bool:
            return job in self.reconnecting

        async def memory(self, spec, jobs, **watch) -> MemorySnapshot:
            return MemorySnapshot()  # no GPU reports: one resident at a time

        async def confirm(self, spec, job) -> bool:
            return True

    sw = Switcher()
    g = LockGroup(GroupSpec(id="g", backend="cooperative", agents=("agent",), lease_seconds=60), sw)
    takeover.adopt_standalone(g, None, set(), {"a"})
    assert list(g.residency.residents) == ["a"] and not g.residency.checkpointed and g.holder is None
    with pytest.raises(SwitchFailed, match="reconnecting"):
        await g.acquire("a", 0, "a1", None)
    assert sw.calls == [((), "a", True)] and g.holder is None  # a restore, which its processes decide
    gb = await asyncio.wait_for(g.acquire("b", 0, "b1", None), 10)
    assert sw.calls[-1] == (("a",), "b", False) and g.residency.checkpointed == {"a"}  # a moved out first
    g.release("b", gb.lease_id, gb.epoch)
    await g.close()


async def test_a_checkpoint_confirmed_while_a_switch_moves_the_job_out_is_placed_by_that_switch() -> None:
    """After a restart, a's process confirms its recorded checkpoint while b's switch moves a
    out; that switch then fails and rolls back, which restores a. a is on the GPU: the group
    must not have taken the confirmation for where a is (the switch's outcome places it)."""
    from timeslice.controller.orchestrator import takeover
    from timeslice.controller.orchestrator.config import GroupSpec
    from timeslice.controller.orchestrator.group_model import SwitchError, SwitchRecord
    from timeslice.controller.orchestrator.orchestrator import Orchestrator
    from timeslice.driver.errors import SwitchFailed

    async def switcher(spec, evict, incoming, restore) -> SwitchRecord:
        orch._checkpoint_learned("g", "a")  # a's process reconnects: its checkpoint is confirmed (on_learned)
        rec = SwitchRecord(evict[0] if evict else None, incoming, evicted=tuple(evict), ok=False,
                           error="checkpoint of c failed; rolled back")  # a restored with the rest
        raise SwitchError(rec.error, rec)

    orch = Orchestrator([GroupSpec(id="g", backend="cooperative", agents=("agent",), lease_seconds=60)],
                        switcher=switcher)
    g = orch.group("g")
    takeover.adopt_standalone(g, None, set(), {"a"})
    with pytest.raises(SwitchFailed, match="rolled back"):
        await g.acquire("b", 0, "b1", None)
    assert "a" in g.residency.residents and "a" not in g.residency.checkpointed
    await orch.close()


async def test_grants_are_delivered_only_once_written_and_those_made_during_a_write_share_the_next(tmp_path,
                                                                                          monkeypatch) -> None:
    """The state file is written off the event loop: the first grant starts a write, the
    grants of 49 groups made while it is in flight share the next journal line, and none is
    delivered before its line is on disk (a restart would otherwise forget the holder, or
    repeat its epoch)."""
    import threading

    from timeslice.controller.orchestrator.config import GroupSpec
    from timeslice.controller.orchestrator.group import LockGroup
    from timeslice.controller.orchestrator.state_file import StateFile
    from timeslice.controller.orchestrator.state_journal import Journal

    path = tmp_path / "state.json"
    state = StateFile(path)
    entered, gate, writes = threading.Event(), threading.Event(), []
    real = Journal.append

    def held_write(journal: Journal, line: bytes) -> None:  # runs in the writer's thread
        entered.set()
        assert gate.wait(30)
        real(journal, line)
        writes.append(json.loads(line))

    monkeypatch.setattr(Journal, "append", held_write)
    groups = [LockGroup(GroupSpec(id=f"g{i}"), None, state=state) for i in range(50)]  # type: ignore[arg-type]
    tasks = [asyncio.create_task(g.acquire("a", 0, "r", None)) for g in groups]
    assert await asyncio.to_thread(entered.wait, 30)
    assert not any(t.done() for t in tasks) and all(g.holder is not None for g in groups)  # held, not delivered
    gate.set()
    grants = await asyncio.gather(*tasks)
    assert len(writes) == 2
    assert {g: p["holder"] for w in writes for g, p in w["groups"].items()} == {f"g{i}": "a" for i in range(50)}
    assert len(writes[0]["groups"]) == 1  # the first grant's, begun at once
    assert all({**writes[0]["epochs"], **writes[1]["epochs"]}[f"g{i}"] > grant.epoch for i, grant in enumerate(grants))
    for g in groups:
        await g.close()


async def test_a_join_that_cannot_be_persisted_leaves_no_caller_in_the_hold(tmp_path) -> None:
    """A caller that joins its job's hold while a write is pending, and whose join fails (the
    write failed) or goes away, is not left as a caller of the hold: the holder's release ends
    it (review, issue 24: the hold went on under a caller that was gone)."""
    from timeslice.controller.orchestrator.config import GroupSpec
    from timeslice.controller.orchestrator.group import LockGroup
    from timeslice.controller.orchestrator.state_file import StateFile
    from timeslice.driver.errors import SwitchFailed

    folder = tmp_path / "state"
    folder.mkdir()
    state = StateFile(folder / "state.json")
    g = LockGroup(GroupSpec(id="g"), None, state=state)  # type: ignore[arg-type]
    grant = await g.acquire("a", 0, "r1", None)
    shutil.rmtree(folder)  # (the state file and its journal)
    folder.write_text("x")  # the disk fails
    state.record("other", "x", [], [])  # a change pending: the join waits for its write
    with pytest.raises(SwitchFailed, match="cannot persist"):
        await g.acquire("a", 0, "r2", None)
    assert g.holder is not None and g.holder.request_ids == {"r1"}
    g.release("a", grant.lease_id, grant.epoch, "r1")
    assert g.holder is None
    await g.close()


async def test_an_app_group_in_a_cluster_never_drops_an_unreleased_job_by_its_processes() -> None:
    """In a cluster the agents find a job's processes through its claims, and a failed API read
    leaves them out of a report as if there were none: the watch for gone clients is off there
    (the job is dropped when its pods are gone)."""
    from timeslice.controller.orchestrator.config import GroupSpec, MemberSpec
    from timeslice.controller.orchestrator.group import LockGroup

    class Reports:
        asked = 0

        async def __call__(self, *args):  # type: ignore[no-untyped-def]
            raise AssertionError("no switch")

        async def memory(self, *args, **kw):  # type: ignore[no-untyped-def]
            Reports.asked += 1
            raise AssertionError("no report asked")

    member = MemberSpec(claim_set="ns/a:gpu", claims_by_agent={"unix:///x": (("ns", "a"),)},
                        app={"engine": "vllm", "url": "http://127.0.0.1:1"})
    g = LockGroup(GroupSpec(id="g", backend="app", agents=("unix:///x",), members=(member,)), Reports())
    g.awake.watch(["ns/a:gpu"])
    assert g.awake._watch is None and Reports.asked == 0
    await g.close()


async def test_a_grant_held_back_for_a_slow_state_file_write_gets_its_whole_lease(tmp_path, monkeypatch) -> None:
    """Issue 24 review: a grant is delivered only once its epoch and holder are written; its
    lease was timed from the decision, so a write that took most of a lease (a loaded disk)
    left the client too little to send its first keep-alive, and the group went on to the
    next job while the holder computed. The lease now runs from the delivery."""
    import threading

    from timeslice.controller.orchestrator.config import GroupSpec
    from timeslice.controller.orchestrator.orchestrator import Orchestrator
    from timeslice.controller.orchestrator.state_file import StateFile
    from timeslice.controller.orchestrator.state_journal import Journal

    now = [100.0]
    started, go = threading.Event(), threading.Event()
    write = Journal.append

    def slow_write(journal: Journal, line: bytes) -> None:  # the grant's write waits until the test lets it go
        started.set()
        go.wait(30)
        write(journal, line)

    orch = Orchestrator([GroupSpec(id="g", backend="none", lease_seconds=10)], state=StateFile(tmp_path / "s.json"))
    monkeypatch.setattr(Journal, "append", slow_write)
    g = orch.group("g")
    g.clock = lambda: now[0]
    grant = asyncio.ensure_future(g.acquire("a", 0, "a1", None))
    await asyncio.to_thread(started.wait, 30)
    now[0] += 9.5  # the write took 9.5 of the 10 s lease
    go.set()
    got = await asyncio.wait_for(grant, 30)
    assert g.holder is not None and g.holder.epoch == got.epoch
    assert g.holder.lease_deadline - now[0] == pytest.approx(10)
    await orch.close()


@settings(max_examples=EXAMPLES, deadline=None)
@given(resident=st.none() | st.sampled_from("abcd"), checkpointed=st.frozensets(st.sampled_from("abcd")),
       must_leave=st.frozensets(st.sampled_from("abcd")), residents=st.frozensets(st.sampled_from("abcd")),
       epoch=st.integers(0, 3000))
def test_a_takeover_puts_every_job_in_one_place_and_the_presumptive_holder_on_the_gpus(
        resident, checkpointed, must_leave, residents, epoch) -> None:
    """`takeover.adoption` over random records: the presumptive holder is on the GPUs, the most
    recently held; the agents' checkpoints of the others stand; a job that must leave is on the
    GPUs (it may compute) and leaves first; nobody is in two places or made up; and `adopt`
    puts the group's residency exactly there."""
    a = takeover.adoption(resident, checkpointed, epoch, must_leave, residents)
    assert not (a.checkpointed & set(a.residents)) and len(set(a.residents)) == len(a.residents)
    assert a.checkpointed == checkpointed - {resident}
    assert set(a.residents) == ({resident} if resident else set()) | ((must_leave | residents) - checkpointed)
    assert set(a.leaving) == (must_leave - checkpointed - {resident}) and set(a.leaving) <= set(a.residents)
    if resident is not None:
        assert a.holder == resident and a.residents[-1] == resident
    assert list(a.residents[:len(a.leaving)]) == sorted(a.leaving, reverse=True)  # (the least recently held)

    async def adopted() -> None:
        g = LockGroup(GroupSpec(id="g", backend="cuda", agents=("agent",)), _NoSwitch())  # type: ignore[arg-type]
        g.adopt(resident, set(checkpointed), epoch, must_leave, residents)
        assert list(g.residency.residents) == list(a.residents) and g.residency.checkpointed == a.checkpointed
        assert set(g.moves.must_leave("")) == set(a.leaving)
        assert g.epoch == epoch and (g.holder.job_id if g.holder else None) == resident
        await g.close()

    asyncio.run(adopted())


OLD, NEW = "abcd", "wxyz"  # (a job belongs to one group)


@settings(max_examples=EXAMPLES, deadline=None)
@given(holder=st.none() | st.sampled_from(OLD), checkpointed=st.frozensets(st.sampled_from(OLD)),
       must_leave=st.frozensets(st.sampled_from(OLD)), residents=st.frozensets(st.sampled_from(OLD)),
       jobs=st.frozensets(st.sampled_from(OLD)), new_holder=st.none() | st.sampled_from(NEW),
       new_must_leave=st.frozensets(st.sampled_from(NEW)), epochs=st.tuples(st.integers(0, 9), st.integers(0, 9)),
       backend=st.sampled_from(["cuda", "freeze", "vmm", "none", "cooperative", "app"]))
def test_groups_reforming_put_every_carried_job_in_one_place_and_never_two_holders_on_the_gpus(
        holder, checkpointed, must_leave, residents, jobs, new_holder, new_must_leave, epochs, backend) -> None:
    """`takeover.carrying` over random groups: the new epoch is below neither group's; a carried
    job is in one place; the carried holder holds on only where the new group has no holder and
    nobody else must leave its GPUs first, else it is parked (it keeps its lease and leaves the
    GPUs before any grant) or, where nothing stops it, revoked; and `carry` moves two real
    `LockGroup`s, each taken over from those records, exactly there."""

    async def carried() -> None:
        apps = {j: AppEngine(engine="vllm", url=f"http://127.0.0.1:{i + 1}") for i, j in enumerate(OLD + NEW)} \
            if backend == "app" else {}
        old, new = (LockGroup(GroupSpec(id=i, backend=backend, agents=("agent",), apps=apps),  # type: ignore[arg-type]
                              _NoSwitch()) for i in ("old", "new"))
        old.adopt(holder, set(checkpointed), epochs[0], must_leave, residents)
        new.adopt(new_holder, set(), epochs[1], new_must_leave)
        ro = old.residency
        c = takeover.carrying(jobs, (old.epoch, new.epoch), set(ro.checkpointed), set(ro.residents),
                              old.moves.must_leave(""), holder, new.holder is not None, set(new.moves.must_leave()),
                              backend)
        assert c.epoch == max(epochs)
        known = jobs & (ro.checkpointed | set(ro.residents))
        assert set(c.checkpointed) | set(c.residents) == known and not set(c.checkpointed) & set(c.residents)
        assert set(c.leaving) <= set(c.residents)
        outcomes = [j for j in (c.holder, c.parked, c.revoked) if j is not None]
        assert outcomes == ([holder] if holder in jobs else []), "the carried holder ends in exactly one way"
        if c.holder is not None:
            assert new_holder is None and not (set(new.moves.must_leave()) | set(c.leaving)) - {holder}
        assert (c.revoked is not None) <= (backend in takeover.REVOKING_BACKENDS)
        assert (c.parked is not None) <= (backend not in takeover.REVOKING_BACKENDS)

        takeover.carry(new, old, set(jobs))
        assert new.epoch == c.epoch
        assert set(c.checkpointed) <= new.residency.checkpointed and set(c.residents) <= set(new.residency.residents)
        assert set(c.leaving) <= set(new.moves.must_leave(""))
        assert (new.holder.job_id if new.holder else None) == (c.holder or new_holder)
        assert old.holder is None if holder in jobs else (old.holder.job_id if old.holder else None) == holder
        if c.parked is not None:
            assert c.parked in new.preemption.parked_jobs() and c.parked in new.moves.must_leave("")
        if c.revoked is not None and backend != "none":  # (`none` moves nothing: the revoked lease is all)
            assert c.revoked in new.moves.must_leave("")
        await old.close()
        await new.close()

    asyncio.run(carried())


class _NoSwitch:
    async def __call__(self, *args, **kwargs):  # pragma: no cover  (nothing is granted here)
        raise AssertionError("no switch in a takeover")
