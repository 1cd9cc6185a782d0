"""`timeslice controller`: cluster state -> lock groups -> the orchestrator, serving clients.

Owned by the controller package; started by the CLI. One asyncio loop runs
`ClusterState` (claims, pods, slices from the API server), the `Reconciler` (groups into
the orchestrator), the orchestrator's gRPC server and the `ClaimStatusWriter`.
Not yet here: leader election between replicas, and client authentication with
TokenReview (see the README's Status).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from kubernetes.aio import client as k8s
from kubernetes.aio import config as k8s_config
from pydantic import BaseModel, ConfigDict
from timeslice.controller.claim_status import ClaimStatusWriter
from timeslice.controller.cluster_state import ClusterState
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.server import create_server
from timeslice.controller.reconciler import Reconciler
from timeslice.driver import names
from timeslice.driver.events import EventRecorder

log = logging.getLogger("timeslice.controller")


class ControllerConfig(BaseModel):
    """`agent_template`: a node's agent address, `{node}` replaced by the node name;
    `default_backend` stands for a group's `auto` backend."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    listen: str = "0.0.0.0:50051"
    agent_template: str = "{node}:50052"
    default_backend: str = "cuda"


async def run(cfg: ControllerConfig, stop: asyncio.Event | None = None) -> None:
    try:
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException:
        await k8s_config.load_kube_config()
    api = k8s.ApiClient()
    resource_api = k8s.ResourceV1Api(api)
    events = EventRecorder(k8s.CoreV1Api(api), f"{names.DRIVER_NAME}/controller")
    reconciler: Reconciler | None = None
    writer = ClaimStatusWriter(resource_api, events, lambda: reconciler.snapshot if reconciler else None)
    orchestrator = Orchestrator(observer=writer.observe)
    reconciler = Reconciler(orchestrator, cfg.agent_template, cfg.default_backend)
    state = ClusterState(api, reconciler.apply)
    server, port = await create_server(orchestrator, cfg.listen)
    writer.start()
    state.start()
    log.info("controller serving listen=%s port=%d agent_template=%s default_backend=%s", cfg.listen, port,
             cfg.agent_template, cfg.default_backend)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop(2)
        await state.stop()
        await writer.stop()
        with contextlib.suppress(Exception):
            await orchestrator.close()
        await api.close()
