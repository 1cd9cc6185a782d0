"""Device health: the NodeWatchResources stream over the DRA socket, and the NVML source.

NVML is a seam: `FakeNvml` stands in for the `pynvml` module (handles by UUID, memory
info, errors) so the Healthy / Unhealthy / Unknown rules run without a GPU.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import grpc
import grpc.aio
import pytest
from timeslice.driver.kubeletapi.health_v1alpha1 import dra_health_pb2 as hpb
from timeslice.driver.kubeletapi.health_v1alpha1 import dra_health_pb2_grpc as hpb_grpc
from timeslice.kubelet_plugin.health import (
    DeviceHealth,
    DeviceRef,
    NvmlHealthSource,
    StaticHealthSource,
)

SEATS = [DeviceRef("node-a", "gpu-0-seat-0", "GPU-aaa"), DeviceRef("node-a", "gpu-1-seat-0", "GPU-bbb"),
         DeviceRef("node-a", "gpu-0-seat-1", "GPU-aaa")]


class NVMLError(Exception):
    pass


class FakeNvml(SimpleNamespace):
    """The three pynvml calls the source makes; `lost` UUIDs fail, `init_error` fails nvmlInit."""

    def __init__(self, lost: set[str] = frozenset(), init_error: str | None = None) -> None:
        super().__init__(lost=set(lost), init_error=init_error, inits=0, queried=[])

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.init_error:
            raise NVMLError(self.init_error)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.queried.append(uuid)
        if uuid in self.lost:
            raise NVMLError("GPU is lost")
        return uuid

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> object:
        return SimpleNamespace(total=141 << 30, used=0, free=141 << 30)


def by_device(snapshot: list[DeviceHealth]) -> dict[str, tuple[str, str]]:
    return {d.device: (d.health, d.message) for d in snapshot}


def test_nvml_source_marks_a_gpu_that_does_not_answer_unhealthy() -> None:
    nvml = FakeNvml(lost={"GPU-bbb"})
    source = NvmlHealthSource(lambda: [*SEATS, DeviceRef("node-a", "fake-0")], nvml=nvml)  # type: ignore[arg-type]
    assert by_device(source.poll()) == {
        "gpu-0-seat-0": ("Healthy", ""),
        "gpu-0-seat-1": ("Healthy", ""),
        "gpu-1-seat-0": ("Unhealthy", "NVML cannot read GPU GPU-bbb: NVMLError: GPU is lost"),
        "fake-0": ("Unknown", "no GPU UUID for this device"),
    }
    assert sorted(nvml.queried) == ["GPU-aaa", "GPU-bbb"]  # once per physical GPU, not per seat
    nvml.lost.clear()
    assert {h for h, _ in by_device(source.poll()).values()} == {"Healthy", "Unknown"}
    assert nvml.inits == 1


def test_without_nvml_every_device_is_unknown_until_it_comes_up() -> None:
    nvml = FakeNvml(init_error="Driver Not Loaded")
    source = NvmlHealthSource(lambda: SEATS, nvml=nvml)  # type: ignore[arg-type]
    snapshot = source.poll()
    assert {(d.health, d.message) for d in snapshot} == {
        ("Unknown", "NVML unavailable: NVMLError: Driver Not Loaded")}
    nvml.init_error = None  # the driver loads later: the next poll sees the GPUs
    assert {d.health for d in source.poll()} == {"Healthy"}


def test_real_pynvml_gives_an_answer_for_every_device() -> None:
    pytest.importorskip("pynvml")
    snapshot = NvmlHealthSource(lambda: SEATS[:1]).poll()
    # no GPU here: Unknown (NVML unavailable); on a GPU node: Unhealthy (this UUID is not there)
    assert [(d.device, d.health in ("Unknown", "Unhealthy"), bool(d.message)) for d in snapshot] == [
        ("gpu-0-seat-0", True, True)]


@pytest.mark.gpu
def test_a_real_gpu_is_healthy_and_a_missing_one_unhealthy() -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    except pynvml.NVMLError as err:
        pytest.skip(f"no NVIDIA GPU: {err}")
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    gone = "GPU-00000000-0000-0000-0000-000000000000"
    devices = [DeviceRef("node-a", "gpu-0-seat-0", uuid), DeviceRef("node-a", "gpu-0-seat-1", uuid),
               DeviceRef("node-a", "gone", gone)]
    assert [(d.health, d.message.split(":")[0]) for d in NvmlHealthSource(lambda: devices).poll()] == [
        ("Healthy", ""), ("Healthy", ""), ("Unhealthy", f"NVML cannot read GPU {gone}")]


async def watch(served, n: int) -> list[hpb.NodeWatchResourcesResponse]:
    """Read `n` responses like kubelet, then hang up."""
    call = hpb_grpc.DRAResourceHealthStub(served.dra).NodeWatchResources(hpb.NodeWatchResourcesRequest(), timeout=5)
    out = []
    async for r in call:
        out.append(r)
        if len(out) == n:
            call.cancel()
            break
    return out


async def test_the_stream_delivers_snapshots_of_every_device(serve_plugin) -> None:
    devices = [DeviceRef("node-a", "gpu-0-seat-0")]
    served = await serve_plugin(health_source=StaticHealthSource(lambda: list(devices), interval=0.01),
                                health_timeout_seconds=45)
    t0 = int(time.time())
    first, *_ = await watch(served, 1)
    [d] = first.devices
    assert (d.device.pool_name, d.device.device_name, d.health) == ("node-a", "gpu-0-seat-0", hpb.HEALTHY)
    assert d.health_check_timeout_seconds == 45 and t0 <= d.last_updated_time <= time.time()
    devices.append(DeviceRef("node-a", "gpu-0-seat-1"))  # the publisher's list is read at every report
    later = await watch(served, 2)
    assert [len(r.devices) for r in later] == [2, 2]


async def test_the_stream_carries_unhealthy_devices_with_a_bounded_message(serve_plugin, caplog) -> None:
    class Broken:
        async def watch(self):
            yield [DeviceHealth("node-a", "gpu-0-seat-0", "Unhealthy", "x" * 5000),
                   DeviceHealth("node-a", "gpu-1-seat-0", "Unknown")]

    served = await serve_plugin(health_source=Broken())
    [r] = await watch(served, 1)
    assert [(d.health, len(d.message)) for d in r.devices] == [(hpb.UNHEALTHY, 1024), (hpb.UNKNOWN, 0)]
    assert "device health changed pool=node-a device=gpu-0-seat-0 health=Unhealthy" in caplog.text


async def test_a_failing_source_ends_the_stream_with_internal(serve_plugin) -> None:
    class Failing:
        async def watch(self):
            yield [DeviceHealth("node-a", "gpu-0-seat-0", "Healthy")]
            raise RuntimeError("NVML thread died")

    served = await serve_plugin(health_source=Failing())
    call = hpb_grpc.DRAResourceHealthStub(served.dra).NodeWatchResources(hpb.NodeWatchResourcesRequest(), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details() == "health source failed: RuntimeError: NVML thread died"


async def test_a_gpu_whose_nvml_call_hangs_is_unknown_and_the_others_keep_reporting() -> None:
    """Issue 12, item 4: one NVML call blocking stopped every GPU's health report (7 s seen)
    and the hung GPU was never reported. Now each GPU is checked in its own thread with a
    deadline; the hung one is Unknown (not checked again until its call returns)."""
    release = threading.Event()

    class HangingNvml(FakeNvml):
        def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
            if uuid == "GPU-bbb":
                self.queried.append(uuid)
                release.wait(30)  # a hung driver call
                return uuid
            return super().nvmlDeviceGetHandleByUUID(uuid)

    nvml = HangingNvml()
    source = NvmlHealthSource(lambda: SEATS, nvml=nvml, check_timeout=0.2)  # type: ignore[arg-type]
    try:
        for _ in range(2):
            snap = by_device(await source.snapshot())
            assert snap["gpu-0-seat-0"] == ("Healthy", "") and snap["gpu-0-seat-1"] == ("Healthy", "")
            assert snap["gpu-1-seat-0"] == ("Unknown", "NVML has not answered for GPU GPU-bbb within 0.2 s")
        assert nvml.queried.count("GPU-bbb") == 1  # the hung call was not piled up
    finally:
        release.set()
    await asyncio.wait_for(source._checks["GPU-bbb"], 10)
    assert {h for h, _ in by_device(await source.snapshot()).values()} == {"Healthy"}
