"""AgentClient / AgentPool: the orchestrator's gRPC calls to node agents.

Owned by the orchestrator; used by `SwitchCoordinator`. One `grpc.aio` channel per
agent target, reused; errors are translated to `timeslice.driver.errors` here. With a
`TokenFile` (the controller's `--agent-token-file`) every call carries `authorization:
Bearer <token>` for agents that run with `--agent-auth tokenreview`.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import grpc.aio
from timeslice.controller.orchestrator.config import MemberSpec
from timeslice.driver.agentapi.v1 import agent_pb2 as apb
from timeslice.driver.agentapi.v1 import agent_pb2_grpc as apb_grpc
from timeslice.driver.bearer import Metadata, TokenFile
from timeslice.driver.errors import Unavailable, error_from_status

# Target prefix of a node without a node agent: `no-agent:<node>` (see MissingAgent).
MISSING_PREFIX = "no-agent:"
# Slack on top of the step's own bound, for the RPC itself (seconds).
RPC_SLACK_SECONDS = 5.0
# A channel is reused across agent restarts (same target under hostNetwork): cap gRPC's
# reconnect backoff (default up to 120 s, during which every call fails at once).
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 1000))


@dataclass(frozen=True)
class StepResult:
    bytes: int
    seconds: float


class AgentClient:
    """`token`: the bearer token file sent on every call (None: no token)."""

    def __init__(self, target: str, token: TokenFile | None = None) -> None:
        self.target = target
        self._token = token
        self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = apb_grpc.NodeAgentStub(self._channel)

    def _metadata(self) -> Metadata | None:
        """The call's token; raises Unauthenticated when the token file cannot be read."""
        return self._token.metadata() if self._token is not None else None

    async def checkpoint(self, job_id: str, backend: str, group_id: str, timeout: float,
                         member: MemberSpec | None = None) -> StepResult:
        """Checkpoint `job_id` on this node (its claims there, when `member` says). Raises a
        `TimeSliceServerError` subclass."""
        return await self._step(self._stub.Checkpoint, "checkpoint", job_id, backend, group_id, timeout, member)

    async def restore(self, job_id: str, backend: str, group_id: str, timeout: float,
                      member: MemberSpec | None = None) -> StepResult:
        """Restore `job_id` on this node. Raises a `TimeSliceServerError` subclass."""
        return await self._step(self._stub.Restore, "restore", job_id, backend, group_id, timeout, member)

    async def _step(self, rpc: grpc.aio.UnaryUnaryMultiCallable, what: str, job_id: str, backend: str,
                    group_id: str, timeout: float, member: MemberSpec | None) -> StepResult:
        claims = member.claims_by_agent.get(self.target, ()) if member else ()
        req = apb.SwitchStepRequest(job_id=job_id, backend=backend, timeout_seconds=timeout, group_id=group_id,
                                    claims=[apb.ClaimRef(namespace=ns, name=n) for ns, n in claims],
                                    pod_uids=member.pod_uids if member else (),
                                    claim_name=member.claim_name if member else "")
        try:
            resp = await rpc(req, timeout=timeout + RPC_SLACK_SECONDS, metadata=self._metadata())
        except grpc.aio.AioRpcError as err:
            raise error_from_status(err.code(), f"{what} of job {job_id} on agent {self.target}: "
                                                f"{err.code().name}: {err.details()}") from err
        return StepResult(int(resp.bytes), float(resp.seconds))

    async def checkpointed_jobs(self) -> set[str]:
        """Jobs this agent holds checkpoint records for (it checkpointed them). Raises a
        `TimeSliceServerError` subclass (`Unauthenticated` / `PermissionDenied`: the agent
        refused our token)."""
        try:
            resp = await self._stub.ListJobs(apb.ListJobsRequest(), timeout=RPC_SLACK_SECONDS,
                                             metadata=self._metadata())
        except grpc.aio.AioRpcError as err:
            raise error_from_status(err.code(), f"list jobs on agent {self.target}: {err.details()}") from err
        return {j.job_id for j in resp.jobs}

    async def close(self) -> None:
        await self._channel.close()


class MissingAgent(AgentClient):
    """The stand-in for a node without a node agent (target `no-agent:<node>`): every
    call raises `Unavailable`, so a switch there fails and rolls back with a clear cause."""

    def __init__(self, target: str) -> None:  # no channel
        self.target = target
        self._node = target.partition(":")[2]

    async def checkpoint(self, job_id: str, *args: object, **kw: object) -> StepResult:
        raise self._missing(f"checkpoint of job {job_id}")

    async def restore(self, job_id: str, *args: object, **kw: object) -> StepResult:
        raise self._missing(f"restore of job {job_id}")

    async def checkpointed_jobs(self) -> set[str]:
        raise self._missing("list jobs")

    def _missing(self, what: str) -> Unavailable:
        return Unavailable(f"{what} on node {self._node}: no node agent there (no running timeslice-kubelet-plugin "
                           "pod on that node)")

    async def close(self) -> None:
        pass


class AgentPool:
    """Agent clients by target, created on first use, all sending `token` (None: no
    token); `MISSING_PREFIX` targets get a `MissingAgent`."""

    def __init__(self, token: TokenFile | None = None) -> None:
        self._token = token
        self._clients: dict[str, AgentClient] = {}

    def get(self, target: str) -> AgentClient:
        client = self._clients.get(target)
        if client is None:
            if target.startswith(MISSING_PREFIX):
                client = self._clients[target] = MissingAgent(target)
            else:
                client = self._clients[target] = AgentClient(target, self._token)
        return client

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()


