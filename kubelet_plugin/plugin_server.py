"""The kubelet plugin's two gRPC servers: `create_servers` builds and starts them.

Owned by the kubelet plugin; called by the `timeslice kubelet-plugin` composition root
and by tests. The DRA server (socket in the plugin data dir) serves DRAPlugin v1 and
v1beta1 (`dra_service`), DRAResourceHealth when a `HealthSource` is given (`health`),
and `grpc.health.v1`. The registration server (socket in kubelet's registry dir) serves
`pluginregistration.Registration` (`registration`).

Order matters: kubelet calls `GetInfo` as soon as the registration socket appears and
then dials the DRA endpoint, so the DRA server starts first and the registration
server last; `PluginServers.stop` goes the other way and removes both sockets.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc.aio
from grpc_health.v1 import health as grpc_health
from pydantic import BaseModel, ConfigDict, Field
from timeslice.driver import grpc_server, names
from timeslice.driver.kubeletapi.health_v1alpha1 import dra_health_pb2 as hpb
from timeslice.driver.kubeletapi.health_v1alpha1 import dra_health_pb2_grpc as hpb_grpc
from timeslice.driver.kubeletapi.registration import registration_pb2_grpc as rpb_grpc
from timeslice.kubelet_plugin import dra_service, sockets
from timeslice.kubelet_plugin.health import DRAResourceHealthServicer, HealthSource
from timeslice.kubelet_plugin.plugin import ClaimPlugin
from timeslice.kubelet_plugin.registration import RegistrationServicer

log = logging.getLogger("timeslice.kubelet_plugin")

HEALTH_SERVICE = hpb.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name


class PluginServerConfig(BaseModel):
    """Where the sockets go. `plugin_data_dir` None means `/var/lib/kubelet/plugins/<driver>`;
    `health_timeout_seconds` is how long kubelet trusts one health report (0: its default, 30 s)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    driver_name: str = Field(default=names.DRIVER_NAME, min_length=1, max_length=63)
    plugin_data_dir: Path | None = None
    registry_dir: Path = sockets.KUBELET_REGISTRY_DIR
    health_timeout_seconds: int = Field(default=0, ge=0)

    def socket_paths(self) -> sockets.SocketPaths:
        return sockets.socket_paths(self.driver_name, self.plugin_data_dir, self.registry_dir)


@dataclass
class PluginServers:
    """The running servers and what tests and the composition root look at."""

    paths: sockets.SocketPaths
    dra_server: grpc.aio.Server
    registration_server: grpc.aio.Server | None
    registration: RegistrationServicer
    dra: dra_service.DRAService
    health: grpc_health.aio.HealthServicer

    async def stop(self, grace: float | None = None) -> None:
        """Registration first (kubelet deregisters when its socket goes), then DRA; sockets removed."""
        if self.registration_server is not None:
            await self.registration_server.stop(grace)
        sockets.remove_socket(self.paths.registration)
        await self.health.enter_graceful_shutdown()
        await self.dra_server.stop(grace)
        sockets.remove_socket(self.paths.dra)
        log.info("kubelet plugin stopped driver=%s", self.registration.info.name)


async def create_servers(config: PluginServerConfig, plugin: ClaimPlugin,
                         health_source: HealthSource | None = None) -> PluginServers:
    """Started DRA and registration servers for `plugin` (and `health_source`, if any)."""
    paths = config.socket_paths()
    service = dra_service.DRAService(plugin)
    dra = grpc_server.new_server()
    served = dra_service.add_to_server(service, dra)
    if health_source is not None:
        hpb_grpc.add_DRAResourceHealthServicer_to_server(
            DRAResourceHealthServicer(health_source, config.health_timeout_seconds), dra)
        served.append(HEALTH_SERVICE)
    health = await grpc_server.add_health(dra, served)
    registration = RegistrationServicer(config.driver_name, paths.dra, health=health_source is not None)
    servers = PluginServers(paths, dra, None, registration, service, health)
    grpc_server.bind(dra, sockets.prepare_socket(paths.dra))
    await dra.start()
    try:
        reg = grpc_server.new_server()
        rpb_grpc.add_RegistrationServicer_to_server(registration, reg)
        grpc_server.bind(reg, sockets.prepare_socket(paths.registration))
        await reg.start()
        servers.registration_server = reg
    except BaseException:
        with contextlib.suppress(Exception):
            await servers.stop(0)
        raise
    log.info("kubelet plugin serving driver=%s dra=%s registration=%s versions=%s", config.driver_name, paths.dra,
             paths.registration, ",".join(registration.info.supported_versions))
    return servers
