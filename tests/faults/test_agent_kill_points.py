"""Fault injection (issue 10): a real node agent process is SIGKILLed at each point of a
checkpoint and a restore, a new agent starts on the same records, and the invariants are
checked: no process is left stopped without a record that owns it, and no record names
processes that run. The stall points live in a backend subclass inside the agent process
(no hook in the product): it says where it is in a file, then waits to be killed."""

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

AGENT = """
    import asyncio, sys
    from pathlib import Path
    from timeslice.kubelet_plugin.agent.backends.freeze import FreezeBackend
    from timeslice.kubelet_plugin.agent.node_agent import JobRef, NodeAgent, StepRequest
    from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
    from timeslice.kubelet_plugin.agent.server import create_server

    target, records, marker, point = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[5]
    pid = int(sys.argv[4])

    async def stall(here):
        if here == point:
            marker.write_text(here)
            await asyncio.Event().wait()

    class Faulty(FreezeBackend):
        async def checkpoint(self, pids, timeout):
            await stall("checkpoint:before")
            states = await super().checkpoint(pids, timeout)
            await stall("checkpoint:after")
            return states

        async def restore(self, pids, timeout):
            await stall("restore:before")
            states = await super().restore(pids, timeout)
            await stall("restore:after")
            return states

    async def main():
        agent = NodeAgent(StaticProcessResolver({"a": [pid]}), backends=[Faulty()], records_path=records)
        server, _ = await create_server(agent, target)
        await asyncio.Event().wait()

    asyncio.run(main())
"""

POINTS = ["checkpoint:before", "checkpoint:after", "restore:before", "restore:after"]


async def _step(target: str, rpc: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        await getattr(apb_grpc.NodeAgentStub(channel), rpc)(
            apb.SwitchStepRequest(job_id="a", backend="freeze", timeout_seconds=30), wait_for_ready=True, timeout=30)


@pytest.mark.parametrize("point", POINTS)
async def test_an_agent_killed_at_each_point_leaves_records_that_match_the_processes(point, children, short_tmp,
                                                                                     tmp_path) -> None:
    job = spinner(children)
    target, records, marker = f"unix://{short_tmp / 'agent.sock'}", tmp_path / "records.json", tmp_path / "at"

    def start_faulty() -> asyncio.Future:
        return asyncio.ensure_future(asyncio.create_subprocess_exec(
            sys.executable, "-c", textwrap.dedent(AGENT), target, str(records), str(marker), str(job.pid), point))

    agent = await start_faulty()
    try:
        if point.startswith("restore"):  # first a checkpoint that completes
            await _step(target, "Checkpoint")
            assert proc_state(job.pid) == "T"
        call = asyncio.ensure_future(_step(target, "Restore" if point.startswith("restore") else "Checkpoint"))
        await eventually(marker.exists, timeout=30)
        agent.send_signal(signal.SIGKILL)
        await agent.wait()
        with pytest.raises(grpc.aio.AioRpcError):
            await call
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
    again = NodeAgent(StaticProcessResolver({"a": [job.pid]}), backends=["freeze"], records_path=records)
    server, _ = await create_server(again, target)  # a new agent on the same records
    try:
        stopped = proc_state(job.pid) == "T"
        recorded = "a" in json.loads(records.read_text())["jobs"] if records.exists() else False
        assert stopped == recorded, f"killed at {point}: process stopped={stopped}, recorded={recorded}"
        if recorded:  # an owner that can restore it: the record does
            await again.restore(StepRequest(JobRef("a"), "freeze", "g", 5))
        assert proc_state(job.pid) in "RS" and "a" not in again.records.jobs
    finally:
        await server.stop(0)
