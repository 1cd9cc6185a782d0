"""Client authentication: projected ServiceAccount tokens checked with TokenReview.

Owned by the controller; used by the orchestrator servicer when the controller runs with
`--auth tokenreview`. A client sends `authorization: Bearer <token>` (the example mounts a
projected token with audience `timeslice.dev`); the TokenReview's user extra names the
pod (`authentication.kubernetes.io/pod-uid`, KEP-4193 / bound service account tokens), and
the servicer lets that pod act only for claim sets whose pods include it. Reviews are
cached for `cache_seconds` by token digest, so a hand-off does not wait on the API server.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

from timeslice.driver.errors import Unauthenticated

AUDIENCE = "timeslice.dev"
POD_UID = "authentication.kubernetes.io/pod-uid"
POD_NAME = "authentication.kubernetes.io/pod-name"


@dataclass(frozen=True)
class PodIdentity:
    username: str
    pod_uid: str
    pod_name: str


def bearer(metadata: Any) -> str:
    """The bearer token of a call's invocation metadata; raises Unauthenticated."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):].strip()
    raise Unauthenticated("no bearer token: mount a projected ServiceAccount token with audience "
                          f"{AUDIENCE} (see manifests/examples) or set TIMESLICE_TOKEN_FILE")


class TokenReviewAuthenticator:
    """`auth_api`: kubernetes.aio AuthenticationV1Api."""

    def __init__(self, auth_api: Any, cache_seconds: float = 60.0) -> None:
        self._api = auth_api
        self._cache: dict[str, tuple[float, PodIdentity]] = {}
        self._ttl = cache_seconds

    async def identify(self, metadata: Any) -> PodIdentity:
        token = bearer(metadata)
        key = hashlib.sha256(token.encode()).hexdigest()
        hit = self._cache.get(key)
        if hit and hit[0] > time.monotonic():
            return hit[1]
        review = await self._api.create_token_review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
             "spec": {"token": token, "audiences": [AUDIENCE]}})
        status = review.status
        if not status or not status.authenticated:
            raise Unauthenticated(f"token rejected: {getattr(status, 'error', None) or 'not authenticated'}")
        extra = status.user.extra or {}
        uid = (extra.get(POD_UID) or [""])[0]
        if not uid:
            raise Unauthenticated(f"token of {status.user.username} is not bound to a pod")
        ident = PodIdentity(status.user.username, uid, (extra.get(POD_NAME) or [""])[0])
        self._cache[key] = (time.monotonic() + self._ttl, ident)
        return ident
