"""The node agent channel over TLS (`kubelet-plugin --agent-tls`, `controller
--require-agent-tls`): a real node-agent gRPC server on 127.0.0.1 serving a real
self-signed certificate (`kubelet_plugin/agent/tls.py`), called by the controller's real
`AgentClient`s from an `AgentPool` that pins the certificate; TokenReviews and the pod
annotation through the real kubernetes.aio client against the fake API server
(tests/fake_apiserver.py) over HTTP."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from timeslice import AsyncTimeSliceOrchestratorClient, SwitchFailed
from timeslice.controller.grouping import Snapshot
from timeslice.controller.node_agents import AgentEndpoint, trim_plugin_pod
from timeslice.controller.orchestrator.agent_pool import AgentPool
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.server import create_server as create_orchestrator_server
from timeslice.controller.reconciler import Reconciler
from timeslice.driver.backoff import Backoff
from timeslice.driver.bearer import TokenFile
from timeslice.driver.certificates import fingerprint
from timeslice.driver.errors import InvalidArgument, TimeSliceServerError, Unavailable
from timeslice.driver.names import (
    AGENT_AUDIENCE,
    AGENT_CERTIFICATE_ANNOTATION,
    AGENT_TLS_SERVER_NAME,
    DEFAULT_AGENT_CALLERS,
)
from timeslice.driver.tokenreview import TokenReviewer
from timeslice.kubelet_plugin.agent.auth import AllowedCallers
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.server import create_server
from timeslice.kubelet_plugin.agent.tls import AgentIdentity, self_signed
from timeslice.kubelet_plugin.agent_certificate import CertificatePublisher

from bench.machine import free_port
from tests.conftest import FakeBackend, eventually
from tests.fake_apiserver import FakeApiServer

CONTROLLER = DEFAULT_AGENT_CALLERS[0]


# -- the certificate ------------------------------------------------------------------

def test_the_self_signed_certificate_names_the_agent_for_one_year() -> None:
    now = dt.datetime(2026, 11, 29, 10, 0, tzinfo=dt.timezone.utc)
    identity = self_signed("gpu-node-7", now=now)
    cert = x509.load_pem_x509_certificate(identity.certificate_pem)
    key = cert.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"
    assert cert.issuer == cert.subject
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [AGENT_TLS_SERVER_NAME, "gpu-node-7"]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH])
    assert cert.not_valid_before_utc == now - dt.timedelta(minutes=5)
    assert cert.not_valid_after_utc == identity.not_after == now + dt.timedelta(days=365)
    assert identity.fingerprint == "sha256:" + cert.fingerprint(hashes.SHA256()).hex()
    assert b"PRIVATE KEY" in identity.key_pem and "PRIVATE" not in repr(identity)
    assert self_signed("gpu-node-7").key_pem != identity.key_pem  # a new key pair every start
    with pytest.raises(ValueError, match="at least 1 day"):
        self_signed("n", days=0)


def test_fingerprint_takes_one_pem_certificate_only() -> None:
    pem = self_signed("n").certificate_pem.decode()
    assert fingerprint(pem) == fingerprint("\n" + pem + "\n")
    for bad in ("", "garbage", pem + pem, pem.replace("CERTIFICATE", "PRIVATE KEY"),
                "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----",
                "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----"):
        with pytest.raises(ValueError):
            fingerprint(bad)


# -- a node agent serving TLS -----------------------------------------------------------

@dataclass
class TlsAgent:
    """A node agent on 127.0.0.1:`port` serving `identity`; only the controller's
    ServiceAccount token (`controller`) may call it."""

    port: int
    identity: AgentIdentity
    apiserver: FakeApiServer
    callers: AllowedCallers
    node_agent: NodeAgent
    calls: list[tuple[str, str, tuple[int, ...]]]
    servers: list[grpc.aio.Server] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pem(self) -> str:
        return self.identity.certificate_pem.decode()

    async def restart(self) -> None:
        """Stop the agent and start it again on the same port with a new certificate, as a
        restarted plugin pod under hostNetwork does."""
        await self.servers[-1].stop(0)
        self.identity = self_signed("node-a")
        server, port = await create_server(self.node_agent, self.target, self.callers,
                                           self.identity.server_credentials())
        assert port == self.port
        self.servers.append(server)


@pytest.fixture
async def agent(token_api, tmp_path) -> AsyncIterator[TlsAgent]:
    apiserver, auth_api = token_api
    apiserver.add_token("controller", CONTROLLER, [AGENT_AUDIENCE])
    calls: list[tuple[str, str, tuple[int, ...]]] = []
    resolver = StaticProcessResolver({"a": [os.getpid()], "b": [os.getppid()]})  # FakeBackend stops none
    node_agent = NodeAgent(resolver, backends=[FakeBackend("n", calls, "freeze")],
                           records_path=tmp_path / "records.json")
    callers = AllowedCallers(TokenReviewer(auth_api, AGENT_AUDIENCE), DEFAULT_AGENT_CALLERS)
    identity = self_signed("node-a")
    server, port = await create_server(node_agent, "127.0.0.1:0", callers, identity.server_credentials())
    tls_agent = TlsAgent(port, identity, apiserver, callers, node_agent, calls, [server])
    yield tls_agent
    await tls_agent.servers[-1].stop(0)


@pytest.fixture
def token(tmp_path: Path) -> TokenFile:
    path = tmp_path / "token"
    path.write_text("controller\n")
    return TokenFile(path)


async def health(target: str, credentials: grpc.ChannelCredentials | None = None) -> int:
    options = [("grpc.ssl_target_name_override", AGENT_TLS_SERVER_NAME)] if credentials else []
    async with (grpc.aio.secure_channel(target, credentials, options=options) if credentials
                else grpc.aio.insecure_channel(target)) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return resp.status


async def test_the_agent_port_speaks_only_tls(agent) -> None:
    assert await health(agent.target, grpc.ssl_channel_credentials(agent.identity.certificate_pem)) == \
        health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await health(agent.target)  # plaintext: the server closes the connection in the handshake
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


# -- the controller's pool pins the published certificate -------------------------------

async def test_a_pinned_certificate_carries_the_calls_and_the_token(agent, token) -> None:
    pool = AgentPool(token)
    pool.set_certificates({agent.target: agent.pem})
    client = pool.get(agent.target)
    assert client.tls and client.fingerprint == agent.identity.fingerprint
    assert (await client.checkpoint("a", "freeze", "g", 5)).bytes == 1000
    assert await client.checkpointed_jobs() == {"a"}
    await client.restore("a", "freeze", "g", 5)
    assert [c[1] for c in agent.calls] == ["checkpoint", "restore"]
    assert agent.apiserver.reviews == [{"token": "controller", "audiences": [AGENT_AUDIENCE]}]  # sent over TLS
    assert pool.get(agent.target) is client  # reused
    with pytest.raises(InvalidArgument) as err:  # the agent's own errors pass unchanged, with no TLS hint
        await client.checkpoint("atlas-ssl-tls", "cuda", "g", 5)
    assert "(TLS:" not in str(err.value)
    await pool.close()


async def test_another_certificate_is_refused_before_the_token_is_sent(agent, token) -> None:
    """An agent that cannot prove it holds the published certificate (here: the pool pins
    another self-signed one) fails the handshake: no call runs, and the token never leaves."""
    other = self_signed("node-a")
    pool = AgentPool(token)
    pool.set_certificates({agent.target: other.certificate_pem.decode()})
    client = pool.get(agent.target)
    with pytest.raises(TimeSliceServerError) as err:
        await client.checkpoint("a", "freeze", "g", 5)
    message = str(err.value)
    assert f"checkpoint of job a on agent {agent.target}: UNAVAILABLE:" in message
    assert "CERTIFICATE_VERIFY_FAILED" in message
    assert (f"(TLS: the agent did not prove it holds the certificate pinned for it, {other.fingerprint}, for the "
            f"name {AGENT_TLS_SERVER_NAME}: in a cluster the one its plugin pod publishes, annotation "
            f"{AGENT_CERTIFICATE_ANNOTATION}") in message and "agent_certificates" in message
    with pytest.raises(TimeSliceServerError, match="CERTIFICATE_VERIFY_FAILED"):
        await client.checkpointed_jobs()
    assert agent.calls == [] and agent.apiserver.reviews == []
    await pool.close()


async def test_a_new_certificate_for_the_same_target_replaces_the_channel(agent, token) -> None:
    """A restarted plugin pod under hostNetwork keeps its IP and port but has a new key:
    the old channel (pinning the old certificate) cannot reach it; the pool replaces the
    client when the reconciler hands it the new certificate."""
    pool = AgentPool(token)
    pool.set_certificates({agent.target: agent.pem})
    old = pool.get(agent.target)
    assert await old.checkpointed_jobs() == set()
    await agent.restart()
    with pytest.raises(TimeSliceServerError, match="CERTIFICATE_VERIFY_FAILED"):
        await old.checkpointed_jobs()
    pool.set_certificates({agent.target: agent.pem})  # the new pod's annotation reached the snapshot
    new = pool.get(agent.target)
    assert new is not old and new.fingerprint == agent.identity.fingerprint != old.fingerprint
    assert await new.checkpointed_jobs() == set()
    await eventually(lambda: old._channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN)  # old channel closed
    pool.set_certificates({agent.target: agent.pem})  # the same certificate again: the client is kept
    assert pool.get(agent.target) is new
    await pool.close()


async def test_required_tls_refuses_an_agent_that_publishes_no_certificate(agent, token) -> None:
    pool = AgentPool(token, require_tls=True)
    client = pool.get(agent.target)
    with pytest.raises(Unavailable) as err:
        await client.checkpoint("a", "freeze", "g", 5)
    assert str(err.value) == (
        f"checkpoint of job a on agent {agent.target}: it publishes no TLS certificate (no annotation "
        f"{AGENT_CERTIFICATE_ANNOTATION} on its timeslice-kubelet-plugin pod: run the plugin with --agent-tls) "
        "and the controller runs with --require-agent-tls")
    with pytest.raises(Unavailable, match="--require-agent-tls"):
        await client.checkpointed_jobs()
    assert agent.calls == []
    pool.set_certificates({agent.target: agent.pem})  # the plugin published its certificate
    assert await pool.get(agent.target).checkpointed_jobs() == set()
    pool.set_certificates({})  # ... and the annotation went away: refused again, never plaintext
    with pytest.raises(Unavailable, match="publishes no TLS certificate"):
        await pool.get(agent.target).checkpointed_jobs()
    await pool.close()


async def test_the_token_never_goes_in_clear_to_an_agent_without_a_certificate(agent, token) -> None:
    """Issue 24, item 6: without a certificate to pin, whoever listens on the agent's port first
    would receive the controller's token; a pool without a token calls in plaintext."""
    pool = AgentPool(token)
    with pytest.raises(Unavailable, match="the agent token is sent to a network address only over TLS pinning the "
                                          "agent's certificate"):
        await pool.get(agent.target).checkpointed_jobs()
    assert agent.calls == []
    await pool.close()
    pool = AgentPool()
    client = pool.get(agent.target)
    assert not client.tls
    with pytest.raises(TimeSliceServerError, match="UNAVAILABLE"):  # this agent speaks only TLS
        await client.checkpointed_jobs()
    await pool.close()


async def test_a_malformed_published_certificate_is_refused_not_downgraded(agent, token) -> None:
    pool = AgentPool(token)
    pool.set_certificates({agent.target: "not a certificate"})
    with pytest.raises(Unavailable, match=r"the certificate its plugin pod publishes \(annotation "
                                          r"timeslice.dev/agent-certificate\) is unusable: not one PEM certificate"):
        await pool.get(agent.target).checkpointed_jobs()
    assert agent.calls == []
    await pool.close()


async def test_the_orchestrator_switches_over_tls_and_fails_clearly_without_a_certificate(agent, token) -> None:
    """Client -> orchestrator -> TLS agent, the certificate handed over as the reconciler
    does (`Orchestrator.set_agent_certificates`); with TLS required and no certificate the
    switch fails with that cause and rolls back."""
    for certificates, ok in [({agent.target: agent.pem}, True), ({}, False)]:
        orch = Orchestrator([GroupSpec(id="g", backend="freeze", agents=(agent.target,))],
                            agents=AgentPool(token, require_tls=True))
        orch.set_agent_certificates(certificates)
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
                await task  # a checkpointed on the agent over TLS, then b granted
                assert agent.calls[-1][1] == "checkpoint"
            else:
                with pytest.raises(SwitchFailed, match=f"checkpoint of job a on agent {agent.target}: it publishes "
                                                       "no TLS certificate"):
                    await task
        finally:
            await a.close()
            await b.close()
            await server.stop(0)
            await orch.close()


async def test_the_reconciler_hands_the_published_certificates_to_the_orchestrator(agent, token) -> None:
    orch = Orchestrator(agents=AgentPool(token, require_tls=True))
    reconciler = Reconciler(orch)
    await reconciler.apply(Snapshot(node_agents={"node-a": AgentEndpoint(agent.target, agent.pem),
                                                 "node-b": AgentEndpoint("127.0.0.1:1")}))
    assert await orch._pool.get(agent.target).checkpointed_jobs() == set()
    with pytest.raises(Unavailable, match="publishes no TLS certificate"):
        await orch._pool.get("127.0.0.1:1").checkpointed_jobs()
    await orch.close()


def test_required_tls_needs_the_plugin_pods() -> None:
    from timeslice.controller.app import ControllerConfig

    assert ControllerConfig(require_agent_tls=True).require_agent_tls
    with pytest.raises(ValueError, match="cannot be combined with agent_template"):
        ControllerConfig(require_agent_tls=True, agent_template="{node}:50052")


# -- the certificate on the plugin's pod ------------------------------------------------

FAST = Backoff(initial=0.01, maximum=0.05, overshoot=False)


@pytest.fixture
async def pods() -> AsyncIterator[tuple[FakeApiServer, object]]:
    """(fake API server holding the plugin's pod `timeslice-system/plugin-a`, a real
    kubernetes.aio CoreV1Api on it)."""
    from kubernetes.aio import client as k8s

    from tests.test_node_agents import plugin_pod

    server = FakeApiServer()
    await server.start()
    pod = plugin_pod("plugin-a", "node-a")
    pod["metadata"]["annotations"] = {"other": "kept"}
    server.put(pod)
    api = k8s.ApiClient(k8s.Configuration(host=server.url))
    yield server, k8s.CoreV1Api(api)
    await api.close()
    await server.stop()


def annotations(server: FakeApiServer) -> dict[str, str]:
    return server.pod("timeslice-system", "plugin-a")["metadata"].get("annotations", {})


async def test_the_certificate_is_published_on_the_plugins_own_pod(pods) -> None:
    server, core = pods
    pem = self_signed("node-a").certificate_pem.decode()
    publisher = CertificatePublisher(core, "timeslice-system", "plugin-a", pem, backoff=FAST)
    publisher.start()
    await asyncio.wait_for(publisher.published.wait(), 5)
    await publisher.stop()
    assert annotations(server) == {"other": "kept", AGENT_CERTIFICATE_ANNOTATION: pem}  # merged, not replaced
    (patch,) = server.pod_patches
    assert patch == ("timeslice-system", "plugin-a", "application/merge-patch+json",
                     {"metadata": {"annotations": {AGENT_CERTIFICATE_ANNOTATION: pem}}})
    assert publisher.fingerprint == fingerprint(pem)
    # what the controller reads from the pod (its reflector's trim) is the same certificate
    trimmed = trim_plugin_pod(server.pod("timeslice-system", "plugin-a"), "timeslice-system")
    assert trimmed["certificate"] == pem


async def test_a_removed_annotation_is_published_again(pods) -> None:
    server, core = pods
    pem = self_signed("node-a").certificate_pem.decode()
    publisher = CertificatePublisher(core, "timeslice-system", "plugin-a", pem, backoff=FAST, recheck_seconds=0.05)
    publisher.start()
    try:
        await asyncio.wait_for(publisher.published.wait(), 5)
        pod = server.pod("timeslice-system", "plugin-a")
        pod["metadata"]["annotations"] = {"other": "kept"}  # someone removed ours
        server.put(pod)
        await eventually(lambda: annotations(server).get(AGENT_CERTIFICATE_ANNOTATION) == pem, timeout=5)
    finally:
        await publisher.stop()


async def test_publishing_is_retried_after_a_server_error(pods, caplog) -> None:
    caplog.set_level(logging.INFO, logger="timeslice")
    server, core = pods
    server.fail("Pod/patch", 500, times=2)
    pem = self_signed("node-a").certificate_pem.decode()
    publisher = CertificatePublisher(core, "timeslice-system", "plugin-a", pem, backoff=FAST)
    publisher.start()
    await asyncio.wait_for(publisher.published.wait(), 5)
    await publisher.stop()
    assert publisher.attempts == 3 and annotations(server)[AGENT_CERTIFICATE_ANNOTATION] == pem
    failures = [r.getMessage() for r in caplog.records if "agent certificate not published" in r.getMessage()]
    assert len(failures) == 2 and "pod=timeslice-system/plugin-a failures=1" in failures[0]
    assert "HTTP 500: injected 500" in failures[0]
    assert any("agent certificate published pod=timeslice-system/plugin-a" in r.getMessage()
               for r in caplog.records)


async def test_a_forbidden_patch_says_which_rbac_is_missing_and_is_retried(pods, caplog) -> None:
    server, core = pods
    server.fail("Pod/patch", 403, times=1)
    publisher = CertificatePublisher(core, "timeslice-system", "plugin-a", self_signed("n").certificate_pem.decode(),
                                     backoff=FAST)
    publisher.start()
    await asyncio.wait_for(publisher.published.wait(), 5)
    await publisher.stop()
    (failure,) = [r for r in caplog.records if "agent certificate not published" in r.getMessage()]
    assert failure.levelname == "ERROR" and "HTTP 403" in failure.getMessage()
    assert "needs 'patch' on pods in its namespace" in failure.getMessage()


async def test_a_wrong_pod_name_keeps_failing_until_stopped(pods) -> None:
    server, core = pods
    publisher = CertificatePublisher(core, "timeslice-system", "no-such-pod", self_signed("n").certificate_pem.decode(),
                                     backoff=FAST)
    publisher.start()
    await eventually(lambda: publisher.attempts >= 3)
    await publisher.stop()
    assert not publisher.published.is_set() and "HTTP 404" in str(publisher.last_error)
    assert AGENT_CERTIFICATE_ANNOTATION not in annotations(server)


async def test_the_fake_api_server_patches_pod_metadata_as_the_api_server_does(pods) -> None:
    """Strategic merge and JSON merge patches agree on metadata.annotations (a map): keys
    merge, null deletes; a JSON Patch is not modelled (415), nor other fields (422)."""
    import aiohttp

    server, _ = pods
    url = f"{server.url}/api/v1/namespaces/timeslice-system/pods/plugin-a"
    async with aiohttp.ClientSession() as http:
        for content_type, body, want in [
                ("application/strategic-merge-patch+json", {"metadata": {"annotations": {"a": "1"}}},
                 {"other": "kept", "a": "1"}),
                ("application/merge-patch+json", {"metadata": {"annotations": {"other": None}}}, {"a": "1"}),
                ("application/merge-patch+json", {"metadata": {"annotations": {"a": None}}}, {})]:
            async with http.patch(url, json=body, headers={"Content-Type": content_type}) as resp:
                assert resp.status == 200
            assert annotations(server) == want
        for content_type, body, code in [("application/json-patch+json", [{"op": "remove", "path": "/x"}], 415),
                                         ("application/merge-patch+json", {"spec": {"nodeName": "x"}}, 422)]:
            async with http.patch(url, json=body, headers={"Content-Type": content_type}) as resp:
                assert resp.status == code
        async with http.patch(url.replace("plugin-a", "gone"), json={"metadata": {}},
                              headers={"Content-Type": "application/merge-patch+json"}) as resp:
            assert resp.status == 404


async def test_the_kubelet_plugin_serves_tls_and_publishes_its_certificate(pods, short_tmp, tmp_path,
                                                                           monkeypatch) -> None:
    """`timeslice kubelet-plugin --agent-tls` as wired by kubelet_plugin/app.py: the agent
    port answers only a caller that pins the certificate found on the plugin's pod."""

    import yaml
    from timeslice.kubelet_plugin.app import KubeletPluginConfig, run

    server, _ = pods
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server.url}}],
        "users": [{"name": "fake", "user": {"token": "plugin"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}))
    from kubernetes.aio.config import kube_config
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))  # read from $KUBECONFIG at import
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("POD_NAME", "plugin-a")
    monkeypatch.setenv("POD_NAMESPACE", "timeslice-system")
    port = free_port()  # for the agent
    cfg = KubeletPluginConfig(node_name="node-a", fake_gpus="1xH200", state_dir=short_tmp / "state",
                              cdi_dir=short_tmp / "cdi", plugin_data_dir=short_tmp / "plugin",
                              registry_dir=short_tmp / "registry", agent_listen=f"127.0.0.1:{port}", agent_tls=True,
                              agent_auth="tokenreview",  # a port needs authenticated callers
                              liveness_file=short_tmp / "live")
    assert (cfg.pod_name, cfg.pod_namespace) == ("plugin-a", "timeslice-system")  # from the downward API's env
    stop = asyncio.Event()
    task = asyncio.create_task(run(cfg, stop))
    try:
        await eventually(lambda: AGENT_CERTIFICATE_ANNOTATION in annotations(server), timeout=20)
        pem = annotations(server)[AGENT_CERTIFICATE_ANNOTATION]
        assert await health(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(pem.encode())) == \
            health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError):
            await health(f"127.0.0.1:{port}")  # plaintext is refused
        assert (short_tmp / "live").exists()  # the heartbeat for the livenessProbe (issue 12, item 1)
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    assert not (short_tmp / "live").exists()


# -- the manifests ----------------------------------------------------------------------

def test_the_manifests_turn_agent_tls_on() -> None:
    """manifests/base: the plugin serves TLS and knows its pod (downward API), may annotate
    pods in its own namespace only; the controller requires TLS. hack/local-driver replaces
    both command lists whole, so it must keep the flags."""
    import yaml

    root = Path(__file__).resolve().parent.parent
    base = root / "manifests" / "base"
    plugin = yaml.safe_load((base / "kubelet-plugin.yaml").read_text())
    container = plugin["spec"]["template"]["spec"]["containers"][0]
    assert "--agent-tls" in container["command"]
    env = {e["name"]: e.get("valueFrom") for e in container["env"]}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    rbac = list(yaml.safe_load_all((base / "rbac-kubelet-plugin.yaml").read_text()))
    role = next(d for d in rbac if d["kind"] == "Role")
    binding = next(d for d in rbac if d["kind"] == "RoleBinding")
    namespace = plugin["metadata"]["namespace"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == namespace
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": plugin["spec"]["template"]["spec"][
        "serviceAccountName"], "namespace": namespace}]
    cluster_role = next(d for d in rbac if d["kind"] == "ClusterRole")
    assert not any("patch" in r["verbs"] for r in cluster_role["rules"] if "pods" in r["resources"])  # not cluster-wide
    controller = next(d for d in yaml.safe_load_all((base / "controller.yaml").read_text())
                      if d["kind"] == "Deployment")
    assert "--require-agent-tls" in controller["spec"]["template"]["spec"]["containers"][0]["command"]
    local = yaml.safe_load((root / "hack" / "local-driver" / "kustomization.yaml").read_text())
    commands = {p["target"]["kind"]: next(op["value"] for op in yaml.safe_load(p["patch"])
                                          if op["path"].endswith("/command"))
                for p in local["patches"] if "/command" in p["patch"]}
    assert "--agent-tls" in commands["DaemonSet"] and "--require-agent-tls" in commands["Deployment"]


async def test_a_rollback_goes_through_the_agents_current_channel() -> None:
    """A switch's rollback asks the pool again: when an agent's certificate changed mid-switch
    (its old client's channel is being closed), the compensating restore uses the new one."""
    from timeslice.controller.orchestrator.agents import StepResult
    from timeslice.controller.orchestrator.group_model import SwitchError
    from timeslice.controller.orchestrator.switch import SwitchCoordinator

    class Client:
        def __init__(self, target: str, name: str, fail: bool = False) -> None:
            self.target, self.name, self.fail = target, name, fail

        async def checkpoint(self, job, *args, **kw):  # kw: the operation id
            calls.append((self.name, "checkpoint", job))
            if self.fail:
                raise Unavailable("down")
            if self.target == "x":
                pool.clients["x"] = Client("x", "x-new")  # the certificate of x changed meanwhile
            return StepResult(1, 0.0)

        async def restore(self, job, *args, **kw):
            calls.append((self.name, "restore", job))
            return StepResult(1, 0.0)

    class Pool:
        def __init__(self) -> None:
            self.clients = {"x": Client("x", "x-old"), "y": Client("y", "y", fail=True)}

        def get(self, target: str) -> Client:
            return self.clients[target]

    calls: list[tuple[str, str, str]] = []
    pool = Pool()
    with pytest.raises(SwitchError, match="rolled back"):
        await SwitchCoordinator(pool)(GroupSpec(id="g", backend="freeze", agents=("x", "y")), "a", "b", True)
    assert sorted(calls) == [("x-new", "restore", "a"), ("x-old", "checkpoint", "a"), ("y", "checkpoint", "a")]


def test_a_token_for_network_agents_without_pinned_certificates_is_refused_at_start(tmp_path: Path) -> None:
    """Issue 24, item 6, at configuration time: the standalone orchestrator and the controller
    refuse to start where their agent token would go in clear; unix sockets are fine."""
    from timeslice.controller.app import ControllerConfig
    from timeslice.controller.orchestrator.config import OrchestratorConfig

    token, cert = tmp_path / "token", tmp_path / "agent.pem"
    group = {"id": "g", "backend": "freeze", "agents": ["10.0.0.7:50052", "unix:///run/agent.sock"]}
    with pytest.raises(ValueError, match=r"agent_token_file: the token would go in clear to 10\.0\.0\.7:50052"):
        OrchestratorConfig.model_validate({"agent_token_file": token, "groups": [group]})
    OrchestratorConfig.model_validate({"agent_token_file": token, "groups": [group],
                                       "agent_certificates": {"10.0.0.7:50052": cert}})
    OrchestratorConfig.model_validate({"groups": [group]})  # no token: nothing to leak
    with pytest.raises(ValueError, match="the token would go in clear to a network address"):
        ControllerConfig(agent_token_file=token, agent_template="{node}:50052")
    ControllerConfig(agent_token_file=token, agent_template="unix:///run/{node}.sock")
