"""Callers of one-box mode: local processes identified by their socket's peer credentials.

Owned by `timeslice serve` (`cli/serve.py`); used by the orchestrator servicer in place of
the cluster's TokenReview authenticator (`auth.py`). A call must arrive through the
`UnixFront` (its `SO_PEERCRED`); the caller acts for the job it names, or, naming none,
for the job of its process group or cgroup (`pgid-<N>`, `cgroup-<name>`). Binding the job
makes the caller's scope part of it, so the node agent moves those processes with it
(`PeerJobs`): nobody types PIDs, and nobody acts for another user's processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from timeslice.driver.errors import ProcessGone, Unauthenticated
from timeslice.driver.peercred import PeerCredentials, PeerJobs, Scope, ScopeKind, UnixFront, scope_of


@dataclass(frozen=True)
class PeerCaller:
    """A local caller: its credentials and its scope. `job_id`: the job a call that names
    none acts for; `pod_uid` is always "" (no pods here)."""

    credentials: PeerCredentials
    scope: Scope
    pod_uid: str = ""

    @property
    def job_id(self) -> str:
        return self.scope.job_name


class PeerAuthenticator:
    """`scope`: what a job is made of, "process-group" (default) or "cgroup"."""

    def __init__(self, front: UnixFront, jobs: PeerJobs, scope: ScopeKind = "process-group") -> None:
        self._front = front
        self._jobs = jobs
        self._scope = scope

    async def identify(self, context: Any) -> PeerCaller:
        """Raises Unauthenticated: the call did not come through the unix socket, or its
        process is gone."""
        creds = self._front.credentials(context.peer())
        if creds is None:
            raise Unauthenticated(f"call over {context.peer()}: in one-box mode, call through the unix socket "
                                  f"{self._front.path}")
        try:
            return PeerCaller(creds, scope_of(creds.pid, self._scope))
        except ProcessGone:
            raise Unauthenticated(f"the calling process {creds.pid} is gone") from None

    async def authenticate(self, context: Any) -> str:
        """Status calls: any local caller that could connect (the socket's mode decides)."""
        return f"uid {(await self.identify(context)).credentials.uid}"

    def admit(self, caller: PeerCaller, group: Any, job: str) -> None:
        """The caller's scope joins `job`. Raises PermissionDenied (`PeerJobs.bind`)."""
        self._jobs.bind(job, caller.credentials, caller.scope)
