"""Fault injection (issue 10): a real node agent process is SIGKILLed at each point of a
checkpoint and a restore, a new agent starts on the same records, and the invariants are
checked: no process is left stopped without a record that owns it, and no record names
processes that run. Then the step whose reply was lost is resent with its operation id, as
the orchestrator does: it completes (a checkpoint leaves the job checkpointed and recorded
under that id, a restore leaves it running without a record), running the backend again
only where the killed step's end was not recorded. The agent is tests/faults/stalling_agent.py:
it says where it stopped in a file, then waits to be killed."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

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
from tests.test_operations import Counted

STALLING_AGENT = Path(__file__).with_name("stalling_agent.py")

# where the agent is killed: in the backend before / after it acted, or once the step's
# record was written (checkpoint) or dropped (restore), before the reply
POINTS = ["checkpoint:before", "checkpoint:after", "checkpoint:recorded", "restore:before", "restore:after",
          "restore:recorded"]


async def _step(target: str, rpc: str, operation_id: str) -> apb.SwitchStepResponse:
    # A channel of its own subchannels: from the global pool, the resend could be written onto
    # the killed agent's connection before gRPC saw it break (UNAVAILABLE "Stream removed").
    async with grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        return await getattr(apb_grpc.NodeAgentStub(channel), rpc)(
            apb.SwitchStepRequest(job_id="a", backend="freeze", timeout_seconds=30, operation_id=operation_id),
            wait_for_ready=True, timeout=30)


@pytest.mark.parametrize("point", POINTS)
async def test_an_agent_killed_at_each_point_leaves_records_that_match_and_a_resend_completes(
        point, children, short_tmp, tmp_path) -> None:
    job = spinner(children)
    target, records, marker = f"unix://{short_tmp / 'agent.sock'}", tmp_path / "records.json", tmp_path / "at"
    agent = await asyncio.create_subprocess_exec(  # stalls at `point` until killed (no "go" file ever comes)
        sys.executable, str(STALLING_AGENT), target, str(records), str(marker), str(tmp_path / "go"), point,
        f"a={job.pid}", stdout=asyncio.subprocess.DEVNULL)
    try:
        if point.startswith("restore"):  # first a checkpoint that completes
            await _step(target, "Checkpoint", "op-0")
            assert proc_state(job.pid) == "T"
        rpc = "Restore" if point.startswith("restore") else "Checkpoint"
        call = asyncio.ensure_future(_step(target, rpc, "op-1"))
        await eventually(marker.exists, timeout=30)
        agent.send_signal(signal.SIGKILL)
        await agent.wait()
        with pytest.raises(grpc.aio.AioRpcError):
            await call
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
    backend = Counted()
    again = NodeAgent(StaticProcessResolver({"a": [job.pid]}), backends=[backend], records_path=records)
    server, _ = await create_server(again, target)  # a new agent on the same records
    try:
        stopped = proc_state(job.pid) == "T"
        recorded = "a" in json.loads(records.read_text())["jobs"] if records.exists() else False
        assert stopped == recorded, f"killed at {point}: process stopped={stopped}, recorded={recorded}"
        before = records.read_bytes() if records.exists() else b""
        await _step(target, rpc, "op-1")  # the resend: completed, not assumed
        jobs = json.loads(records.read_text())["jobs"]
        if rpc == "Checkpoint":
            assert proc_state(job.pid) == "T" and jobs["a"]["phase"] == "checkpointed"
            assert jobs["a"]["operation"] == "op-1"
            ran = backend.checkpoints
        else:
            assert proc_state(job.pid) in "RS" and "a" not in jobs
            ran = backend.restores
        # A step whose end was recorded is answered from the records. One killed before that runs
        # again: undone at start (checkpoint), or not done (restore:before), or done on processes
        # that run already (restore:after: a backend's restore of a running process changes nothing).
        recorded_end = point.endswith("recorded")
        assert ran == (0 if recorded_end else 1), f"killed at {point}: the resend ran the backend {ran} time(s)"
        if point == "checkpoint:recorded":
            assert records.read_bytes() == before  # answered from the record, not rewritten
        await again.restore(StepRequest(JobRef("a"), "freeze", "g", 5, "op-2"))  # the owner puts it back
        assert proc_state(job.pid) in "RS" and "a" not in again.records.jobs
    finally:
        await server.stop(0)
