"""Bearer tokens on gRPC calls: the caller's side (`TokenFile`) and the server's (`bearer`).

Owned by the driver package. A caller sends `authorization: Bearer <token>` in a call's
metadata; the server takes it out with `bearer()` and checks it with TokenReview
(`tokenreview.py`). The token is a projected ServiceAccount token (KEP-1205, bound
service account tokens): audience-bound, short-lived, and rewritten by the kubelet
before it expires, so a long-running caller re-reads the file (`TokenFile`). No
`kubernetes` import: the orchestrator without a cluster imports this module too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from timeslice.driver.errors import Unauthenticated

log = logging.getLogger("timeslice.auth")

AUTHORIZATION = "authorization"
_SCHEME = "Bearer "

Metadata = tuple[tuple[str, str], ...]


def bearer(metadata: Iterable[tuple[str, Any]] | None, hint: str = "") -> str:
    """The bearer token of a call's invocation metadata (`authorization: Bearer <token>`).

    Raises `Unauthenticated("no bearer token[: <hint>]")` when there is none or it is empty;
    `hint` tells the caller how to get one."""
    for key, value in metadata or ():
        if key == AUTHORIZATION and isinstance(value, str) and value.startswith(_SCHEME):
            token = value[len(_SCHEME):].strip()
            if token:
                return token
    raise Unauthenticated(f"no bearer token: {hint}" if hint else "no bearer token")


def call_metadata(token: str) -> Metadata:
    """The metadata that carries `token` on a call."""
    return ((AUTHORIZATION, _SCHEME + token),)


class TokenFile:
    """A token file, read again only when it changed: its mtime (or inode or size) differs
    from the last read. One `os.stat` per call, no read.

    Meant for a projected ServiceAccount token: the kubelet writes a new token when the
    old one is older than 80% of its `expirationSeconds` or 24 h (KEP-1205; Kubernetes
    docs, "Configure Service Accounts for Pods", service account token volume
    projection), swapping the file atomically (a new inode behind the `..data` symlink).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._stamp: tuple[int, int, int] | None = None
        self._token = ""
        self._failing = False

    def token(self) -> str:
        """The current token. Raises `Unauthenticated` when the file cannot be read or is
        empty and no earlier read succeeded; after a good read, a file that went missing or
        empty keeps the last token (logged once) until the file is back."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_ino, st.st_size)
            if stamp != self._stamp:
                with open(self.path) as f:
                    token = f.read().strip()
                if not token:
                    raise OSError(f"{self.path} is empty")
                self._token, self._stamp = token, stamp
                if self._failing:
                    log.info("token file readable again path=%s", self.path)
                self._failing = False
        except OSError as err:
            if not self._token:
                raise Unauthenticated(f"cannot read the token file {self.path}: {err}") from err
            if not self._failing:
                log.warning("token file unreadable, keeping the last token path=%s: %s", self.path, err)
            self._failing = True
        return self._token

    def metadata(self) -> Metadata:
        """`authorization: Bearer <token>` for a call; raises like `token()`."""
        return call_metadata(self.token())
