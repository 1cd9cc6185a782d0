"""Switch steps as the node agent runs them: the job a step names (`JobRef`), the request
(`StepRequest`) and its outcome (`StepOutcome`).

Owned by the node agent: the gRPC servicer builds a `StepRequest` from each validated
`SwitchStepRequest` and passes it to `NodeAgent.checkpoint` / `.restore`, which return
a `StepOutcome`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from timeslice.kubelet_plugin.agent.backends.base import ProcState


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
    for (logs and records), its bound in seconds (0: the agent's default) and the
    orchestrator's operation id ("": none, each call runs the step)."""

    job: JobRef
    backend: str
    group_id: str = ""
    timeout: float = 0.0
    operation_id: str = ""

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
