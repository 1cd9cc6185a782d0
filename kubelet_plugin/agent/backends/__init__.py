"""Checkpoint backends of the node agent, by name (see `base.Backend`).

`make_backend(name)` builds one, raising BackendError when the node lacks what the
backend needs (cuda-bindings and a driver for `cuda`, the binary for
`cuda-checkpoint`). `app` is bound to a job's engine per step (`Backend.bind`).
"""

from __future__ import annotations

from collections.abc import Callable

from timeslice.driver import names
from timeslice.driver.errors import InvalidArgument
from timeslice.kubelet_plugin.agent.backends.base import Backend
from timeslice.kubelet_plugin.agent.gpu_memory import GpuInfo, gpus


def make_backend(name: str, lock_timeout: float = names.DEFAULT_LOCK_TIMEOUT_SECONDS,
                 memory_probe: Callable[[], list[GpuInfo]] = gpus) -> Backend:
    """`memory_probe`: NVML per GPU (`gpu_memory.gpus`), which `app` checks its sleeps with."""
    if name == names.BACKEND_FREEZE:
        from timeslice.kubelet_plugin.agent.backends.freeze import FreezeBackend
        return FreezeBackend()
    if name == names.BACKEND_NONE:
        from timeslice.kubelet_plugin.agent.backends.none import NoneBackend
        return NoneBackend()
    if name == names.BACKEND_APP:
        from timeslice.kubelet_plugin.agent.backends.app import AppBackend
        return AppBackend(memory_probe=memory_probe)
    if name == names.BACKEND_CUDA:
        from timeslice.kubelet_plugin.agent.backends.cuda import CudaBackend
        return CudaBackend(lock_timeout)
    if name == names.BACKEND_VMM:
        from timeslice.kubelet_plugin.agent.backends.vmm import VmmBackend
        return VmmBackend(lock_timeout, memory_probe)
    if name == names.BACKEND_CUDA_CHECKPOINT:
        from timeslice.kubelet_plugin.agent.backends.cuda_checkpoint import CudaCheckpointBackend
        return CudaCheckpointBackend(lock_timeout)
    raise InvalidArgument(f"unknown backend {name!r}; known: {', '.join(names.BACKENDS)}")
