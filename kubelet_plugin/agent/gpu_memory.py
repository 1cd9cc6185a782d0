"""GPU memory per GPU and per process, from NVML (`nvidia-ml-py`).

Owned by the node agent; used to report the bytes a checkpoint moves and the memory
report (`GetMemory`) that residency decisions rest on. Tests replace NVML with a model
GPU (`model_gpu.py`, selected by `$TIMESLICE_MODEL_GPU`). NVML lists only processes with
a live CUDA context: a checkpointed process is absent (reference/checkpoint-h200.md),
so the agent records the size at checkpoint time.
"""

from __future__ import annotations

import logging
import threading

from timeslice.kubelet_plugin.agent import model_gpu
from timeslice.kubelet_plugin.agent.gpu_info import GpuInfo

__all__ = ["GpuInfo", "gpus", "process_gpu_bytes", "process_gpus"]

log = logging.getLogger("timeslice.agent")
_lock = threading.Lock()
_nvml_ok: bool | None = None


def _nvml() -> object | None:
    global _nvml_ok
    try:
        import pynvml
    except ImportError:
        return None
    with _lock:
        if _nvml_ok is None:
            try:
                pynvml.nvmlInit()
                _nvml_ok = True
            except pynvml.NVMLError as err:
                log.info("NVML unavailable: %s", err)
                _nvml_ok = False
    return pynvml if _nvml_ok else None


def process_gpu_bytes() -> dict[int, int]:
    """{pid: bytes of GPU memory in use} over all GPUs; empty without NVML."""
    sizes: dict[int, int] = {}
    for gpu in gpus():
        for pid, n in gpu.processes.items():
            sizes[pid] = sizes.get(pid, 0) + n
    return sizes


def process_gpus() -> dict[int, set[int]]:
    """{pid: NVML indices of the GPUs it has a CUDA context on}; empty without NVML."""
    out: dict[int, set[int]] = {}
    for gpu in gpus():
        for pid in gpu.processes:
            out.setdefault(pid, set()).add(gpu.index)
    return out


def gpus() -> list[GpuInfo]:
    """Every GPU of the node; empty without NVML. With `$TIMESLICE_MODEL_GPU` (tests only),
    the one model GPU of that ledger instead (`model_gpu.py`)."""
    model = model_gpu.from_env()
    if model is not None:
        return [model.read()]
    nv = _nvml()
    if nv is None:
        return []
    out = []
    for i in range(nv.nvmlDeviceGetCount()):  # type: ignore[attr-defined]
        handle = nv.nvmlDeviceGetHandleByIndex(i)  # type: ignore[attr-defined]
        mem = nv.nvmlDeviceGetMemoryInfo(handle)  # type: ignore[attr-defined]
        uuid = nv.nvmlDeviceGetUUID(handle)  # type: ignore[attr-defined]
        procs: dict[int, int] = {}
        for p in nv.nvmlDeviceGetComputeRunningProcesses(handle):  # type: ignore[attr-defined]
            procs[p.pid] = procs.get(p.pid, 0) + int(p.usedGpuMemory or 0)
        out.append(GpuInfo(uuid if isinstance(uuid, str) else uuid.decode(), i, int(mem.total), int(mem.free), procs))
    return out
