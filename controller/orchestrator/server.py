"""Orchestrator gRPC server: `create_server` builds it, `serve` runs it (and, with
`metrics_listen`, the Prometheus `/metrics` endpoint) until a signal.

Owned by the orchestrator; called by `timeslice orchestrator`, the demo and tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator

import grpc.aio
from timeslice.controller.orchestrator.agent_pool import AgentPool
from timeslice.controller.orchestrator.config import OrchestratorConfig
from timeslice.controller.orchestrator.gone_holders import GoneHolders
from timeslice.controller.orchestrator.metrics import start_metrics_server
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.pinned_pool import PinnedPool
from timeslice.controller.orchestrator.service import Authenticator, OrchestratorServicer
from timeslice.controller.orchestrator.state_file import StateFile
from timeslice.driver import grpc_server, signals
from timeslice.driver.bearer import TokenFile
from timeslice.driver.tasks import cancel_and_wait
from timeslice.v1 import orchestrator_pb2 as pb
from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

log = logging.getLogger("timeslice.orchestrator")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Orchestrator"].full_name


async def create_server(orchestrator: Orchestrator, listen: str,
                        authenticator: Authenticator | None = None) -> tuple[grpc.aio.Server, int]:
    """A started server for `orchestrator` on `listen`; returns (server, bound port)."""
    servicer = OrchestratorServicer(orchestrator, authenticator)
    return await grpc_server.start(lambda s: pb_grpc.add_OrchestratorServicer_to_server(servicer, s),
                                   [SERVICE_NAME], listen)


@contextlib.asynccontextmanager
async def running(config: OrchestratorConfig, authenticator: Authenticator | None = None,
                  grace: float = 1.0) -> AsyncIterator[tuple[Orchestrator, int]]:
    """The orchestrator of `config` serving on `config.listen` (and `/metrics` with
    `metrics_listen`), with its watch of gone holders (`GoneHolders`); yields
    (orchestrator, bound port), then stops with `grace` seconds for in-flight calls (short:
    what is in flight at a stop is mostly Acquires blocked in a queue, and clients retry those
    with the same request id against the next orchestrator).
    Used by `serve` and by one-box mode (`timeslice serve`). Raises OSError (listen, a
    certificate file)."""
    pool = PinnedPool(config.pinned_pool.path, config.pinned_pool.bytes, populate=True) if config.pinned_pool else None
    agents = AgentPool(TokenFile(config.agent_token_file) if config.agent_token_file else None)
    agents.set_certificates({t: p.read_text() for t, p in config.agent_certificates.items()})
    orchestrator = Orchestrator(config.groups, agents=agents, pinned_pool=pool, state=StateFile(config.state_file))
    metrics = server = watch = None
    try:
        await orchestrator.adopt_agents()
        if config.metrics_listen:
            metrics, _ = await start_metrics_server(orchestrator.metrics, config.metrics_listen)
        server, port = await create_server(orchestrator, config.listen, authenticator)
        # (its first look before any call: a holder that exited while no server ran is handed on now)
        holders = GoneHolders(orchestrator.groups, orchestrator.agent)
        orchestrator.add_observer(holders.observe)
        watch = asyncio.get_running_loop().create_task(holders.watch(), name="gone-holders")
        log.info("orchestrator serving listen=%s port=%s groups=%d pinned_pool=%s", config.listen, port or "-",
                 len(config.groups), f"{pool.path}({pool.size})" if pool else "-")
        gc.freeze()  # start-up objects live forever: keep them out of every GC pass (shorter pauses)
        yield orchestrator, port
    finally:
        log.info("orchestrator stopping grace=%gs", grace)
        await cancel_and_wait(watch)
        orchestrator.cooperative.keep_pool_if_in_use()  # before the streams close: do processes map the pool?
        if server is not None:
            await server.stop(grace)
        if metrics is not None:
            await metrics.cleanup()
        with contextlib.suppress(Exception):
            await orchestrator.close()


async def serve(config: OrchestratorConfig, grace: float = 1.0) -> None:
    """`timeslice orchestrator`: run until SIGINT/SIGTERM/SIGHUP (`running`); prints
    `ready listen=<host>:<port>` on stdout once it serves (the port it bound: `listen` may
    name port 0), as `serve` and `node-agent` print theirs."""
    stop = signals.stop_event()
    async with running(config, grace=grace) as (_, port):
        host = config.listen.rsplit(":", 1)[0]
        print(f"ready listen={host}:{port}", flush=True)
        await stop.wait()
