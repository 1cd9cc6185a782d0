"""Switch steps as the node agent runs them: the job a step names (`JobRef`), the request
(`StepRequest`), its outcome (`StepOutcome`), and the recent steps by operation id
(`Operations`).

Owned by the node agent: the gRPC servicer builds a `StepRequest` from each validated
`SwitchStepRequest` and passes it to `NodeAgent.checkpoint` / `.restore`, which return
a `StepOutcome` and run a step that names an operation id once (`Operations`).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from timeslice.driver.app_engine import AppEngine
from timeslice.driver.errors import InvalidArgument
from timeslice.kubelet_plugin.agent.backends.base import ProcState

# Steps the agent remembers by operation id (issue 10, item 11: bounded agent state).
MAX_OPERATIONS = 1024


@dataclass(frozen=True)
class JobRef:
    """A job as a switch step names it: its id and, in a cluster, the claims of its claim set
    on this node, its pods among the claims' pods, and the pod-level claim name."""

    job_id: str
    claims: Sequence[tuple[str, str]] = ()
    pod_uids: Sequence[str] = ()
    claim_name: str = ""


@dataclass(frozen=True)
class StepRequest:
    """One checkpoint or restore step: the job, the backend that moves it, the group it runs
    for (logs and records), its bound in seconds (0: the agent's default), the
    orchestrator's operation id ("": none, each call runs the step) and, for backend
    `app`, the job's engine."""

    job: JobRef
    backend: str
    group_id: str = ""
    timeout: float = 0.0
    operation_id: str = ""
    app: AppEngine | None = None

    @property
    def job_id(self) -> str:
        return self.job.job_id


@dataclass(frozen=True)
class StepOutcome:
    """What a step did: the job's processes after it, the bytes it moved, its duration (s)."""

    job_id: str
    processes: list[ProcState]
    bytes: int
    seconds: float


@dataclass(frozen=True)
class _Operation:
    kind: str
    job_id: str
    backend: str
    task: asyncio.Task[StepOutcome]


class Operations:
    """The last `limit` steps that named an operation id, running or ended, oldest forgotten
    first. A step is its task: a resend awaits the same task, so it joins a running step
    and gets an ended one's outcome, or its error, again. What is forgotten here the
    records still know (`NodeAgent`: a checkpoint recorded under the id is not run again)."""

    def __init__(self, limit: int = MAX_OPERATIONS) -> None:
        self.limit = limit
        self._ops: OrderedDict[str, _Operation] = OrderedDict()
        self._running: set[asyncio.Task[StepOutcome]] = set()  # kept until done, also once forgotten

    def __len__(self) -> int:
        return len(self._ops)

    def find(self, kind: str, req: StepRequest) -> asyncio.Task[StepOutcome] | None:
        """The task of the step `req.operation_id` names, None when unknown; raises
        InvalidArgument when that id named another step (kind, job or backend)."""
        op = self._ops.get(req.operation_id)
        if op is None:
            return None
        if (op.kind, op.job_id, op.backend) != (kind, req.job_id, req.backend):
            raise InvalidArgument(f"operation_id {req.operation_id!r} names the {op.kind} of job {op.job_id!r} "
                                  f"(backend {op.backend}), not the {kind} of job {req.job_id!r} (backend "
                                  f"{req.backend}): an operation id names one step")
        self._ops.move_to_end(req.operation_id)
        return op.task

    def start(self, kind: str, req: StepRequest, step: Coroutine[Any, Any, StepOutcome]) -> asyncio.Task[StepOutcome]:
        """Run `step` as the operation `req.operation_id` names (a task of its own: a caller
        that goes away does not cancel it)."""
        task = asyncio.get_running_loop().create_task(step, name=f"{kind}-{req.job_id}-{req.operation_id}")
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        self._ops[req.operation_id] = _Operation(kind, req.job_id, req.backend, task)
        while len(self._ops) > self.limit:
            self._ops.popitem(last=False)
        return task
