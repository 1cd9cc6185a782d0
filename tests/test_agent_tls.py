"""The node agent channel over TLS (`kubelet-plugin --agent-tls`, `controller
--require-agent-tls`): a real node-agent gRPC server on 127.0.0.1 serving a real
self-signed certificate (`kubelet_plugin/agent/tls.py`), called by the controller's real
`AgentClient`s from an `AgentPool` that pins the certificate; TokenReviews and the pod
annotation through the real kubernetes.aio client against the fake API server
(tests/fake_apiserver.py) over HTTP."""

from __future__ import annotations

import datetime as dt
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
from timeslice.driver.bearer import TokenFile
from timeslice.driver.certificates import fingerprint
from timeslice.driver.names import AGENT_AUDIENCE, AGENT_TLS_SERVER_NAME, DEFAULT_AGENT_CALLERS
from timeslice.driver.tokenreview import TokenReviewer
from timeslice.kubelet_plugin.agent.auth import AllowedCallers
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.server import create_server
from timeslice.kubelet_plugin.agent.tls import AgentIdentity, self_signed

from tests.conftest import FakeBackend
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
