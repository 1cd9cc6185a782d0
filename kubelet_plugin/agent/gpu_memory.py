"""GPU memory per process, from NVML (`nvidia-ml-py`).

Owned by the node agent; used to report the bytes a checkpoint moves. NVML lists
only processes with a live CUDA context: a checkpointed process is absent
(reference/checkpoint-h200.md), so the agent records the size at checkpoint time.
"""

from __future__ import annotations

import logging
import threading

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
    nv = _nvml()
    if nv is None:
        return {}
    sizes: dict[int, int] = {}
    for i in range(nv.nvmlDeviceGetCount()):  # type: ignore[attr-defined]
        handle = nv.nvmlDeviceGetHandleByIndex(i)  # type: ignore[attr-defined]
        for p in nv.nvmlDeviceGetComputeRunningProcesses(handle):  # type: ignore[attr-defined]
            sizes[p.pid] = sizes.get(p.pid, 0) + int(p.usedGpuMemory or 0)
    return sizes
