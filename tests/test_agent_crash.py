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
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
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
        await agent.checkpoint("a", "freeze", "g", 5)
    assert proc_state(job.pid) in "RS" and agent.records.jobs == {}
    assert not list(tmp_path.glob("**/*.tmp"))  # no temporary left behind
