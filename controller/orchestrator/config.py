"""Typed configuration of the orchestrator: its listen address and its static groups.

Owned by the orchestrator; built by the CLI (`timeslice orchestrator --config`) and by
the demo. In the cluster (controller) groups come from ResourceClaims instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel
from timeslice.driver import names
from timeslice.driver.app_engine import AppEngine
from timeslice.driver.config import problem_lines
from timeslice.driver.headroom import parse_headroom

Backend = Literal["cuda", "cuda-checkpoint", "vmm", "freeze", "cooperative", "app", "none"]
# Backends that move GPU memory, whose groups place jobs by memory (residency "auto").
MEMORY_BACKENDS = frozenset({names.BACKEND_CUDA, names.BACKEND_CUDA_CHECKPOINT, names.BACKEND_VMM,
                             names.BACKEND_COOPERATIVE})


class MemberSpec(BaseModel):
    """One claim set of a group, in a cluster: `claim_set` is its id `<namespace>/<job>:<claim
    source>` (`grouping.claim_set_id`: a ResourceClaimTemplate's or ResourceClaim's name), the
    holder id (`job_id` on the wire) its clients' handles resolve to (`Orchestrator.group_for`);
    for each node agent the claim set's claims on that node (namespace, name),
    and the job's pods. The agent finds the processes from these (claim -> pods -> PIDs).
    `priority`, `max_hold_seconds` and `memory` (bytes per GPU) come from the claim set's
    TimeSliceConfig (`memory` also from a consumable-capacity request) and override what
    its client asks for; `app` (backend app) its inference engine, which the
    agents sleep and wake. (In static mode a group has no members and a holder id is a job
    name from the agents' job tables.)"""

    model_config = ConfigDict(extra="forbid", frozen=True)

    claim_set: str
    claims_by_agent: dict[str, tuple[tuple[str, str], ...]]
    pod_uids: tuple[str, ...] = ()
    claim_name: str = ""  # the pod-level claim name its pods use (marks its processes)
    priority: int = 0
    max_hold_seconds: float | None = Field(default=None, gt=0)
    app: AppEngine | None = None
    # bytes per GPU the claim set declared (TimeSliceConfig `memory`, or its claims'
    # consumable-capacity `memory` request); 0: none
    memory: int = Field(default=0, ge=0)


class GroupSpec(BaseModel):
    """One lock group.

    `agents` are node-agent gRPC targets (`unix:///path` or `host:port`), one per node
    that runs the group's jobs; `backend` names the checkpoint backend the agents use
    (`none` needs no agent: lock hand-off only; `cooperative` is moved by the jobs' own
    processes, its agents report memory); `max_hold_seconds` bounds a hold once another
    job waits (members' own values win). Times are seconds. `residency`: `auto` moves
    memory only when the incoming job does not fit, keeping `memory_headroom` free on
    each GPU (a percent of its memory, "10%", or a quantity, "8Gi"), and lets waiters
    that are resident pass, for at most `resident_first_seconds`, a waiter of their
    priority whose grant would move memory; `exclusive` checkpoints at every hand-off.
    `apps` (backend app, static mode): each job's inference engine by job name, in the
    wire form of TimeSliceConfig `app` (`{engine: vllm, url: "http://127.0.0.1:8000"}`).
    A config file names each field as here (snake_case); a name as TimeSliceConfig spells it
    (`memoryHeadroom`, camelCase: claims) is refused naming the one to use.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=253)
    backend: Backend = "none"
    agents: tuple[str, ...] = ()
    lease_seconds: float = Field(default=names.DEFAULT_LEASE_SECONDS, gt=0)
    step_timeout_seconds: float = Field(default=names.DEFAULT_STEP_TIMEOUT_SECONDS, gt=0)
    max_hold_seconds: float | None = Field(default=None, gt=0)
    residency: Literal["auto", "exclusive"] = names.RESIDENCY_AUTO
    memory_headroom: str | int = names.DEFAULT_MEMORY_HEADROOM
    resident_first_seconds: float = Field(default=names.DEFAULT_RESIDENT_FIRST_SECONDS, ge=0)
    # Cluster mode: the group's jobs and where they run. Empty (static mode): any job may
    # acquire, and every agent resolves the job by its own table.
    members: tuple[MemberSpec, ...] = ()
    apps: dict[str, AppEngine] = {}

    def member(self, holder: str) -> MemberSpec | None:
        """The member whose claim-set id is `holder` (None: not a member, or static mode)."""
        return next((m for m in self.members if m.claim_set == holder), None)

    def app(self, holder: str) -> AppEngine | None:
        """`holder`'s inference engine (backend app): its member's, else `apps`' entry; None
        for other backends."""
        if self.backend != names.BACKEND_APP:
            return None
        m = self.member(holder)
        return m.app if m is not None and m.app is not None else self.apps.get(holder)

    @model_validator(mode="before")
    @classmethod
    def _snake_case(cls, data: object) -> object:
        if isinstance(data, dict):
            for name in cls.model_fields:
                if to_camel(name) != name and to_camel(name) in data:
                    raise ValueError(f"{to_camel(name)}: a group in this file names it {name} (snake_case; "
                                     "the camelCase names are TimeSliceConfig's, in claims)")
        return data

    @field_validator("apps", mode="before")
    @classmethod
    def _apps_snake_case(cls, apps: object) -> object:
        """This file's style for an engine too: `timeout_seconds` (AppEngine's `timeoutSeconds`
        is the claims' name); the camelCase one is refused naming the one to use."""
        if not isinstance(apps, dict):
            return apps
        out = {}
        for job, app in apps.items():
            if isinstance(app, dict):
                if "timeoutSeconds" in app:
                    raise ValueError(f"apps.{job}.timeoutSeconds: a group in this file names it timeout_seconds "
                                     "(snake_case; the camelCase names are TimeSliceConfig's, in claims)")
                app = {("timeoutSeconds" if k == "timeout_seconds" else k): v for k, v in app.items()}
            out[job] = app
        return out

    @field_validator("apps")
    @classmethod
    def _one_engine_per_job(cls, apps: dict[str, AppEngine]) -> dict[str, AppEngine]:
        """Each job its own engine: a sleep for one job's switch would put to sleep the engine
        another job generates on (a helper's attack: two jobs naming one URL were accepted, and
        only their failed switches said anything). Engine URLs are a loopback host and a port
        (`AppEngine`), so two are one engine when their ports are: `localhost` and `127.0.0.1`
        name the same server."""
        by_port: dict[int, tuple[str, str]] = {}
        for job, app in sorted(apps.items()):
            other, other_url = by_port.setdefault(urlsplit(app.url).port or 80, (job, app.url))
            if other != job:
                raise ValueError(f"apps.{other} and apps.{job} name the same engine ({other_url}, {app.url}): each "
                                 "job needs its own engine, which its switches put to sleep and wake")
        return apps

    @field_validator("agents")
    @classmethod
    def _agent_targets(cls, agents: tuple[str, ...]) -> tuple[str, ...]:
        """A node agent is `unix:///path` or `host:port`: a bare path was taken for a host name
        (a helper's try: "hostname lookup error ... Domain name not found" at the first switch)."""
        for a in agents:
            if not a or a.startswith(("/", "./", "~")):
                raise ValueError(f"agent {a!r}: write a unix socket as unix://{a or '/path'} (or host:port)")
        return agents

    @field_validator("memory_headroom")
    @classmethod
    def _headroom(cls, v: str | int) -> str | int:
        parse_headroom(v)
        return v

    @model_validator(mode="after")
    def _agents_for_backend(self) -> GroupSpec:
        if self.backend != "none" and not self.agents:
            raise ValueError(f"group {self.id!r}: backend {self.backend!r} needs at least one agent")
        if self.apps and self.backend != "app":
            raise ValueError(f"group {self.id!r}: `apps` (inference engines) apply to backend app only, not "
                             f"{self.backend!r}")
        if self.backend == "app" and not self.apps and not self.members:
            raise ValueError(f"group {self.id!r}: backend app needs each job's engine: apps: {{<job>: {{engine: "
                             "vllm|sglang, url: http://127.0.0.1:PORT}} (name the jobs: TIMESLICE_JOB)")
        return self


class PinnedPoolSpec(BaseModel):
    """This node's pinned host pool for cooperative checkpoints: a file on a memory
    filesystem and its size, bytes (the node's bound on pinned memory)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path
    bytes: int = Field(gt=0)


class OrchestratorConfig(BaseModel):
    """`listen` is `host:port` (port 0 picks one); bind to 127.0.0.1 outside a cluster.
    `metrics_listen`: `host:port` of the Prometheus `/metrics` endpoint (None: off).
    `pinned_pool`: the node's shared pinned pool for cooperative groups (one-box mode).
    `state_file`: persisted epoch floors and placements (`state_file.py`).
    `agent_token_file`: a token sent to every node agent (standalone nodes run `timeslice
    node-agent --token-file` with the same token); `agent_certificates`: node-agent target
    -> its certificate (PEM file, written by `timeslice node-agent --tls`), pinned: a target
    listed here is called over TLS, and only that certificate is accepted. With a token, every
    network (non-unix) agent target must be listed: the token never goes in clear."""

    model_config = ConfigDict(extra="forbid")

    listen: str = "127.0.0.1:50051"
    metrics_listen: str | None = None
    pinned_pool: PinnedPoolSpec | None = None
    # Where fencing-epoch floors persist across restarts (None: epochs restart at 0).
    state_file: Path | None = None
    agent_token_file: Path | None = None
    agent_certificates: dict[str, Path] = {}
    groups: list[GroupSpec] = []

    @model_validator(mode="after")
    def _token_only_over_pinned_tls(self) -> OrchestratorConfig:
        if self.agent_token_file is None:
            return self
        clear = sorted({a for g in self.groups for a in g.agents
                        if not a.startswith("unix:") and a not in self.agent_certificates})
        if clear:
            raise ValueError(f"agent_token_file: the token would go in clear to {', '.join(clear)} (whoever listens "
                             "there first would receive it): pin each one's certificate under agent_certificates "
                             "(`timeslice node-agent --tls` writes it), or reach the agent on a unix socket")
        return self

    @model_validator(mode="after")
    def _unique_ids(self) -> OrchestratorConfig:
        ids = [g.id for g in self.groups]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate group ids: {', '.join(dupes)}")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> OrchestratorConfig:
        """Load from a YAML file; raises ValueError (malformed YAML; invalid settings: one
        line per bad field, `<path>: groups[0].backend: ...`), or OSError."""
        with open(path) as f:
            try:
                data = yaml.safe_load(f)
            except yaml.YAMLError as err:
                raise ValueError(f"{path}: not valid YAML: {err}") from None
        try:
            return cls.model_validate(data or {})
        except ValidationError as err:
            raise ValueError("\n".join(problem_lines(err, f"{path}: "))) from None
