"""A node agent killed in the middle of a checkpoint, and one whose records cannot be
written (issue 10, item 1): real agent processes killed with SIGKILL, real frozen processes."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap

import grpc
import grpc.aio
import pytest
from timeslice.driver.agentapi.v1 import agent_pb2 as apb
from timeslice.driver.agentapi.v1 import agent_pb2_grpc as apb_grpc
from timeslice.kubelet_plugin.agent.node_agent import JobRef, NodeAgent, StepRequest
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.procfs import proc_state
from timeslice.kubelet_plugin.agent.server import create_server

from tests.conftest import eventually
from tests.test_freeze import spinner

# An agent whose freeze backend stops the job's processes, says so in a file, then never
# returns: the test kills it there, between touching the processes and recording the result.
STALLING_AGENT = """
    import asyncio, sys
    from pathlib import Path
    from timeslice.kubelet_plugin.agent.backends.freeze import FreezeBackend
    from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
    from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
    from timeslice.kubelet_plugin.agent.server import create_server

    target, records, marker, pid = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])

    class Stalling(FreezeBackend):
        async def checkpoint(self, pids, timeout):
            states = await super().checkpoint(pids, timeout)
            marker.write_text("frozen")
            await asyncio.Event().wait()
            return states

    async def main():
        agent = NodeAgent(StaticProcessResolver({"a": [pid]}), backends=[Stalling()], records_path=records)
        server, _ = await create_server(agent, target)  # kept: a collected server stops serving
        await asyncio.Event().wait()

    asyncio.run(main())
"""


async def acquire_as_a_client_does(g, job: str):  # -> GrantInfo
    """`g.acquire(job)`, asked again after each SwitchFailed (a client retries it; the
    agent's channel reconnects meanwhile), for at most 20 s."""
    from timeslice.driver.errors import SwitchFailed

    grants = []

    async def acquired() -> bool:
        try:
            grants.append(await g.acquire(job, 0, f"{job}-retry-{len(grants)}", None))
        except SwitchFailed:
            return False
        return True

    await eventually(acquired, timeout=20)
    return grants[-1]


async def test_an_agent_killed_mid_checkpoint_leaves_no_process_stopped_after_it_restarts(children, short_tmp,
                                                                                         tmp_path) -> None:
    job = spinner(children)
    target, records, marker = f"unix://{short_tmp / 'agent.sock'}", tmp_path / "records.json", tmp_path / "frozen"
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", textwrap.dedent(STALLING_AGENT), target, str(records), str(marker), str(job.pid))
    try:
        channel = grpc.aio.insecure_channel(target)
        call = asyncio.ensure_future(apb_grpc.NodeAgentStub(channel).Checkpoint(
            apb.SwitchStepRequest(job_id="a", backend="freeze", timeout_seconds=30), wait_for_ready=True))
        await eventually(marker.exists, timeout=30)
        agent.send_signal(signal.SIGKILL)
        await agent.wait()
        with pytest.raises(grpc.aio.AioRpcError):
            await call
        await channel.close()
        assert proc_state(job.pid) == "T"  # stopped, and the write-ahead record says so
        assert json.loads(records.read_text())["jobs"]["a"]["phase"] == "checkpointing"
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
    again = NodeAgent(StaticProcessResolver({"a": [job.pid]}), backends=["freeze"], records_path=records)
    server, _ = await create_server(again, target)  # recovery undoes the interrupted checkpoint
    try:
        assert proc_state(job.pid) in "RS" and "a" not in again.records.jobs
        assert json.loads(records.read_text())["jobs"] == {}
    finally:
        await server.stop(0)


async def test_a_checkpoint_whose_record_cannot_be_written_touches_nothing(children, tmp_path) -> None:
    job = spinner(children)
    blocker = tmp_path / "a-file"  # the records' folder cannot be made (root ignores permissions)
    blocker.write_text("x")
    agent = NodeAgent(StaticProcessResolver({"a": [job.pid]}), backends=["freeze"],
                      records_path=blocker / "records.json")
    from timeslice.driver.errors import FailedPrecondition

    with pytest.raises(FailedPrecondition, match=r"cannot write its records .*nothing was touched"):
        await agent.checkpoint(StepRequest(JobRef("a"), "freeze", "g", 5))
    assert proc_state(job.pid) in "RS" and agent.records.jobs == {}
    assert not list(tmp_path.glob("**/*.tmp"))  # no temporary left behind


@pytest.mark.slow  # > 5 s: left out of `make unit`, run by `make test`
async def test_a_switch_whose_agent_did_not_answer_is_undone_and_never_assumed(children, short_tmp,
                                                                               caplog) -> None:
    """Issue 10, item 1 (orchestrator side): the agent died during a checkpoint; the switch was
    reported "rolled back" with the outgoing job kept resident, and that job's next acquire was
    granted at once with its process possibly still stopped. A step with no reply is resent
    with its operation id (tests/test_operations.py: an agent back in time completes it);
    when the agent stays away for the whole resend window the step is undone, and when the
    undo cannot reach the agent either the job counts as off the GPU until an agent that
    answers, with no step of it in flight, says where it is (`in_flight.py`): here the
    checkpoint never ran (the agent was gone), so the agent holds no record of it, and the job,
    whose process runs, is granted as resident."""
    from timeslice.controller.orchestrator.config import GroupSpec
    from timeslice.controller.orchestrator.orchestrator import Orchestrator
    from timeslice.driver.errors import SwitchFailed

    a_proc, b_proc = spinner(children), spinner(children)
    target = f"unix://{short_tmp / 'agent.sock'}"

    def agent() -> NodeAgent:
        return NodeAgent(StaticProcessResolver({"a": [a_proc.pid], "b": [b_proc.pid]}), backends=["freeze"])

    server, _ = await create_server(agent(), target)
    orch = Orchestrator([GroupSpec(id="g", backend="freeze", agents=(target,), step_timeout_seconds=2)])
    g = orch.group("g")
    try:
        ga = await g.acquire("a", 0, "a1", None)
        g.release("a", ga.lease_id, ga.epoch)
        await server.stop(0)  # the agent is gone
        with pytest.raises(SwitchFailed, match="ROLLBACK INCOMPLETE"):
            await g.acquire("b", 0, "b1", None)
        assert "checkpoint resent group=g job=a" in caplog.text  # asked again before giving up
        assert "a" in g.checkpointed  # not assumed resident
        server, _ = await create_server(agent(), target)  # the agent is back
        ga = await acquire_as_a_client_does(g, "a")
        assert "job a is on the GPUs after all" in caplog.text and not ga.restored
        assert proc_state(a_proc.pid) in "RS" and "a" not in g.failed_jobs
    finally:
        await server.stop(0)
        await orch.close()


SLOW_AGENT = """
    import asyncio, sys
    from pathlib import Path
    from timeslice.kubelet_plugin.agent.backends.freeze import FreezeBackend
    from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
    from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
    from timeslice.kubelet_plugin.agent.server import create_server

    target, records, marker, pid = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    forked = [int(a) for a in sys.argv[5:]]  # processes of the job that appear during its first step
    resolver = StaticProcessResolver({"a": [pid]})
    cut = asyncio.Event()

    class Slow(FreezeBackend):  # a large checkpoint: the processes are stopped long before it ends
        async def checkpoint(self, pids, timeout):
            states = await super().checkpoint(pids, timeout)
            if forked and pids == [pid]:  # "forked" during the step: found when the job is listed again
                resolver.set("a", [pid, *forked])
                return states
            marker.write_text("frozen")
            await asyncio.wait_for(cut.wait(), 30)  # it ends only after its call was cut
            return states

    class Agent(NodeAgent):
        async def _undo_cancelled(self, *args):  # the agent saw its caller go away
            cut.set()
            await super()._undo_cancelled(*args)

    async def main():
        agent = Agent(resolver, backends=[Slow()], records_path=records)
        server, _ = await create_server(agent, target)
        await asyncio.Event().wait()

    asyncio.run(main())
"""


@pytest.mark.parametrize("forks", [False, True], ids=["", "forked-during-the-step"])
async def test_a_checkpoint_whose_call_is_cut_is_finished_then_undone_by_the_agent(children, short_tmp,
                                                                                 tmp_path, forks) -> None:
    """The orchestrator's call was cut (deadline, its switch cancelled) mid-checkpoint: the
    process stayed stopped and its record was dropped, so nobody would ever restore it. Also
    when the cut lands while the agent stops a process forked during the step (`freeze`): every
    process the step stopped runs again."""
    job = spinner(children)
    forked = [str(spinner(children).pid)] if forks else []
    target, records, marker = f"unix://{short_tmp / 'agent.sock'}", tmp_path / "records.json", tmp_path / "frozen"
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", textwrap.dedent(SLOW_AGENT), target, str(records), str(marker), str(job.pid), *forked)
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            call = asyncio.ensure_future(apb_grpc.NodeAgentStub(channel).Checkpoint(
                apb.SwitchStepRequest(job_id="a", backend="freeze", timeout_seconds=30), wait_for_ready=True))
            await eventually(marker.exists, timeout=30)
            call.cancel()  # the caller goes away while the processes are stopped
            with pytest.raises(asyncio.CancelledError):
                await call
        await eventually(lambda: all(proc_state(p) in "RS" for p in [job.pid, *map(int, forked)])
                         and json.loads(records.read_text())["jobs"] == {}, timeout=30)
    finally:
        agent.kill()
        await agent.wait()


async def test_a_restore_the_agent_reports_timed_out_counts_toward_failing_the_job(make_cluster) -> None:
    """The agent's own StepTimeout comes back as DEADLINE_EXCEEDED: a reply, not a lost call.
    It was taken as "unreachable", so a job whose restore kept timing out never failed and
    every acquire repeated checkpoint -> restore -> rollback."""
    from timeslice.controller.orchestrator.switch_outcome import MAX_RESTORE_FAILURES, RESTORE_FAILURE_SECONDS
    from timeslice.driver.errors import StepTimeout, SwitchFailed

    c = await make_cluster(backend="cuda")
    fake = c.backends["node-0"]
    g = c.orchestrator.group("g")
    ga = await g.acquire("a", 0, "a1", None)
    g.release("a", ga.lease_id, ga.epoch)
    gb = await g.acquire("b", 0, "b1", None)  # a checkpointed
    g.release("b", gb.lease_id, gb.epoch)
    a_pid = c.resolvers["node-0"]._jobs["a"][0]

    async def timing_out(pids, timeout):
        if a_pid in pids:
            raise StepTimeout(f"injected: restore of {pids} timed out")
        return await type(fake).restore(fake, pids, timeout)

    fake.restore = timing_out  # type: ignore[method-assign]
    now = [g.clock()]
    g.clock = lambda: now[0]  # (the failures span RESTORE_FAILURE_SECONDS, as its client's retries would)
    for i in range(MAX_RESTORE_FAILURES):
        with pytest.raises(SwitchFailed, match="timed out"):
            await g.acquire("a", 0, f"a-{i}", None)
        now[0] += RESTORE_FAILURE_SECONDS / (MAX_RESTORE_FAILURES - 1)
    assert "a" in g.failed_jobs and "outcome is unknown" not in g.failed_jobs["a"]


async def test_a_job_believed_resident_is_granted_only_once_its_agent_confirms_it(children, short_tmp) -> None:
    """Issue 10, "a grant is made only when every agent of the group has confirmed that the
    incoming job runs with its state on the GPU": the group believes `a` resident (it released
    with nobody waiting), but its node agent holds a checkpoint record of it (a step the group
    never heard of). Before, `a` was granted at once with its process stopped. Now the agent's
    record wins: `a` is restored, then granted. An agent that does not answer gets no grant on
    a guess."""
    from timeslice.controller.orchestrator.config import GroupSpec
    from timeslice.controller.orchestrator.orchestrator import Orchestrator
    from timeslice.driver.errors import SwitchFailed

    a_proc = spinner(children)
    target = f"unix://{short_tmp / 'agent.sock'}"
    agent = NodeAgent(StaticProcessResolver({"a": [a_proc.pid]}), backends=["freeze"])
    server, _ = await create_server(agent, target)
    orch = Orchestrator([GroupSpec(id="g", backend="freeze", agents=(target,), step_timeout_seconds=2)])
    g = orch.group("g")
    try:
        ga = await g.acquire("a", 0, "a1", None)
        g.release("a", ga.lease_id, ga.epoch)
        assert g.resident == "a" and not ga.restored
        await agent.checkpoint(StepRequest(JobRef("a"), "freeze", "g", 5))  # behind the group's back
        assert proc_state(a_proc.pid) == "T"
        again = await asyncio.wait_for(g.acquire("a", 0, "a2", None), 10)
        assert again.restored and proc_state(a_proc.pid) in "RS" and "a" not in agent.records.jobs
        g.release("a", again.lease_id, again.epoch)

        await server.stop(0)  # the agent is gone: the resident job is not granted on a guess
        with pytest.raises(SwitchFailed, match="cannot confirm that job a has its state on the GPUs"):
            await asyncio.wait_for(g.acquire("a", 0, "a3", None), 20)
        assert g.holder is None
        server, _ = await create_server(agent, target)  # back: confirmed, granted without a move
        assert not (await acquire_as_a_client_does(g, "a")).restored and g.counters.switches == 1
    finally:
        await server.stop(0)
        await orch.close()
