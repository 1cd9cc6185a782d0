"""TokenReview of bearer tokens for one audience, with positive answers cached.

Owned by the driver package; used by the controller (client pods: audience
`timeslice.dev`, `controller/auth.py`) and by the node agent (the orchestrator: audience
`timeslice.dev/node-agent`, `kubelet_plugin/agent/auth.py`). Each decides from the
`ReviewedUser` what the caller may do. Needs the `kubernetes` extra.

The review is the TokenReview API (`authentication.k8s.io/v1`, `create` on
`tokenreviews`; the reviewing ServiceAccount needs that RBAC verb). `spec.audiences`
names our audience, and the answer must name it again in `status.audiences`: the API
reference says an authenticated review with empty `status.audiences` means the token is
valid for the API server's own audience, not ours.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes.aio.client.exceptions import ApiException
from timeslice.driver.errors import Unauthenticated
from timeslice.driver.kubeapi import api_error

# How long a positive review is reused, seconds: a revoked token (its pod or
# ServiceAccount deleted) is still accepted for at most this long.
DEFAULT_CACHE_SECONDS = 60.0
# Bound on one TokenReview call, seconds.
DEFAULT_REVIEW_TIMEOUT_SECONDS = 10.0
# Cached reviews kept at most (one per distinct valid token seen within the cache time).
MAX_CACHED = 1024


@dataclass(frozen=True)
class ReviewedUser:
    """`status.user` of a positive TokenReview. `extra` holds, for ServiceAccount tokens
    bound to a pod, `authentication.kubernetes.io/pod-name` and `.../pod-uid`."""

    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False)

    def first(self, key: str) -> str:
        """The first value of `extra[key]`, "" when absent."""
        values = self.extra.get(key) or ("",)
        return values[0]


class TokenReviewer:
    """Reviews tokens for `audience` with `auth_api` (kubernetes.aio AuthenticationV1Api, or
    anything with its `create_token_review(body)`). Positive reviews are cached for
    `cache_seconds` by the token's SHA-256 (the token itself is not kept); rejections and
    failed calls are not cached. `clock`: monotonic seconds (tests)."""

    def __init__(self, auth_api: Any, audience: str, cache_seconds: float = DEFAULT_CACHE_SECONDS,
                 timeout: float = DEFAULT_REVIEW_TIMEOUT_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._api = auth_api
        self.audience = audience
        self._ttl = cache_seconds
        self._timeout = timeout
        self._clock = clock
        self._cache: dict[str, tuple[float, ReviewedUser]] = {}

    async def review(self, token: str) -> ReviewedUser:
        """The user `token` authenticates for our audience.

        Raises `Unauthenticated` ("token rejected: ...") when the API server does not
        authenticate it for this audience; `KubernetesApiError` (retryable: no connection,
        timeout after `timeout` s, 5xx) or `KubernetesApiRejected` (e.g. 403: no RBAC for
        `create tokenreviews`) when the review itself fails."""
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self._clock()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token, "audiences": [self.audience]}}
        try:
            review = await asyncio.wait_for(self._api.create_token_review(body), self._timeout)
        except (ApiException, aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            raise api_error(err, f"TokenReview for audience {self.audience}") from err
        status = review.status
        if status is None or not status.authenticated:
            raise Unauthenticated(f"token rejected: {getattr(status, 'error', None) or 'not authenticated'}")
        audiences = tuple(getattr(status, "audiences", None) or ())
        if self.audience not in audiences:
            raise Unauthenticated(f"token rejected: not valid for audience {self.audience} "
                                  f"(the review answered audiences {list(audiences)})")
        u = status.user
        user = ReviewedUser(username=u.username or "", uid=getattr(u, "uid", None) or "",
                            groups=tuple(getattr(u, "groups", None) or ()),
                            extra={k: tuple(v or ()) for k, v in (getattr(u, "extra", None) or {}).items()})
        self._remember(key, now + self._ttl, user)
        return user

    def _remember(self, key: str, until: float, user: ReviewedUser) -> None:
        if len(self._cache) >= MAX_CACHED:
            now = self._clock()
            for k in [k for k, (t, _) in self._cache.items() if t <= now]:
                del self._cache[k]
            while len(self._cache) >= MAX_CACHED:  # all still valid: drop the oldest
                del self._cache[next(iter(self._cache))]
        self._cache[key] = (until, user)
