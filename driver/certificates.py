"""PEM certificates as both ends of the node-agent channel name them: `fingerprint`.

Owned by the driver package; used by the kubelet plugin (it logs the certificate it
publishes) and by the controller (it logs, and checks, the certificate it pins), so the
two logs can be matched: `sha256:<hex>` of the certificate's DER bytes, the same value as
`openssl x509 -noout -fingerprint -sha256` (without the colons, lower case). Standard
library only (`ssl.PEM_cert_to_DER_cert`): the controller needs no crypto package.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ssl


def fingerprint(pem: str) -> str:
    """`sha256:<64 hex digits>` of one PEM certificate (`-----BEGIN CERTIFICATE-----`).

    Raises ValueError when `pem` is not exactly one well-framed PEM certificate with valid
    base64 (no X.509 parsing: gRPC's TLS stack rejects a malformed one when it dials)."""
    text = pem.strip()
    if not (text.startswith(ssl.PEM_HEADER) and text.endswith(ssl.PEM_FOOTER)) or text.count(ssl.PEM_HEADER) != 1:
        raise ValueError(f"not one PEM certificate ({ssl.PEM_HEADER} ... {ssl.PEM_FOOTER})")
    body = text[len(ssl.PEM_HEADER):-len(ssl.PEM_FOOTER)]
    try:
        der = base64.b64decode("".join(body.split()), validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"PEM certificate with bad base64: {err}") from None
    if not der:
        raise ValueError("empty PEM certificate")
    return "sha256:" + hashlib.sha256(der).hexdigest()
