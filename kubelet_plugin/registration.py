"""Kubelet plugin registration: the `pluginregistration.Registration` servicer.

Owned by the kubelet plugin; `plugin_server.create_servers` serves it on the socket in
the kubelet's registry directory. Kubelet finds that socket (fsnotify), calls `GetInfo`
(1 s timeout) to learn the driver name, the DRA socket and the services we serve, then
reports the outcome with `NotifyRegistrationStatus` (reference/dra-protocol.md §2).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc.aio
from google.protobuf.descriptor import ServiceDescriptor
from timeslice.driver.grpc_server import rpc_method
from timeslice.driver.kubeletapi.dra_v1 import dra_pb2 as v1
from timeslice.driver.kubeletapi.dra_v1beta1 import dra_pb2 as v1beta1
from timeslice.driver.kubeletapi.health_v1alpha1 import dra_health_pb2 as hpb
from timeslice.driver.kubeletapi.registration import registration_pb2 as rpb
from timeslice.driver.kubeletapi.registration import registration_pb2_grpc as rpb_grpc

log = logging.getLogger("timeslice.kubelet_plugin.registration")

PLUGIN_TYPE = "DRAPlugin"


def service_version(service: ServiceDescriptor) -> str:
    """The name kubelet expects in `supported_versions`: `<last package element>.<service>`."""
    return f"{service.file.package.rsplit('.', 1)[-1]}.{service.name}"


DRA_V1 = service_version(v1.DESCRIPTOR.services_by_name["DRAPlugin"])  # "v1.DRAPlugin"
DRA_V1BETA1 = service_version(v1beta1.DESCRIPTOR.services_by_name["DRAPlugin"])  # "v1beta1.DRAPlugin"
HEALTH_V1ALPHA1 = service_version(hpb.DESCRIPTOR.services_by_name["DRAResourceHealth"])  # "v1alpha1.DRAResourceHealth"


def supported_versions(health: bool) -> list[str]:
    """Services we serve, preferred first (kubelet takes the first it supports)."""
    return [DRA_V1, DRA_V1BETA1, *([HEALTH_V1ALPHA1] if health else [])]


class RegistrationServicer(rpb_grpc.RegistrationServicer):
    """Answers `GetInfo` for one driver and records what kubelet reports.

    `registered` is set while kubelet reports success and cleared when it reports a
    failure; `last_error` holds kubelet's last error message (None after a success).
    """

    def __init__(self, driver_name: str, endpoint: str | Path, *, health: bool = False) -> None:
        if not Path(endpoint).is_absolute():
            raise ValueError(f"DRA endpoint must be an absolute socket path, got {str(endpoint)!r}")
        self.info = rpb.PluginInfo(type=PLUGIN_TYPE, name=driver_name, endpoint=str(endpoint),
                                   supported_versions=supported_versions(health))
        self.registered = asyncio.Event()
        self.last_error: str | None = None

    @rpc_method
    async def GetInfo(self, request: rpb.InfoRequest, context: grpc.aio.ServicerContext) -> rpb.PluginInfo:
        log.debug("kubelet asked for plugin info driver=%s", self.info.name)
        return self.info

    @rpc_method
    async def NotifyRegistrationStatus(self, request: rpb.RegistrationStatus,
                                       context: grpc.aio.ServicerContext) -> rpb.RegistrationStatusResponse:
        if request.plugin_registered:
            self.last_error = None
            self.registered.set()
            log.info("registered with kubelet driver=%s endpoint=%s versions=%s", self.info.name,
                     self.info.endpoint, ",".join(self.info.supported_versions))
        else:
            self.last_error = request.error or "kubelet gave no reason"
            self.registered.clear()
            log.error("kubelet refused the registration driver=%s endpoint=%s error=%s", self.info.name,
                      self.info.endpoint, self.last_error)
        return rpb.RegistrationStatusResponse()
