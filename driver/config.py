"""`TimeSliceConfig`: the opaque per-claim configuration of our driver, and its resolution.

Owned by the driver package; used by the kubelet plugin (validation at prepare) and the
controller (job-level values). Wire form, in a DeviceClass's or a claim's
`spec.config[].opaque` with `driver: gpu.timeslice.dev`:

    parameters:
      apiVersion: timeslice.dev/v1alpha1
      kind: TimeSliceConfig
      priority: 10               # queue priority, higher first (-1000..1000)
      backend: auto              # auto | cuda | cuda-checkpoint | cooperative | freeze | app | none
      app:                       # backend app only (and required by it): the job's inference engine
        engine: vllm             # vllm | sglang (driver/app_engine.py)
        url: http://127.0.0.1:8000   # loopback only
        level: 1                 # vLLM sleep level 1 or 2
        timeoutSeconds: 120      # bound on one sleep or wake call
      residency: auto            # auto: move memory only when the next job does not fit | exclusive
      memoryHeadroom: "10%"      # kept free per GPU under residency auto: percent or quantity ("8Gi")
      residentFirstSeconds: 30   # residency auto: resident waiters may pass one that needs a switch this long
      maxHoldSeconds: 600        # counted from a waiter's arrival; absent = no limit
      leaseSeconds: 10           # holder lease without keep-alive
      job: my-job                # job identity override (else pod label / owner)

Precedence (DESIGN.md, "Config precedence"): the allocation result lists DeviceClass
configs, then claim configs, in order; for each request the last `TimeSliceConfig` that
applies to it (empty `requests` = every request) replaces earlier ones as a whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from timeslice.driver import names
from timeslice.driver.app_engine import AppEngine
from timeslice.driver.errors import InvalidArgument
from timeslice.driver.headroom import parse_headroom
from timeslice.quantity import parse_bytes


class TimeSliceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    apiVersion: Literal["timeslice.dev/v1alpha1"]
    kind: Literal["TimeSliceConfig"]
    job: str | None = Field(default=None, min_length=1, max_length=253)
    priority: int = Field(default=0, ge=-1000, le=1000)
    backend: Literal["auto", "cuda", "cuda-checkpoint", "vmm", "cooperative", "freeze", "app", "none"] = "auto"
    # backend app: the job's inference engine, which sleeps and wakes on the agent's call
    app: AppEngine | None = None
    residency: Literal["auto", "exclusive"] = names.RESIDENCY_AUTO
    memoryHeadroom: str = names.DEFAULT_MEMORY_HEADROOM
    residentFirstSeconds: float = Field(default=names.DEFAULT_RESIDENT_FIRST_SECONDS, ge=0, le=3600)
    maxHoldSeconds: float | None = Field(default=None, gt=0)
    leaseSeconds: float = Field(default=names.DEFAULT_LEASE_SECONDS, gt=0, le=300)
    # False: the claim's containers get NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1 (CDI env), so
    # that backends cuda and cuda-checkpoint can move a multi-GPU NCCL job (issue 14)
    ncclPeerTransports: bool = True
    # the most GPU memory the job holds while it computes, per GPU ("57Gi", "60G"): the
    # orchestrator reserves max(this, what it saw the job use); unset: the job runs alone
    # until its memory stopped growing (a consumable-capacity `memory` request counts too)
    memory: str | None = None

    @field_validator("memoryHeadroom")
    @classmethod
    def _headroom(cls, v: str) -> str:
        parse_headroom(v)
        return v

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: str | None) -> str | None:
        if v is not None:
            parse_bytes(v)
        return v

    def memory_bytes(self) -> int:
        """`memory` in bytes per GPU; 0 when unset."""
        return parse_bytes(self.memory) if self.memory else 0

    @model_validator(mode="after")
    def _app_with_backend_app(self) -> TimeSliceConfig:
        if self.backend == names.BACKEND_APP and self.app is None:
            raise ValueError("backend app needs the job's engine: app: {engine: vllm|sglang, url: "
                             "http://127.0.0.1:<port>}")
        if self.app is not None and self.backend != names.BACKEND_APP:
            raise ValueError(f"app is set, but backend is {self.backend}: set backend: app to switch the job by "
                             "its engine's sleep and wake, or drop app")
        return self


DEFAULT = TimeSliceConfig.model_validate({"apiVersion": names.CONFIG_API_VERSION, "kind": names.CONFIG_KIND})


def parse(parameters: Any, where: str) -> TimeSliceConfig:
    """Validate one opaque `parameters` object; raises InvalidArgument naming `where` and
    every bad field (unknown field, wrong type, unknown backend, ...)."""
    try:
        return TimeSliceConfig.model_validate(parameters)
    except ValidationError as err:
        raise InvalidArgument(f"invalid TimeSliceConfig in {where}: {problems(err)}") from None


def problems(err: ValidationError, prefix: str = "") -> str:
    """Every bad field of `err` (`problem_lines`), joined by "; "."""
    return "; ".join(problem_lines(err, prefix))


def problem_lines(err: ValidationError, prefix: str = "") -> list[str]:
    """One line per bad field of `err`: `<prefix><field path>: <message>`, the path as
    `groups[0].backend`, and the value given when it is a scalar (`(got 'freez')`)."""
    lines = []
    for e in err.errors():
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".") or "(object)"
        given = e.get("input")
        got = f" (got {given!r})" if isinstance(given, str | int | float | bool) and e["type"] != "missing" else ""
        lines.append(f"{prefix}{path}: {e['msg']}{got}")
    return lines


def resolve(config_entries: Iterable[Mapping[str, Any]], requests: Iterable[str]) -> dict[str, TimeSliceConfig]:
    """Effective config per request name from `status.allocation.devices.config` entries
    (`{source, requests, opaque: {driver, parameters}}`, in order). Entries of other
    drivers are skipped; every entry of ours is validated, even a superseded one."""
    effective = {r: DEFAULT for r in requests}
    for i, entry in enumerate(config_entries):
        opaque = entry.get("opaque") or {}
        if opaque.get("driver") != names.DRIVER_NAME:
            continue
        where = f"config[{i}] ({entry.get('source', 'unknown source')})"
        cfg = parse(opaque.get("parameters"), where)
        targets = entry.get("requests") or list(effective)
        for r in targets:
            effective[r.split("/", 1)[0]] = cfg  # a subrequest result names "<request>/<sub>"
    return effective
