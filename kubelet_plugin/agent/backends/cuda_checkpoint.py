"""Backend `cuda-checkpoint`: NVIDIA's `cuda-checkpoint` CLI, when it is on the PATH.

Runs `cuda-checkpoint --action {lock,checkpoint,restore,unlock} --pid N` (lock with
`--timeout <ms>`) and `cuda-checkpoint --get-state --pid N` (prints `running`,
`locked`, `checkpointed` or `failed`), as documented in NVIDIA/cuda-checkpoint's
README for driver r570+. Same state machine as the `cuda` backend.
"""

from __future__ import annotations

import asyncio
import shutil

from timeslice.driver.errors import BackendError, StepTimeout
from timeslice.kubelet_plugin.agent.backends.cuda_style import CudaStyleBackend
from timeslice.kubelet_plugin.agent.procfs import gone_or_failed

BINARY = "cuda-checkpoint"
# Bound on one CLI call other than lock/checkpoint/restore, seconds.
CALL_SECONDS = 30.0


class CudaCheckpointBackend(CudaStyleBackend):
    name = "cuda-checkpoint"

    def __init__(self, lock_timeout: float, binary: str | None = None) -> None:
        super().__init__(lock_timeout)
        path = binary or shutil.which(BINARY)
        if not path:
            raise BackendError(f"backend cuda-checkpoint needs the {BINARY} binary on the PATH")
        self.binary = path

    async def _run(self, pid: int, *args: str, timeout: float | None = CALL_SECONDS) -> str:
        proc = await asyncio.create_subprocess_exec(
            self.binary, *args, "--pid", str(pid),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise StepTimeout(f"{BINARY} {' '.join(args)} pid {pid}: no answer in {timeout} s") from None
        text = out.decode(errors="replace").strip()
        if proc.returncode != 0:
            message = f"{BINARY} {' '.join(args)} pid {pid} exited {proc.returncode}: {text[-300:]}"
            if "No such process" in text or "does not exist" in text:
                raise gone_or_failed(pid, message)
            raise BackendError(message)
        return text

    async def lock(self, pid: int, timeout: float) -> None:
        await self._run(pid, "--action", "lock", "--timeout", str(max(1, int(timeout * 1000))),
                        timeout=timeout + CALL_SECONDS)

    async def do_checkpoint(self, pid: int) -> None:
        await self._run(pid, "--action", "checkpoint", timeout=None)

    async def do_restore(self, pid: int) -> None:
        await self._run(pid, "--action", "restore", timeout=None)

    async def unlock(self, pid: int) -> None:
        await self._run(pid, "--action", "unlock")

    async def get_state(self, pid: int) -> str:
        return (await self._run(pid, "--get-state")).splitlines()[-1].strip().lower()
