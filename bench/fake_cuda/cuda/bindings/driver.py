"""A fake `cuda.bindings.driver`: the CUDA checkpoint API over a model GPU, with faults.

Put first on the node agent's PYTHONPATH by `bench/schedules.py --backend cuda`, so the
agent's real `cuda` backend (`kubelet_plugin/agent/backends/cuda.py`) drives the job
processes of `$TIMESLICE_MODEL_GPU` (`model_gpu.ModelGpu`: `cuda_lock`, `cuda_checkpoint`,
`cuda_restore`, `cuda_unlock`, `cuda_state`). Only what that backend calls is here, with
the names and values of cuda-bindings (`CUresult`, `CUprocessState`: CUDA Driver API,
cuda.h), so a name the backend uses that the real module lacks fails here too.

As the driver answers: a process that does not exist: CUDA_ERROR_OPERATING_SYSTEM; one with
no context (it never allocated): CUDA_ERROR_NOT_INITIALIZED; a call in the wrong state:
CUDA_ERROR_ILLEGAL_STATE; a lock whose process still computes after its timeout:
CUDA_ERROR_NOT_READY; a restore that does not fit: CUDA_ERROR_OUT_OF_MEMORY (logged as an
OOM of the model GPU: the orchestrator restored into memory that was not free).

Faults (`$TIMESLICE_FAKE_CUDA_FAULTS`, a JSON list of {"call": lock|checkpoint|restore|unlock,
"nth": the call's number, counted over the schedule in `<ledger>.calls`, "kind": hang|error|die,
"error": a CUresult name, "seconds": how long a hang lasts}): `hang` sleeps, then does the call;
`error` answers the error and does nothing; `die` does the call, then ends the whole agent
process (`DIE_EXIT`) before it answers: a driver crash in the middle of a step.
"""

from __future__ import annotations

import enum
import fcntl
import json
import os
import time
from typing import Any

from timeslice.kubelet_plugin.agent.model_gpu import CHECKPOINTED, LOCKED, RUNNING, ModelGpu, ModelGpuOom, from_env

FAULTS_ENV = "TIMESLICE_FAKE_CUDA_FAULTS"
DIE_EXIT = 86


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_DEINITIALIZED = 4
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_ECC_UNCORRECTABLE = 214
    CUDA_ERROR_OPERATING_SYSTEM = 304
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_LAUNCH_FAILED = 719
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_UNKNOWN = 999


class CUprocessState(enum.IntEnum):
    CU_PROCESS_STATE_RUNNING = 0
    CU_PROCESS_STATE_LOCKED = 1
    CU_PROCESS_STATE_CHECKPOINTED = 2
    CU_PROCESS_STATE_FAILED = 3


_STATES = {RUNNING: CUprocessState.CU_PROCESS_STATE_RUNNING, LOCKED: CUprocessState.CU_PROCESS_STATE_LOCKED,
           CHECKPOINTED: CUprocessState.CU_PROCESS_STATE_CHECKPOINTED}


class CUcheckpointLockArgs:
    def __init__(self) -> None:
        self.timeoutMs = 0


class CUcheckpointCheckpointArgs:
    pass


class CUcheckpointRestoreArgs:
    pass


class CUcheckpointUnlockArgs:
    pass


def _gpu() -> ModelGpu:
    gpu = from_env()
    if gpu is None:
        raise RuntimeError("the fake CUDA driver needs $TIMESLICE_MODEL_GPU")
    return gpu


def cuInit(flags: int) -> tuple[CUresult]:
    return (CUresult.CUDA_SUCCESS if from_env() is not None else CUresult.CUDA_ERROR_NOT_INITIALIZED,)


def _fault(call: str) -> dict[str, Any] | None:
    """The fault planned for this call of `call` (its number counted in `<ledger>.calls`)."""
    plan = json.loads(os.environ.get(FAULTS_ENV) or "[]")
    if not plan:
        return None
    path = str(_gpu().path) + ".calls"
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        counts = json.loads(f.read() or "{}")
        counts[call] = n = counts.get(call, 0) + 1
        f.seek(0)
        f.truncate()
        f.write(json.dumps(counts))
    return next((x for x in plan if x["call"] == call and x["nth"] == n), None)


def _run(call: str, pid: int, act: Any) -> CUresult:
    """One checkpoint call on `pid`: the planned fault, then `act(gpu)` (False: not ready)."""
    fault = _fault(call)
    if fault is not None and fault["kind"] == "error":
        return CUresult[fault["error"]]
    if fault is not None and fault["kind"] == "hang":
        time.sleep(fault["seconds"])
    gpu = _gpu()
    err, _ = _state(gpu, pid)
    if err != CUresult.CUDA_SUCCESS:
        return err
    try:
        done = act(gpu)
    except ModelGpuOom:
        return CUresult.CUDA_ERROR_OUT_OF_MEMORY
    except ValueError:  # the wrong state for this call
        return CUresult.CUDA_ERROR_ILLEGAL_STATE
    if fault is not None and fault["kind"] == "die":
        os._exit(DIE_EXIT)
    return CUresult.CUDA_SUCCESS if done is not False else CUresult.CUDA_ERROR_NOT_READY


def cuCheckpointProcessLock(pid: int, args: CUcheckpointLockArgs) -> tuple[CUresult]:
    return (_run("lock", pid, lambda gpu: gpu.cuda_lock(pid, args.timeoutMs / 1000)),)


def cuCheckpointProcessCheckpoint(pid: int, args: CUcheckpointCheckpointArgs) -> tuple[CUresult]:
    return (_run("checkpoint", pid, lambda gpu: gpu.cuda_checkpoint(pid)),)


def cuCheckpointProcessRestore(pid: int, args: CUcheckpointRestoreArgs) -> tuple[CUresult]:
    return (_run("restore", pid, lambda gpu: gpu.cuda_restore(pid)),)


def cuCheckpointProcessUnlock(pid: int, args: CUcheckpointUnlockArgs) -> tuple[CUresult]:
    return (_run("unlock", pid, lambda gpu: gpu.cuda_unlock(pid)),)


def _state(gpu: ModelGpu, pid: int) -> tuple[CUresult, CUprocessState | None]:
    """`pid`'s state as the driver answers it: no process, no context, or its state."""
    try:
        state = gpu.cuda_state(pid)
    except ProcessLookupError:
        return CUresult.CUDA_ERROR_OPERATING_SYSTEM, None
    if state is None:
        return CUresult.CUDA_ERROR_NOT_INITIALIZED, None
    return CUresult.CUDA_SUCCESS, _STATES[state]


def cuCheckpointProcessGetState(pid: int) -> tuple[CUresult, CUprocessState | None]:
    return _state(_gpu(), pid)
