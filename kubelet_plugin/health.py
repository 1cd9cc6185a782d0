"""Device health for kubelet: the `v1alpha1.DRAResourceHealth` servicer and its sources.

Owned by the kubelet plugin; `plugin_server.create_servers` serves it on the DRA socket
when a `HealthSource` is given. Kubelet (gate ResourceHealthStatus) opens one
`NodeWatchResources` stream and shows each device's health in the pod status; a device
not reported again within its timeout (30 s by default) turns Unknown, so sources
report every device every `interval` seconds (reference/dra-protocol.md §1.4).

Device names are not ours to invent: every source takes a `DeviceLister`, a callable
returning the devices as published in the ResourceSlices (the slice publisher owns
the names), each with the UUID of the physical GPU behind it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Literal, Protocol

import grpc.aio
from timeslice.driver.grpc_server import rpc_method
from timeslice.driver.kubeletapi.health_v1alpha1 import dra_health_pb2 as hpb
from timeslice.driver.kubeletapi.health_v1alpha1 import dra_health_pb2_grpc as hpb_grpc

log = logging.getLogger("timeslice.kubelet_plugin.health")

Health = Literal["Healthy", "Unhealthy", "Unknown"]
HEALTHY: Health = "Healthy"
UNHEALTHY: Health = "Unhealthy"
UNKNOWN: Health = "Unknown"
_WIRE = {HEALTHY: hpb.HEALTHY, UNHEALTHY: hpb.UNHEALTHY, UNKNOWN: hpb.UNKNOWN}
MAX_MESSAGE = 1024  # kubelet truncates longer messages
DEFAULT_INTERVAL = 10.0  # seconds between reports; kubelet's default timeout is 30 s
CHECK_TIMEOUT = 2.0  # seconds one GPU's NVML check may take before it is reported Unknown


@dataclass(frozen=True)
class DeviceRef:
    """A published device: its pool and name, and the physical GPU's UUID ("" for a fake GPU)."""

    pool: str
    device: str
    uuid: str = ""


@dataclass(frozen=True)
class DeviceHealth:
    pool: str
    device: str
    health: Health
    message: str = ""


DeviceLister = Callable[[], Iterable[DeviceRef]]


class HealthSource(Protocol):
    def watch(self) -> AsyncIterator[list[DeviceHealth]]:
        """Snapshots of every device's health: the first at once, then one per interval, forever."""
        ...


class StaticHealthSource:
    """Every device Healthy: for fake GPUs (tests, demos)."""

    def __init__(self, devices: DeviceLister, interval: float = DEFAULT_INTERVAL) -> None:
        self._devices = devices
        self.interval = interval

    async def watch(self) -> AsyncIterator[list[DeviceHealth]]:
        while True:
            yield [DeviceHealth(d.pool, d.device, HEALTHY) for d in self._devices()]
            await asyncio.sleep(self.interval)


class NvmlHealthSource:
    """Polls NVML every `interval` s: a GPU is Healthy when its handle (by UUID) answers and
    its memory info is readable, Unhealthy with the NVML error otherwise, and Unknown when
    NVML itself is unavailable (no `pynvml`, no driver) or the device has no UUID.

    `nvml` is the `pynvml` module (imported when None); tests pass a stand-in. NVML calls
    block, so each GPU's check runs in its own worker thread (`watch`), with a deadline of
    `check_timeout` s: a GPU whose check does not answer in time is reported Unknown with a
    message (and not checked again until that call returns), and the others keep reporting.
    """

    def __init__(self, devices: DeviceLister, interval: float = DEFAULT_INTERVAL,
                 nvml: ModuleType | None = None, check_timeout: float = CHECK_TIMEOUT) -> None:
        self._devices = devices
        self.interval = interval
        self._nvml = nvml
        self._initialized = False
        self.check_timeout = check_timeout
        self._checks: dict[str, asyncio.Future[tuple[Health, str]]] = {}  # GPU uuid -> its check in flight

    def _init(self) -> str | None:
        """Load and initialize NVML once; returns why it is unavailable, or None."""
        if self._initialized:
            return None
        try:
            if self._nvml is None:
                import pynvml
                self._nvml = pynvml
            self._nvml.nvmlInit()
        except Exception as err:  # ImportError, NVMLError (no driver, no library)
            return f"NVML unavailable: {type(err).__name__}: {err}"
        self._initialized = True
        return None

    def _check(self, uuid: str) -> tuple[Health, str]:
        nv = self._nvml
        assert nv is not None
        try:
            nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByUUID(uuid))
        except Exception as err:
            return UNHEALTHY, f"NVML cannot read GPU {uuid}: {type(err).__name__}: {err}"
        return HEALTHY, ""

    def poll(self) -> list[DeviceHealth]:
        """One snapshot (blocking: every GPU checked in turn, no deadline)."""
        devices = list(self._devices())
        down = self._init()
        if down:
            return [DeviceHealth(d.pool, d.device, UNKNOWN, down) for d in devices]
        return self._report(devices, {uuid: self._check(uuid) for uuid in {d.uuid for d in devices if d.uuid}})

    async def snapshot(self) -> list[DeviceHealth]:
        """One snapshot, each GPU checked in its own thread within `check_timeout` s."""
        devices = list(self._devices())
        down = await asyncio.to_thread(self._init)
        if down:
            return [DeviceHealth(d.pool, d.device, UNKNOWN, down) for d in devices]
        uuids = {d.uuid for d in devices if d.uuid}
        for uuid in uuids - set(self._checks):
            self._checks[uuid] = asyncio.ensure_future(asyncio.to_thread(self._check, uuid))
        await asyncio.wait([self._checks[u] for u in uuids], timeout=self.check_timeout)
        per_gpu: dict[str, tuple[Health, str]] = {}
        for uuid in uuids:
            check = self._checks[uuid]
            if check.done():
                per_gpu[uuid] = check.result()
                del self._checks[uuid]
            else:
                per_gpu[uuid] = (UNKNOWN, f"NVML has not answered for GPU {uuid} within {self.check_timeout:g} s")
        return self._report(devices, per_gpu)

    @staticmethod
    def _report(devices: list[DeviceRef], per_gpu: dict[str, tuple[Health, str]]) -> list[DeviceHealth]:
        return [DeviceHealth(d.pool, d.device, *per_gpu[d.uuid]) if d.uuid
                else DeviceHealth(d.pool, d.device, UNKNOWN, "no GPU UUID for this device") for d in devices]

    async def watch(self) -> AsyncIterator[list[DeviceHealth]]:
        while True:
            yield await self.snapshot()
            await asyncio.sleep(self.interval)


def to_response(snapshot: Iterable[DeviceHealth], timeout_seconds: int = 0,
                now: float | None = None) -> hpb.NodeWatchResourcesResponse:
    stamp = int(time.time() if now is None else now)
    return hpb.NodeWatchResourcesResponse(devices=[
        hpb.DeviceHealth(device=hpb.DeviceIdentifier(pool_name=d.pool, device_name=d.device), health=_WIRE[d.health],
                         last_updated_time=stamp, health_check_timeout_seconds=timeout_seconds,
                         message=d.message[:MAX_MESSAGE])
        for d in snapshot])


class DRAResourceHealthServicer(hpb_grpc.DRAResourceHealthServicer):
    """Streams `source` to each `NodeWatchResources` caller until it hangs up.

    `timeout_seconds` tells kubelet how long a report holds (0: kubelet's default, 30 s);
    keep it above the source's interval.
    """

    def __init__(self, source: HealthSource, timeout_seconds: int = 0) -> None:
        self._source = source
        self._timeout = timeout_seconds

    @rpc_method
    async def NodeWatchResources(self, request: hpb.NodeWatchResourcesRequest,
                                 context: grpc.aio.ServicerContext) -> None:
        log.info("kubelet watches device health")
        snapshots = self._source.watch()
        last: dict[tuple[str, str], Health] = {}
        try:
            async for snapshot in snapshots:
                for d in snapshot:
                    if last.get((d.pool, d.device), HEALTHY) != d.health:
                        log.log(logging.INFO if d.health == HEALTHY else logging.WARNING,
                                "device health changed pool=%s device=%s health=%s message=%r", d.pool, d.device,
                                d.health, d.message)
                last = {(d.pool, d.device): d.health for d in snapshot}
                await context.write(to_response(snapshot, self._timeout))
        except Exception as err:
            log.exception("health source failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"health source failed: {type(err).__name__}: {err}")
        finally:
            aclose = getattr(snapshots, "aclose", None)
            if aclose is not None:
                await aclose()
            log.info("device health stream ended")
