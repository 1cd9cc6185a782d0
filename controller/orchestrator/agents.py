"""AgentClient: the orchestrator's gRPC calls to one node agent.

Used by `SwitchCoordinator` through the `AgentPool` (agent_pool.py), which makes one client per agent
target. One `grpc.aio` channel per agent target, reused; errors are translated to `timeslice.driver.errors`
here. With a `TokenFile` (the controller's `--agent-token-file`) every call carries `authorization:
Bearer <token>` for agents that run with `--agent-auth tokenreview`. Every step carries an
operation id (`new_operation_id`, or the caller's: the same id on a resend of a step whose
reply was lost, so that the agent runs it once and answers with its outcome).

TLS: for a target with a certificate (its plugin pod's, kubelet plugin `--agent-tls`) the channel is TLS
with that certificate as the only trusted root and the server name `timeslice-node-agent` checked instead
of the address (`grpc.ssl_channel_credentials(root_certificates=...)` and the channel option
`grpc.ssl_target_name_override`, gRPC Python API reference): pinning, no CA. A target without one gets a
plaintext channel (the pool decides whether such a target may be called).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio
from timeslice.controller.orchestrator.config import MemberSpec
from timeslice.driver.agentapi.v1 import agent_pb2 as apb
from timeslice.driver.agentapi.v1 import agent_pb2_grpc as apb_grpc
from timeslice.driver.app_engine import AppEngine
from timeslice.driver.bearer import Metadata, TokenFile
from timeslice.driver.certificates import fingerprint
from timeslice.driver.errors import OutcomeUnknown, TimeSliceServerError, error_from_status
from timeslice.driver.names import AGENT_CERTIFICATE_ANNOTATION, AGENT_TLS_SERVER_NAME

# Slack on top of the step's own bound, for the RPC itself (seconds).
RPC_SLACK_SECONDS = 5.0
# A channel is reused across agent restarts (same target under hostNetwork): cap gRPC's
# reconnect backoff (default up to 120 s, during which every call fails at once).
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 1000))
# TLS channels check this name in the agent's certificate instead of the target's address
# (an IP, the node's under hostNetwork, which a self-signed certificate cannot foresee).
TLS_OPTIONS = (("grpc.ssl_target_name_override", AGENT_TLS_SERVER_NAME),)
# Words of gRPC's error details (of an UNAVAILABLE call) that mark a failed TLS handshake or
# certificate check, e.g. "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: ...
# CERTIFICATE_VERIFY_FAILED" or "Hostname Verification Check failed".
_TLS_FAILURE_WORDS = ("handshake", "certificate_verify_failed", "ssl_error", "hostname verification")


def new_operation_id() -> str:
    """A fresh operation id: one per step attempt (`SwitchStepRequest.operation_id`)."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class StepResult:
    """What one step did on one node: bytes moved, seconds, and how many of the job's
    processes it found there (None: not told, as by a cooperative job's processes);
    `departed`: a process of the job left during the step (cooperative), so what it held
    leaves the GPUs only as it exits."""

    bytes: int
    seconds: float
    processes: int | None = None
    departed: bool = False


@dataclass(frozen=True)
class AgentMemory:
    """One node's `GetMemory` answer: `gpus` uuid -> (total, free) bytes; per job, bytes by
    GPU uuid on the GPUs now and checkpointed; host bytes available for checkpoints;
    `incarnation`: the answering agent's run (a new one after a restart; "" from older agents);
    `processes`: per job, the names of its processes the bytes were counted from
    ("<pid>:<start time>", `JobMemory.processes`); `exiting`: uuid -> bytes of ended processes
    (`GpuMemory.exiting_bytes`)."""

    gpus: dict[str, tuple[int, int]]
    device_bytes: dict[str, dict[str, int]]
    checkpointed_bytes: dict[str, dict[str, int]]
    host_available: int
    peak_bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # over a watch (`memory(watch=...)`)
    incarnation: str = ""
    processes: dict[str, list[str]] = field(default_factory=dict)
    exiting: dict[str, int] = field(default_factory=dict)
    busy: set[str] = field(default_factory=set)  # jobs with a step in flight there (`MemoryReport.busy_jobs`)


class AgentClient:
    """Calls one node agent at `target` (`host:port` or `unix:///path`). `token`: the bearer
    token file sent on every call (None: no token). `certificate`: the agent's own
    certificate (PEM), pinned as the only trusted root of a TLS channel that checks the
    name `timeslice-node-agent` (None: a plaintext channel). Raises ValueError when
    `certificate` is not one PEM certificate."""

    def __init__(self, target: str, token: TokenFile | None = None, certificate: str | None = None) -> None:
        self.target = target
        self._token = token
        self.certificate = certificate
        if certificate is None:
            self.fingerprint = ""
            self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        else:
            self.fingerprint = fingerprint(certificate)
            credentials = grpc.ssl_channel_credentials(root_certificates=certificate.encode())
            self._channel = grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS + TLS_OPTIONS)
        self._stub = apb_grpc.NodeAgentStub(self._channel)

    @property
    def tls(self) -> bool:
        return self.certificate is not None

    def _metadata(self) -> Metadata | None:
        """The call's token; raises Unauthenticated when the token file cannot be read."""
        return self._token.metadata() if self._token is not None else None

    def _error(self, err: grpc.aio.AioRpcError, what: str) -> TimeSliceServerError:
        """`err` in the driver's tree, its message naming the call, the agent and, for a
        failed TLS handshake, the certificate that was pinned."""
        details = err.details() or ""
        message = f"{what} on agent {self.target}: {err.code().name}: {details}"
        if self.tls and err.code() == grpc.StatusCode.UNAVAILABLE and \
                any(w in details.lower() for w in _TLS_FAILURE_WORDS):
            message += (f" (TLS: the agent did not prove it holds the certificate pinned for it, "
                        f"{self.fingerprint}, for the name {AGENT_TLS_SERVER_NAME}: in a cluster the one its "
                        f"plugin pod publishes, annotation {AGENT_CERTIFICATE_ANNOTATION} (a restarted plugin "
                        f"publishes a new one, which replaces this channel); for `timeslice node-agent`, the file "
                        f"agent_certificates names in the orchestrator's config)")
        return error_from_status(err.code(), message)

    async def checkpoint(self, job_id: str, backend: str, group_id: str, timeout: float,
                         member: MemberSpec | None = None, operation_id: str = "",
                         app: AppEngine | None = None) -> StepResult:
        """Checkpoint `job_id` on this node (its claims there, when `member` says) as the
        operation `operation_id` ("": a new one); `app`: its engine (backend app). Raises a
        `TimeSliceServerError` subclass; `OutcomeUnknown` with `no_reply` when no reply came
        (resend it with the same id)."""
        return await self._step(self._stub.Checkpoint, "checkpoint", job_id, backend, group_id, timeout, member,
                                operation_id, app)

    async def restore(self, job_id: str, backend: str, group_id: str, timeout: float,
                      member: MemberSpec | None = None, operation_id: str = "",
                      app: AppEngine | None = None) -> StepResult:
        """Restore `job_id` on this node, as `checkpoint`. Raises a `TimeSliceServerError` subclass."""
        return await self._step(self._stub.Restore, "restore", job_id, backend, group_id, timeout, member,
                                operation_id, app)

    async def _step(self, rpc: grpc.aio.UnaryUnaryMultiCallable, what: str, job_id: str, backend: str,
                    group_id: str, timeout: float, member: MemberSpec | None, operation_id: str,
                    app: AppEngine | None) -> StepResult:
        operation_id = operation_id or new_operation_id()
        req = self._step_request(job_id, backend, group_id, timeout, member, operation_id, app)
        deadline = timeout + RPC_SLACK_SECONDS
        t0 = time.monotonic()
        try:
            resp = await rpc(req, timeout=deadline, metadata=self._metadata())
        except grpc.aio.AioRpcError as err:
            known = self._error(err, f"{what} of job {job_id}")
            code = err.code()
            # DEADLINE_EXCEEDED before our own deadline is the agent's reply (its step timed out
            # and was rolled back); at our deadline, no reply came
            no_reply = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or (
                code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 >= deadline - 0.1)
            if no_reply or code == grpc.StatusCode.UNKNOWN:
                why = "no reply" if no_reply else "an unexpected error"
                raise OutcomeUnknown(f"{known} (operation {operation_id}: the step's outcome is unknown: {why})",
                                     no_reply) from err
            raise known from err
        return StepResult(int(resp.bytes), float(resp.seconds), len(resp.processes))

    async def memory(self, jobs: Sequence[tuple[str, MemberSpec | None]], watch: float = 0.0,
                     low_free: int = 0) -> AgentMemory:
        """This node's memory report for `jobs` ((job, member) pairs). `watch` > 0 seconds:
        the agent samples its GPUs for that long, or until one has less than `low_free`
        bytes free, and reports each job's peak over the samples. Raises a
        `TimeSliceServerError` subclass."""
        req = apb.GetMemoryRequest(jobs=[self._step_request(job, "", "", 0.0, member) for job, member in jobs],
                                   watch_seconds=watch, low_free_bytes=low_free)
        try:
            resp = await self._stub.GetMemory(req, timeout=watch + RPC_SLACK_SECONDS, metadata=self._metadata())
        except grpc.aio.AioRpcError as err:
            raise self._error(err, "memory report") from err
        return AgentMemory({g.uuid: (int(g.total_bytes), int(g.free_bytes)) for g in resp.gpus},
                           {j.job_id: dict(j.device_bytes) for j in resp.jobs},
                           {j.job_id: dict(j.checkpointed_bytes) for j in resp.jobs if j.checkpointed_bytes},
                           int(resp.host_available_bytes),
                           {j.job_id: dict(j.peak_device_bytes) for j in resp.jobs if j.peak_device_bytes},
                           resp.incarnation, {j.job_id: list(j.processes) for j in resp.jobs if j.processes},
                           {g.uuid: int(g.exiting_bytes) for g in resp.gpus if g.exiting_bytes}, set(resp.busy_jobs))

    async def live_jobs(self, jobs: Sequence[tuple[str, MemberSpec | None, AppEngine | None]]
                        ) -> tuple[set[str], set[str], set[str]]:
        """(live, gone, clientless) among `jobs` ((job, member, its engine on backend app)) on
        this node (`GetLiveJobs`): a process of the job runs here; none does and the job had
        processes here; only its engine's do, its client's are gone. Raises a
        `TimeSliceServerError` subclass."""
        req = apb.GetLiveJobsRequest(jobs=[self._step_request(job, "", "", 0.0, member, app=app)
                                           for job, member, app in jobs])
        try:
            resp = await self._stub.GetLiveJobs(req, timeout=RPC_SLACK_SECONDS, metadata=self._metadata())
        except grpc.aio.AioRpcError as err:
            raise self._error(err, "live jobs") from err
        return set(resp.live), set(resp.gone), set(resp.clientless)

    def _step_request(self, job_id: str, backend: str, group_id: str, timeout: float,
                      member: MemberSpec | None, operation_id: str = "",
                      app: AppEngine | None = None) -> apb.SwitchStepRequest:
        claims = member.claims_by_agent.get(self.target, ()) if member else ()
        engine = apb.AppEngine(engine=app.engine, url=app.url, level=app.level,
                               timeout_seconds=app.timeoutSeconds) if app is not None else None
        return apb.SwitchStepRequest(job_id=job_id, backend=backend, timeout_seconds=timeout, group_id=group_id,
                                     claims=[apb.ClaimRef(namespace=ns, name=n) for ns, n in claims],
                                     pod_uids=member.pod_uids if member else (),
                                     claim_name=member.claim_name if member else "", operation_id=operation_id,
                                     app=engine)

    async def checkpointed_jobs(self, group_id: str | None = None) -> set[str]:
        """Jobs this agent holds checkpoint records for (it checkpointed them), of `group_id`
        only when given (records made for another group sharing the agent are not ours). Raises a
        `TimeSliceServerError` subclass (`Unauthenticated` / `PermissionDenied`: the agent
        refused our token)."""
        try:
            resp = await self._stub.ListJobs(apb.ListJobsRequest(), timeout=RPC_SLACK_SECONDS,
                                             metadata=self._metadata())
        except grpc.aio.AioRpcError as err:
            raise self._error(err, "list jobs") from err
        return {j.job_id for j in resp.jobs if group_id is None or j.group_id in ("", group_id)}

    async def close(self, grace: float | None = None) -> None:
        """Close the channel; calls still running get `grace` seconds (None: cancelled now)."""
        await self._channel.close(grace)
