"""The node agent API with `--agent-auth tokenreview`: a real agent gRPC server on
loopback TCP; TokenReviews by the real kubernetes.aio client against the fake API server
(tests/fake_apiserver.py) over HTTP."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from timeslice.driver.agentapi.v1 import agent_pb2 as apb
from timeslice.driver.agentapi.v1 import agent_pb2_grpc as apb_grpc
from timeslice.driver.names import AGENT_AUDIENCE, DEFAULT_AGENT_CALLERS
from timeslice.driver.tokenreview import TokenReviewer
from timeslice.kubelet_plugin.agent.auth import AllowedCallers
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.server import create_server

from tests.conftest import FakeBackend
from tests.fake_apiserver import FakeApiServer

CONTROLLER = DEFAULT_AGENT_CALLERS[0]


@dataclass
class Agent:
    target: str
    apiserver: FakeApiServer
    calls: list[tuple[str, str, tuple[int, ...]]]


@pytest.fixture
async def agent(token_api, tmp_path) -> AsyncIterator[Agent]:
    """A node agent on 127.0.0.1 that only the controller's ServiceAccount may call. Tokens:
    `controller` (the controller, audience timeslice.dev/node-agent), `other-sa` (another
    ServiceAccount, same audience), `client-pod` (the controller's, but for audience
    timeslice.dev, as client pods mount)."""
    apiserver, auth_api = token_api
    apiserver.add_token("controller", CONTROLLER, [AGENT_AUDIENCE])
    apiserver.add_token("other-sa", "system:serviceaccount:ns:intruder", [AGENT_AUDIENCE])
    apiserver.add_token("client-pod", CONTROLLER, ["timeslice.dev"])
    calls: list[tuple[str, str, tuple[int, ...]]] = []
    node_agent = NodeAgent(StaticProcessResolver({"job-a": [os.getpid()]}), backends=[FakeBackend("n", calls, "none")],
                           records_path=tmp_path / "records.json")
    callers = AllowedCallers(TokenReviewer(auth_api, AGENT_AUDIENCE), DEFAULT_AGENT_CALLERS)
    server, port = await create_server(node_agent, "127.0.0.1:0", callers)
    yield Agent(f"127.0.0.1:{port}", apiserver, calls)
    await server.stop(0)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def test_every_node_agent_method_needs_the_controllers_token(agent) -> None:
    requests = {"Checkpoint": apb.SwitchStepRequest(job_id="job-a", backend="none"),
                "Restore": apb.SwitchStepRequest(job_id="job-a", backend="none"),
                "GetJobState": apb.GetJobStateRequest(job_id="job-a", backend="none"),
                "ListJobs": apb.ListJobsRequest()}
    assert set(requests) == set(apb.DESCRIPTOR.services_by_name["NodeAgent"].methods_by_name)
    async with grpc.aio.insecure_channel(agent.target) as ch:
        stub = apb_grpc.NodeAgentStub(ch)
        for method, req in requests.items():
            for metadata, code, text in [
                    (None, grpc.StatusCode.UNAUTHENTICATED, "no bearer token: the node agent runs with --agent-auth "
                                                            "tokenreview"),
                    (bearer("forged"), grpc.StatusCode.UNAUTHENTICATED, "token rejected: invalid bearer token"),
                    (bearer("client-pod"), grpc.StatusCode.UNAUTHENTICATED, "invalid for the target audiences"),
                    (bearer("other-sa"), grpc.StatusCode.PERMISSION_DENIED,
                     "system:serviceaccount:ns:intruder may not call the node agent (allowed: " + CONTROLLER)]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await getattr(stub, method)(req, metadata=metadata)
                assert err.value.code() == code and text in err.value.details(), (method, err.value.details())
            await getattr(stub, method)(req, metadata=bearer("controller"))
    assert [c[1] for c in agent.calls] == ["checkpoint", "restore"]  # only the controller's calls ran


async def test_the_health_service_stays_open(agent) -> None:
    async with grpc.aio.insecure_channel(agent.target) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    assert agent.apiserver.reviews == []


async def test_a_failing_token_review_is_unavailable_not_a_crash(agent) -> None:
    agent.apiserver.fail("TokenReview", 503)
    async with grpc.aio.insecure_channel(agent.target) as ch:
        stub = apb_grpc.NodeAgentStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListJobs(apb.ListJobsRequest(), metadata=bearer("controller"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "TokenReview for audience timeslice.dev/node-agent: HTTP 503" in err.value.details()
        await stub.ListJobs(apb.ListJobsRequest(), metadata=bearer("controller"))  # next one reviews again


def test_allowed_callers_needs_someone() -> None:
    with pytest.raises(ValueError, match="no allowed users"):
        AllowedCallers(TokenReviewer(object(), AGENT_AUDIENCE), [])
