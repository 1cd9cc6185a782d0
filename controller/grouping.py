"""Claims, pods and ResourceSlices -> claim sets and lock groups (DESIGN.md, "Lock groups").

Owned by the controller; `ClusterState` calls `compute` on every change of its caches,
the orchestrator wiring consumes the `Snapshot` and `diff`. Pure: API JSON in (camelCase
dicts, as the API server sends them), frozen dataclasses out, no I/O, no clock.

Definitions:

- A **claim set** is what one job (`jobs.job_id`) holds from one **claim source** across
  all its pods and nodes: the ResourceClaimTemplate its pods' claims are generated from
  (`pod.spec.resourceClaims[].resourceClaimTemplateName`), or the ResourceClaim they name
  (`resourceClaimName`). A claim is in a claim set when a pod of the job references it
  from that source, the claim is reserved for that pod (`status.reservedFor`) and the pod
  is not finished. The pod-level claim name (`pod.spec.resourceClaims[].name`) is only the
  client's handle: a job whose trainer and sampler pods both call their claim `gpu`, from
  templates `trainer-gpu` and `sampler-gpu`, has two claim sets, as with role-named claims
  (the calling pod tells them apart, see `reconciler.aliases`). A pod that asks for the
  DeviceClass's extended resource (`timeslice.dev/gpu` in its containers' resources, gate
  DRAExtendedResource) gets a claim from kube-scheduler, named in
  `pod.status.extendedResourceClaimStatus`: its handle and source are the extended
  resource's name, so a job's pods that ask for it form one claim set. Only allocation results of
  driver `gpu.timeslice.dev` count; admin-access requests and results are never counted,
  so a claim with nothing else is in no claim set. A claim shared by pods of two jobs is
  in a claim set of each (and so puts both in one group).
- A **lock group** is a connected component of claim sets whose devices overlap on
  physical GPUs (union-find over GPU ids). A claim set alone on its GPUs is a group of
  one; a job with claim sets on disjoint GPUs is in several groups.
- The physical GPU of a published device comes from the ResourceSlices of our driver
  (`physical_gpus`): attribute `physicalGpu`, else `uuid`; both hold the GPU's uuid,
  unique in the cluster. A device no slice publishes counts as its own GPU (a warning).

Group ids: `g-` + the first 16 hex digits of the SHA-256 of the group's sorted physical
GPU ids. Groups are disjoint in GPUs, so ids are distinct; the id depends on cluster
state only (no counter, no order of arrival), so a restarted controller derives the same
ids. GPUs rather than members, because the common change is a job joining or leaving a
set of shared GPUs: the GPU set, and so the id and the orchestrator's queue, survives it,
while an id taken from the oldest claim would change whenever that job leaves. The id
changes only when the group's GPUs change (two groups merged by a bridging claim set,
or split when it leaves); `diff` then names the predecessors.

Job-level configuration (`TimeSliceConfig`, resolved per request by `config.resolve`):
a claim's values are those of its first result of our driver; within a claim set the
oldest claim (creationTimestamp, then namespace/name) decides, and every claim whose
values differ gets a `GroupingWarning` (the caller turns them into Warning Events).
Per group: `backend` is the oldest claim set's (warning on the others when they differ),
`lease_seconds` the largest of its claim sets' (no holder loses the lock sooner than its
own config promises).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from timeslice.controller.jobs import job_id, safe_id
from timeslice.controller.node_agents import AgentEndpoint
from timeslice.driver import config as ts_config
from timeslice.driver import names
from timeslice.driver.app_engine import AppEngine
from timeslice.driver.errors import InvalidArgument
from timeslice.quantity import parse_bytes

DeviceRef = tuple[str, str]  # (pool, device) of an allocation result
FINISHED_PHASES = ("Succeeded", "Failed")

# Warning reasons (Event reasons, CamelCase).
CONFLICTING_JOB_CONFIG = "ConflictingJobConfig"
CONFLICTING_GROUP_CONFIG = "ConflictingGroupConfig"
INVALID_CONFIG = "InvalidConfig"
UNKNOWN_DEVICE = "UnknownDevice"


@dataclass(frozen=True, order=True)
class ClaimRef:
    """A ResourceClaim; orders oldest first (`created` is RFC 3339 UTC, sorts as text)."""

    created: str
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class PhysicalGpu:
    id: str                   # the GPU's uuid (attribute physicalGpu or uuid)
    node: str                 # spec.nodeName of the slice that publishes it (its pool when unknown)
    product: str = ""         # attribute productName, e.g. "NVIDIA H200"
    driver_version: str = ""  # attribute driverVersion (semver), e.g. "580.159.4"

    def status_data(self) -> dict[str, str]:
        """What a claim's `status.devices[].data` says of the GPU (as the peer drivers do)."""
        return {"uuid": self.id, "productName": self.product, "driverVersion": self.driver_version}


@dataclass(frozen=True)
class JobConfig:
    """Job-level values of `TimeSliceConfig`."""

    priority: int = 0
    backend: str = "auto"
    max_hold_seconds: float | None = None
    lease_seconds: float = names.DEFAULT_LEASE_SECONDS
    residency: str = names.RESIDENCY_AUTO
    memory_headroom: str = names.DEFAULT_MEMORY_HEADROOM
    resident_first_seconds: float = names.DEFAULT_RESIDENT_FIRST_SECONDS
    app: AppEngine | None = None  # backend app: the claim set's own engine
    memory: int = 0  # bytes per GPU it declared (TimeSliceConfig.memory or its consumed `memory` capacity)

    @classmethod
    def of(cls, cfg: ts_config.TimeSliceConfig, consumed_memory: int = 0) -> JobConfig:
        return cls(cfg.priority, cfg.backend, cfg.maxHoldSeconds, cfg.leaseSeconds, cfg.residency,
                   cfg.memoryHeadroom, cfg.residentFirstSeconds, cfg.app, max(cfg.memory_bytes(), consumed_memory))

    def describe(self) -> str:
        return (f"priority={self.priority} backend={self.backend} maxHoldSeconds={self.max_hold_seconds} "
                f"leaseSeconds={self.lease_seconds:g} residency={self.residency} "
                f"memoryHeadroom={self.memory_headroom} residentFirstSeconds={self.resident_first_seconds:g}"
                + (f" app={self.app.describe()}" if self.app else "")
                + (f" memory={self.memory}" if self.memory else ""))


def claim_set_id(job: str, source: str) -> str:
    """`<job>:<claim source>` (a ResourceClaimTemplate's or a ResourceClaim's name): the
    holder id of a claim set in its group. Object names hold no ":", so the id splits back
    at its last ":"."""
    return safe_id(f"{job}:{source}")


@dataclass(frozen=True)
class ClaimSet:
    job: str
    name: str                       # the pod-level claim name its pods use, e.g. "trainer" (the first, sorted)
    claims: tuple[ClaimRef, ...]    # oldest first
    devices: tuple[DeviceRef, ...]  # sorted
    gpus: tuple[str, ...]           # physical GPU ids, sorted
    nodes: tuple[str, ...]          # sorted
    pods: tuple[str, ...]           # pod uids, sorted
    config: JobConfig
    source: str = ""                # the ResourceClaimTemplate or ResourceClaim name ("": the pod-level name)
    names: tuple[str, ...] = ()     # every pod-level name its pods use, sorted (default: (name,))

    @property
    def id(self) -> str:
        return claim_set_id(self.job, self.source or self.name)

    @property
    def handles(self) -> tuple[str, ...]:
        """The names a client of the job may lock it by: its pod-level names and its source."""
        return tuple(dict.fromkeys((*(self.names or (self.name,)), *((self.source,) if self.source else ()))))

    @property
    def oldest(self) -> ClaimRef:
        return self.claims[0]


@dataclass(frozen=True)
class Group:
    id: str
    claim_sets: tuple[ClaimSet, ...]  # sorted by id
    nodes: tuple[str, ...]
    gpus: tuple[str, ...]
    backend: str                      # "auto" when every claim set leaves it to the node
    lease_seconds: float
    residency: str = names.RESIDENCY_AUTO  # the oldest claim set's, like the backend
    memory_headroom: str = names.DEFAULT_MEMORY_HEADROOM
    resident_first_seconds: float = names.DEFAULT_RESIDENT_FIRST_SECONDS

    @property
    def jobs(self) -> tuple[str, ...]:
        return tuple(sorted({cs.job for cs in self.claim_sets}))


@dataclass(frozen=True, order=True)
class GroupingWarning:
    """Something a user should fix, about one claim (the caller records a Warning Event)."""

    claim: ClaimRef
    reason: str
    message: str


@dataclass(frozen=True)
class Snapshot:
    groups: Mapping[str, Group] = field(default_factory=dict)          # by group id
    claim_sets: Mapping[str, ClaimSet] = field(default_factory=dict)   # by claim-set id
    group_of: Mapping[str, str] = field(default_factory=dict)          # claim-set id -> group id
    warnings: tuple[GroupingWarning, ...] = ()
    node_agents: Mapping[str, AgentEndpoint] = field(default_factory=dict)  # node name -> (agent target, cert)
    gpus: Mapping[DeviceRef, PhysicalGpu] = field(default_factory=dict)     # the ResourceSlices' devices

    def claim_set(self, job: str, source: str) -> ClaimSet | None:
        return self.claim_sets.get(claim_set_id(job, source))

    def claim_sets_of_pod(self, pod_uid: str) -> tuple[ClaimSet, ...]:
        return tuple(cs for cs in self.claim_sets.values() if pod_uid in cs.pods)


@dataclass(frozen=True)
class SnapshotDiff:
    added: tuple[Group, ...] = ()
    removed: tuple[Group, ...] = ()                   # as they were
    changed: tuple[Group, ...] = ()                   # as they are now (same id)
    claim_sets_gone: tuple[ClaimSet, ...] = ()        # as they were: every claim deallocated or pod gone
    claims_gone: tuple[ClaimRef, ...] = ()            # in a claim set before, in none now
    predecessors: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Added group id -> ids of the old groups that held any of its claim sets (merge, split)."""

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed or self.claim_sets_gone or self.claims_gone)


# -- ResourceSlices ------------------------------------------------------------------

def _attribute(device: Mapping[str, Any], name: str, kind: str = "string") -> str | None:
    attrs = device.get("attributes") or {}
    value = attrs.get(name) or attrs.get(f"{names.DRIVER_NAME}/{name}") or {}
    s = value.get(kind)
    return s if isinstance(s, str) and s else None


def physical_gpus(slices: Iterable[Mapping[str, Any]]) -> dict[DeviceRef, PhysicalGpu]:
    """(pool, device) -> its physical GPU, from ResourceSlice JSON. Slices of other drivers
    are skipped, and so are slices of a pool's older generations (the pool is mid-update);
    devices with neither `physicalGpu` nor `uuid` are left out."""
    ours = [s for s in slices if (s.get("spec") or {}).get("driver") == names.DRIVER_NAME]
    newest: dict[str, int] = {}
    for s in ours:
        pool = s["spec"].get("pool") or {}
        newest[pool.get("name", "")] = max(newest.get(pool.get("name", ""), 0), int(pool.get("generation", 0)))
    table: dict[DeviceRef, PhysicalGpu] = {}
    for s in ours:
        spec = s["spec"]
        pool = spec.get("pool") or {}
        pool_name = pool.get("name", "")
        if int(pool.get("generation", 0)) != newest[pool_name]:
            continue
        node = spec.get("nodeName") or pool_name
        for device in spec.get("devices") or ():
            gpu = _attribute(device, "physicalGpu") or _attribute(device, "uuid")
            if gpu and device.get("name"):
                table[(pool_name, device["name"])] = PhysicalGpu(
                    gpu, node, _attribute(device, "productName") or "",
                    _attribute(device, "driverVersion", "version") or "")
    return table


# -- claims and pods ----------------------------------------------------------------

@dataclass
class _Claim:
    ref: ClaimRef
    devices: list[DeviceRef]
    config: JobConfig
    job_override: str | None
    reserved_for: set[str]


def _claim_ref(claim: Mapping[str, Any]) -> ClaimRef:
    meta = claim.get("metadata") or {}
    return ClaimRef(meta.get("creationTimestamp") or "", meta.get("namespace") or "", meta.get("name") or "",
                    meta.get("uid") or "")


def _parse_claim(claim: Mapping[str, Any], warnings: list[GroupingWarning]) -> _Claim | None:
    """The claim's devices of our driver (admin access left out) and its job-level config;
    None when it has none."""
    ref = _claim_ref(claim)
    admin_requests = {r.get("name") for r in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ()
                      if (r.get("exactly") or {}).get("adminAccess")}
    allocation = (claim.get("status") or {}).get("allocation") or {}
    devices_status = allocation.get("devices") or {}
    results = [r for r in devices_status.get("results") or ()
               if r.get("driver") == names.DRIVER_NAME and not r.get("adminAccess")
               and str(r.get("request", "")).split("/", 1)[0] not in admin_requests]
    if not results:
        return None
    requests = list(dict.fromkeys(str(r.get("request", "")).split("/", 1)[0] for r in results))
    try:
        per_request = ts_config.resolve(devices_status.get("config") or (), requests)
    except InvalidArgument as err:
        warnings.append(GroupingWarning(ref, INVALID_CONFIG, f"{err}; the defaults apply"))
        per_request = {r: ts_config.DEFAULT for r in requests}
    cfg = per_request[requests[0]]
    if any(per_request[r] != cfg for r in requests[1:]):
        warnings.append(GroupingWarning(
            ref, CONFLICTING_JOB_CONFIG,
            f"requests {', '.join(requests)} carry different TimeSliceConfigs: the node plugin refuses to prepare "
            "this claim (a claim is locked as one unit), so its pods do not start; give every request the same "
            "config (an entry without `requests` applies to all) or split the claim"))
    reserved = {c.get("uid") for c in (claim.get("status") or {}).get("reservedFor") or ()
                if c.get("resource", "pods") == "pods" and c.get("uid")}
    return _Claim(ref, sorted({(r.get("pool", ""), r.get("device", "")) for r in results}),
                  JobConfig.of(cfg, _consumed_memory(ref, results, warnings)), cfg.job, reserved)


def _consumed_memory(ref: ClaimRef, results: Iterable[Mapping[str, Any]], warnings: list[GroupingWarning]) -> int:
    """The most `memory` capacity one allocation result consumed (KEP-5075
    `consumedCapacity`, bytes; a device shared with `allowMultipleAllocations`); 0: none."""
    most = 0
    for r in results:
        value = (r.get("consumedCapacity") or {}).get("memory")
        if value is not None:
            try:
                most = max(most, parse_bytes(str(value)))
            except ValueError as err:
                warnings.append(GroupingWarning(ref, INVALID_CONFIG, f"allocation result {r.get('pool')}/"
                                                f"{r.get('device')}: consumedCapacity {err}; not counted"))
    return most


def pod_claim_names(pod: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(pod-level claim name, ResourceClaim name, claim source) of every claim the pod
    references that exists: named in the spec (the source is that claim), generated
    from a template (`status.resourceClaimStatuses`; the source is the template), or
    created by kube-scheduler for the extended resources its containers ask for
    (`status.extendedResourceClaimStatus`, KEP-5004; the name and the source are each
    extended resource's name, e.g. `timeslice.dev/gpu`)."""
    status = pod.get("status") or {}
    generated = {s.get("name"): s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or ()}
    out = []
    for ref in (pod.get("spec") or {}).get("resourceClaims") or ():
        claim = ref.get("resourceClaimName") or generated.get(ref.get("name"))
        if ref.get("name") and claim:
            out.append((ref["name"], claim, ref.get("resourceClaimName") or ref.get("resourceClaimTemplateName") or ""))
    extended = status.get("extendedResourceClaimStatus") or {}
    if extended.get("resourceClaimName"):
        resources = sorted({m.get("resourceName") for m in extended.get("requestMappings") or ()} - {None, ""})
        out.extend((r, extended["resourceClaimName"], resources[0]) for r in resources)
    return out


# -- union-find ----------------------------------------------------------------------

class _UnionFind:
    def __init__(self) -> None:
        self._parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self._parent.setdefault(x, x)
        root = x
        while self._parent[root] != root:
            root = self._parent[root]
        while self._parent[x] != root:
            self._parent[x], x = root, self._parent[x]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self._parent[max(ra, rb)] = min(ra, rb)


def group_id(gpus: Iterable[str]) -> str:
    """The stable id of the group on these physical GPUs (module docstring)."""
    return "g-" + hashlib.sha256("\n".join(sorted(set(gpus))).encode()).hexdigest()[:16]


# -- compute -------------------------------------------------------------------------

def compute(claims: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
            gpus: Mapping[DeviceRef, PhysicalGpu]) -> Snapshot:
    """Claim sets and lock groups of the cluster; the same state in any order gives an
    equal `Snapshot`."""
    warnings: list[GroupingWarning] = []
    index: dict[tuple[str, str], _Claim] = {}
    for obj in claims:
        c = _parse_claim(obj, warnings)
        if c is not None:
            index[(c.ref.namespace, c.ref.name)] = c
    for c in index.values():
        for pool, device in c.devices:
            if (pool, device) not in gpus:
                warnings.append(GroupingWarning(
                    c.ref, UNKNOWN_DEVICE, f"device {device} of pool {pool} is in no ResourceSlice of "
                    f"{names.DRIVER_NAME}: it counts as a GPU of its own until its slice appears"))
    sets: dict[str, ClaimSet] = {}
    for (ns, job, source), (claim_names, pod_uids, handles) in _members(pods, index).items():
        parts = sorted((index[(ns, n)] for n in claim_names), key=lambda c: c.ref)
        cs = _claim_set(job, source, parts, pod_uids, handles, gpus, warnings)
        sets[cs.id] = cs
    groups: dict[str, Group] = {}
    group_of: dict[str, str] = {}
    for members in _components(list(sets.values())):
        g = _group(sorted(members, key=lambda cs: cs.id), warnings)
        groups[g.id] = g
        group_of.update((cs.id, g.id) for cs in g.claim_sets)
    return Snapshot(groups=dict(sorted(groups.items())), claim_sets=dict(sorted(sets.items())),
                    group_of=dict(sorted(group_of.items())), warnings=tuple(sorted(set(warnings))), gpus=dict(gpus))


def _members(pods: Iterable[Mapping[str, Any]], index: Mapping[tuple[str, str], _Claim]
             ) -> dict[tuple[str, str, str], tuple[set[str], set[str], set[str]]]:
    """(namespace, job, claim source) -> (claim names, pod uids, pod-level names) of the pods
    that have not finished, over the claims reserved for them."""
    members: dict[tuple[str, str, str], tuple[set[str], set[str], set[str]]] = \
        defaultdict(lambda: (set(), set(), set()))
    for pod in pods:
        meta = pod.get("metadata") or {}
        uid, ns = meta.get("uid"), meta.get("namespace") or ""
        if not uid or (pod.get("status") or {}).get("phase") in FINISHED_PHASES:
            continue
        for pod_claim, claim_name, source in pod_claim_names(pod):
            c = index.get((ns, claim_name))
            if c is None or uid not in c.reserved_for:
                continue
            claim_keys, pod_uids, handles = members[(ns, job_id(pod, c.job_override), source or pod_claim)]
            claim_keys.add(claim_name)
            pod_uids.add(uid)
            handles.add(pod_claim)
    return members


def _claim_set(job: str, source: str, parts: list[_Claim], pod_uids: set[str], handles: set[str],
               gpus: Mapping[DeviceRef, PhysicalGpu], warnings: list[GroupingWarning]) -> ClaimSet:
    """The claim set of `parts` (sorted by reference; the oldest decides its config, the
    others that differ get a warning)."""
    devices = sorted({d for c in parts for d in c.devices})
    placed = [gpus.get(d) or PhysicalGpu(f"{d[0]}/{d[1]}", d[0]) for d in devices]
    oldest = parts[0]
    for c in parts[1:]:
        if c.config != oldest.config:
            warnings.append(GroupingWarning(
                c.ref, CONFLICTING_JOB_CONFIG,
                f"claim {c.ref} asks {c.config.describe()}, but claim set {source!r} of job {job} follows "
                f"its oldest claim {oldest.ref}: {oldest.config.describe()}"))
    return ClaimSet(job=job, name=min(handles), claims=tuple(c.ref for c in parts), devices=tuple(devices),
                    gpus=tuple(sorted({g.id for g in placed})), nodes=tuple(sorted({g.node for g in placed})),
                    pods=tuple(sorted(pod_uids)), config=oldest.config, source=source,
                    names=tuple(sorted(handles)))


def _components(sets: Sequence[ClaimSet]) -> list[list[ClaimSet]]:
    """Claim sets joined by the GPUs they share (transitively)."""
    uf = _UnionFind()
    for cs in sets:
        uf.find("cs:" + cs.id)
        for g in cs.gpus:
            uf.union("cs:" + cs.id, "gpu:" + g)
    components: dict[str, list[ClaimSet]] = defaultdict(list)
    for cs in sets:
        components[uf.find("cs:" + cs.id)].append(cs)
    return list(components.values())


def _group(claim_sets: list[ClaimSet], warnings: list[GroupingWarning]) -> Group:
    gpus = sorted({g for cs in claim_sets for g in cs.gpus})
    first = min(claim_sets, key=lambda cs: (cs.oldest, cs.id))
    gid = group_id(gpus)
    for cs in claim_sets:
        for key in ("backend", "residency", "memory_headroom", "resident_first_seconds"):
            mine, theirs = getattr(cs.config, key), getattr(first.config, key)
            if mine != theirs:
                warnings.append(GroupingWarning(
                    cs.oldest, CONFLICTING_GROUP_CONFIG,
                    f"claim set {cs.id} asks {key}={mine}, but group {gid} uses {key}={theirs} of its oldest "
                    f"claim set {first.id}"))
    return Group(id=gid, claim_sets=tuple(claim_sets), nodes=tuple(sorted({n for cs in claim_sets for n in cs.nodes})),
                 gpus=tuple(gpus), backend=first.config.backend,
                 lease_seconds=max(cs.config.lease_seconds for cs in claim_sets),
                 residency=first.config.residency, memory_headroom=first.config.memory_headroom,
                 resident_first_seconds=first.config.resident_first_seconds)


def diff(old: Snapshot, new: Snapshot) -> SnapshotDiff:
    """What changed from `old` to `new` (both from `compute`)."""
    added = tuple(g for gid, g in new.groups.items() if gid not in old.groups)
    removed = tuple(g for gid, g in old.groups.items() if gid not in new.groups)
    changed = tuple(g for gid, g in new.groups.items() if gid in old.groups and old.groups[gid] != g)
    gone = tuple(cs for cid, cs in old.claim_sets.items() if cid not in new.claim_sets)
    claims_now = {c.uid for cs in new.claim_sets.values() for c in cs.claims}
    claims_gone = tuple(sorted({c for cs in old.claim_sets.values() for c in cs.claims if c.uid not in claims_now}))
    predecessors = {}
    for g in added:
        before = sorted({old.group_of[cs.id] for cs in g.claim_sets if cs.id in old.group_of})
        if before:
            predecessors[g.id] = tuple(before)
    return SnapshotDiff(added, removed, changed, gone, claims_gone, predecessors)
