"""Operation ids (issue 10): a node agent runs a step once per id, and the orchestrator resends
a step whose reply was lost with the same id, so the step is completed instead of undone
(tests/test_agent_crash.py: an agent that stays away is undone, never assumed).

Real agents (gRPC servers over unix sockets, an agent process killed with SIGKILL), real
frozen processes; the freeze backend is subclassed at the backend seam only to count its
calls and to hold a step open until the test lets it end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import sys
import textwrap
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import grpc.aio
import pytest
from timeslice.driver.agentapi.v1 import agent_pb2 as apb
from timeslice.driver.agentapi.v1 import agent_pb2_grpc as apb_grpc
from timeslice.kubelet_plugin.agent.backends.base import ProcState
from timeslice.kubelet_plugin.agent.backends.freeze import FreezeBackend
from timeslice.kubelet_plugin.agent.node_agent import JobRef, NodeAgent, StepRequest
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.procfs import proc_state
from timeslice.kubelet_plugin.agent.server import create_server
from timeslice.kubelet_plugin.agent.steps import MAX_OPERATIONS

from tests.conftest import eventually
from tests.test_freeze import spinner


class Counted(FreezeBackend):
    """The freeze backend, counting its steps; with `held`, a checkpoint stops the processes,
    says so (`entered`) and ends only once `release` is set; `fail` fails the next step."""

    def __init__(self, held: bool = False) -> None:
        self.checkpoints = self.restores = 0
        self.entered, self.release = asyncio.Event(), asyncio.Event()
        self.fail = False
        if not held:
            self.release.set()

    async def checkpoint(self, pids: Sequence[int], timeout: float) -> list[ProcState]:
        self.checkpoints += 1
        if self.fail:
            from timeslice.driver.errors import BackendError

            raise BackendError("injected checkpoint failure")
        states = await super().checkpoint(pids, timeout)
        self.entered.set()
        await self.release.wait()
        return states

    async def restore(self, pids: Sequence[int], timeout: float) -> list[ProcState]:
        self.restores += 1
        return await super().restore(pids, timeout)


@contextlib.asynccontextmanager
async def agent_stub(agent: NodeAgent, sock_dir: Path) -> AsyncIterator[apb_grpc.NodeAgentStub]:
    """`agent` served on a unix socket in `sock_dir`, and a stub that calls it."""
    target = f"unix://{sock_dir / 'agent.sock'}"
    server, _ = await create_server(agent, target)
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            yield apb_grpc.NodeAgentStub(channel)
    finally:
        await server.stop(0)


def step(op: str, job: str = "a", backend: str = "freeze") -> apb.SwitchStepRequest:
    return apb.SwitchStepRequest(job_id=job, backend=backend, group_id="g", timeout_seconds=10, operation_id=op)


def request(op: str, job: str = "a") -> StepRequest:
    return StepRequest(JobRef(job), "freeze", "g", 10, op)


async def test_two_checkpoints_with_one_operation_id_run_the_backend_once(children, tmp_path, short_tmp,
                                                                          caplog) -> None:
    caplog.set_level(logging.INFO, logger="timeslice.agent")
    proc = spinner(children)
    backend, records = Counted(held=True), tmp_path / "records.json"
    agent = NodeAgent(StaticProcessResolver({"a": [proc.pid]}), backends=[backend], records_path=records)
    async with agent_stub(agent, short_tmp) as stub:
        first = asyncio.ensure_future(stub.Checkpoint(step("op-1")))
        await asyncio.wait_for(backend.entered.wait(), 10)
        second = asyncio.ensure_future(stub.Checkpoint(step("op-1")))
        await eventually(lambda: "operation=op-1: joined the running step" in caplog.text, timeout=10)
        backend.release.set()
        one, two = await first, await second
    assert one == two and [p.state for p in one.processes] == ["stopped"]
    assert backend.checkpoints == 1 and proc_state(proc.pid) == "T"
    record = json.loads(records.read_text())["jobs"]["a"]
    assert record["phase"] == "checkpointed" and record["operation"] == "op-1"


async def test_a_resend_after_the_step_ended_gets_its_outcome_and_touches_nothing(children, tmp_path,
                                                                                  short_tmp) -> None:
    proc = spinner(children)
    backend, records = Counted(), tmp_path / "records.json"
    agent = NodeAgent(StaticProcessResolver({"a": [proc.pid]}), backends=[backend], records_path=records)
    async with agent_stub(agent, short_tmp) as stub:
        done = await stub.Checkpoint(step("op-1"))
        written, mtime = records.read_bytes(), records.stat().st_mtime_ns
        assert await stub.Checkpoint(step("op-1")) == done  # the same outcome, seconds included
        assert backend.checkpoints == 1 and proc_state(proc.pid) == "T"
        assert records.read_bytes() == written and records.stat().st_mtime_ns == mtime  # not rewritten
        back = await stub.Restore(step("op-2"))
        assert await stub.Restore(step("op-2")) == back and backend.restores == 1 and proc_state(proc.pid) in "RS"
        # a step that failed fails again with the same error, without running again
        backend.fail = True
        with pytest.raises(grpc.aio.AioRpcError) as first:
            await stub.Checkpoint(step("op-3"))
        backend.fail = False
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await stub.Checkpoint(step("op-3"))
        assert (again.value.code(), again.value.details()) == (first.value.code(), first.value.details())
        assert "injected checkpoint failure" in again.value.details() and backend.checkpoints == 2
        assert proc_state(proc.pid) in "RS" and "a" not in agent.records.jobs
        # an operation id names one step: another step under it is refused, nothing runs
        with pytest.raises(grpc.aio.AioRpcError) as other:
            await stub.Restore(step("op-1"))
        assert other.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "operation_id 'op-1' names the checkpoint of job 'a'" in other.value.details()
        assert backend.restores == 1


@pytest.mark.parametrize(("op", "text"), [("x" * 129, "operation_id is 129 characters; at most 128"),
                                          ("op\n1", "operation_id must be printable ASCII"),
                                          ("op-é", "operation_id must be printable ASCII")])
async def test_a_bad_operation_id_is_invalid_argument_and_touches_nothing(op, text, children, short_tmp) -> None:
    proc = spinner(children)
    backend = Counted()
    agent = NodeAgent(StaticProcessResolver({"a": [proc.pid]}), backends=[backend])
    async with agent_stub(agent, short_tmp) as stub:
        for rpc in (stub.Checkpoint, stub.Restore):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rpc(step(op))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in err.value.details()
        assert (await stub.Checkpoint(step("x" * 128))).processes  # 128 is fine
    assert backend.checkpoints == 1 and backend.restores == 0


async def test_a_resend_to_a_restarted_agent_is_answered_from_its_records(children, tmp_path) -> None:
    """After a restart the agent remembers no operation; its records do: a checkpoint recorded
    under the resent id is done (bytes from the record) and not run again, and so is a restore
    that consumed a record under the resent id (0 bytes)."""
    proc = spinner(children)
    records = tmp_path / "records.json"

    def agent(backend: Counted) -> NodeAgent:
        return NodeAgent(StaticProcessResolver({"a": [proc.pid]}), backends=[backend], records_path=records)

    first = agent(Counted())
    await first.checkpoint(request("op-1"))
    written = records.read_bytes()
    backend = Counted()
    again = agent(backend)
    await again.recover()  # as at start: a finished checkpoint is kept
    outcome = await again.checkpoint(request("op-1"))
    assert outcome.job_id == "a" and [p.state for p in outcome.processes] == ["stopped"]
    assert backend.checkpoints == 0 and proc_state(proc.pid) == "T" and records.read_bytes() == written
    assert (await again.restore(request("op-2"))).processes and backend.restores == 1
    assert proc_state(proc.pid) in "RS"
    assert json.loads(records.read_text()) == {"apiVersion": "timeslice.dev/agent-records/v1", "jobs": {},
                                               "restored": {"op-2": "a"}}
    backend = Counted()
    third = agent(backend)
    await third.recover()
    outcome = await third.restore(request("op-2"))
    assert outcome.bytes == 0 and [p.state for p in outcome.processes] == ["running"]
    assert backend.restores == 0 and proc_state(proc.pid) in "RS"
    # without an operation id nothing changes: the restore runs (an older orchestrator)
    await third.restore(StepRequest(JobRef("a"), "freeze", "g", 10))
    assert backend.restores == 1


async def test_a_step_whose_caller_went_away_finishes_and_keeps_its_record(children, tmp_path, short_tmp) -> None:
    """With an operation id the caller will ask again (resend) or undo (a restore): the agent
    finishes the step and keeps its record, instead of undoing it as for a call without one
    (tests/test_agent_crash.py)."""
    proc = spinner(children)
    backend, records = Counted(held=True), tmp_path / "records.json"
    agent = NodeAgent(StaticProcessResolver({"a": [proc.pid]}), backends=[backend], records_path=records)
    async with agent_stub(agent, short_tmp) as stub:
        call = asyncio.ensure_future(stub.Checkpoint(step("op-1")))
        await asyncio.wait_for(backend.entered.wait(), 10)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        backend.release.set()

        def recorded() -> bool:
            return json.loads(records.read_text())["jobs"].get("a", {}).get("phase") == "checkpointed"

        await eventually(recorded, timeout=10)
        resent = await stub.Checkpoint(step("op-1"))
    assert [p.state for p in resent.processes] == ["stopped"] and backend.checkpoints == 1
    assert proc_state(proc.pid) == "T" and backend.restores == 0  # owned by its record, not undone


async def test_the_agent_remembers_a_bounded_number_of_operations(tmp_path) -> None:
    """Issue 10, item 11: agent state stays bounded whatever the callers send: operations in
    memory, and the restores its records file remembers."""
    import os

    from timeslice.kubelet_plugin.agent.records import MAX_RESTORED

    agent = NodeAgent(StaticProcessResolver({"me": [os.getpid()]}), backends=["none"],
                      records_path=tmp_path / "records.json")  # `none` moves nothing: this process is safe
    for i in range(5000):
        await agent.checkpoint(StepRequest(JobRef(f"job-{i}"), "none", "g", 1, f"op-{i}"))
    assert len(agent.operations) <= MAX_OPERATIONS
    assert agent.operations.find("checkpoint", StepRequest(JobRef("job-4999"), "none", "g", 1, "op-4999"))
    assert agent.operations.find("checkpoint", StepRequest(JobRef("job-0"), "none", "g", 1, "op-0")) is None
    for i in range(MAX_RESTORED + 50):
        await agent.checkpoint(StepRequest(JobRef("me"), "none", "g", 1, f"cp-{i}"))
        await agent.restore(StepRequest(JobRef("me"), "none", "g", 1, f"rs-{i}"))
    restored = json.loads((tmp_path / "records.json").read_text())["restored"]
    assert len(restored) == MAX_RESTORED and f"rs-{MAX_RESTORED + 49}" in restored and "rs-0" not in restored
    assert len(agent.operations) <= MAX_OPERATIONS


def resent_operation(log_text: str, step: str = "checkpoint", job: str = "a") -> str:
    """The operation id of the first resend the switch logged for `step` of `job`."""
    found = re.search(rf"{step} resent group=g job={job} agent=\S+ operation=(\w+) try=1", log_text)
    assert found, f"no resend of the {step} of {job} logged"
    return found.group(1)


async def test_a_step_whose_reply_was_lost_to_the_deadline_is_resent_and_completed(children, tmp_path, short_tmp,
                                                                                  caplog, monkeypatch) -> None:
    """The checkpoint outlives the orchestrator's call (a large job, a slow node): the call's
    deadline passes, the switch resends the step with its operation id, the resend joins the
    running step and gets its outcome. The switch goes on: nothing is undone or run twice."""
    from timeslice.controller.orchestrator import agents
    from timeslice.controller.orchestrator.config import GroupSpec
    from timeslice.controller.orchestrator.orchestrator import Orchestrator

    monkeypatch.setattr(agents, "RPC_SLACK_SECONDS", 0.0)  # the call's deadline is the step's own bound
    caplog.set_level(logging.INFO)
    a_proc, b_proc = spinner(children), spinner(children)
    backend, records = Counted(held=True), tmp_path / "records.json"
    agent = NodeAgent(StaticProcessResolver({"a": [a_proc.pid], "b": [b_proc.pid]}), backends=[backend],
                      records_path=records)
    target = f"unix://{short_tmp / 'agent.sock'}"
    server, _ = await create_server(agent, target)
    orch = Orchestrator([GroupSpec(id="g", backend="freeze", agents=(target,), step_timeout_seconds=3)])
    g = orch.group("g")
    try:
        ga = await g.acquire("a", 0, "a1", None)
        g.release("a", ga.lease_id, ga.epoch)
        grant = asyncio.ensure_future(g.acquire("b", 0, "b1", None))
        await eventually(lambda: "checkpoint resent group=g job=a" in caplog.text or grant.done(), timeout=20)
        backend.release.set()  # the slow step ends now, after its call's deadline
        await asyncio.wait_for(grant, 20)  # a switch that was undone raises SwitchFailed here
        assert "checkpoint completed by resend group=g job=a" in caplog.text
        assert backend.checkpoints == 1 and backend.restores == 0 and proc_state(a_proc.pid) == "T"
        assert "a" in g.checkpointed and g.recent[-1].ok and g.counters.failed_switches == 0
        record = json.loads(records.read_text())["jobs"]["a"]
        assert record["phase"] == "checkpointed" and record["operation"] == resent_operation(caplog.text)
    finally:
        await server.stop(0)
        await orch.close()


# A node agent process: its first run (argv "stall") stops the job's processes at a
# checkpoint, says so in a file and never answers; a run with "serve" works normally, one
# with "fail" fails every checkpoint (a definite error) before touching anything.
AGENT = """
    import asyncio, sys
    from pathlib import Path
    from timeslice.driver.errors import BackendError
    from timeslice.kubelet_plugin.agent.backends.freeze import FreezeBackend
    from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
    from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
    from timeslice.kubelet_plugin.agent.server import create_server

    target, records, marker, mode = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    jobs = {"a": [int(sys.argv[5])], "b": [int(sys.argv[6])]}

    class Stalling(FreezeBackend):
        async def checkpoint(self, pids, timeout):
            if mode == "fail":
                raise BackendError("injected: this node cannot checkpoint now")
            states = await super().checkpoint(pids, timeout)
            if mode == "stall":
                marker.write_text("frozen")
                await asyncio.Event().wait()
            return states

    async def main():
        agent = NodeAgent(StaticProcessResolver(jobs), backends=[Stalling()], records_path=records)
        server, _ = await create_server(agent, target)  # kept: a collected server stops serving
        await asyncio.Event().wait()

    asyncio.run(main())
"""


@pytest.mark.parametrize("back", ["serve", "fail"])
async def test_an_agent_killed_mid_checkpoint_and_back_within_the_step_timeout_completes_or_undoes_the_switch(
        back, children, tmp_path, short_tmp, caplog) -> None:
    """The agent is SIGKILLed with the outgoing job stopped and its write-ahead record written,
    and a new agent starts on the same records while the switch resends: it undoes the
    interrupted checkpoint at start and runs the resent one. `serve`: the switch completes with
    the job checkpointed and recorded under the resent operation id; its next grant restores
    it. `fail` (the resend gets a definite error): the switch is undone, the job resident and
    running, no record; never assumed either way."""
    from timeslice.controller.orchestrator.config import GroupSpec
    from timeslice.controller.orchestrator.orchestrator import Orchestrator
    from timeslice.driver.errors import SwitchFailed

    caplog.set_level(logging.INFO, logger="timeslice.switch")
    a_proc, b_proc = spinner(children), spinner(children)
    sock, records, marker = short_tmp / "agent.sock", tmp_path / "records.json", tmp_path / "frozen"

    async def start(mode: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-c", textwrap.dedent(AGENT), f"unix://{sock}", str(records), str(marker), mode,
            str(a_proc.pid), str(b_proc.pid))

    agent = await start("stall")
    orch = Orchestrator([GroupSpec(id="g", backend="freeze", agents=(f"unix://{sock}",), step_timeout_seconds=20)])
    g = orch.group("g")
    try:
        await eventually(sock.exists, timeout=30)
        ga = await g.acquire("a", 0, "a1", None)
        g.release("a", ga.lease_id, ga.epoch)
        grant = asyncio.ensure_future(g.acquire("b", 0, "b1", None))
        await eventually(marker.exists, timeout=30)
        agent.send_signal(signal.SIGKILL)
        await agent.wait()
        assert proc_state(a_proc.pid) == "T"
        assert json.loads(records.read_text())["jobs"]["a"]["phase"] == "checkpointing"
        await eventually(lambda: "checkpoint resent group=g job=a" in caplog.text or grant.done(), timeout=20)
        agent = await start(back)  # back while the switch resends
        if back == "fail":
            with pytest.raises(SwitchFailed, match=r"injected: this node cannot checkpoint now.*; rolled back"):
                await asyncio.wait_for(grant, 30)
            assert proc_state(a_proc.pid) in "RS" and json.loads(records.read_text())["jobs"] == {}
            assert "a" not in g.checkpointed and g.counters.failed_switches == 1
            ga = await g.acquire("a", 0, "a2", None)
            assert not ga.restored and proc_state(a_proc.pid) in "RS"
            return
        gb = await asyncio.wait_for(grant, 30)  # a switch that was undone raises SwitchFailed here
        record = json.loads(records.read_text())["jobs"]["a"]
        assert proc_state(a_proc.pid) == "T" and record["phase"] == "checkpointed"
        assert record["operation"] == resent_operation(caplog.text)
        assert "a" in g.checkpointed and g.recent[-1].ok and g.counters.failed_switches == 0
        waiter = asyncio.ensure_future(g.acquire("a", 0, "a2", None))  # the record owns the stopped process:
        await eventually(lambda: len(g.queue) == 1)
        g.release("b", gb.lease_id, gb.epoch)
        ga = await waiter  # restored for its grant
        jobs = json.loads(records.read_text())["jobs"]
        assert ga.restored and proc_state(a_proc.pid) in "RS" and "a" not in jobs
        assert proc_state(b_proc.pid) == "T" and jobs["b"]["phase"] == "checkpointed"  # b made room for it
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
        await orch.close()
