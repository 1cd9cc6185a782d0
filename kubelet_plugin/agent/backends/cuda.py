"""Backend `cuda`: the CUDA driver checkpoint API through `cuda-bindings`.

Calls `cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock,GetState}` (CUDA Driver API,
group CUDA_CHECKPOINT; CUDA >= 12.8, driver >= 570) on another process by PID. The
agent must run as root (or as the target's user). Calls block for seconds (~1.5 GB/s
out, ~4 GB/s in on an H200: reference/checkpoint-h200.md), so each runs in a worker
thread. The lock waits for the target's queued GPU work up to `lock_timeout`; on
CUDA_ERROR_NOT_READY the process stays RUNNING and the step fails with StepTimeout.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from timeslice.driver.errors import (
    BackendError,
    FailedPrecondition,
    StepTimeout,
    TimeSliceServerError,
)
from timeslice.kubelet_plugin.agent.backends.base import CHECKPOINTED, FAILED, LOCKED, RUNNING
from timeslice.kubelet_plugin.agent.backends.cuda_style import CudaStyleBackend
from timeslice.kubelet_plugin.agent.procfs import gone_or_failed

_init_lock = threading.Lock()
_STATES = {0: RUNNING, 1: LOCKED, 2: CHECKPOINTED, 3: FAILED, 4: "checkpointing", 5: "restoring"}
# CUresult names (cuda-bindings, cuda.h) read as: no usable CUDA context in the process, or the
# wrong state for the call. A name cuda-bindings lacks would turn every other error of every
# call into an AttributeError (CUDA_ERROR_INITIALIZATION_ERROR, a runtime API name, did).
NO_CONTEXT_ERRORS = ("CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_DEINITIALIZED", "CUDA_ERROR_ILLEGAL_STATE")


def _driver() -> Any:
    """`cuda.bindings.driver` after `cuInit(0)`; raises BackendError when unusable."""
    try:
        from cuda.bindings import driver
    except ImportError as err:
        raise BackendError("backend cuda needs the cuda-bindings package (extra `gpu`)") from err
    with _init_lock:
        try:
            (result,) = driver.cuInit(0)
        except Exception as exc:  # cuda-bindings raises when libcuda.so is missing
            raise BackendError(f"no NVIDIA driver: {exc}") from exc
        if result != driver.CUresult.CUDA_SUCCESS:
            raise BackendError(f"cuInit failed: {result.name}")
    return driver


class CudaBackend(CudaStyleBackend):
    name = "cuda"

    def __init__(self, lock_timeout: float) -> None:
        super().__init__(lock_timeout)
        self._cu = _driver()
        self._no_context = {getattr(self._cu.CUresult, n) for n in NO_CONTEXT_ERRORS}

    def _call(self, what: str, pid: int, fn: Any, *args: Any) -> Any:
        result = fn(pid, *args)
        err = result[0] if isinstance(result, tuple) else result
        cu = self._cu
        if err == cu.CUresult.CUDA_SUCCESS:
            return result[1] if isinstance(result, tuple) and len(result) > 1 else None
        message = f"{what} pid {pid}: {err.name}"
        cls: type[TimeSliceServerError] = BackendError
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            cls = StepTimeout
        elif err == cu.CUresult.CUDA_ERROR_OPERATING_SYSTEM:  # seen for a PID that does not exist, not only
            raise gone_or_failed(pid, message)
        elif err in self._no_context:
            cls = FailedPrecondition  # no (usable) CUDA context in the process, or wrong state
        raise cls(message)

    async def lock(self, pid: int, timeout: float) -> None:
        args = self._cu.CUcheckpointLockArgs()
        args.timeoutMs = max(1, int(timeout * 1000))
        await asyncio.to_thread(self._call, "cuCheckpointProcessLock", pid,
                                self._cu.cuCheckpointProcessLock, args)

    async def do_checkpoint(self, pid: int) -> None:
        await asyncio.to_thread(self._call, "cuCheckpointProcessCheckpoint", pid,
                                self._cu.cuCheckpointProcessCheckpoint, self._cu.CUcheckpointCheckpointArgs())

    async def do_restore(self, pid: int) -> None:
        await asyncio.to_thread(self._call, "cuCheckpointProcessRestore", pid,
                                self._cu.cuCheckpointProcessRestore, self._cu.CUcheckpointRestoreArgs())

    async def unlock(self, pid: int) -> None:
        await asyncio.to_thread(self._call, "cuCheckpointProcessUnlock", pid,
                                self._cu.cuCheckpointProcessUnlock, self._cu.CUcheckpointUnlockArgs())

    async def get_state(self, pid: int) -> str:
        state = await asyncio.to_thread(self._call, "cuCheckpointProcessGetState", pid,
                                        self._cu.cuCheckpointProcessGetState)
        return _STATES.get(int(state), str(state))
