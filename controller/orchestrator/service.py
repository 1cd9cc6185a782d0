"""gRPC servicer of `timeslice.v1.Orchestrator`: validates requests, calls `LockGroup`.

Owned by the orchestrator server. Domain errors (`timeslice.driver.errors`) become
gRPC statuses with a message naming the field or state that was wrong
(`grpc_server.rpc_method`). A blocked Acquire is an awaiting coroutine, never a thread.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc.aio
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.group import LockGroup
from timeslice.controller.orchestrator.group_model import GroupView
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.driver import names
from timeslice.driver.errors import FailedPrecondition, InvalidArgument, TimeSliceServerError
from timeslice.driver.grpc_server import rpc_method
from timeslice.v1 import orchestrator_pb2 as pb
from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

# Printable, no whitespace, at most 253 characters (a DNS subdomain's length).
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,252}$")


def _check_id(field: str, value: str) -> str:
    if not value:
        raise InvalidArgument(f"{field} is required")
    if not _ID.fullmatch(value):
        raise InvalidArgument(f"{field} {value[:64]!r} is invalid: use at most 253 letters, digits and . _ : / @ -,"
                              " starting with a letter or digit")
    return value


def _jobs(v: GroupView) -> list[pb.JobResidency]:
    snap = v.memory
    out = []
    for job in sorted({*v.resident_jobs, *v.checkpointed_jobs, *v.peaks, *v.declared}):
        state = "resident" if job in v.resident_jobs else ("checkpointed" if job in v.checkpointed_jobs else "unknown")
        out.append(pb.JobResidency(
            job_id=job, state=state, peak_bytes=sum(v.peaks.get(job, {}).values()),
            device_bytes=sum(snap.on_device(job).values()) if snap else 0,
            checkpointed_bytes=sum(snap.checkpointed_bytes.get(job, {}).values()) if snap else 0,
            declared_bytes=v.declared.get(job, 0),
            reserved_bytes=sum(v.reserved.get(job, {}).values()), settled=job in v.reserved))
    return out


def group_status(v: GroupView) -> pb.GroupStatus:
    snap = v.memory
    s = pb.GroupStatus(
        residency=v.residency, resident_job_ids=v.resident_jobs, jobs=_jobs(v), warnings=v.warnings,
        devices=[pb.DeviceMemory(device=d, total_bytes=m.total, free_bytes=m.free,
                                 age_seconds=max(0.0, time.monotonic() - snap.taken_at))
                 for d, m in sorted(snap.devices.items())] if snap else [],
        group_id=v.group_id, backend=v.backend, phase=v.phase, epoch=v.epoch,
        resident_job_id=v.resident_job or "", checkpointed_job_ids=v.checkpointed_jobs,
        grants=v.counters.grants, switches=v.counters.switches,
        failed_switches=v.counters.failed_switches, lease_expiries=v.counters.lease_expiries,
        preemptions=v.counters.preemptions, agent_targets=v.agents,
        waiters=[pb.Waiter(job_id=w.job_id, priority=w.priority, waiting_seconds=w.waiting_seconds,
                           position=w.position) for w in v.waiters],
        recent_switches=[pb.SwitchRecord(
            from_job_id=",".join(r.evicted) or r.from_job or "", to_job_id=r.to_job, ok=r.ok, error=r.error,
            checkpoint_seconds=r.checkpoint_seconds, restore_seconds=r.restore_seconds,
            bytes_checkpointed=r.bytes_checkpointed, bytes_restored=r.bytes_restored,
            finished_at_unix=r.finished_at_unix) for r in v.recent_switches])
    if v.holder is not None:  # never the lease id: it is the holder's secret (a release needs it)
        s.holder.CopyFrom(pb.Holder(job_id=v.holder.job_id,
                                    epoch=v.holder.epoch, held_seconds=v.held_seconds,
                                    lease_remaining_seconds=v.lease_remaining_seconds,
                                    kept_past_lease=v.holder.kept))
    return s


class Caller(Protocol):
    pod_uid: str  # the caller's pod ("" outside a cluster)

    @property
    def job_id(self) -> str:
        """The job a call that names none acts for ("": the job of the caller's pod)."""
        ...

    def job_for(self, named: str) -> str:
        """The job a call that names `named` acts for."""
        ...


class Authenticator(Protocol):
    """Who calls: the cluster's TokenReview (`controller/auth.py`) or one-box mode's peer
    credentials (`controller/peer_auth.py`)."""

    async def identify(self, context: grpc.aio.ServicerContext) -> Caller:
        """The caller of a lock call; raises Unauthenticated."""
        ...

    async def authenticate(self, context: grpc.aio.ServicerContext) -> str:
        """A status call's caller, by name; raises Unauthenticated."""
        ...

    def admit(self, caller: Caller, group: LockGroup, job: str) -> None:
        """May `caller` act for `job` in `group`? Raises PermissionDenied / FailedPrecondition."""
        ...


class OrchestratorServicer(pb_grpc.OrchestratorServicer):
    """`authenticator`: None serves anyone (static groups, the demo); else every lock call
    must come from a caller the authenticator admits for the job it acts for, and a status
    call from any caller it accepts (status carries no lease ids)."""

    def __init__(self, orchestrator: Orchestrator, authenticator: Authenticator | None = None) -> None:
        self._orch = orchestrator
        self._auth = authenticator

    async def _resolve(self, request: Any, context: grpc.aio.ServicerContext) -> tuple[LockGroup, str]:
        """(group, member job) the request acts for, admitted for the caller."""
        if self._auth is None:
            return self._orch.group_for(_check_id("job_id", request.job_id), _check_id("group_id", request.group_id))
        group_id = _check_id("group_id", request.group_id) if request.group_id else ""  # "": the pod's only claim
        caller = await self._auth.identify(context)
        # unnamed, "": the job of the caller's pod (token -> pod -> claim sets)
        job = caller.job_for(_check_id("job_id", request.job_id)) if request.job_id else caller.job_id
        group, job = self._orch.group_for(_check_id("job_id", job) if job else "", group_id, caller.pod_uid)
        self._auth.admit(caller, group, job)
        return group, job

    async def _authenticated(self, context: grpc.aio.ServicerContext) -> None:
        if self._auth is not None:
            await self._auth.authenticate(context)

    @rpc_method
    async def Acquire(self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext) -> pb.AcquireResponse:
        group, job = await self._resolve(request, context)
        t = request.timeout_seconds
        if not math.isfinite(t) or t < 0:
            raise InvalidArgument(f"timeout_seconds must be a finite number >= 0, got {t}")
        request_id = request.request_id or uuid.uuid4().hex
        if len(request_id) > 128 or request_id.startswith("*"):
            raise InvalidArgument("request_id must be at most 128 characters and not start with '*' "
                                  "(reserved for the orchestrator's own queue entries)")
        if group.spec.backend == names.BACKEND_APP and group.spec.app(job) is None:
            raise InvalidArgument(_no_engine(group.spec, job))
        grant = await group.acquire(job, request.priority, request_id, t or None, request.memory_bytes)
        return pb.AcquireResponse(lease_id=grant.lease_id, epoch=grant.epoch, lease_seconds=grant.lease_seconds,
                                  waited_seconds=grant.waited_seconds, restored=grant.restored,
                                  switch_seconds=grant.switch_seconds, job_id=job)

    @rpc_method
    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        group, job = await self._resolve(request, context)
        waiters, started = group.release(job, request.lease_id, request.epoch, request.request_id)
        return pb.ReleaseResponse(waiters=waiters, switch_started=started)

    @rpc_method
    async def CancelAcquire(self, request: pb.CancelAcquireRequest,
                            context: grpc.aio.ServicerContext) -> pb.CancelAcquireResponse:
        group, job = await self._resolve(request, context)
        if not request.request_id:
            raise InvalidArgument("request_id is required")
        return pb.CancelAcquireResponse(was=group.cancel(job, request.request_id))

    @rpc_method
    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        group, job = await self._resolve(request, context)
        return pb.LeaveResponse(result=self._orch.leave(group.id, job))

    @rpc_method
    async def KeepAlive(self, request: pb.KeepAliveRequest,
                        context: grpc.aio.ServicerContext) -> pb.KeepAliveResponse:
        group, job = await self._resolve(request, context)
        remaining = group.keep_alive(job, request.lease_id, request.epoch, request.request_id, request.confirm,
                                     request.lost)
        return pb.KeepAliveResponse(lease_remaining_seconds=remaining)

    async def MemoryCommands(self, request: pb.MemoryCommandsRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.MemoryCommand]:
        """A cooperative process's command stream (`CooperativeJobs.stream`)."""
        try:
            group, job = await self._resolve(request, context)
            if group.spec.backend != names.BACKEND_COOPERATIVE:
                raise FailedPrecondition(f"group {group.id} uses backend {group.spec.backend}, not cooperative: its "
                                         "GPU state is moved by the node agent, nothing to register")
            if not request.stream_id or len(request.stream_id) > 128:
                raise InvalidArgument("stream_id is required (at most 128 characters)")
        except TimeSliceServerError as err:
            await context.abort(err.code, str(err))
        report = request.checkpoint if request.HasField("checkpoint") else None
        async for command in self._orch.cooperative.stream(group.id, job, request.stream_id, request.pid,
                                                           request.registered_bytes, report):
            yield command

    @rpc_method
    async def AckMemoryCommand(self, request: pb.MemoryCommandAck,
                               context: grpc.aio.ServicerContext) -> pb.MemoryCommandAckResponse:
        _, job = await self._resolve(request, context)
        request.job_id = job
        self._orch.cooperative.ack(request)
        return pb.MemoryCommandAckResponse()

    @rpc_method
    async def GetGroupStatus(self, request: pb.GetGroupStatusRequest,
                             context: grpc.aio.ServicerContext) -> pb.GroupStatus:
        await self._authenticated(context)
        return group_status(self._orch.group(_check_id("group_id", request.group_id)).view())

    @rpc_method
    async def ListGroups(self, request: pb.ListGroupsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListGroupsResponse:
        await self._authenticated(context)
        return pb.ListGroupsResponse(groups=[group_status(g.view()) for g in self._orch.groups()])


def _no_engine(spec: GroupSpec, job: str) -> str:
    """Why `job` may not acquire group `spec` on backend `app`: no engine of it is named (its
    switches would fail at the other jobs' grants, naming it: a helper's attack, unnamed clients
    of a one-box group)."""
    where = (f"the group's `apps` names {', '.join(sorted(spec.apps)) or 'none'}: run the job's client and its "
             f"engine with TIMESLICE_JOB set to its name there" if not spec.members
             else "its claim's TimeSliceConfig names no `app`")
    return f"group {spec.id} uses backend app and names no inference engine for job {job}: {where}"
