"""Review findings: maxHoldSeconds preemption (group.py) and node-agent discovery.

Each test reproduces one finding of an adversarial review of maxHoldSeconds and node-agent
discovery, and failed before its fix."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from timeslice.controller.app import Controller
from timeslice.controller.node_agents import missing_target
from timeslice.controller.orchestrator.agents import AgentClient
from timeslice.controller.orchestrator.config import GroupSpec, MemberSpec
from timeslice.controller.orchestrator.group_model import SwitchRecord
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.driver.errors import TimeSliceServerError
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.server import create_server as create_agent_server

from tests.conftest import FakeBackend, eventually
from tests.test_max_hold import _waiting, set_group
from tests.test_orchestrator import acquire, release


def _members(c, *jobs: tuple[str, int, float | None]) -> tuple[MemberSpec, ...]:
    target = c.orchestrator.group("g").spec.agents[0]
    return tuple(MemberSpec(claim_set=j, claims_by_agent={target: ()}, priority=p, max_hold_seconds=m)
                 for j, p, m in jobs)


# -- maxHoldSeconds ----------------------------------------------------------------


async def test_adopted_holder_preempted_before_its_first_keep_alive_keeps_its_lease(make_cluster) -> None:
    """After a leader change the resident job is a presumptive holder (lease `*adopted*`)
    until its next keep-alive shows its old lease. Waiters retry right after the change, so
    a short maxHoldSeconds can preempt it before that keep-alive: the parked hold is then
    keyed by "*adopted*", and the job's real lease is refused (StaleLease) although its
    entry still waits in the queue. The preemption must stay invisible to its code."""
    c = await make_cluster(backend="cuda", lease_seconds=5.0)
    set_group(c, max_hold_seconds=0.2)
    group = c.orchestrator.group("g")
    group.adopt("a", set(), epoch=7)
    await asyncio.wait_for(c.stub.Acquire(acquire("b", "b1")), 5)  # a preempted after 0.2 s
    assert (await c.status()).preemptions == 1
    assert group.keep_alive("a", "old-lease", 7) > 0  # raised StaleLease before the fix
    assert group.release("a", "old-lease", 7)[0] == 0  # and a's release leaves the queue
    assert not (await c.status()).waiters


async def test_release_of_the_last_preempted_waiter_stops_the_new_holders_clock(make_cluster) -> None:
    """a is preempted for b; a's phase then ends (Release while parked): nobody waits for
    b any more, yet b's maxHoldSeconds timer stayed armed, so b was "preempted" with nobody
    waiting (spurious Preempted Event, epoch bumped, re-granted at once)."""
    c = await make_cluster(backend="cuda")
    set_group(c, max_hold_seconds=0.2)
    ga = await c.stub.Acquire(acquire("a", "a1"))
    gb = await asyncio.wait_for(c.stub.Acquire(acquire("b", "b1")), 5)
    await c.stub.Release(release("a", ga))
    await asyncio.sleep(0.5)
    status = await c.status()
    assert status.preemptions == 1  # was 2
    assert status.holder.job_id == "b" and status.holder.epoch == gb.epoch


async def test_preempted_adopted_holder_is_requeued_at_its_configured_priority(make_cluster) -> None:
    """adopt() builds the presumptive Hold with priority 0, ignoring the member's
    configured priority; when that holder is preempted it is re-queued at 0, behind
    lower-priority jobs that its claim config ranks below it."""
    c = await make_cluster(backend="cuda")
    set_group(c, members=_members(c, ("a", 5, 0.3), ("b", 0, None), ("c", 5, None)))
    c.orchestrator.group("g").adopt("a", set(), epoch=3)
    tb = asyncio.ensure_future(c.stub.Acquire(acquire("b", "b")))
    await eventually(lambda: _waiting(c, "b"))
    tc = asyncio.ensure_future(c.stub.Acquire(acquire("c", "c")))
    await eventually(lambda: _waiting(c, "c"))
    await asyncio.wait_for(tc, 5)  # a preempted, c (priority 5, first in line) granted
    assert [(w.job_id, w.priority) for w in (await c.status()).waiters] == [("a", 5), ("b", 0)]  # was b, a@0
    tb.cancel()


async def test_holder_outranking_every_waiter_is_not_preempted_in_a_loop(make_cluster) -> None:
    """a (priority 5, maxHoldSeconds 0.2) holds, b (priority 0) waits: only a waiter at the
    holder's priority or above starts the clock. (It used to: every 0.2 s a was preempted,
    re-queued ahead of b and re-granted, a Preempted Event and an epoch per period, while
    with backend `none` the same config revoked a in favour of b.)"""
    c = await make_cluster(backend="cuda")
    set_group(c, members=_members(c, ("a", 5, 0.2), ("b", 0, None)))
    ga = await c.stub.Acquire(acquire("a", "a"))
    tb = asyncio.ensure_future(c.stub.Acquire(acquire("b", "b")))
    await asyncio.sleep(1.0)
    status = await c.status()
    tb.cancel()
    assert status.holder.job_id == "a"
    assert status.preemptions == 0 and status.epoch == ga.epoch  # was: ~4 preemptions, epoch +4


# -- node agents -----------------------------------------------------------------


async def test_take_over_with_a_node_without_agent_keeps_the_recorded_epoch_and_resident() -> None:
    """A new leader takes over while a node of the group has no running plugin pod (e.g.
    the controller and the plugin DaemonSet rolled together): its target is `no-agent:`,
    `MissingAgent.checkpointed_jobs` raises. `take_over` used to raise, and `lead()` started
    the group empty: epoch back to 0 (the fencing token going backwards) and no resident,
    so the next waiter was granted without checkpointing the job still on the GPU."""
    node = "node-a"
    members = tuple(MemberSpec(claim_set=j, claims_by_agent={missing_target(node): ()}) for j in ("a", "b"))

    async def switcher(spec, outgoing, incoming, restore):
        return SwitchRecord(outgoing, incoming)

    orch = Orchestrator([GroupSpec(id="g", backend="cuda", agents=(missing_target(node),), members=members)],
                        switcher=switcher)

    async def recorded(group):
        return "a", 7  # claim status: a resident, epoch 7

    ctl = SimpleNamespace(writer=SimpleNamespace(recorded=recorded), orchestrator=orch)
    group = orch.group("g")
    try:
        await Controller.take_over(ctl, group)  # type: ignore[arg-type]
        assert group.epoch == 7 and group.resident == "a"
    finally:
        await orch.close()


@pytest.mark.slow  # > 5 s: left out of `make unit`, run by `make test`
async def test_pooled_agent_channel_recovers_promptly_when_the_agent_is_back() -> None:
    """With hostNetwork (the shipped manifest) a restarted plugin pod has the same target,
    and a crash-looping agent keeps its Running pod and target, so `AgentPool` reuses one
    channel across agent restarts. Switch attempts while the agent is down push gRPC's
    reconnect backoff up (1 s x1.6 ... 120 s), and a channel in backoff fails every RPC at
    once: switches kept failing for ~10 s (up to 2 min) after the agent was back."""
    d = Path(tempfile.mkdtemp(prefix="ts-"))
    target = f"unix://{d / 'agent.sock'}"

    def agent() -> NodeAgent:
        return NodeAgent(StaticProcessResolver({}), backends=[FakeBackend("n", [], name="cuda")])

    server, _ = await create_agent_server(agent(), target)
    client = AgentClient(target)
    try:
        assert await client.checkpointed_jobs() == set()
        await server.stop(0)
        loop = asyncio.get_running_loop()
        down_until = loop.time() + 16.5
        while loop.time() < down_until:  # switches attempted while the agent is down
            with pytest.raises(TimeSliceServerError):
                await client.checkpointed_jobs()
            await asyncio.sleep(0.5)
        server, _ = await create_agent_server(agent(), target)
        t0 = time.monotonic()
        while True:
            try:
                await client.checkpointed_jobs()
                break
            except TimeSliceServerError:
                await asyncio.sleep(0.1)
        assert time.monotonic() - t0 < 3.0
    finally:
        await client.close()
        await server.stop(0)
        shutil.rmtree(d, ignore_errors=True)
