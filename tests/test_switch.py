"""The switch transaction over node agents (real gRPC agents, FakeBackend at the seam)."""

from __future__ import annotations

import asyncio
import re

import pytest
from timeslice import GroupNotFound, SwitchFailed

from tests.conftest import eventually

# Clients that raise a failed switch at once (by default they ask again until their timeout):
# the tests below look at the switch transaction itself.
AT_ONCE = {"retry_failed_switches": False}


async def hold_then_handoff(c, first: str, second: str, **kw: object):
    """`first` holds, `second` queues, `first` releases; returns `second`'s acquire task.
    `kw`: client arguments."""
    a = c.client(first, **kw)
    await a.acquire()
    b = c.client(second, **kw)
    task = asyncio.create_task(b.acquire())
    await eventually(lambda: _waiting(c, second))
    await a.release()
    return a, b, task


def pids(c, node: int, job: str) -> list[int]:
    return c.resolvers[f"node-{node}"]._jobs[job]


async def _waiting(c, job: str) -> bool:
    return job in [w.job_id for w in (await c.status()).waiters]


async def test_switch_checkpoints_every_node_before_restoring_any(make_cluster) -> None:
    c = await make_cluster(backend="cuda", nodes=3)
    a, b, task = await hold_then_handoff(c, "a", "b")
    grant_b = await task
    assert not grant_b.restored  # b never ran: nothing to restore
    assert sorted(c.calls) == [(f"node-{i}", "checkpoint", tuple(pids(c, i, "a"))) for i in range(3)]
    c.calls.clear()
    task = asyncio.create_task(a.acquire())
    await eventually(lambda: _waiting(c, "a"))
    await b.release()
    grant_a = await task
    assert grant_a.restored and grant_a.switch_seconds > 0
    steps = [step for _, step, _ in c.calls]
    assert steps == ["checkpoint"] * 3 + ["restore"] * 3
    status = await c.status()
    assert status.resident_job_id == "a" and list(status.checkpointed_job_ids) == ["b"]
    last = status.recent_switches[-1]
    assert last.ok and last.bytes_checkpointed == 3000 and last.bytes_restored == 3000
    for cl in (a, b):
        await cl.close()


async def test_failed_checkpoint_rolls_back_and_the_group_keeps_serving(make_cluster) -> None:
    c = await make_cluster(backend="cuda", nodes=2)
    c.backends["node-1"].fail.add("checkpoint")
    a, b, task = await hold_then_handoff(c, "a", "b", **AT_ONCE)
    with pytest.raises(SwitchFailed, match="injected checkpoint failure on node-1"):
        await task
    # node-0 checkpointed a and was rolled back; node-1 failed (its agent restored nothing)
    assert ("node-0", "restore", tuple(pids(c, 0, "a"))) in c.calls
    status = await c.status()
    assert status.failed_switches == 1 and status.resident_job_id == "a" and status.phase == "idle"
    assert not status.recent_switches[-1].ok and "rolled back" in status.recent_switches[-1].error
    # the group keeps serving: a's next acquire is immediate, and b succeeds once the node heals
    assert not (await a.acquire()).restored
    c.backends["node-1"].fail.clear()
    task = asyncio.create_task(b.acquire())
    await eventually(lambda: _waiting(c, "b"))
    await a.release()
    await task
    assert (await c.status()).holder.job_id == "b"
    for cl in (a, b):
        await cl.close()


async def test_failed_restore_puts_the_outgoing_job_back(make_cluster) -> None:
    c = await make_cluster(backend="cuda", nodes=2)
    a, b, task = await hold_then_handoff(c, "a", "b", **AT_ONCE)
    await task  # b holds; a is checkpointed
    await b.release()
    # a comes back: checkpoint b everywhere, then restore a fails on node-0
    c.backends["node-0"].fail.add(f"restore:{pids(c, 0, 'a')[0]}")
    c.calls.clear()
    with pytest.raises(SwitchFailed, match="restore of a failed"):
        await a.acquire(timeout=5)
    # the incoming job a: restored on node-1 -> checkpointed again; outgoing b restored on both nodes
    assert ("node-1", "checkpoint", tuple(pids(c, 1, "a"))) in c.calls
    assert {(f"node-{i}", "restore", tuple(pids(c, i, "b"))) for i in (0, 1)} <= set(c.calls)
    status = await c.status()
    assert status.resident_job_id == "b" and status.failed_switches == 1
    for cl in (a, b):
        await cl.close()


async def test_incomplete_rollback_is_visible_and_the_group_keeps_serving(make_cluster) -> None:
    c = await make_cluster(backend="cuda")
    a, b, task = await hold_then_handoff(c, "a", "b", **AT_ONCE)
    await task
    await b.release()
    c.backends["node-0"].fail.add("restore")  # a cannot come back, and neither can b
    with pytest.raises(SwitchFailed, match="ROLLBACK INCOMPLETE"):
        await a.acquire(timeout=5)
    status = await c.status()
    assert status.resident_job_id == "" and sorted(status.checkpointed_job_ids) == ["a", "b"]
    c.backends["node-0"].fail.clear()
    await b.acquire(timeout=5)  # b is restored by the next switch
    assert (await c.status()).recent_switches[-1].ok
    for cl in (a, b):
        await cl.close()


async def test_waiter_that_leaves_during_the_switch_is_not_granted(make_cluster) -> None:
    c = await make_cluster(backend="cuda")
    c.backends["node-0"].delay = 0.3
    a = c.client("a")
    await a.acquire()
    b = c.client("b")
    task = asyncio.create_task(b.acquire())
    await eventually(lambda: _waiting(c, "b"))
    await a.release()
    await eventually(lambda: _phase(c, "switching"))
    task.cancel()
    await eventually(lambda: _phase(c, "idle"))
    status = await c.status()
    assert not status.holder.job_id and status.grants == 1
    for cl in (a, b):
        await cl.close()


async def _phase(c, phase: str) -> bool:
    return (await c.status()).phase == phase


async def test_cluster_members_are_switched_on_their_own_nodes_with_their_claims(make_cluster) -> None:
    """Group members name, per node agent, their claims there; the agent resolves them."""
    from timeslice.controller.orchestrator.config import GroupSpec, MemberSpec

    c = await make_cluster(backend="cuda", nodes=2)
    asked: list[tuple[str, tuple, tuple]] = []

    class Resolver:  # the agent's claim -> PIDs seam
        def __init__(self, node: str, pid: int) -> None:
            self.node, self.pid = node, pid

        async def pids(self, claims, pod_uids=(), claim_name=""):
            asked.append((self.node, tuple(claims), tuple(pod_uids)))
            return [self.pid]

    targets = list(c.orchestrator.group("g").spec.agents)
    for i, node in enumerate(("node-0", "node-1")):
        c.agents[node].claim_resolver = Resolver(node, pids(c, i, "a")[0])
    members = (MemberSpec(claim_set="a", claims_by_agent={targets[0]: (("ns", "a-0"),), targets[1]: (("ns", "a-1"),)},
                          pod_uids=("pod-a",)),
               MemberSpec(claim_set="b", claims_by_agent={targets[1]: (("ns", "b-1"),)}, pod_uids=("pod-b",)))
    spec = c.orchestrator.group("g").spec
    # exclusive: only the switch steps ask the resolver (auto would add memory reports)
    c.orchestrator.add_group(GroupSpec(**{**spec.model_dump(), "members": members, "residency": "exclusive"}))
    c.orchestrator.set_aliases({("a", "trainer"): (("g", "a"),), ("b", "trainer"): (("g", "b"),)})
    a, b = c.client("a", group="trainer"), c.client("b", group="trainer")
    await a.acquire()
    task = asyncio.create_task(b.acquire())
    await eventually(lambda: _waiting(c, "b"))
    await a.release()
    await task
    assert sorted(asked) == [("node-0", (("ns", "a-0"),), ("pod-a",)), ("node-1", (("ns", "a-1"),), ("pod-a",))]
    with pytest.raises(GroupNotFound, match="job 'x' has no claim in group 'g'"):
        await c.client("x", group="g").acquire()
    for cl in (a, b):
        await cl.close()


async def test_a_node_without_agent_fails_the_switch_clearly_and_rolls_back(make_cluster) -> None:
    """The holder runs on a node with no node-plugin pod (target `no-agent:<node>`): the
    switch away from it fails with that cause, nothing is left checkpointed, and the job's
    next acquire says the same instead of trusting a state nobody can confirm."""
    from timeslice.controller.node_agents import missing_target
    from timeslice.controller.orchestrator.config import GroupSpec, MemberSpec

    c = await make_cluster(backend="cuda", nodes=1)

    spec = c.orchestrator.group("g").spec
    node0, nowhere = spec.agents[0], missing_target("node-9")
    members = (MemberSpec(claim_set="a", claims_by_agent={nowhere: (("ns", "a-0"),)}),
               MemberSpec(claim_set="b", claims_by_agent={node0: (("ns", "b-0"),)}))
    c.orchestrator.add_group(GroupSpec(**{**spec.model_dump(), "agents": (node0, nowhere), "members": members}))
    a, b, task = await hold_then_handoff(c, "a", "b", **AT_ONCE)
    with pytest.raises(SwitchFailed, match="checkpoint of job a on node node-9: no node agent there"):
        await task
    status = await c.status()
    assert status.failed_switches == 1 and status.resident_job_id == "a" and "rolled back" in \
        status.recent_switches[-1].error
    assert not c.calls  # no agent was asked to move anything
    with pytest.raises(SwitchFailed, match=r"cannot confirm that job a has its state on the GPUs: .*no node agent "
                                           r"there"):  # a resident is granted only once its agents confirm it
        await a.acquire()
    for cl in (a, b):
        await cl.close()


async def test_a_restore_first_whose_checkpoint_fails_puts_both_jobs_back(make_cluster) -> None:
    """A switch that restores the incoming job first (its residents' checkpoints need the host
    memory its restore gives back) and then fails a checkpoint: the resident is restored
    where it was checkpointed and the incoming job checkpointed again, as before the switch."""
    from timeslice.controller.orchestrator.group_model import SwitchError

    c = await make_cluster(backend="cuda", nodes=2)
    g = c.orchestrator.group("g")
    await g.switcher(g.spec, ("b",), "a", False)  # b checkpointed on both nodes, a resident
    c.backends["node-1"].fail.add(f"checkpoint:{pids(c, 1, 'a')[0]}")
    c.calls.clear()
    with pytest.raises(SwitchError, match=r"checkpoint of a failed .* rolled back") as err:
        await g.switcher(g.spec, ("a",), "b", True, restore_first=True)
    steps = sorted((node, step, job) for node, step, p in c.calls
                   for job in "ab" if p == tuple(pids(c, int(node[-1]), job)))
    assert steps == [("node-0", "checkpoint", "a"), ("node-0", "checkpoint", "b"), ("node-0", "restore", "a"),
                     ("node-0", "restore", "b"), ("node-1", "checkpoint", "a"), ("node-1", "checkpoint", "b"),
                     ("node-1", "restore", "b")]
    assert {s for _, s, _ in c.calls[:2]} == {"restore"}  # b's restore came first, on both nodes
    assert not err.value.off_gpu and err.value.record.failed_step == "checkpoint"


async def test_a_checkpoint_that_hangs_past_its_deadline_grants_nobody_until_it_and_its_rollback_ended(
        make_cluster, monkeypatch) -> None:
    """Issue 22: a's checkpoint hung in the backend past its step deadline; the rollback's restore
    queued behind it on the agent and timed out too ("ROLLBACK INCOMPLETE"); b, asking again, was
    granted at once, and then the late rollback thawed a beside it. Now, until the agent has no
    step of a in flight (`MemoryReport.busy_jobs`), b's acquires fail and it asks again; then a's
    records say it is on the GPU, and it is checkpointed before b is granted."""
    from timeslice.controller.orchestrator import agents, in_flight
    from timeslice.driver import errors

    monkeypatch.setattr(agents, "RPC_SLACK_SECONDS", 0.3)
    monkeypatch.setattr(in_flight, "IN_FLIGHT_WAIT_SECONDS", 0.5)
    c = await make_cluster(backend="freeze", spec={"step_timeout_seconds": 0.5})
    g = c.orchestrator.group("g")
    a = pids(c, 0, "a")[0]
    grant = await g.acquire("a", 0, "a1", None)
    g.release("a", grant.lease_id, grant.epoch)
    hang = c.backends["node-0"].hang[f"checkpoint:{a}"] = asyncio.Event()
    with pytest.raises(errors.SwitchFailed, match="ROLLBACK INCOMPLETE"):  # (the server's, not the client's)
        await g.acquire("b", 0, "b1", None)
    with pytest.raises(errors.SwitchFailed, match="still runs"):  # a's checkpoint and its undo are in flight
        await g.acquire("b", 0, "b2", None)
    assert g.holder is None
    hang.set()  # the checkpoint ends; the undo restore queued behind it runs: a is thawed
    await eventually(lambda: [s for _, s, p in c.calls if p == (a,)][-1:] == ["restore"])
    await g.acquire("b", 0, "b3", 10)
    assert [s for _, s, p in c.calls if p == (a,)] == ["checkpoint", "restore", "checkpoint"]  # frozen again
    assert "a" in g.checkpointed and g.holder is not None and g.holder.job_id == "b"


async def test_a_restore_that_hangs_while_its_agent_answers_counts_toward_failing_the_job(
        make_cluster, monkeypatch) -> None:
    """Issue 22: a's restore hung past its step deadline, on an agent that answered every other
    call; the failure was taken for an unreachable agent and never counted, and a was moved in and
    out again and again. Now it counts: the third fails the job."""
    from timeslice.controller.orchestrator import agents
    from timeslice.controller.orchestrator.switch_outcome import RESTORE_FAILURE_SECONDS
    from timeslice.driver import errors

    monkeypatch.setattr(agents, "RPC_SLACK_SECONDS", 0.3)
    c = await make_cluster(backend="freeze", spec={"step_timeout_seconds": 0.5})
    g = c.orchestrator.group("g")
    a = pids(c, 0, "a")[0]
    for job in "ab":  # a, then b, held once: a is checkpointed
        grant = await g.acquire(job, 0, f"{job}0", None)
        g.release(job, grant.lease_id, grant.epoch)
    hang = c.backends["node-0"].hang[f"restore:{a}"] = asyncio.Event()
    now = [g.clock()]
    g.clock = lambda: now[0]  # (the failures span RESTORE_FAILURE_SECONDS, as its client's retries would)
    failed = 0  # (the first may be an idle restore's, which fails no waiter's count)
    while True:
        hang.clear()
        try:
            await g.acquire("a", 0, f"a{failed}", 30)
        except errors.JobFailed as err:
            assert re.search(r"[34] restores in a row failed", str(err)), err
            break
        except errors.SwitchFailed as err:
            assert "restore of a failed" in str(err)
        failed += 1
        now[0] += RESTORE_FAILURE_SECONDS / 2
        assert failed <= 4, "a hung restore was not counted"
        hang.set()  # the hung restore ends, then the undo queued behind it
        await eventually(lambda: not c.agents["node-0"].busy)


def test_a_rollback_that_waits_for_room_says_so_and_only_a_failed_step_is_incomplete() -> None:
    """A rollback that found no room leaves the evicted jobs intact in their checkpoints (restored
    when they next ask): "rolled back", naming them, never "ROLLBACK INCOMPLETE" (which it said
    before, though nothing was lost); a restore or undo that failed is incomplete."""
    from timeslice.controller.orchestrator.switch import Rollback

    assert Rollback().outcome(True) == "rolled back"
    waiting = Rollback(waiting=("a", "b")).outcome(True)
    assert waiting.startswith("rolled back; a, b left checkpointed until there is room")
    assert Rollback(failed=("a",)).outcome(True) == "ROLLBACK INCOMPLETE"
    assert Rollback(waiting=("a",)).outcome(False) == "ROLLBACK INCOMPLETE"
    assert Rollback(failed=("a",), waiting=("b",)).off_gpu == ["a", "b"]
