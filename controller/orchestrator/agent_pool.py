"""AgentPool: the orchestrator's node-agent clients by target, and stand-ins for agents it must not call.

Owned by the orchestrator; used by `SwitchCoordinator`. One `AgentClient` (agents.py) per agent target,
created on first use and reused; a node without a node agent gets a `MissingAgent`, a target that must
not be called an `UnusableAgent`: both refuse every call with `Unavailable`, naming why.

The token is never sent in clear to a network address: a TCP target without a certificate is
refused while the pool has a token (a unix socket is fine: its file mode guards it).

TLS: the controller's reconciler hands the pool each agent's certificate as its plugin
pod publishes it (`set_certificates`, target -> PEM; kubelet plugin `--agent-tls`). A target
with a certificate gets a client whose TLS channel pins it (agents.py). A target
without one gets a plaintext channel, or, with `require_tls` (`--require-agent-tls`), a
stand-in that refuses every call with `Unavailable`. When a target's certificate changes
(a restarted plugin under hostNetwork keeps its address but makes a new key), its client
is replaced by a new channel; the old one is closed after `RETIRE_GRACE_SECONDS`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from timeslice.controller.orchestrator.agents import AgentClient, AgentMemory, StepResult
from timeslice.controller.orchestrator.config import MemberSpec
from timeslice.driver.app_engine import AppEngine
from timeslice.driver.bearer import TokenFile
from timeslice.driver.certificates import fingerprint
from timeslice.driver.errors import Unavailable
from timeslice.driver.names import AGENT_CERTIFICATE_ANNOTATION, AGENT_TLS_SERVER_NAME

log = logging.getLogger("timeslice.orchestrator.agents")

# Target prefix of a node without a node agent: `no-agent:<node>` (see MissingAgent).
MISSING_PREFIX = "no-agent:"
# Calls still running on a replaced channel (its agent's certificate changed) get this
# long before the channel is closed (seconds).
RETIRE_GRACE_SECONDS = 5.0


class UnusableAgent(AgentClient):
    """The stand-in for an agent the orchestrator must not call: every call raises
    `Unavailable("<call> on <where>: <why>")`, so a switch there fails and rolls back with a
    clear cause. `certificate`: what its plugin pod published (kept so that the pool
    replaces this stand-in when that changes)."""

    def __init__(self, target: str, where: str, why: str, certificate: str | None = None) -> None:  # no channel
        self.target = target
        self.certificate = certificate
        self.fingerprint = ""
        self._where = where
        self._why = why

    async def checkpoint(self, job_id: str, *args: object, **kw: object) -> StepResult:
        raise self._refused(f"checkpoint of job {job_id}")

    async def restore(self, job_id: str, *args: object, **kw: object) -> StepResult:
        raise self._refused(f"restore of job {job_id}")

    async def live_jobs(self, jobs: Sequence[tuple[str, MemberSpec | None, AppEngine | None]]
                        ) -> tuple[set[str], set[str], set[str]]:
        raise self._refused("live jobs")

    async def checkpointed_jobs(self, group_id: str | None = None) -> set[str]:
        raise self._refused("list jobs")

    async def memory(self, jobs: Sequence[tuple[str, MemberSpec | None]], watch: float = 0.0,
                     low_free: int = 0) -> AgentMemory:
        raise self._refused("memory report")

    def _refused(self, what: str) -> Unavailable:
        return Unavailable(f"{what} on {self._where}: {self._why}")

    async def close(self, grace: float | None = None) -> None:
        pass


class MissingAgent(UnusableAgent):
    """The stand-in for a node without a node agent (target `no-agent:<node>`)."""

    def __init__(self, target: str) -> None:
        super().__init__(target, f"node {target.partition(':')[2]}",
                         "no node agent there (no running timeslice-kubelet-plugin pod on that node)")


class AgentPool:
    """Agent clients by target, created on first use, all sending `token` (None: no
    token); `MISSING_PREFIX` targets get a `MissingAgent`. Targets with a certificate
    (`set_certificates`) get a TLS client pinning it; the others a plaintext one, or, with
    `require_tls` or (network targets) a token, an `UnusableAgent` that says why."""

    def __init__(self, token: TokenFile | None = None, require_tls: bool = False) -> None:
        self._token = token
        self.require_tls = require_tls
        self._clients: dict[str, AgentClient] = {}
        self._certificates: dict[str, str] = {}
        self._retiring: set[asyncio.Task[None]] = set()

    def set_certificates(self, certificates: Mapping[str, str]) -> None:
        """Replace the table target -> the agent's certificate (PEM), as the agents' plugin
        pods publish them now. A pooled client whose target's certificate changed, appeared
        or went away is dropped (its channel closed after `RETIRE_GRACE_SECONDS`, in the
        background: call from within the event loop); the next `get` makes a new one."""
        self._certificates = dict(certificates)
        for target, client in list(self._clients.items()):
            if target.startswith(MISSING_PREFIX) or client.certificate == self._certificates.get(target):
                continue
            del self._clients[target]
            log.info("agent certificate changed target=%s old=%s new=%s: new channel", target,
                     client.fingerprint or ("none" if client.certificate is None else "unusable"),
                     self._describe(self._certificates.get(target)))
            task = asyncio.get_running_loop().create_task(client.close(RETIRE_GRACE_SECONDS),
                                                          name=f"close-agent-channel-{target}")
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    @staticmethod
    def _describe(certificate: str | None) -> str:
        if certificate is None:
            return "none"
        try:
            return fingerprint(certificate)
        except ValueError:
            return "unusable"

    def get(self, target: str) -> AgentClient:
        client = self._clients.get(target)
        if client is None:
            client = self._clients[target] = self._new(target)
        return client

    def _new(self, target: str) -> AgentClient:
        if target.startswith(MISSING_PREFIX):
            return MissingAgent(target)
        certificate = self._certificates.get(target)
        if certificate is None:
            token_in_clear = self._token is not None and not target.startswith("unix:")
            if self.require_tls or token_in_clear:
                log.warning("agent refused target=%s: no TLS certificate published and %s", target,
                            "TLS is required" if self.require_tls else "the agent token goes only over TLS")
                return UnusableAgent(
                    target, f"agent {target}",
                    f"it publishes no TLS certificate (no annotation {AGENT_CERTIFICATE_ANNOTATION} on its "
                    "timeslice-kubelet-plugin pod: run the plugin with --agent-tls) and " + (
                        "the controller runs with --require-agent-tls" if self.require_tls else
                        "the agent token is sent to a network address only over TLS pinning the agent's "
                        "certificate: in clear, whoever listens there first would receive it"))
            log.info("agent channel target=%s tls=off", target)
            return AgentClient(target, self._token)
        try:
            client = AgentClient(target, self._token, certificate)
        except ValueError as err:
            log.warning("agent refused target=%s: unusable certificate: %s", target, err)
            why = f"the certificate its plugin pod publishes (annotation {AGENT_CERTIFICATE_ANNOTATION}) is unusable"
            return UnusableAgent(target, f"agent {target}", f"{why}: {err}", certificate)
        log.info("agent channel target=%s tls=pinned certificate=%s server_name=%s", target, client.fingerprint,
                 AGENT_TLS_SERVER_NAME)
        return client

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)
