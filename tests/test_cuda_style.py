"""The CUDA checkpoint state machine (`CudaStyleBackend`) with scripted primitives: what the
driver answers per PID is the test's input, so every branch runs on the CPU."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest
from timeslice.driver.errors import BackendError, FailedPrecondition, StepTimeout
from timeslice.driver.names import NCCL_NO_PEER_MEMORY_ENV
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


async def test_a_lock_refused_for_a_process_that_holds_gpu_memory_fails_the_step() -> None:
    """The driver's "no context" is taken only for a process NVML shows holding nothing: one
    holding memory whose lock is refused (an injected CUDA_ERROR_ILLEGAL_STATE in the
    randomized schedules of backend cuda) was reported `no-context`, its job counted as
    moved while its memory stayed on the GPU and it could still compute. Now the step fails
    and nothing stays locked."""
    b = Scripted()
    b.process_gpu_bytes = lambda: {TARGET: 10**9, HELPER: 5 * 10**8}  # type: ignore[method-assign]
    with pytest.raises(BackendError, match=f"process {HELPER} holds 500000000 bytes"):
        await b.checkpoint([TARGET, HELPER], timeout=5)
    assert b.states == {TARGET: RUNNING, HELPER: RUNNING} and ("checkpoint", TARGET) not in b.calls
    b.process_gpu_bytes = lambda: {TARGET: 10**9}  # type: ignore[method-assign]
    states = {p.pid: p.state for p in await b.checkpoint([TARGET, HELPER], timeout=5)}
    assert states == {TARGET: CHECKPOINTED, HELPER: NO_CONTEXT}


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



class FailsToUnlock(Scripted):
    """HELPER's unlock answers an error and does nothing (the fake driver's planned
    CUDA_ERROR_ILLEGAL_STATE at an unlock)."""

    async def unlock(self, pid: int) -> None:
        if pid == HELPER:
            self.calls.append(("unlock", pid))
            raise FailedPrecondition(f"cuCheckpointProcessUnlock pid {pid}: CUDA_ERROR_ILLEGAL_STATE")
        await super().unlock(pid)


async def test_a_restore_whose_unlock_fails_leaves_every_process_checkpointed() -> None:
    """Cuda schedules seeds 957 and 989: an unlock failed after the restore had brought the
    process's memory back; the step failed, its process stayed LOCKED with its memory on the
    GPU while the orchestrator counted it checkpointed, and the rollback's restore of the
    evicted jobs ran out of memory beside it. A failed restore leaves each of its processes
    as it found them."""
    b = FailsToUnlock()
    b.states = {TARGET: CHECKPOINTED, HELPER: CHECKPOINTED}
    with pytest.raises(FailedPrecondition, match="CUDA_ERROR_ILLEGAL_STATE"):
        await b.restore([TARGET, HELPER], timeout=5)
    assert b.states == {TARGET: CHECKPOINTED, HELPER: CHECKPOINTED}, b.calls


# -- issue 14, item 0: never checkpoint what cannot be restored ---------------------------

# A rank: NCCL loaded (a file named libnccl.so.2 mapped), then it waits until it is killed.
RANK = """
    import mmap, signal, sys
    f = open(sys.argv[1], "rb")
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    print("ready", flush=True)
    signal.pause()
"""


class PeerMappedDriver(Scripted):
    """What two H200s answered for NCCL ranks with peer-to-peer on: the lock and the
    checkpoint succeed, the restore fails, and the ranks stay stuck."""

    def __init__(self, gpus_of: dict[int, set[int]]) -> None:
        super().__init__()
        self.states = {pid: RUNNING for pid in gpus_of}
        self.process_gpus = lambda: gpus_of  # type: ignore[method-assign]

    async def do_restore(self, pid: int) -> None:
        self.calls.append(("restore", pid))
        raise BackendError(f"cuCheckpointProcessRestore pid {pid}: CUDA_ERROR_NOT_SUPPORTED")


def ranks(tmp_path, children, env: dict[str, str], n: int = 2) -> list[int]:
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"\0" * 4096)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")} | env
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(RANK), str(lib)], stdout=subprocess.PIPE,
                              text=True, env=env) for _ in range(n)]
    children.extend(procs)
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return [p.pid for p in procs]


async def test_nccl_ranks_on_two_gpus_without_the_variables_are_refused_before_any_lock(tmp_path, children) -> None:
    pids = ranks(tmp_path, children, {})
    b = PeerMappedDriver({pids[0]: {0}, pids[1]: {1}})
    with pytest.raises(BackendError, match="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1") as err:
        await b.checkpoint(pids, timeout=5)
    assert "backend cooperative" in str(err.value) and "ncclPeerTransports: false" in str(err.value)
    assert b.calls == [] and set(b.states.values()) == {RUNNING}  # nothing was locked


async def test_nccl_ranks_with_the_variables_or_on_one_gpu_are_moved(tmp_path, children) -> None:
    safe = ranks(tmp_path, children, NCCL_NO_PEER_MEMORY_ENV)
    b = PeerMappedDriver({safe[0]: {0}, safe[1]: {1}})
    assert {s.state for s in await b.checkpoint(safe, timeout=5)} == {CHECKPOINTED}
    # this driver would now leave them stuck: what the refusal above keeps from happening
    with pytest.raises(BackendError, match="CUDA_ERROR_NOT_SUPPORTED"):
        await b.restore(safe, timeout=5)
    unsafe = ranks(tmp_path, children, {"NCCL_P2P_DISABLE": "1"})  # only one of the two
    one_gpu = PeerMappedDriver({unsafe[0]: {0}, unsafe[1]: {0}})
    assert {s.state for s in await one_gpu.checkpoint(unsafe, timeout=5)} == {CHECKPOINTED}
    with pytest.raises(BackendError, match="NCCL"):
        await PeerMappedDriver({unsafe[0]: {0}, unsafe[1]: {1}}).checkpoint(unsafe, timeout=5)


async def test_a_restore_the_tool_calls_no_such_process_fails_for_a_live_process(tmp_path) -> None:
    """Issue 22: a restore answered as if the process were gone (the driver's
    CUDA_ERROR_OPERATING_SYSTEM, cuda-checkpoint's "No such process") was read as "nothing
    left to restore": the waiter was granted while its state was still checkpointed. Gone
    is what /proc says: a live process's restore fails; a dead one's is reported gone."""
    from timeslice.driver.errors import ProcessGone
    from timeslice.kubelet_plugin.agent.backends.base import GONE
    from timeslice.kubelet_plugin.agent.backends.cuda_checkpoint import CudaCheckpointBackend

    tool = tmp_path / "cuda-checkpoint"
    tool.write_text("#!/bin/sh\n"
                    'case "$*" in *--get-state*) echo checkpointed ;;\n'
                    '  *) echo "Error: No such process" >&2; exit 1 ;; esac\n')
    tool.chmod(0o755)
    b = CudaCheckpointBackend(lock_timeout=1.0, binary=str(tool))
    dead = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await dead.wait()
    with pytest.raises(BackendError, match="the process is alive") as err:
        await b.restore([os.getpid()], timeout=5)
    assert not isinstance(err.value, ProcessGone)
    assert [p.state for p in await b.restore([dead.pid], timeout=5)] == [GONE]


def test_cuda_error_304_is_gone_only_when_proc_says_so() -> None:
    """The same for the driver API (`cuda` backend): CUDA_ERROR_OPERATING_SYSTEM (304) is
    ProcessGone for a PID that does not exist, BackendError for a live one."""
    driver = pytest.importorskip("cuda.bindings.driver")
    from timeslice.driver.errors import ProcessGone
    from timeslice.kubelet_plugin.agent.backends.cuda import CudaBackend

    b = _error_mapping_only(CudaBackend, driver)

    def answer(pid: int) -> tuple:
        return (driver.CUresult.CUDA_ERROR_OPERATING_SYSTEM,)

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with pytest.raises(BackendError, match="alive") as err:
        b._call("cuCheckpointProcessRestore", os.getpid(), answer)
    assert not isinstance(err.value, ProcessGone)
    with pytest.raises(ProcessGone):
        b._call("cuCheckpointProcessRestore", dead.pid, answer)


def _error_mapping_only(cls: type, driver: object) -> object:
    """A CudaBackend without a driver: only its error mapping runs, over cuda-bindings' names."""
    from timeslice.kubelet_plugin.agent.backends.cuda import NO_CONTEXT_ERRORS

    b = object.__new__(cls)
    b._cu = driver
    b._no_context = {getattr(driver.CUresult, n) for n in NO_CONTEXT_ERRORS}
    return b


@pytest.mark.parametrize("name", ["CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_UNKNOWN",
                                  "CUDA_ERROR_ECC_UNCORRECTABLE"])
def test_every_cuda_error_reaches_the_step_by_its_name(name: str) -> None:
    """A CUDA error other than the ones read specially fails the step as BackendError naming
    it (randomized schedules of backend cuda over bench/fake_cuda: a name missing from
    cuda-bindings' CUresult, CUDA_ERROR_INITIALIZATION_ERROR, turned each of them into an
    AttributeError naming that missing name); the no-context errors exist in cuda-bindings."""
    driver = pytest.importorskip("cuda.bindings.driver")
    from timeslice.kubelet_plugin.agent.backends.cuda import NO_CONTEXT_ERRORS, CudaBackend

    assert all(hasattr(driver.CUresult, n) for n in NO_CONTEXT_ERRORS)
    b = _error_mapping_only(CudaBackend, driver)
    with pytest.raises(BackendError, match=name) as err:
        b._call("cuCheckpointProcessLock", os.getpid(), lambda pid: (getattr(driver.CUresult, name),))
    assert type(err.value) is BackendError
