"""Who may call the node agent: the orchestrator's ServiceAccount, checked with TokenReview,
or, on a standalone node (`timeslice node-agent`), whoever has the node's shared token.

Owned by the node agent; built by the kubelet plugin's wiring with `--agent-auth
tokenreview` and handed to the servicer (`service.py`), which checks every NodeAgent call
(the gRPC health service stays open). The orchestrator sends its projected ServiceAccount
token (audience `timeslice.dev/node-agent`, `names.AGENT_AUDIENCE`) as `authorization:
Bearer <token>`; the driver's `TokenReviewer` reviews it (TokenReview API,
`authentication.k8s.io/v1`; positive reviews cached by token digest) and the user must be
one of `allowed_users`. Any pod can mint a token for any audience, so the audience alone
does not identify the orchestrator: the user name does.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from timeslice.driver.bearer import TokenFile, bearer
from timeslice.driver.errors import PermissionDenied, Unauthenticated
from timeslice.driver.names import AGENT_AUDIENCE

if TYPE_CHECKING:  # the reviewer needs the `kubernetes` extra; a standalone node (SharedToken) does not
    from timeslice.driver.tokenreview import TokenReviewer

_HINT = (f"the node agent runs with --agent-auth tokenreview: give the orchestrator a projected "
         f"ServiceAccount token with audience {AGENT_AUDIENCE} (timeslice controller --agent-token-file)")


class AllowedCallers:
    """`reviewer` reviews for `AGENT_AUDIENCE`; `allowed_users`: TokenReview user names
    (`system:serviceaccount:<namespace>:<name>`). Raises ValueError when none is given."""

    def __init__(self, reviewer: TokenReviewer, allowed_users: Iterable[str]) -> None:
        self._reviewer = reviewer
        self.allowed_users = frozenset(allowed_users)
        if not self.allowed_users:
            raise ValueError("no allowed users: nobody could call the node agent")

    async def check(self, metadata: Any) -> str:
        """The caller's user name when it may call the agent. Raises Unauthenticated (no
        token, token rejected), PermissionDenied (a valid token of another user) or
        KubernetesApiError (the review failed)."""
        user = await self._reviewer.review(bearer(metadata, hint=_HINT))
        if user.username not in self.allowed_users:
            raise PermissionDenied(f"{user.username} may not call the node agent (allowed: "
                                   f"{', '.join(sorted(self.allowed_users))}; see --agent-allowed-users)")
        return user.username


class SharedToken:
    """`timeslice node-agent --token-file`: a caller must send the file's token (the
    standalone orchestrator's `agent_token_file`), compared in constant time; the file is
    read again when it changes (`TokenFile`)."""

    def __init__(self, path: str) -> None:
        """Raises ValueError when the file cannot be read or is empty."""
        self._file = TokenFile(path)
        try:
            self._file.token()
        except Unauthenticated as err:
            raise ValueError(f"--token-file {path}: {err}") from None

    async def check(self, metadata: Any) -> str:
        """Raises Unauthenticated (no token) or PermissionDenied (another token)."""
        sent = bearer(metadata, hint="the node agent runs with --token-file: set agent_token_file in the "
                                     "orchestrator's config to a file with the same token")
        if not hmac.compare_digest(sent.encode(), self._file.token().encode()):
            raise PermissionDenied("the token sent is not the node agent's (--token-file)")
        return "token holder"
