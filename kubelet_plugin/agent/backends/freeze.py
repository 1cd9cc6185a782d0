"""Backend `freeze`: SIGSTOP / SIGCONT of a job's processes.

The real mechanism on GPU-less nodes and in the CPU demo: a frozen process keeps its
memory but cannot run, so the CPU (the stand-in accelerator) is free for the next
job. A step waits until the kernel reports the new state (`/proc/<pid>/stat` field
3: `T` stopped) within its timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Sequence

from timeslice.driver.errors import ProcessGone, StepTimeout
from timeslice.kubelet_plugin.agent.backends.base import (
    RUNNING,
    STOPPED,
    Backend,
    ProcState,
    run_step,
)
from timeslice.kubelet_plugin.agent.procfs import proc_state

POLL_SECONDS = 0.0005


def _stopped(letter: str) -> bool:
    return letter in ("T", "t")


class FreezeBackend(Backend):
    name = "freeze"

    async def checkpoint(self, pids: Sequence[int], timeout: float) -> list[ProcState]:
        return await run_step("freeze", pids, lambda p: self._signal(p, signal.SIGSTOP, True, timeout),
                              lambda p: self._signal(p, signal.SIGCONT, False, timeout))

    async def restore(self, pids: Sequence[int], timeout: float) -> list[ProcState]:
        return await run_step("thaw", pids, lambda p: self._signal(p, signal.SIGCONT, False, timeout),
                              lambda p: self._signal(p, signal.SIGSTOP, True, timeout))

    async def state(self, pids: Sequence[int]) -> list[ProcState]:
        return [ProcState(pid, STOPPED if _stopped(proc_state(pid)) else RUNNING) for pid in pids]

    async def _signal(self, pid: int, sig: signal.Signals, want_stopped: bool, timeout: float) -> ProcState:
        """Send `sig` and wait until `pid` is in the wanted state. Raises ProcessGone once it is
        gone or a zombie, also while waiting (a process that exited before its SIGSTOP took
        effect stays a zombie while its parent is stopped: waiting for it to stop hung the
        step, and its group, for the whole step timeout), StepTimeout after `timeout` seconds."""
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            raise ProcessGone(f"process {pid} does not exist") from None
        deadline = time.monotonic() + timeout
        while (letter := proc_state(pid)) == "Z" or _stopped(letter) != want_stopped:
            if letter == "Z":
                raise ProcessGone(f"process {pid} has exited (zombie)")
            if time.monotonic() > deadline:
                raise StepTimeout(f"process {pid} not {'stopped' if want_stopped else 'running'} "
                                  f"after {timeout} s ({sig.name} sent)")
            await asyncio.sleep(POLL_SECONDS)
        return ProcState(pid, STOPPED if want_stopped else RUNNING)
