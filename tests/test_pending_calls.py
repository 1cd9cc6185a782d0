"""Issue 10, item 15: with 200 groups x 8 clients, ~30 first Acquires per run failed with a bare
CANCELLED. Cause: gRPC core cancels calls it received but the asyncio server had not picked up
yet, at random past 1000 pending and all past 3000 (GRPC_ARG_SERVER_MAX_PENDING_REQUESTS and its
hard limit; random early detection), which a burst of clients connecting at once reaches. The
server now allows far more. Input: a client process that sends 3,500 Acquires at once to a real
orchestrator server; none may come back CANCELLED."""

from __future__ import annotations

import asyncio
import sys
import textwrap

from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.server import create_server

from tests.conftest import eventually

GROUPS, JOBS = 100, 35

FLOOD = """
    import asyncio, sys, uuid
    import grpc
    from timeslice.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc as pb_grpc

    async def main(target, groups, jobs):
        async with grpc.aio.insecure_channel(target) as ch:
            await ch.channel_ready()
            stub = pb_grpc.OrchestratorStub(ch)
            calls = [stub.Acquire(pb.AcquireRequest(job_id=f"j{j}", group_id=f"g{g}", request_id=uuid.uuid4().hex))
                     for g in range(groups) for j in range(jobs)]
            print("sent", flush=True)
            for c in asyncio.as_completed([c.code() for c in calls]):  # the holders' grants; a cancelled call
                print((await c).name, flush=True)                        # says so at once

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


async def test_a_burst_of_acquires_is_never_cancelled_by_the_server() -> None:
    orch = Orchestrator([GroupSpec(id=f"g{g}", backend="none") for g in range(GROUPS)])
    server, port = await create_server(orch, "127.0.0.1:0")
    try:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", textwrap.dedent(FLOOD), f"127.0.0.1:{port}", str(GROUPS), str(JOBS),
            stdout=asyncio.subprocess.PIPE)
        assert child.stdout is not None
        try:
            assert await asyncio.wait_for(child.stdout.readline(), 60) == b"sent\n"
            # every Acquire reaches the orchestrator (a call the core cancelled never does): one
            # holder per group, the others waiting
            await eventually(lambda: sum(len(orch.group(f"g{g}").queue) for g in range(GROUPS)) == GROUPS * (JOBS - 1)
                             and all(orch.group(f"g{g}").holder for g in range(GROUPS)), timeout=120)
            codes = [(await asyncio.wait_for(child.stdout.readline(), 60)).decode().strip() for _ in range(GROUPS)]
            assert codes == ["OK"] * GROUPS, codes
        finally:
            child.kill()
            await child.wait()
    finally:
        await server.stop(0)
        await orch.close()
