"""The node's physical GPUs: `GpuInfo`, found through NVML or declared by a fake profile.

Owned by the kubelet plugin; called once at start-up by its entry point, whose result
feeds ResourceSlice building (`resourceslices.py`) and CDI specs (device node paths).

`discover_gpus(None)` asks NVML (`nvidia-ml-py`) and raises `GpuDiscoveryError` when
the library or the NVIDIA driver is missing. `discover_gpus("4xH200")` returns fake
GPUs for tests and demos on nodes without GPUs (DESIGN.md, "Devices and claims"):
realistic Hopper profiles, uuids `GPU-fake-<node>-<i>` that are stable per node, and
`fake=True`, which the published slices carry as an attribute.

NVML is synchronous; call `discover_gpus` through `asyncio.to_thread` from the loop.
"""

from __future__ import annotations

import hashlib
import logging
import re
import socket
from dataclasses import dataclass
from typing import Any

from timeslice.driver.errors import GpuDiscoveryError
from timeslice.driver.names import install_hint

log = logging.getLogger("timeslice.kubelet_plugin")

# Opened by every CUDA process besides its GPU's /dev/nvidia<minor>.
CONTROL_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")

# Longest string attribute value the API server accepts (DeviceAttributeMaxValueLength).
_MAX_ATTRIBUTE_VALUE = 64

# nvmlDeviceGetArchitecture() codes (nvml.h NVML_DEVICE_ARCH_*), as product family names.
_ARCHITECTURES = {
    2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere", 8: "Ada",
    9: "Hopper", 10: "Blackwell", 13: "Rubin",
}


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU of this node, as published and as passed to containers."""

    index: int                      # NVML index (PCI bus order)
    uuid: str                       # "GPU-..." from NVML; "GPU-fake-<node>-<i>" for fakes
    product_name: str               # e.g. "NVIDIA H200"
    architecture: str               # e.g. "Hopper"
    cuda_compute_capability: str    # "<major>.<minor>", e.g. "9.0"
    driver_version: str             # NVIDIA kernel driver, e.g. "580.159.04"
    memory_bytes: int               # total device memory
    minor: int                      # minor number of /dev/nvidia<minor>
    fake: bool = False

    @property
    def device_node(self) -> str:
        return f"/dev/nvidia{self.minor}"

    @property
    def device_nodes(self) -> tuple[str, ...]:
        """Device nodes a container needs for this GPU: its own node, then the control nodes;
        none for a fake GPU (there is nothing to pass through, and CDI fails on a missing node)."""
        return () if self.fake else (self.device_node, *CONTROL_DEVICE_NODES)


@dataclass(frozen=True)
class FakeProfile:
    """A GPU model for `--fake-gpus <N>x<model>`; the numbers are what NVML reports."""

    product_name: str
    memory_bytes: int
    architecture: str = "Hopper"
    cuda_compute_capability: str = "9.0"
    driver_version: str = "580.159.04"


_MIB = 1 << 20
# H200: measured on the lent H200 host (bench/results/checkpoint-h200.json: "NVIDIA H200,
# 143771 MiB, 580.159.04"). H100: the SXM5 80 GB part as NVML reports it (81559 MiB).
FAKE_PROFILES: dict[str, FakeProfile] = {
    "H200": FakeProfile("NVIDIA H200", 143771 * _MIB),
    "H100": FakeProfile("NVIDIA H100 80GB HBM3", 81559 * _MIB),
}

_FAKE_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*([A-Za-z0-9][A-Za-z0-9-]*)\s*$")


def parse_fake_profile(spec: str) -> tuple[int, FakeProfile]:
    """`"4xH200"` -> (4, FAKE_PROFILES["H200"]); the model is case-insensitive.

    Raises ValueError naming the accepted form or the known models.
    """
    m = _FAKE_SPEC.match(spec)
    if not m:
        raise ValueError(f"fake GPU profile {spec!r}: expected <count>x<model>, e.g. 4xH200 "
                         f"(known models: {', '.join(sorted(FAKE_PROFILES))})")
    count, model = int(m.group(1)), m.group(2).upper()
    if count < 1:
        raise ValueError(f"fake GPU profile {spec!r}: count must be at least 1")
    if model not in FAKE_PROFILES:
        raise ValueError(f"fake GPU profile {spec!r}: unknown model {m.group(2)!r} "
                         f"(known models: {', '.join(sorted(FAKE_PROFILES))})")
    return count, FAKE_PROFILES[model]


def fake_uuid(node: str, index: int) -> str:
    """`GPU-fake-<node>-<i>`, stable per node; long node names are shortened with a hash so
    the uuid stays within the 64 characters of a string attribute."""
    uuid = f"GPU-fake-{node}-{index}"
    if len(uuid) <= _MAX_ATTRIBUTE_VALUE:
        return uuid
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    room = _MAX_ATTRIBUTE_VALUE - len(f"GPU-fake--{digest}-{index}")
    return f"GPU-fake-{node[:room]}-{digest}-{index}"


def fake_gpus(spec: str, node: str) -> list[GpuInfo]:
    """The GPUs of a fake profile `spec` (e.g. "4xH200") on `node`; minor number = index."""
    count, profile = parse_fake_profile(spec)
    return [GpuInfo(index=i, uuid=fake_uuid(node, i), product_name=profile.product_name,
                    architecture=profile.architecture,
                    cuda_compute_capability=profile.cuda_compute_capability,
                    driver_version=profile.driver_version, memory_bytes=profile.memory_bytes,
                    minor=i, fake=True)
            for i in range(count)]


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def nvml_gpus() -> list[GpuInfo]:
    """The node's GPUs from NVML, in NVML index order.

    Raises GpuDiscoveryError when nvidia-ml-py is not installed, NVML cannot start (no
    driver: library not found, driver not loaded) or a query fails.
    """
    try:
        import pynvml
    except ImportError as err:
        raise GpuDiscoveryError(
            "GPU discovery needs NVML: the nvidia-ml-py package is not installed "
            f"({install_hint('gpu')}), or run with --fake-gpus for tests") from err
    nv: Any = pynvml
    try:
        nv.nvmlInit()
    except nv.NVMLError as err:
        raise GpuDiscoveryError(
            f"GPU discovery: NVML did not start ({err}); is the NVIDIA driver installed and "
            "libnvidia-ml.so visible to this process? Use --fake-gpus on nodes without GPUs") from err
    try:
        driver_version = _text(nv.nvmlSystemGetDriverVersion())
        gpus = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            major, minor_cc = nv.nvmlDeviceGetCudaComputeCapability(h)
            arch = nv.nvmlDeviceGetArchitecture(h)
            gpus.append(GpuInfo(
                index=i, uuid=_text(nv.nvmlDeviceGetUUID(h)), product_name=_text(nv.nvmlDeviceGetName(h)),
                architecture=_ARCHITECTURES.get(arch, "Unknown"),
                cuda_compute_capability=f"{major}.{minor_cc}", driver_version=driver_version,
                memory_bytes=int(nv.nvmlDeviceGetMemoryInfo(h).total), minor=int(nv.nvmlDeviceGetMinorNumber(h))))
        return gpus
    except nv.NVMLError as err:
        raise GpuDiscoveryError(f"GPU discovery: an NVML query failed: {err}") from err
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError as err:  # already reported what matters
            log.debug("nvmlShutdown: %s", err)


def discover_gpus(fake: str | None, node: str | None = None) -> list[GpuInfo]:
    """The node's GPUs: from NVML when `fake` is None, else from the fake profile `fake`.

    `node` (default: the host name) only seeds the fake uuids. Raises GpuDiscoveryError
    (NVML path) or ValueError (bad fake profile).
    """
    if fake is None:
        gpus = nvml_gpus()
        log.info("discovered gpus=%d source=nvml %s", len(gpus),
                 " ".join(f"gpu{g.index}={g.uuid}" for g in gpus))
        return gpus
    gpus = fake_gpus(fake, node or socket.gethostname())
    log.info("discovered gpus=%d source=fake profile=%s", len(gpus), fake)
    return gpus
