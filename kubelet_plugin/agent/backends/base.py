"""The backend interface, and the all-or-nothing step over a job's processes.

Owned by the node agent; each backend module subclasses `Backend`. A step acts on
every PID of a job concurrently; if any PID fails, the PIDs that succeeded are put
back (the inverse step) before the error is raised, so a job is never left half
moved and a process is never left LOCKED or stopped by a failed step.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from timeslice.driver.app_engine import AppEngine
from timeslice.driver.errors import BackendError, ProcessGone, TimeSliceServerError
from timeslice.driver.rollback import undo

log = logging.getLogger("timeslice.agent")

# Per-process states reported by backends (agent.proto ProcessState.state).
RUNNING = "running"
LOCKED = "locked"
CHECKPOINTED = "checkpointed"
STOPPED = "stopped"
FAILED = "failed"
NO_CONTEXT = "no-context"  # no CUDA context: nothing on the GPU to move
GONE = "gone"  # the process ended (crashed) during the step: nothing left to move
UNKNOWN = "unknown"


@dataclass(frozen=True)
class ProcState:
    """A process after a step: `gpu_bytes` is its GPU memory before checkpoint (0: unknown)."""

    pid: int
    state: str
    gpu_bytes: int = 0


Step = Callable[[int], Awaitable[ProcState]]


class Backend(ABC):
    """Moves a job's processes off and back onto the GPU. Times in seconds.

    `checkpoint` and `restore` are idempotent per process (a process already in the
    target state counts as done) and all-or-nothing per call (see `run_step`).
    They raise `TimeSliceServerError` subclasses: ProcessGone, StepTimeout,
    FailedPrecondition, BackendError.
    """

    name: str

    @abstractmethod
    async def checkpoint(self, pids: Sequence[int], timeout: float) -> list[ProcState]: ...

    @abstractmethod
    async def restore(self, pids: Sequence[int], timeout: float) -> list[ProcState]: ...

    @abstractmethod
    async def state(self, pids: Sequence[int]) -> list[ProcState]: ...

    async def host_memory_settled(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the host memory that this backend's answered steps
        still release to be released (`vmm`: a process's shim frees its checkpoint's buffer
        after answering its restore); whether it all was. Raises nothing. Default: no step
        releases memory after its answer."""
        return True

    def pinned_free_bytes(self) -> int:
        """Bytes of this backend's pinned pool that are free for checkpoints and already taken
        from the host (so not in MemAvailable): the node agent adds them to the host's room.
        Default: no pool."""
        return 0

    async def pinned_free_for(self, pids: Sequence[int]) -> int:
        """Bytes of `pinned_free_bytes` that a checkpoint of the processes `pids` lands in: the
        node agent adds them to the host's room for that checkpoint. Raises nothing. Default: all
        of them."""
        return self.pinned_free_bytes()

    def seen(self, pids: Sequence[int]) -> None:
        """The node agent resolved `pids` as a job's (a memory report): a backend may prepare
        them for a later step, in the background (`vmm` hands its pool to their shims).
        Raises nothing. Default: nothing."""
        return None

    def bind(self, app: AppEngine | None) -> Backend:
        """This backend for the steps of one job whose inference engine is `app` (the step's
        `app`, from the claim's TimeSliceConfig). Backend `app` acts through the engine and
        needs it (InvalidArgument without); the others act on processes and ignore it."""
        return self


async def run_step(what: str, pids: Sequence[int], forward: Step, inverse: Step) -> list[ProcState]:
    """Run `forward` on every PID; on any failure run `inverse` on those that succeeded.

    A process that ends during the step (ProcessGone: it crashed, or exited) is reported
    as `gone`, not as a failure: nothing of it is left to move or to undo.
    Raises the first failure (a `TimeSliceServerError`), with the other failures and
    any rollback problem named in its message.
    """
    results = await asyncio.gather(*(forward(pid) for pid in pids), return_exceptions=True)
    for pid, r in zip(pids, results):
        if isinstance(r, ProcessGone):
            log.warning("%s: process %d ended during the step (%s): reported gone", what, pid, r)
    results = [ProcState(pid, GONE) if isinstance(r, ProcessGone) else r for pid, r in zip(pids, results)]
    done = [r for r in results if isinstance(r, ProcState) and r.state != GONE]
    gone = [r for r in results if isinstance(r, ProcState) and r.state == GONE]
    failures = [(pid, r) for pid, r in zip(pids, results) if isinstance(r, BaseException)]
    if not failures:
        return done + gone
    causes = "; ".join(f"pid {pid}: {err}" for pid, err in failures)
    failure = f"{what} failed ({causes})"
    message = f"{failure}; " + await undo(done, lambda st: inverse(st.pid), lambda st: f"pid {st.pid}", failure)
    first = failures[0][1]
    cls = type(first) if isinstance(first, TimeSliceServerError) else BackendError
    raise cls(message) from first
