"""The CUDA checkpoint state machine shared by the `cuda` and `cuda-checkpoint` backends.

Owned by the node agent. Per process (CUDA Driver API, "CUDA Checkpointing"):
RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED -restore-> LOCKED -unlock-> RUNNING.
Subclasses supply the five primitives; this class composes them so that a failed
call is undone: a lock is always followed by unlock on failure, a checkpoint that
fails after the lock unlocks, a restore that fails leaves the process CHECKPOINTED
(owned by the agent's records; also when its unlock fails: it is checkpointed again), and
an unlock that fails is retried once. A process
without a CUDA context has nothing on the GPU: it is reported as `no-context`, not
as a failure. The driver's word for that (a state or lock answered "not initialized" or
"illegal state") is taken only for a process NVML shows holding no GPU memory: one that
holds some fails the step, since its memory would stay on the GPU while the job counted
as moved (randomized schedules of backend `cuda`, bench/fake_cuda).
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence

from timeslice.driver.errors import BackendError, FailedPrecondition, TimeSliceServerError
from timeslice.kubelet_plugin.agent import gpu_memory
from timeslice.kubelet_plugin.agent.backends.base import (
    CHECKPOINTED,
    LOCKED,
    NO_CONTEXT,
    RUNNING,
    Backend,
    ProcState,
    log,
    run_step,
)
from timeslice.kubelet_plugin.agent.backends.peer_memory import shared_gpu_memory


class CudaStyleBackend(Backend):
    # pid -> NVML indices of its GPUs (a test replaces it)
    process_gpus: Callable[[], Mapping[int, set[int]]] = staticmethod(gpu_memory.process_gpus)
    # pid -> bytes it holds on the GPUs (NVML; a test replaces it)
    process_gpu_bytes: Callable[[], Mapping[int, int]] = staticmethod(gpu_memory.process_gpu_bytes)

    def __init__(self, lock_timeout: float) -> None:
        self.lock_timeout = lock_timeout

    # primitives: raise TimeSliceServerError subclasses
    @abstractmethod
    async def lock(self, pid: int, timeout: float) -> None: ...

    @abstractmethod
    async def do_checkpoint(self, pid: int) -> None: ...

    @abstractmethod
    async def do_restore(self, pid: int) -> None: ...

    @abstractmethod
    async def unlock(self, pid: int) -> None: ...

    @abstractmethod
    async def get_state(self, pid: int) -> str: ...

    async def checkpoint(self, pids: Sequence[int], timeout: float) -> list[ProcState]:
        """Two phases over the job's processes: lock them all (at once: a process whose GPU
        memory or communicators are shared, NCCL's peers, blocks in its lock until its peers are
        locked too), and only then checkpoint the locked ones. A lock that fails unlocks the
        others before anything is checkpointed; a checkpoint that fails restores the ones done
        and unlocks every process still locked. Processes whose GPU memory NCCL may have
        mapped into each other are refused before anything is locked (`peer_memory`):
        BackendError."""
        shared = await asyncio.to_thread(lambda: shared_gpu_memory(pids, self.process_gpus()))
        if shared is not None:
            raise BackendError(shared.message(self.name))
        sizes = await asyncio.to_thread(self.process_gpu_bytes)
        locked = await run_step(f"{self.name} lock", pids, lambda p: self._lock_one(p, timeout, sizes.get(p, 0)),
                                self._unlock_one)
        to_move = [s.pid for s in locked if s.state == LOCKED]
        try:
            moved = await run_step(f"{self.name} checkpoint", to_move,
                                   lambda p: self._checkpoint_locked(p, sizes.get(p, 0)), self._restore_one)
        except BaseException:
            await asyncio.gather(*(self._unlock_one(p) for p in to_move), return_exceptions=True)
            raise
        return [s for s in locked if s.state != LOCKED] + moved

    async def restore(self, pids: Sequence[int], timeout: float) -> list[ProcState]:
        return await run_step(f"{self.name} restore", pids, lambda p: self._restore_one(p, again=True),
                              lambda p: self._checkpoint_one(p, timeout, 0))

    async def state(self, pids: Sequence[int]) -> list[ProcState]:
        return [ProcState(pid, await self.get_state(pid)) for pid in pids]

    async def _state_or_none(self, pid: int) -> str | None:
        """The process's CUDA state, or None when it has no CUDA context (nothing on the GPU:
        CUDA_ERROR_NOT_INITIALIZED, e.g. a process that is tearing its context down)."""
        try:
            return await self.get_state(pid)
        except FailedPrecondition as err:
            log.warning("no CUDA context pid=%d: %s", pid, err)
            return None

    async def _nothing_to_move(self, pid: int, gpu_bytes: int | None, err: Exception | str) -> ProcState:
        """`no-context` for a process the driver says has no (lockable) context, when NVML
        shows it holding no GPU memory (`gpu_bytes`, None: asked now); else BackendError:
        its memory would stay on the GPU while the job counts as moved."""
        if gpu_bytes is None:
            gpu_bytes = (await asyncio.to_thread(self.process_gpu_bytes)).get(pid, 0)
        if gpu_bytes:
            raise BackendError(f"process {pid} holds {gpu_bytes} bytes on the GPUs (NVML) but the driver has no "
                               f"context of it to move ({err}): nothing moved")
        log.warning("no CUDA context, nothing to move pid=%d: %s", pid, err)
        return ProcState(pid, NO_CONTEXT)

    async def _lock_one(self, pid: int, timeout: float, gpu_bytes: int | None = None) -> ProcState:
        """LOCKED when this call locked it (or found it locked); else what it is (no context,
        already checkpointed: nothing to lock). `gpu_bytes`: what NVML showed it hold (None:
        not asked yet)."""
        state = await self._state_or_none(pid)
        if state is None:
            return await self._nothing_to_move(pid, gpu_bytes, "no CUDA state")
        if state in (CHECKPOINTED, LOCKED):
            return ProcState(pid, state)
        if state != RUNNING:
            raise BackendError(f"process {pid} is {state}, cannot checkpoint")
        try:
            await self.lock(pid, min(self.lock_timeout, timeout))
        except FailedPrecondition as err:  # a helper whose context cannot be locked: nothing to move
            return await self._nothing_to_move(pid, gpu_bytes, err)
        return ProcState(pid, LOCKED)

    async def _unlock_one(self, pid: int) -> ProcState:
        """Undo a lock: unlock a process that is LOCKED (others are left as they are)."""
        if await self._state_or_none(pid) == LOCKED:
            await self._unlock_retry(pid)
        return ProcState(pid, RUNNING)

    async def _checkpoint_locked(self, pid: int, gpu_bytes: int) -> ProcState:
        await self.do_checkpoint(pid)
        return ProcState(pid, CHECKPOINTED, gpu_bytes)

    async def _checkpoint_one(self, pid: int, timeout: float, gpu_bytes: int) -> ProcState:
        """(The undo of a restore.)"""
        state = await self._state_or_none(pid)
        if state is None:
            return await self._nothing_to_move(pid, None, "no CUDA state")
        if state == CHECKPOINTED:
            return ProcState(pid, CHECKPOINTED, gpu_bytes)
        if state == RUNNING:
            try:
                await self.lock(pid, min(self.lock_timeout, timeout))
            except FailedPrecondition as err:  # a helper whose context cannot be locked: nothing to move
                return await self._nothing_to_move(pid, None, err)
        elif state != LOCKED:
            raise BackendError(f"process {pid} is {state}, cannot checkpoint")
        try:
            await self.do_checkpoint(pid)
        except BaseException:
            try:
                await self._unlock_retry(pid)
            except TimeSliceServerError as unlock_err:  # keep the first error: it is the cause
                log.error("unlock after a failed checkpoint failed pid=%d: %s", pid, unlock_err)
            raise
        return ProcState(pid, CHECKPOINTED, gpu_bytes)

    async def _restore_one(self, pid: int, again: bool = False) -> ProcState:
        """Restore and unlock `pid`. `again` (a restore step, not the undo of a checkpoint,
        whose caller then drops the job's record): a failed unlock checkpoints it again."""
        state = await self._state_or_none(pid)
        if state is None:
            return ProcState(pid, NO_CONTEXT)
        if state == RUNNING:
            return ProcState(pid, RUNNING)
        if state == CHECKPOINTED:
            await self.do_restore(pid)
        elif state != LOCKED:
            raise BackendError(f"process {pid} is {state}, cannot restore")
        try:
            await self._unlock_retry(pid)
        except TimeSliceServerError:
            # checkpointed again, as the step found it (cuda schedules seeds 957 and 989: its memory stayed on
            # the GPU while the job counted as checkpointed, and the rollback's restores ran out of memory
            # beside it); a failure of that is logged, the step's error raised
            if again and state == CHECKPOINTED and await self._state_or_none(pid) == LOCKED:
                try:
                    await self._checkpoint_one(pid, self.lock_timeout, 0)
                except TimeSliceServerError as undo_err:
                    log.error("checkpoint after a failed unlock failed pid=%d: %s", pid, undo_err)
            raise
        return ProcState(pid, RUNNING)

    async def _unlock_retry(self, pid: int) -> None:
        try:
            await self.unlock(pid)
        except BackendError:
            await self.unlock(pid)
