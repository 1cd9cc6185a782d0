"""The `cuda` backend on a real GPU (marked `gpu`; skipped without GPU, PyTorch and root).

Results of the GPU runs are committed under bench/results/ (CI has no GPU).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from timeslice.driver.errors import ProcessGone, StepTimeout

ROOT = Path(__file__).resolve().parent.parent


def _gpu() -> bool:
    if not (importlib.util.find_spec("torch") and importlib.util.find_spec("cuda")) or os.geteuid() != 0:
        return False
    from timeslice.cli.demo import gpu_present

    return gpu_present()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu(), reason="needs an NVIDIA GPU, PyTorch and root")]


@pytest.fixture
def holder():
    child = subprocess.Popen([sys.executable, str(ROOT / "bench" / "gpu_holder.py"), "1"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().startswith("ready")

    def ask(cmd: str) -> str:
        child.stdin.write(cmd + "\n")
        child.stdin.flush()
        return child.stdout.readline().strip()

    child.ask = ask  # type: ignore[attr-defined]
    yield child
    child.kill()
    child.wait()
    child.stdin.close()
    child.stdout.close()


async def test_checkpoint_frees_gpu_memory_and_restore_keeps_data(holder) -> None:
    from timeslice.kubelet_plugin.agent.backends.cuda import CudaBackend
    from timeslice.kubelet_plugin.agent.gpu_memory import process_gpu_bytes

    before = holder.ask("sum")
    b = CudaBackend(lock_timeout=10)
    assert process_gpu_bytes().get(holder.pid, 0) > 1e9
    procs = await b.checkpoint([holder.pid], timeout=120)
    assert procs[0].state == "checkpointed" and procs[0].gpu_bytes > 1e9
    assert holder.pid not in process_gpu_bytes()  # NVML no longer lists it
    assert (await b.state([holder.pid]))[0].state == "checkpointed"
    assert (await b.checkpoint([holder.pid], timeout=120))[0].state == "checkpointed"  # idempotent
    await b.restore([holder.pid], timeout=120)
    assert (await b.state([holder.pid]))[0].state == "running"
    assert holder.ask("sum") == before


async def test_lock_timeout_leaves_a_busy_process_running(holder) -> None:
    from timeslice.kubelet_plugin.agent.backends.cuda import CudaBackend

    assert holder.ask("busy 8") == "queued"
    b = CudaBackend(lock_timeout=0.1)
    with pytest.raises(StepTimeout, match="CUDA_ERROR_NOT_READY"):
        await b.checkpoint([holder.pid], timeout=120)
    assert (await b.state([holder.pid]))[0].state == "running"


async def test_failure_on_one_process_rolls_back_the_other(holder) -> None:
    from timeslice.kubelet_plugin.agent.backends.cuda import CudaBackend

    gone = subprocess.Popen(["true"])  # noqa: ASYNC220
    gone.wait()  # its PID no longer exists: CUDA_ERROR_OPERATING_SYSTEM
    before = holder.ask("sum")
    with pytest.raises(ProcessGone, match="rolled back 1 process"):
        await CudaBackend(lock_timeout=10).checkpoint([holder.pid, gone.pid], timeout=120)
    assert (await CudaBackend(lock_timeout=10).state([holder.pid]))[0].state == "running"
    assert holder.ask("sum") == before


async def test_process_without_cuda_context_has_nothing_to_move(holder) -> None:
    from timeslice.kubelet_plugin.agent.backends.cuda import CudaBackend

    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # noqa: ASYNC220 (no CUDA)
    try:
        b = CudaBackend(lock_timeout=10)
        states = await b.checkpoint([holder.pid, plain.pid], timeout=120)
        assert [s.state for s in states] == ["checkpointed", "no-context"]
        await b.restore([holder.pid, plain.pid], timeout=120)
        assert (await b.state([holder.pid]))[0].state == "running"
    finally:
        plain.kill()
        plain.wait()
