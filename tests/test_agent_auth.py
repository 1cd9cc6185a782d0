"""The node agent API with `--agent-auth tokenreview`: a real agent gRPC server on a unix
socket (over TCP the orchestrator sends its token only with TLS: tests/test_agent_tls.py),
called by the controller's real `AgentClient` (and orchestrator) with a token file;
TokenReviews by the real kubernetes.aio client against the fake API server
(tests/fake_apiserver.py) over HTTP."""

from __future__ import annotations

import asyncio
import os
import re
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from timeslice import AsyncTimeSliceOrchestratorClient, SwitchFailed
from timeslice.controller.orchestrator.agent_pool import AgentPool
from timeslice.controller.orchestrator.agents import AgentClient
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.server import create_server as create_orchestrator_server
from timeslice.driver.agentapi.v1 import agent_pb2 as apb
from timeslice.driver.agentapi.v1 import agent_pb2_grpc as apb_grpc
from timeslice.driver.bearer import TokenFile
from timeslice.driver.errors import PermissionDenied, Unauthenticated
from timeslice.driver.names import AGENT_AUDIENCE, DEFAULT_AGENT_CALLERS
from timeslice.driver.tokenreview import TokenReviewer
from timeslice.kubelet_plugin.agent.auth import AllowedCallers
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.server import create_server

from tests.conftest import FakeBackend, eventually
from tests.fake_apiserver import FakeApiServer

CONTROLLER = DEFAULT_AGENT_CALLERS[0]


@dataclass
class Agent:
    target: str
    apiserver: FakeApiServer
    calls: list[tuple[str, str, tuple[int, ...]]]


@pytest.fixture
async def agent(token_api, tmp_path, short_tmp) -> AsyncIterator[Agent]:
    """A node agent on a unix socket that only the controller's ServiceAccount may call. Tokens:
    `controller` (the controller, audience timeslice.dev/node-agent), `other-sa` (another
    ServiceAccount, same audience), `client-pod` (the controller's, but for audience
    timeslice.dev, as client pods mount)."""
    apiserver, auth_api = token_api
    apiserver.add_token("controller", CONTROLLER, [AGENT_AUDIENCE])
    apiserver.add_token("other-sa", "system:serviceaccount:ns:intruder", [AGENT_AUDIENCE])
    apiserver.add_token("client-pod", CONTROLLER, ["timeslice.dev"])
    calls: list[tuple[str, str, tuple[int, ...]]] = []
    resolver = StaticProcessResolver({"a": [os.getpid()], "b": [os.getppid()]})  # live PIDs; FakeBackend stops none
    node_agent = NodeAgent(resolver, backends=[FakeBackend("n", calls, "freeze")],
                           records_path=tmp_path / "records.json")
    callers = AllowedCallers(TokenReviewer(auth_api, AGENT_AUDIENCE), DEFAULT_AGENT_CALLERS)
    target = f"unix://{short_tmp / 'agent.sock'}"
    server, _ = await create_server(node_agent, target, callers)
    yield Agent(target, apiserver, calls)
    await server.stop(0)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def test_every_node_agent_method_needs_the_controllers_token(agent) -> None:
    requests = {"Checkpoint": apb.SwitchStepRequest(job_id="a", backend="freeze"),
                "Restore": apb.SwitchStepRequest(job_id="a", backend="freeze"),
                "GetJobState": apb.GetJobStateRequest(job_id="a", backend="freeze"),
                "ListJobs": apb.ListJobsRequest(),
                "GetMemory": apb.GetMemoryRequest(jobs=[apb.SwitchStepRequest(job_id="a")]),
                "GetLiveJobs": apb.GetLiveJobsRequest(jobs=[apb.SwitchStepRequest(job_id="a")])}
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


def write_token(path: Path, token: str) -> None:
    """Replace the token file as the kubelet does: a new file renamed over the old one."""
    new = path.with_name(path.name + ".new")
    new.write_text(token + "\n")
    os.replace(new, path)


async def test_agent_client_without_a_token_is_unauthenticated(agent) -> None:
    client = AgentClient(agent.target)
    with pytest.raises(Unauthenticated, match=rf"checkpoint of job a on agent {re.escape(agent.target)}: "
                                              r"UNAUTHENTICATED: no bearer token"):
        await client.checkpoint("a", "freeze", "g", 5)
    with pytest.raises(Unauthenticated, match="no bearer token"):
        await client.checkpointed_jobs()
    await client.close()
    assert agent.calls == [] and agent.apiserver.reviews == []


async def test_agent_client_with_another_users_token_is_denied(agent, tmp_path) -> None:
    write_token(tmp_path / "token", "other-sa")
    client = AgentClient(agent.target, TokenFile(tmp_path / "token"))
    with pytest.raises(PermissionDenied, match="PERMISSION_DENIED: system:serviceaccount:ns:intruder may not call"):
        await client.restore("a", "freeze", "g", 5)
    await client.close()
    assert agent.calls == []


async def test_agent_client_with_the_controllers_token_works_and_the_review_is_cached(agent, tmp_path) -> None:
    write_token(tmp_path / "token", "controller")
    client = AgentClient(agent.target, TokenFile(tmp_path / "token"))
    step = await client.checkpoint("a", "freeze", "g", 5)
    assert step.bytes == 1000
    assert await client.checkpointed_jobs() == {"a"}
    await client.restore("a", "freeze", "g", 5)
    assert [c[1] for c in agent.calls] == ["checkpoint", "restore"]
    assert agent.apiserver.reviews == [{"token": "controller", "audiences": [AGENT_AUDIENCE]}]  # one for 3 calls
    await client.close()


async def test_a_rotated_token_file_is_picked_up(agent, tmp_path) -> None:
    agent.apiserver.add_token("controller-2", CONTROLLER, [AGENT_AUDIENCE])
    path = tmp_path / "token"
    write_token(path, "controller")
    client = AgentClient(agent.target, TokenFile(path))
    await client.checkpointed_jobs()
    write_token(path, "controller-2")  # the kubelet rotated the token
    await client.checkpointed_jobs()
    assert [r["token"] for r in agent.apiserver.reviews] == ["controller", "controller-2"]
    write_token(path, "other-sa")  # the next call sends the new token at once: no stale one
    with pytest.raises(PermissionDenied):
        await client.checkpointed_jobs()
    await client.close()


async def test_the_orchestrator_switches_jobs_on_an_authenticated_agent(agent, tmp_path) -> None:
    write_token(tmp_path / "token", "controller")
    for pool, ok in [(AgentPool(TokenFile(tmp_path / "token")), True), (AgentPool(), False)]:
        orch = Orchestrator([GroupSpec(id="g", backend="freeze", agents=(agent.target,))], agents=pool)
        server, port = await create_orchestrator_server(orch, "127.0.0.1:0")
        a = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{port}", "a", "g")
        b = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{port}", "b", "g",
                                             retry_failed_switches=False)  # the failure itself is tested
        try:
            await a.acquire()
            task = asyncio.create_task(b.acquire())
            await eventually(lambda o=orch: o.group("g").view().waiters)
            await a.release()
            if ok:
                await task  # a checkpointed on the agent, then b granted
                assert agent.calls[-1][1] == "checkpoint"
            else:
                with pytest.raises(SwitchFailed, match="UNAUTHENTICATED: no bearer token"):
                    await task
        finally:
            await a.close()
            await b.close()
            await server.stop(0)
            await orch.close()


def test_the_manifests_wire_the_agent_token() -> None:
    """manifests/base: the controller mounts a token of the agents' audience and sends it;
    the plugin checks it and may create TokenReviews; the allowed user is the controller's."""
    import yaml

    base = Path(__file__).resolve().parent.parent / "manifests" / "base"
    controller = next(d for d in yaml.safe_load_all((base / "controller.yaml").read_text())
                      if d["kind"] == "Deployment")
    pod = controller["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "projected" in v]
    (source,) = volume["projected"]["sources"]
    assert source["serviceAccountToken"] == {"path": "token", "audience": AGENT_AUDIENCE, "expirationSeconds": 3600}
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    command = pod["containers"][0]["command"]
    assert command[command.index("--agent-token-file") + 1] == f"{mount['mountPath']}/token"
    assert CONTROLLER == (f"system:serviceaccount:{controller['metadata']['namespace']}:"
                          f"{pod['serviceAccountName']}")
    plugin = yaml.safe_load((base / "kubelet-plugin.yaml").read_text())["spec"]["template"]["spec"]
    command = plugin["containers"][0]["command"]
    assert command[command.index("--agent-auth") + 1] == "tokenreview"
    role = next(d for d in yaml.safe_load_all((base / "rbac-kubelet-plugin.yaml").read_text())
                if d["kind"] == "ClusterRole")
    assert {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]} in role["rules"]


async def test_an_unauthenticated_agent_socket_is_its_owners_only(short_tmp) -> None:
    """Issue 10, item 12: `--agent-auth none` listened on 127.0.0.1:50052, where any local
    user could freeze any claim's processes. Now it serves a unix socket of mode 0600 (a
    socket left by an earlier run is replaced)."""
    import stat

    from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
    from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
    from timeslice.kubelet_plugin.agent.server import create_server

    path = short_tmp / "agent" / "agent.sock"
    for _ in range(2):
        server, _ = await create_server(NodeAgent(StaticProcessResolver()), f"unix://{path}")
        try:
            assert stat.S_ISSOCK(path.stat().st_mode)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        finally:
            await server.stop(0)
        if not path.exists():  # what a killed plugin leaves behind: a socket file nobody listens on
            left = socket.socket(socket.AF_UNIX)
            left.bind(str(path))
            left.close()
