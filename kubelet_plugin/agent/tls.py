"""The node agent's TLS identity: a self-signed certificate made at start, its key in memory.

Owned by the node agent; made by the kubelet plugin's wiring with `--agent-tls`, which
serves the agent port with `AgentIdentity.server_credentials()` (`server.create_server`)
and publishes `certificate_pem` on its own pod as the annotation
`timeslice.dev/agent-certificate` (`kubelet_plugin/agent_certificate.py`). The controller
pins exactly that certificate as the only root it trusts for this agent and checks the
name `timeslice-node-agent` (`names.AGENT_TLS_SERVER_NAME`), so there is no CA to run and
no Secret to distribute: each plugin start has a new key pair and publishes the new
certificate. The private key is never written anywhere (not to disk, not to the API).

The certificate (X.509 v3, built with the `cryptography` package): an ECDSA P-256 key
(`ec.generate_private_key(ec.SECP256R1())`), signed by itself with SHA-256; valid from
`NOT_BEFORE_SLACK` before now (clock skew between nodes) for `VALID_DAYS` days; subject
CN and SAN DNS names `timeslice-node-agent` and the node name; BasicConstraints CA:FALSE,
KeyUsage digitalSignature, ExtendedKeyUsage serverAuth. gRPC's TLS stack (BoringSSL)
accepts such a self-signed end-entity certificate as the trust root it was given
(`grpc.ssl_channel_credentials(root_certificates=...)`, gRPC Python API reference).
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from timeslice.driver.certificates import fingerprint
from timeslice.driver.names import AGENT_TLS_SERVER_NAME

VALID_DAYS = 365
NOT_BEFORE_SLACK = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class AgentIdentity:
    """A private key and its self-signed certificate, both PEM. `not_after`: when the
    certificate expires (UTC); `fingerprint`: `sha256:<hex>` of the certificate
    (`driver/certificates.py`), as the controller logs it."""

    key_pem: bytes = field(repr=False)
    certificate_pem: bytes
    not_after: dt.datetime
    fingerprint: str

    def server_credentials(self) -> grpc.ServerCredentials:
        """TLS credentials for the agent's port (`grpc.ssl_server_credentials`: server
        authentication only; the caller is authenticated by its bearer token)."""
        return grpc.ssl_server_credentials([(self.key_pem, self.certificate_pem)])


def self_signed(node_name: str, days: int = VALID_DAYS, now: dt.datetime | None = None) -> AgentIdentity:
    """A new key pair and a certificate for the node agent of `node_name`, valid `days`
    days from `now` (default: the current UTC time). The node name goes into the SAN when
    it is a plain ASCII name (Kubernetes node names are DNS subdomains); the controller
    checks only `timeslice-node-agent`. Raises ValueError for `days` < 1."""
    if days < 1:
        raise ValueError(f"a certificate must be valid for at least 1 day, not {days}")
    now = now or dt.datetime.now(dt.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, AGENT_TLS_SERVER_NAME)])
    names = [AGENT_TLS_SERVER_NAME]
    if node_name and node_name != AGENT_TLS_SERVER_NAME and node_name.isascii():
        names.append(node_name)
    cert = (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - NOT_BEFORE_SLACK)
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(key, hashes.SHA256()))
    certificate_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return AgentIdentity(key_pem, certificate_pem, cert.not_valid_after_utc, fingerprint(certificate_pem.decode()))


def kept(directory: Path, node_name: str, renew_before: dt.timedelta = dt.timedelta(days=30)) -> AgentIdentity:
    """The identity stored in `directory` (`agent-key.pem`, mode 0600, and `agent-cert.pem`)
    while its certificate has more than `renew_before` left, else a new one (`self_signed`),
    stored there: a standalone node agent (`timeslice node-agent --tls`) keeps the
    certificate an orchestrator pins across its restarts. Raises OSError, ValueError (files
    that are not a key and its certificate)."""
    key_file, cert_file = directory / "agent-key.pem", directory / "agent-cert.pem"
    if key_file.exists() and cert_file.exists():
        key_pem, cert_pem = key_file.read_bytes(), cert_file.read_bytes()
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
        if key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) \
                != cert.public_key().public_bytes(serialization.Encoding.DER,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo):
            raise ValueError(f"{key_file} is not the key of {cert_file}")
        if cert.not_valid_after_utc - dt.datetime.now(dt.timezone.utc) > renew_before:
            return AgentIdentity(key_pem, cert_pem, cert.not_valid_after_utc, fingerprint(cert_pem.decode()))
    identity = self_signed(node_name)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(key_file.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(identity.key_pem)
    os.replace(key_file.with_suffix(".tmp"), key_file)
    cert_file.write_bytes(identity.certificate_pem)
    return identity
