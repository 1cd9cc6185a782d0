"""gRPC servicer of `timeslice.agent.v1.NodeAgent`: checks the caller, validates, calls `NodeAgent`.

Owned by the agent server. Domain errors become gRPC statuses with their message (`grpc_server.rpc_method`).
With a `CallerCheck` (`auth.AllowedCallers`) every call must pass it first: UNAUTHENTICATED
without a valid token, PERMISSION_DENIED for another user. A check in the servicer rather
than a server interceptor, as `rpc_method` (the aio interceptor path costs hand-off time).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import grpc.aio
from pydantic import ValidationError
from timeslice.driver.agentapi.v1 import agent_pb2 as apb
from timeslice.driver.agentapi.v1 import agent_pb2_grpc as apb_grpc
from timeslice.driver.app_engine import DEFAULT_APP_TIMEOUT_SECONDS, AppEngine
from timeslice.driver.config import problems
from timeslice.driver.errors import InvalidArgument
from timeslice.driver.grpc_server import rpc_method
from timeslice.kubelet_plugin.agent.backends.base import ProcState
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent, job_state
from timeslice.kubelet_plugin.agent.steps import JobRef, StepOutcome, StepRequest

MAX_ID_LENGTH = 253  # a job id is a DNS subdomain at most (names.py; the orchestrator's rule)
MAX_OPERATION_ID_LENGTH = 128  # the orchestrator sends 32 (uuid4 hex)


def _procs(procs: list[ProcState]) -> list[apb.ProcessState]:
    return [apb.ProcessState(pid=p.pid, state=p.state, gpu_bytes=p.gpu_bytes) for p in procs]


def _check_job_id(job_id: str) -> None:
    if not job_id:
        raise InvalidArgument("job_id is required")
    if len(job_id) > MAX_ID_LENGTH:
        raise InvalidArgument(f"job_id is {len(job_id)} characters; at most {MAX_ID_LENGTH}")


def _step_request(request: apb.SwitchStepRequest, backend_required: bool = True) -> StepRequest:
    """The validated step; raises InvalidArgument naming the bad field."""
    _check_job_id(request.job_id)
    if backend_required and not request.backend:
        raise InvalidArgument("backend is required")
    t = request.timeout_seconds
    if not math.isfinite(t) or t < 0:
        raise InvalidArgument(f"timeout_seconds must be a finite number >= 0, got {t}")
    claims = [(c.namespace, c.name) for c in request.claims]
    if any(not ns or not name for ns, name in claims):
        raise InvalidArgument("every claim needs a namespace and a name")
    op = request.operation_id
    if len(op) > MAX_OPERATION_ID_LENGTH:
        raise InvalidArgument(f"operation_id is {len(op)} characters; at most {MAX_OPERATION_ID_LENGTH}")
    if not (op.isascii() and op.isprintable()):
        raise InvalidArgument(f"operation_id must be printable ASCII, got {op!r}")
    return StepRequest(JobRef(request.job_id, claims, list(request.pod_uids), request.claim_name), request.backend,
                       request.group_id, t, op, _app(request))


def _app(request: apb.SwitchStepRequest) -> AppEngine | None:
    """The step's engine (None when absent); raises InvalidArgument naming the bad field
    (a URL that is not loopback, an unknown engine, ...)."""
    if not request.HasField("app"):
        return None
    a = request.app
    try:
        return AppEngine(engine=a.engine, url=a.url, level=a.level or 1,  # type: ignore[arg-type]
                         timeoutSeconds=a.timeout_seconds or DEFAULT_APP_TIMEOUT_SECONDS)
    except ValidationError as err:
        raise InvalidArgument(f"invalid app engine: {problems(err, 'app.')}") from None


def _outcome(o: StepOutcome) -> apb.SwitchStepResponse:
    return apb.SwitchStepResponse(job_id=o.job_id, processes=_procs(o.processes), bytes=o.bytes,
                                  seconds=o.seconds)


class CallerCheck(Protocol):
    async def check(self, metadata: Any) -> str:
        """The caller's name; raises Unauthenticated or PermissionDenied."""
        ...


class NodeAgentServicer(apb_grpc.NodeAgentServicer):
    """`callers`: None serves anyone (unix sockets, the demo, tests); else every call must
    pass `callers.check` with its invocation metadata."""

    def __init__(self, agent: NodeAgent, callers: CallerCheck | None = None) -> None:
        self._agent = agent
        self._callers = callers

    async def _check(self, context: grpc.aio.ServicerContext) -> None:
        if self._callers is not None:
            await self._callers.check(context.invocation_metadata())

    @rpc_method
    async def Checkpoint(self, request: apb.SwitchStepRequest,
                         context: grpc.aio.ServicerContext) -> apb.SwitchStepResponse:
        await self._check(context)
        return _outcome(await self._agent.checkpoint(_step_request(request)))

    @rpc_method
    async def Restore(self, request: apb.SwitchStepRequest,
                      context: grpc.aio.ServicerContext) -> apb.SwitchStepResponse:
        await self._check(context)
        return _outcome(await self._agent.restore(_step_request(request)))

    @rpc_method
    async def GetJobState(self, request: apb.GetJobStateRequest,
                          context: grpc.aio.ServicerContext) -> apb.JobState:
        await self._check(context)
        _check_job_id(request.job_id)
        procs = await self._agent.state(request.job_id, request.backend)
        return apb.JobState(job_id=request.job_id, backend=request.backend, state=job_state(procs),
                            processes=_procs(procs))

    @rpc_method
    async def GetMemory(self, request: apb.GetMemoryRequest,
                        context: grpc.aio.ServicerContext) -> apb.MemoryReport:
        await self._check(context)
        view = await self._agent.memory([_step_request(j, backend_required=False).job for j in request.jobs],
                                        request.watch_seconds, request.low_free_bytes)
        names = sorted(set(view.device_bytes) | set(view.checkpointed_bytes) | set(view.processes))
        return apb.MemoryReport(
            gpus=[apb.GpuMemory(uuid=g.uuid, index=g.index, total_bytes=g.total, free_bytes=g.free,
                                exiting_bytes=view.exiting_bytes.get(g.uuid, 0)) for g in view.gpus],
            jobs=[apb.JobMemory(job_id=n, device_bytes=view.device_bytes.get(n, {}),
                                checkpointed_bytes=view.checkpointed_bytes.get(n, {}),
                                peak_device_bytes=view.peak_bytes.get(n, {}),
                                processes=view.processes.get(n, [])) for n in names],
            host_available_bytes=view.host_available, incarnation=view.incarnation, busy_jobs=view.busy_jobs)

    @rpc_method
    async def GetLiveJobs(self, request: apb.GetLiveJobsRequest, context: grpc.aio.ServicerContext) -> apb.LiveJobs:
        await self._check(context)
        steps = [_step_request(j, backend_required=False) for j in request.jobs]
        live, gone, clientless = await self._agent.live_jobs([r.job for r in steps],
                                                             {r.job.job_id: r.app for r in steps if r.app is not None})
        return apb.LiveJobs(live=live, gone=gone, clientless=clientless)

    @rpc_method
    async def ListJobs(self, request: apb.ListJobsRequest,
                       context: grpc.aio.ServicerContext) -> apb.ListJobsResponse:
        await self._check(context)
        jobs = [apb.JobState(job_id=job, backend=r.backend, state=r.phase, group_id=r.group,
                             processes=[apb.ProcessState(pid=p, state="checkpointed", gpu_bytes=b)
                                        for p, b in r.pids.items()])
                for job, r in sorted(self._agent.records.jobs.items())]
        return apb.ListJobsResponse(jobs=jobs)
