"""Orchestrator gRPC server: `create_server` builds it, `serve` runs it (and, with
`metrics_listen`, the Prometheus `/metrics` endpoint) until a signal.

Owned by the orchestrator; called by `timeslice orchestrator`, the demo and tests.
"""

from __future__ import annotations

import contextlib
import gc
import logging

import grpc.aio
from timeslice.controller.orchestrator.config import OrchestratorConfig
from timeslice.controller.orchestrator.metrics import start_metrics_server
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.pinned_pool import PinnedPool
from timeslice.controller.orchestrator.service import Authenticator, OrchestratorServicer
from timeslice.controller.orchestrator.state_file import StateFile
from timeslice.driver import grpc_server, signals
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


async def serve(config: OrchestratorConfig, grace: float = 1.0) -> None:
    """Run until SIGINT/SIGTERM, then stop with `grace` seconds for in-flight calls (short:
    what is in flight at a stop is mostly Acquires blocked in a queue, and clients retry
    those with the same request id against the next orchestrator)."""
    pool = PinnedPool(config.pinned_pool.path, config.pinned_pool.bytes, populate=True) if config.pinned_pool else None
    orchestrator = Orchestrator(config.groups, pinned_pool=pool, state=StateFile(config.state_file))
    await orchestrator.adopt_agents()
    metrics = None
    if config.metrics_listen:
        metrics, _ = await start_metrics_server(orchestrator.metrics, config.metrics_listen)
    try:
        server, port = await create_server(orchestrator, config.listen)
    except BaseException:
        if metrics is not None:
            await metrics.cleanup()
        raise
    log.info("orchestrator serving listen=%s port=%s groups=%d", config.listen, port or "-", len(config.groups))
    gc.freeze()  # start-up objects live forever: keep them out of every GC pass (shorter pauses)
    stop = signals.stop_event()
    try:
        await stop.wait()
    finally:
        log.info("orchestrator stopping grace=%gs", grace)
        await server.stop(grace)
        if metrics is not None:
            await metrics.cleanup()
        with contextlib.suppress(Exception):
            await orchestrator.close()
