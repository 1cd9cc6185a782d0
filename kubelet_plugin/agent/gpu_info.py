"""GpuInfo: what the node agent knows of one GPU's memory (NVML, or the tests' model GPU).

Its own module so that the memory source (`gpu_memory.py`) and the model GPU that stands
in for NVML in tests (`model_gpu.py`) both use it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GpuInfo"]


@dataclass(frozen=True)
class GpuInfo:
    """One GPU: NVML uuid and index, total and free bytes (`nvmlDeviceGetMemoryInfo`), and
    bytes used by each process with a CUDA context on it (`nvmlDeviceGetComputeRunningProcesses`)."""

    uuid: str
    index: int
    total: int
    free: int
    processes: dict[int, int] = field(default_factory=dict)
