"""The CUDA checkpoint state machine (`CudaStyleBackend`) with scripted primitives: what the
driver answers per PID is the test's input, so every branch runs on the CPU."""

from __future__ import annotations

import pytest
from timeslice.driver.errors import BackendError, FailedPrecondition, StepTimeout
from timeslice.kubelet_plugin.agent.backends.base import CHECKPOINTED, LOCKED, NO_CONTEXT, RUNNING
from timeslice.kubelet_plugin.agent.backends.cuda_style import CudaStyleBackend

TARGET, HELPER = 100, 101


class Scripted(CudaStyleBackend):
    name = "cuda"

    def __init__(self) -> None:
        super().__init__(lock_timeout=1.0)
        self.states = {TARGET: RUNNING, HELPER: RUNNING}
        self.calls: list[tuple[str, int]] = []

    async def lock(self, pid: int, timeout: float) -> None:
        self.calls.append(("lock", pid))
        if pid == HELPER:  # cuCheckpointProcessLock: CUDA_ERROR_INITIALIZATION_ERROR on a helper process
            raise FailedPrecondition(f"cuCheckpointProcessLock pid {pid}: CUDA_ERROR_INITIALIZATION_ERROR")
        self.states[pid] = LOCKED

    async def do_checkpoint(self, pid: int) -> None:
        self.calls.append(("checkpoint", pid))
        self.states[pid] = CHECKPOINTED

    async def do_restore(self, pid: int) -> None:
        self.calls.append(("restore", pid))
        self.states[pid] = LOCKED

    async def unlock(self, pid: int) -> None:
        self.calls.append(("unlock", pid))
        self.states[pid] = RUNNING

    async def get_state(self, pid: int) -> str:
        return self.states[pid]


async def test_a_helper_whose_lock_is_refused_has_nothing_to_move_and_the_switch_goes_on() -> None:
    """Issue 10, item 10: a lock failing with CUDA_ERROR_INITIALIZATION_ERROR on a helper
    process failed the whole switch."""
    b = Scripted()
    states = {p.pid: p.state for p in await b.checkpoint([TARGET, HELPER], timeout=5)}
    assert states == {TARGET: CHECKPOINTED, HELPER: NO_CONTEXT}
    assert ("checkpoint", HELPER) not in b.calls and b.states[HELPER] == RUNNING
    states = {p.pid: p.state for p in await b.restore([TARGET, HELPER], timeout=5)}
    assert states == {TARGET: RUNNING, HELPER: RUNNING} and b.states[TARGET] == RUNNING


class Stuck(Scripted):
    """TARGET's peer never locks (it waits for a peer outside the job: the NCCL case)."""

    async def lock(self, pid: int, timeout: float) -> None:
        if pid == HELPER:
            self.calls.append(("lock", pid))
            raise StepTimeout(f"cuCheckpointProcessLock pid {pid}: CUDA_ERROR_NOT_READY")
        await super().lock(pid, timeout)


async def test_every_process_is_locked_before_any_is_checkpointed_and_a_failed_lock_undoes_all() -> None:
    """Issue 10, item 3: with one process that never locks, the first process was already
    checkpointed when the switch failed, and stayed so while the orchestrator called the job
    resident."""
    b = Stuck()
    with pytest.raises(StepTimeout, match="rolled back 1 process"):
        await b.checkpoint([TARGET, HELPER], timeout=5)
    assert not any(step == "checkpoint" for step, _ in b.calls)
    assert b.states == {TARGET: RUNNING, HELPER: RUNNING}


class FailsToCheckpoint(Scripted):
    async def do_checkpoint(self, pid: int) -> None:
        if pid == HELPER:
            raise BackendError(f"cuCheckpointProcessCheckpoint pid {pid}: CUDA_ERROR_UNKNOWN")
        await super().do_checkpoint(pid)

    async def lock(self, pid: int, timeout: float) -> None:  # both lock
        self.calls.append(("lock", pid))
        self.states[pid] = LOCKED


async def test_a_failed_checkpoint_restores_the_others_and_unlocks_everyone() -> None:
    b = FailsToCheckpoint()
    with pytest.raises(BackendError, match="CUDA_ERROR_UNKNOWN"):
        await b.checkpoint([TARGET, HELPER], timeout=5)
    assert b.states == {TARGET: RUNNING, HELPER: RUNNING}
