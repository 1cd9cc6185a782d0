"""Typed configuration of the orchestrator: its listen address and its static groups.

Owned by the orchestrator; built by the CLI (`timeslice orchestrator --config`) and by
the demo. In the cluster (controller) groups come from ResourceClaims instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from timeslice.driver import names

Backend = Literal["cuda", "cuda-checkpoint", "freeze", "none"]


class MemberSpec(BaseModel):
    """Where one job (a claim set, in a cluster) of a group runs: for each node agent the
    job's claims on that node (namespace, name), and the job's pods. The agent finds the
    processes from these (claim -> pods -> PIDs). `priority` and `max_hold_seconds` come
    from the claim set's TimeSliceConfig and override what its client asks for."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: str
    claims_by_agent: dict[str, tuple[tuple[str, str], ...]]
    pod_uids: tuple[str, ...] = ()
    claim_name: str = ""  # the pod-level claim name of the claim set
    priority: int = 0
    max_hold_seconds: float | None = Field(default=None, gt=0)


class GroupSpec(BaseModel):
    """One lock group.

    `agents` are node-agent gRPC targets (`unix:///path` or `host:port`), one per node
    that runs the group's jobs; `backend` names the checkpoint backend the agents use
    (`none` needs no agent: lock hand-off only); `max_hold_seconds` bounds a hold once
    another job waits (members' own values win). Times are seconds.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=253)
    backend: Backend = "none"
    agents: tuple[str, ...] = ()
    lease_seconds: float = Field(default=names.DEFAULT_LEASE_SECONDS, gt=0)
    step_timeout_seconds: float = Field(default=names.DEFAULT_STEP_TIMEOUT_SECONDS, gt=0)
    max_hold_seconds: float | None = Field(default=None, gt=0)
    # Cluster mode: the group's jobs and where they run. Empty (static mode): any job may
    # acquire, and every agent resolves the job by its own table.
    members: tuple[MemberSpec, ...] = ()

    def member(self, job: str) -> MemberSpec | None:
        return next((m for m in self.members if m.job == job), None)

    @model_validator(mode="after")
    def _agents_for_backend(self) -> GroupSpec:
        if self.backend != "none" and not self.agents:
            raise ValueError(f"group {self.id!r}: backend {self.backend!r} needs at least one agent")
        return self


class OrchestratorConfig(BaseModel):
    """`listen` is `host:port` (port 0 picks one); bind to 127.0.0.1 outside a cluster.
    `metrics_listen`: `host:port` of the Prometheus `/metrics` endpoint (None: off)."""

    model_config = ConfigDict(extra="forbid")

    listen: str = "127.0.0.1:50051"
    metrics_listen: str | None = None
    groups: list[GroupSpec] = []

    @model_validator(mode="after")
    def _unique_ids(self) -> OrchestratorConfig:
        ids = [g.id for g in self.groups]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate group ids: {', '.join(dupes)}")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> OrchestratorConfig:
        """Load from a YAML file; raises pydantic.ValidationError (a ValueError), ValueError
        for malformed YAML, or OSError."""
        with open(path) as f:
            try:
                data = yaml.safe_load(f)
            except yaml.YAMLError as err:
                raise ValueError(f"{path}: not valid YAML: {err}") from None
        return cls.model_validate(data or {})
