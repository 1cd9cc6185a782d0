"""`timeslice controller`: cluster state -> lock groups -> the orchestrator, serving clients.

Owned by the controller package; started by the CLI. One asyncio loop runs
`ClusterState` (claims, pods, slices from the API server; kept warm on every replica),
the `Reconciler` (groups into the orchestrator) and the `ClaimStatusWriter`. With
leader election (a `coordination.k8s.io` Lease, kubernetes.aio.leaderelection) only the
leader serves the orchestrator's gRPC port; a new leader first takes over each group's
state (checkpointed jobs from the node agents, the resident job, the last epoch from
claim status) and makes the resident job a presumptive holder, so a holder keeps its
lock and waiters re-queue by retrying (at most one lease period lost). A leader that loses
its Lease exits (its pod restarts as a follower).
With `auth: tokenreview` every lock call carries a projected ServiceAccount token that
must belong to a pod of the claim set it acts for (`auth.py`). With `agent_token_file`
every node-agent call carries the controller's own projected token (audience
`timeslice.dev/node-agent`), for agents that run with `--agent-auth tokenreview`. An
agent whose plugin pod publishes a TLS certificate (`--agent-tls` on the plugin) is
called over TLS pinning that certificate; with `require_agent_tls` an agent that
publishes none is not called at all (its switches fail with `Unavailable` and roll back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Literal

from kubernetes.aio import client as k8s
from kubernetes.aio.client.exceptions import ApiException
from kubernetes.aio.leaderelection import electionconfig, leaderelection
from kubernetes.aio.leaderelection.resourcelock.leaselock import LeaseLock
from pydantic import BaseModel, ConfigDict, Field, model_validator
from timeslice.controller.auth import TokenReviewAuthenticator
from timeslice.controller.claim_status import ClaimStatusWriter
from timeslice.controller.cluster_state import ClusterState
from timeslice.controller.config_warnings import ConfigWarnings
from timeslice.controller.grouping import Snapshot
from timeslice.controller.orchestrator.agent_pool import AgentPool
from timeslice.controller.orchestrator.group import LockGroup
from timeslice.controller.orchestrator.metrics import start_metrics_server
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.server import create_server
from timeslice.controller.reconciler import Reconciler
from timeslice.driver import kubeapi, names, signals
from timeslice.driver.bearer import TokenFile
from timeslice.driver.errors import Unauthenticated
from timeslice.driver.events import EventRecorder
from timeslice.driver.liveness import Heartbeat, tasks_alive
from timeslice.driver.tasks import cancel_and_wait

log = logging.getLogger("timeslice.controller")


class ControllerConfig(BaseModel):
    """`agent_template`: a node's agent address, `{node}` replaced by the node name, for
    agents that are not pods (None: the node-plugin pods in `agent_namespace`, labelled
    `app.kubernetes.io/name=timeslice-kubelet-plugin`, at their `agent` port);
    `default_backend` stands for a group's `auto` backend; `agent_token_file`: a token
    file sent to the node agents as `authorization: Bearer`, re-read when it changes
    (None: no token); `require_agent_tls`: call only agents whose plugin pod publishes a
    TLS certificate (annotation `timeslice.dev/agent-certificate`), so it needs the
    plugin pods (no `agent_template`); `metrics_listen`: `host:port` of the Prometheus
    `/metrics` endpoint, served on every replica (a replica that does not lead reports no
    groups; None: off); `liveness_file`: touched while the replica works
    (`driver.liveness`; None: off). Times in seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    listen: str = "0.0.0.0:50051"
    metrics_listen: str | None = None
    agent_template: str | None = None
    agent_namespace: str = Field(default_factory=lambda: os.environ.get("POD_NAMESPACE", "timeslice-system"))
    default_backend: str = "cuda"
    leader_election: bool = False
    lease_name: str = "timeslice-controller"
    lease_namespace: str = Field(default_factory=lambda: os.environ.get("POD_NAMESPACE", "timeslice-system"))
    identity: str = Field(default_factory=lambda: os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}")
    auth: Literal["none", "tokenreview"] = "none"
    agent_token_file: Path | None = None
    require_agent_tls: bool = False
    lease_duration: int = 15
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    resync_seconds: float = Field(default=300.0, gt=0)  # full relist of claims, pods, slices (a missed event heals)
    liveness_file: Path | None = None


    @model_validator(mode="after")
    def _renew_before_the_lease_lapses(self) -> ControllerConfig:
        # kubernetes.aio.leaderelection's own rules (electionconfig.Config), said at start, not at the election
        if self.leader_election and not (1 <= self.retry_period and 1.2 * self.retry_period < self.renew_deadline
                                         < self.lease_duration):
            raise ValueError(f"leader election needs 1 <= retry_period, 1.2 x retry_period < renew_deadline < "
                             f"lease_duration (got {self.retry_period:g}, {self.renew_deadline:g}, "
                             f"{self.lease_duration}): a leader stops serving once it could not renew for "
                             "renew_deadline seconds, before a standby may take the Lease")
        return self

    @model_validator(mode="after")
    def _token_only_over_pinned_tls(self) -> ControllerConfig:
        if self.agent_token_file is not None and self.agent_template is not None \
                and not self.agent_template.startswith("unix:"):
            raise ValueError(f"agent_token_file with agent_template {self.agent_template!r}: the token would go in "
                             "clear to a network address (certificates are pinned only from the plugin pods): "
                             "leave agent_template out, or give the agents unix sockets")
        return self

    @model_validator(mode="after")
    def _tls_needs_plugin_pods(self) -> ControllerConfig:
        if self.require_agent_tls and self.agent_template is not None:
            raise ValueError("require_agent_tls needs the agents' certificates from their plugin pods: it cannot be "
                             "combined with agent_template (--agent-template)")
        return self


class _LeaseLock(LeaseLock):
    """The library's LeaseLock (kubernetes.aio.leaderelection), with every Lease call bounded
    by `request_timeout` seconds, and `renewed_at` (monotonic seconds) when this replica last
    sent a write of the Lease as its holder that succeeded. Without a bound a call waits for
    the client's default of 300 s: the library's renew loop checks its renew deadline only
    between calls, so a leader whose API server connection hung kept serving beside the
    standby that took the Lease after it lapsed (issue 24: both served for 21.5 of 30 s).
    The bound is `asyncio.timeout`, not `asyncio.wait_for`, which on Python 3.11 swallows a
    cancellation that meets the call's end (CPython gh-86296): the controller's stop then
    waited for the library to give up by itself (95 s in e2e/test_leader_serving.py).
    `create` also drops the library's `pretty=True` (kubernetes 37.0.2's own argument
    validation rejects it, so no Lease was ever created)."""

    def __init__(self, name: str, namespace: str, identity: str, api: k8s.ApiClient, request_timeout: float) -> None:
        super().__init__(name, namespace, identity, api)
        self.request_timeout = request_timeout
        self.renewed_at: float | None = None

    async def get(self, name: str, namespace: str) -> Any:
        try:
            async with asyncio.timeout(self.request_timeout):
                return await super().get(name, namespace)
        except TimeoutError:  # the library reads a failed get's `reason`
            return False, ApiException(status=0, reason=f"no answer within {self.request_timeout:g} s")

    async def create(self, name: str, namespace: str, election_record: Any) -> bool:
        body = k8s.V1Lease(metadata=k8s.V1ObjectMeta(name=name), spec=self.update_lease(election_record))
        sent = time.monotonic()
        try:
            async with asyncio.timeout(self.request_timeout):
                await self.api_instance.create_namespaced_lease(namespace, body)
        except (ApiException, TimeoutError) as err:
            log.warning("lease not created %s/%s: %s", namespace, name, getattr(err, "reason", None) or "no answer")
            return False
        self._written(election_record, sent)
        return True

    async def update(self, name: str, namespace: str, updated_record: Any) -> bool:
        sent = time.monotonic()
        try:
            async with asyncio.timeout(self.request_timeout):
                ok = await super().update(name, namespace, updated_record)
        except TimeoutError:
            log.warning("lease not renewed %s/%s: no answer within %g s", namespace, name, self.request_timeout)
            return False
        if ok:
            self._written(updated_record, sent)
        return bool(ok)

    def _written(self, record: Any, sent: float) -> None:
        """The Lease was written as `record`, by a request sent at `sent` (monotonic): the API
        server wrote it after that, so a standby's lease clock starts no earlier."""
        if record.holder_identity == self.identity:
            self.renewed_at = sent

    async def lapses(self, renew_deadline: float, period: float) -> None:
        """Return once this replica has not renewed the Lease for `renew_deadline` seconds
        (checked every `period`)."""
        while True:
            since = time.monotonic() - (self.renewed_at or time.monotonic())
            if since >= renew_deadline:
                return
            await asyncio.sleep(min(period, renew_deadline - since))


class Controller:
    """The controller's parts, owned together; `lead()` serves while this replica leads."""

    def __init__(self, cfg: ControllerConfig, api: k8s.ApiClient) -> None:
        self.cfg = cfg
        self.api = api
        resource_api = k8s.ResourceV1Api(api)
        events = EventRecorder(k8s.CoreV1Api(api), f"{names.DRIVER_NAME}/controller", cfg.identity)
        self.writer = ClaimStatusWriter(resource_api, events, lambda: self.reconciler.snapshot)
        token = TokenFile(cfg.agent_token_file) if cfg.agent_token_file else None
        if token is not None:
            try:
                token.token()
            except Unauthenticated as err:  # the agents will refuse every call: say so now
                log.error("no token for the node agents: %s", err)
        self.orchestrator = Orchestrator(observer=self.writer.observe,
                                         agents=AgentPool(token, require_tls=cfg.require_agent_tls))
        self.orchestrator.metrics.active = False  # groups are reported while leading (they are served then)
        self.reconciler = Reconciler(self.orchestrator, cfg.agent_template, cfg.default_backend, self.writer.mark)
        self.warnings = ConfigWarnings(events)
        self._leading = False
        self.failed: Exception | None = None  # why serving failed while leading (`run` raises it)
        self.state = ClusterState(api, self._apply, resync_seconds=cfg.resync_seconds,
                                  agent_namespace=None if cfg.agent_template else cfg.agent_namespace)

    async def _apply(self, snapshot: Snapshot) -> None:
        await self.reconciler.apply(snapshot)
        if self._leading:  # only the leader records Events
            self.warnings.publish(snapshot.warnings)

    async def lead(self) -> None:
        """Take over recorded state, then serve the orchestrator until cancelled."""
        await self.reconciler.apply(await self.state.wait_synced())
        self._leading = True
        self.warnings.publish(self.reconciler.snapshot.warnings)
        for group in self.orchestrator.groups():
            try:
                await self.take_over(group)
            except Exception as err:  # nothing to take over: start the group empty
                log.warning("no state adopted group=%s: %s", group.id, err)
        auth = TokenReviewAuthenticator(k8s.AuthenticationV1Api(self.api)) if self.cfg.auth == "tokenreview" else None
        server, port = await self._bind(auth)
        self.orchestrator.metrics.active = True
        self.writer.start()  # only the leader writes claim status
        agents = self.cfg.agent_template or f"plugin pods in {self.cfg.agent_namespace}"
        log.info("controller serving identity=%s listen=%s port=%d agents=%s default_backend=%s agent_token_file=%s "
                 "agent_tls=%s", self.cfg.identity, self.cfg.listen, port, agents, self.cfg.default_backend,
                 self.cfg.agent_token_file or "-", "required" if self.cfg.require_agent_tls else "when published")
        try:
            await asyncio.Event().wait()
        finally:
            log.info("controller stops serving identity=%s", self.cfg.identity)
            await server.stop(2)

    async def _bind(self, auth: TokenReviewAuthenticator | None) -> tuple[Any, int]:
        """Start serving; while the address is in use (a replaced leader on the same host
        network still stopping) retry for up to two lease durations. Raises OSError."""
        deadline = asyncio.get_running_loop().time() + 2 * self.cfg.lease_duration
        while True:
            try:
                return await create_server(self.orchestrator, self.cfg.listen, auth)
            except OSError as err:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                log.warning("cannot serve yet listen=%s: %s; retrying", self.cfg.listen, err)
                await asyncio.sleep(0.5)

    async def take_over(self, group: LockGroup) -> None:
        """Adopt a group's state after a leader change: checkpointed jobs from the node
        agents (the truth; claim status can lag a crash), the resident job from claim
        status when the agents agree it is not checkpointed, else the one member they do
        not report checkpointed."""
        recorded, epoch = await self.writer.recorded(group)
        checkpointed = await self.orchestrator.checkpointed_jobs(group) if group.spec.agents else set()
        running = [m.claim_set for m in group.spec.members if m.claim_set not in checkpointed]
        resident = recorded if recorded in running else (running[0] if len(running) == 1 else None)
        group.adopt(resident, checkpointed, epoch)

    async def elect(self, stop: asyncio.Event) -> None:
        """Run for leadership; serve while leading; set `stop` when leadership is lost, or
        when serving fails while leading (the library goes on renewing the Lease when its
        leading task fails: a leader that cannot serve would keep it for good)."""
        async def lost() -> None:
            log.error("leadership lost identity=%s: exiting", self.cfg.identity)
            stop.set()

        async def lead() -> None:
            serving = asyncio.create_task(self.lead())
            unrenewed = asyncio.create_task(lock.lapses(c.renew_deadline, c.retry_period / 2))
            try:
                await asyncio.wait([serving, unrenewed], return_when=asyncio.FIRST_COMPLETED)
                if not serving.done():  # stop serving before the Lease can lapse and a standby take it
                    log.error("Lease not renewed for %g s identity=%s (the API server does not answer): stopping "
                              "serving and exiting", c.renew_deadline, self.cfg.identity)
                    await cancel_and_wait(serving)
                    stop.set()
                    return
                await serving
            except Exception as err:
                log.error("serving failed while leading identity=%s: %s: giving up the Lease and exiting",
                          self.cfg.identity, err)
                self.failed = err
                stop.set()
                raise
            finally:
                unrenewed.cancel()
                serving.cancel()

        c = self.cfg
        lock = _LeaseLock(c.lease_name, c.lease_namespace, c.identity, self.api, request_timeout=c.renew_deadline / 2)
        # the library writes lease_duration as the Lease's integer leaseDurationSeconds
        config = electionconfig.Config(lock, int(c.lease_duration), c.renew_deadline, c.retry_period, lead, lost)
        log.info("waiting for leadership identity=%s lease=%s/%s", c.identity, c.lease_namespace, c.lease_name)
        await leaderelection.LeaderElection(config).run()


async def run(cfg: ControllerConfig, stop: asyncio.Event | None = None) -> None:
    api = await kubeapi.api_client()
    ctl = Controller(cfg, api)
    metrics = None
    if cfg.metrics_listen:
        try:
            metrics, _ = await start_metrics_server(ctl.orchestrator.metrics, cfg.metrics_listen)
        except BaseException:
            await api.close()
            raise
    ctl.state.start()
    if stop is None:
        stop = signals.stop_event()
    task = asyncio.create_task(ctl.elect(stop) if cfg.leader_election else ctl.lead())

    def ended(t: asyncio.Task[None]) -> None:  # serving or electing must never end silently
        if not t.cancelled() and t.exception() is not None:
            log.error("controller stopped: %r", t.exception(), exc_info=t.exception())
        stop.set()

    task.add_done_callback(ended)
    heartbeat = None
    if cfg.liveness_file:  # its reflectors, its election or serving, and (leading) its status writer
        heartbeat = Heartbeat(cfg.liveness_file, {"controller": tasks_alive(
            lambda: [task, *ctl.state.tasks, ctl.writer.task])})
        heartbeat.start()
    try:
        await stop.wait()
    finally:
        if heartbeat is not None:
            await heartbeat.stop()
        await cancel_and_wait(task)  # (a cancel the election library swallows is sent again)
        await ctl.state.stop()
        await ctl.writer.stop()
        await ctl.warnings.stop()
        if metrics is not None:
            await metrics.cleanup()
        with contextlib.suppress(Exception):
            await ctl.orchestrator.close()
        await api.close()
    if ctl.failed is not None:  # the process exits non-zero: its pod restarts, another replica leads
        raise ctl.failed
