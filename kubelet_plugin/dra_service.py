"""The gRPC adapter of the kubelet's DRA calls: DRAPlugin v1 and v1beta1 over one `ClaimPlugin`.

Owned by the kubelet plugin; `plugin_server.create_servers` registers both servicers on
the DRA socket. This module owns everything gRPC-shaped about
`NodePrepareResources` / `NodeUnprepareResources` (reference/dra-protocol.md §1):

- request validation: an empty claim list, or a claim without namespace, uid or name,
  is INVALID_ARGUMENT (a gRPC error: kubelet ignores the whole response);
- conversion of both API versions to the same domain objects (`plugin.py`); v1beta1
  has no `Device.share_id`, so a share id is dropped there;
- the plugin contract (`ClaimPlugin`): one answer per requested claim UID, a missing
  one filled with an error, unknown UIDs dropped (kubelet fails a call that answers for
  a claim it did not ask about), an exception turned into a per-claim error for every
  claim of the call, subrequest names reduced to their request;
- request logs (`claim=` lines). Calls run at once (kubelet prepares the claims of
  different pods in parallel): the plugin locks what it shares.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import grpc.aio
from timeslice.driver.errors import InvalidArgument
from timeslice.driver.grpc_server import rpc_method
from timeslice.driver.kubeletapi.dra_v1 import dra_pb2 as v1
from timeslice.driver.kubeletapi.dra_v1 import dra_pb2_grpc as v1_grpc
from timeslice.driver.kubeletapi.dra_v1beta1 import dra_pb2 as v1beta1
from timeslice.driver.kubeletapi.dra_v1beta1 import dra_pb2_grpc as v1beta1_grpc
from timeslice.kubelet_plugin.plugin import ClaimPlugin, ClaimRef, PreparedDevice, PrepareResult

log = logging.getLogger("timeslice.kubelet_plugin.dra")

# gRPC service names, for the health service and logs.
V1_SERVICE = v1.DESCRIPTOR.services_by_name["DRAPlugin"].full_name
V1BETA1_SERVICE = v1beta1.DESCRIPTOR.services_by_name["DRAPlugin"].full_name


def claims_from_request(claims: Iterable[Any]) -> list[ClaimRef]:
    """Validated `ClaimRef`s of a request's `claims` (either version), first of each UID kept.

    Raises `InvalidArgument` for an empty list or a claim missing a field.
    """
    refs: dict[str, ClaimRef] = {}
    for i, c in enumerate(claims):
        missing = [f for f in ("namespace", "uid", "name") if not getattr(c, f)]
        if missing:
            raise InvalidArgument(f"claims[{i}] ({c.namespace}/{c.name} uid={c.uid!r}) has no {', '.join(missing)}")
        refs.setdefault(c.uid, ClaimRef(c.namespace, c.uid, c.name))
    if not refs:
        raise InvalidArgument("claims is empty: name at least one claim")
    return list(refs.values())


def _base_requests(names: Iterable[str]) -> list[str]:
    """`req/sub` -> `req` (kubelet matches containers by request), duplicates removed, order kept."""
    return list(dict.fromkeys(n.split("/", 1)[0] for n in names))


def _checked(result: PrepareResult) -> PrepareResult:
    if result.error:
        return PrepareResult(error=result.error)
    for d in result.devices:
        if not d.pool_name or not d.device_name:
            return PrepareResult(error=f"the plugin returned a device without pool or device name: {d}")
    return PrepareResult([PreparedDevice(_base_requests(d.request_names), d.pool_name, d.device_name,
                                         list(d.cdi_device_ids), d.share_id) for d in result.devices])


class DRAService:
    """Calls the `ClaimPlugin` and enforces its contract (module docstring). Both version
    servicers share one `DRAService`."""

    def __init__(self, plugin: ClaimPlugin) -> None:
        self.plugin = plugin

    async def prepare(self, claims: list[ClaimRef], api: str = "v1") -> dict[str, PrepareResult]:
        """{uid: result} for exactly the UIDs of `claims`; never raises for a plugin failure."""
        t0 = time.monotonic()
        try:
            raw: dict[str, PrepareResult] = dict(await self.plugin.prepare(list(claims)))
        except Exception as err:
            log.exception("prepare failed in the plugin api=%s claims=%s", api, _names(claims))
            raw = {c.uid: PrepareResult(error=f"prepare failed: {type(err).__name__}: {err}") for c in claims}
        results = {c.uid: _checked(raw.pop(c.uid, None) or PrepareResult(
            error="prepare: the plugin returned no result for this claim")) for c in claims}
        if raw:
            log.warning("prepare api=%s: dropped results for claims not asked for uids=%s", api, sorted(raw))
        for c in claims:
            r = results[c.uid]
            if r.error:
                log.warning("prepare failed api=%s claim=%s uid=%s error=%s", api, c, c.uid, r.error)
            else:
                log.info("prepared api=%s claim=%s uid=%s devices=%s", api, c, c.uid,
                         ",".join(f"{d.pool_name}/{d.device_name}" for d in r.devices) or "-")
        log.debug("prepare api=%s claims=%d seconds=%.4f", api, len(claims), time.monotonic() - t0)
        return results

    async def unprepare(self, claims: list[ClaimRef], api: str = "v1") -> dict[str, str | None]:
        """{uid: error or None} for exactly the UIDs of `claims`; never raises for a plugin failure."""
        try:
            raw: dict[str, str | None] = dict(await self.plugin.unprepare(list(claims)))
        except Exception as err:
            log.exception("unprepare failed in the plugin api=%s claims=%s", api, _names(claims))
            raw = {c.uid: f"unprepare failed: {type(err).__name__}: {err}" for c in claims}
        missing = "unprepare: the plugin returned no result for this claim"
        results = {c.uid: raw.pop(c.uid) if c.uid in raw else missing for c in claims}
        if raw:
            log.warning("unprepare api=%s: dropped results for claims not asked for uids=%s", api, sorted(raw))
        for c in claims:
            if results[c.uid]:
                log.warning("unprepare failed api=%s claim=%s uid=%s error=%s", api, c, c.uid, results[c.uid])
            else:
                log.info("unprepared api=%s claim=%s uid=%s", api, c, c.uid)
        return results


def _names(claims: Iterable[ClaimRef]) -> str:
    return ",".join(f"{c}({c.uid})" for c in claims)


class DRAPluginV1Servicer(v1_grpc.DRAPluginServicer):
    """`k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin` on a `DRAService`."""

    def __init__(self, service: DRAService) -> None:
        self._service = service

    @rpc_method
    async def NodePrepareResources(self, request: v1.NodePrepareResourcesRequest,
                                   context: grpc.aio.ServicerContext) -> v1.NodePrepareResourcesResponse:
        results = await self._service.prepare(claims_from_request(request.claims), "v1")
        return v1.NodePrepareResourcesResponse(claims={
            uid: v1.NodePrepareResourceResponse(
                devices=[v1.Device(request_names=d.request_names, pool_name=d.pool_name, device_name=d.device_name,
                                   cdi_device_ids=d.cdi_device_ids, share_id=d.share_id) for d in r.devices],
                error=r.error or "")
            for uid, r in results.items()})

    @rpc_method
    async def NodeUnprepareResources(self, request: v1.NodeUnprepareResourcesRequest,
                                     context: grpc.aio.ServicerContext) -> v1.NodeUnprepareResourcesResponse:
        results = await self._service.unprepare(claims_from_request(request.claims), "v1")
        return v1.NodeUnprepareResourcesResponse(claims={
            uid: v1.NodeUnprepareResourceResponse(error=err or "") for uid, err in results.items()})


class DRAPluginV1beta1Servicer(v1beta1_grpc.DRAPluginServicer):
    """`k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin` on a `DRAService` (no share ids)."""

    def __init__(self, service: DRAService) -> None:
        self._service = service

    @rpc_method
    async def NodePrepareResources(self, request: v1beta1.NodePrepareResourcesRequest,
                                   context: grpc.aio.ServicerContext) -> v1beta1.NodePrepareResourcesResponse:
        results = await self._service.prepare(claims_from_request(request.claims), "v1beta1")
        return v1beta1.NodePrepareResourcesResponse(claims={
            uid: v1beta1.NodePrepareResourceResponse(
                devices=[v1beta1.Device(request_names=d.request_names, pool_name=d.pool_name,
                                        device_name=d.device_name, cdi_device_ids=d.cdi_device_ids)
                         for d in r.devices],
                error=r.error or "")
            for uid, r in results.items()})

    @rpc_method
    async def NodeUnprepareResources(self, request: v1beta1.NodeUnprepareResourcesRequest,
                                     context: grpc.aio.ServicerContext) -> v1beta1.NodeUnprepareResourcesResponse:
        results = await self._service.unprepare(claims_from_request(request.claims), "v1beta1")
        return v1beta1.NodeUnprepareResourcesResponse(claims={
            uid: v1beta1.NodeUnprepareResourceResponse(error=err or "") for uid, err in results.items()})


def add_to_server(service: DRAService, server: grpc.aio.Server) -> list[str]:
    """Register both versions of `DRAPlugin` on `server`; returns their gRPC service names."""
    v1_grpc.add_DRAPluginServicer_to_server(DRAPluginV1Servicer(service), server)
    v1beta1_grpc.add_DRAPluginServicer_to_server(DRAPluginV1beta1Servicer(service), server)
    return [V1_SERVICE, V1BETA1_SERVICE]
