"""Client authentication: projected ServiceAccount tokens checked with TokenReview.

Owned by the controller; used by the orchestrator servicer when the controller runs with
`--auth tokenreview`. A client sends `authorization: Bearer <token>` (the example mounts a
projected token with audience `timeslice.dev`); the TokenReview's user extra names the
pod (`authentication.kubernetes.io/pod-uid`, KEP-4193 / bound service account tokens), and
the servicer lets that pod act only for claim sets whose pods include it. The review and
its cache (`cache_seconds`, by token digest, so a hand-off does not wait on the API
server) are the driver's `TokenReviewer`, shared with the node agent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from timeslice.driver import bearer as bearer_token
from timeslice.driver.errors import PermissionDenied, Unauthenticated
from timeslice.driver.tokenreview import DEFAULT_CACHE_SECONDS, TokenReviewer

AUDIENCE = "timeslice.dev"
POD_UID = "authentication.kubernetes.io/pod-uid"
POD_NAME = "authentication.kubernetes.io/pod-name"


@dataclass(frozen=True)
class PodIdentity:
    username: str
    pod_uid: str
    pod_name: str
    job_id: str = ""  # a call that names no job acts for the job of this pod

    def job_for(self, named: str) -> str:
        """A call that names a job acts for it (admitted when the pod holds a claim of it)."""
        return named


def bearer(metadata: Any) -> str:
    """The bearer token of a call's invocation metadata; raises Unauthenticated."""
    return bearer_token.bearer(metadata, hint=f"mount a projected ServiceAccount token with audience {AUDIENCE} "
                                              "(see manifests/examples) or set TIMESLICE_TOKEN_FILE")


class TokenReviewAuthenticator:
    """`auth_api`: kubernetes.aio AuthenticationV1Api."""

    def __init__(self, auth_api: Any, cache_seconds: float = DEFAULT_CACHE_SECONDS) -> None:
        self._reviewer = TokenReviewer(auth_api, AUDIENCE, cache_seconds)

    async def authenticate(self, context: Any) -> str:
        """The user name of the call's token, bound to a pod or not (status calls: an admin's
        `kubectl create token <sa> --audience timeslice.dev` will do). Raises Unauthenticated
        (no token, token rejected) or KubernetesApiError (the review failed)."""
        return str((await self._reviewer.review(bearer(context.invocation_metadata()))).username)

    async def identify(self, context: Any) -> PodIdentity:
        """The pod the call's token is bound to. Raises Unauthenticated (no token, token
        rejected, not bound to a pod) or KubernetesApiError (the review failed)."""
        user = await self._reviewer.review(bearer(context.invocation_metadata()))
        uid = user.first(POD_UID)
        if not uid:
            raise Unauthenticated(f"token of {user.username} is not bound to a pod")
        return PodIdentity(user.username, uid, user.first(POD_NAME))

    def admit(self, caller: PodIdentity, group: Any, job: str) -> None:
        """Only a pod of the claim set `job` acts for it. Raises PermissionDenied."""
        member = group.spec.member(job)
        if member is None or caller.pod_uid not in member.pod_uids:
            raise PermissionDenied(f"pod {caller.pod_name or caller.pod_uid} holds no claim of {job!r} "
                                   f"in group {group.id}")
