"""ClaimPreparer: prepare and unprepare ResourceClaims on this node (the DRA plugin seam).

Owned by the kubelet plugin; called by the DRA gRPC adapter (`dra_service.py`). Each claim
is a transaction (STYLE.md 7): return the checkpointed answer if already prepared (the
CDI spec is rewritten: /var/run/cdi is usually tmpfs); else read the claim from the API
server, check it is allocated to this node and driver, validate its `TimeSliceConfig` (one
for all its requests: a claim is one lock unit),
refuse two seats of one GPU in one request (unless the request is `allocationMode: All` or
admin access: every matching seat, e.g. a whole GPU to one claim, or a monitor), write
the CDI spec, then the checkpoint.

Contracts: idempotent; exactly one result per claim UID; a bad claim fails only its own
slot (with a Warning Event on the claim) and never the others; unprepare of an unknown
claim succeeds; unprepare may run in a fresh process after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from timeslice.driver import config, names
from timeslice.driver.errors import FailedPrecondition, InvalidArgument, NotFound, TimeSliceServerError
from timeslice.driver.events import EventRecorder
from timeslice.driver.kubeapi import api_error
from timeslice.kubelet_plugin import cdi
from timeslice.kubelet_plugin.checkpoint import Checkpoint
from timeslice.kubelet_plugin.plugin import ClaimRef, PreparedDevice, PrepareResult

log = logging.getLogger("timeslice.kubelet_plugin")


class DeviceInfo(Protocol):
    """What the preparer needs of a published device's physical GPU."""

    uuid: str
    device_nodes: tuple[str, ...]


@dataclass(frozen=True)
class PlannedDevice:
    request: str
    pool: str
    device: str
    physical_gpu: str
    device_nodes: tuple[str, ...]


@dataclass(frozen=True)
class ClaimPlan:
    devices: tuple[PlannedDevice, ...]
    configs: dict[str, config.TimeSliceConfig]
    admin_access: bool


def plan_claim(claim: dict[str, Any], uid: str, node: str, lookup: Callable[[str], DeviceInfo | None]) -> ClaimPlan:
    """Check a claim (API JSON form) against this node; raises a TimeSliceServerError
    whose message says what is wrong and, where it can, how to fix it."""
    meta = claim.get("metadata", {})
    ref = f"{meta.get('namespace')}/{meta.get('name')}"
    if meta.get("uid") != uid:
        raise FailedPrecondition(f"claim {ref} was replaced: it has uid {meta.get('uid')}, the kubelet asked for {uid}")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise FailedPrecondition(f"claim {ref} is not allocated")
    results = [r for r in allocation.get("devices", {}).get("results", []) if r.get("driver") == names.DRIVER_NAME]
    if not results:
        raise FailedPrecondition(f"claim {ref} has no devices of driver {names.DRIVER_NAME}")
    whole = _every_seat_requests(claim)
    planned = []
    passed: set[str] = set()  # GPUs whose device nodes an earlier seat of this claim passes through
    seats: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))  # request -> GPU -> seats
    for r in results:
        if r["pool"] != node:
            raise FailedPrecondition(f"claim {ref}: device {r['pool']}/{r['device']} is allocated to node "
                                     f"{r['pool']}, not to this node {node}")
        info = lookup(r["device"])
        if info is None:
            raise FailedPrecondition(f"claim {ref}: device {r['device']} is not published by this node")
        planned.append(PlannedDevice(r["request"].split("/", 1)[0], r["pool"], r["device"], info.uuid,
                                     () if info.uuid in passed else tuple(info.device_nodes)))
        passed.add(info.uuid)
        seats[r["request"]][info.uuid].append(r["device"])
        if r.get("adminAccess"):
            whole.add(r["request"])
    for request, gpus in seats.items():
        for gpu, devices in gpus.items():
            if len(devices) > 1 and request not in whole:
                raise InvalidArgument(
                    f"claim {ref}: request {request!r} got {len(devices)} seats of one physical GPU {gpu} "
                    f"({', '.join(devices)}); two seats of one GPU are not two GPUs. Ask for distinct GPUs "
                    f"with spec.devices.constraints: [{{matchAttribute: {names.DRIVER_NAME}/seat, "
                    f"requests: [{request}]}}]")
    configs = config.resolve(allocation.get("devices", {}).get("config", []) or [],
                             sorted({d.request for d in planned}))
    first, *rest = sorted(configs)
    differ = [r for r in rest if configs[r] != configs[first]]
    if differ:  # one claim is one lock unit (in one claim set): one job, one priority, one backend
        raise InvalidArgument(
            f"claim {ref}: requests {first!r} and {', '.join(map(repr, differ))} carry different TimeSliceConfigs "
            f"({_described(configs[first])} vs {_described(configs[differ[0]])}); a claim is locked as one unit, so "
            "give every request the same config (an entry without `requests` applies to all) or split the claim")
    admin = any(r.get("adminAccess") for r in results)
    return ClaimPlan(tuple(planned), configs, admin)


def _described(cfg: config.TimeSliceConfig) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.model_dump(exclude={"apiVersion", "kind"}).items())


def _every_seat_requests(claim: dict[str, Any]) -> set[str]:
    """Names of the claim's requests (and `firstAvailable` subrequests, as "request/sub",
    the form of an allocation result's `request`) whose `allocationMode` is `All` (resource.k8s.io/v1
    ExactDeviceRequest / DeviceSubRequest): they hold every seat their selectors match, so
    several seats of one GPU are what the user asked for (a whole GPU to one claim), not a
    miscount of GPUs."""
    out: set[str] = set()
    for req in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ():
        name = req.get("name", "")
        if (req.get("exactly") or {}).get("allocationMode") == "All":
            out.add(name)
        for sub in req.get("firstAvailable") or ():
            if sub.get("allocationMode") == "All":
                out.add(f"{name}/{sub.get('name', '')}")
    return out


class ClaimPreparer:
    """Implements the `ClaimPlugin` seam. `read_claim(namespace, name)` returns the claim in
    API JSON form or raises NotFound; `lookup(device)` maps a published device name to
    its GPU; times in seconds."""

    def __init__(self, *, node_name: str, read_claim: Callable[[str, str], Any],
                 lookup: Callable[[str], DeviceInfo | None], checkpoint: Checkpoint, cdi_dir: Path,
                 events: EventRecorder | None = None, orchestrator: str = "",
                 driver_mounts: tuple[tuple[str, str], ...] = (), vmm_shim: tuple[str, str] | None = None) -> None:
        self.node = node_name
        self._driver_mounts = driver_mounts  # (host path, container path): `DriverRoot.mounts`
        self._vmm_shim = vmm_shim  # (host path, container path) of the timeslice-vmm shim: backend vmm offered
        self._read_claim = read_claim
        self._lookup = lookup
        self.checkpoint = checkpoint
        self.cdi_dir = cdi_dir
        self._events = events
        self._orchestrator = orchestrator
        # one claim's prepare, unprepare and prune run one at a time; different claims, at once
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # claim uid -> (its lock, callers holding or waiting)

    def restore_cdi_specs(self) -> int:
        """Rewrite the CDI spec of every checkpointed claim (after a restart or reboot), once
        the temporaries of interrupted writes are gone (`cdi.remove_leftovers`)."""
        for name in cdi.remove_leftovers(self.cdi_dir):
            log.warning("removed the leftover of an interrupted CDI spec write: %s", name)
        for uid, rec in self.checkpoint.claims.items():
            cdi.write(self.cdi_dir, self._spec(uid, rec))
        return len(self.checkpoint.claims)

    async def prune_gone(self) -> list[str]:
        """Forget prepared claims that no longer exist (a missed NodeUnprepareResources: the
        plugin was down when the claim was deleted): a claim the API server no longer has,
        or has under another uid, loses its CDI spec and checkpoint entry. A claim whose read
        fails otherwise is kept (asked again next time). The checkpoint is written once for all
        of them: a write per claim serialized every claim and fsynced on the event loop (500 gone
        claims blocked it for 4.6 s at start-up, and the kubelet's GetInfo calls missed their 1 s
        deadline; issue 24). A crash before that write prunes them again at the next start.
        Returns the uids removed."""
        refs = [ClaimRef(rec["namespace"], uid, rec["name"]) for uid, rec in list(self.checkpoint.claims.items())]
        gone = await asyncio.gather(*(self._prune_one(ref) for ref in refs))
        if any(gone):
            self.checkpoint.save()
        return [ref.uid for ref, g in zip(refs, gone) if g]

    async def _prune_one(self, ref: ClaimRef) -> bool:
        async with self._lock(ref.uid):
            if ref.uid not in self.checkpoint.claims:
                return False  # unprepared meanwhile
            try:
                claim = await self._read(ref)
            except NotFound:
                claim = None
            except TimeSliceServerError as err:
                log.info("prepared claim %s/%s not checked: %s", ref.namespace, ref.name, err)
                return False
            if claim is not None and (claim.get("metadata") or {}).get("uid") == ref.uid:
                return False
            cdi.remove(self.cdi_dir, ref.uid)
            self.checkpoint.pop(ref.uid, save=False)  # saved once for all (`prune_gone`)
        log.warning("prepared claim %s/%s uid=%s no longer exists: its CDI spec and checkpoint entry are removed (its "
                    "unprepare was missed)", ref.namespace, ref.name, ref.uid)
        return True

    @contextlib.asynccontextmanager
    async def _lock(self, uid: str) -> AsyncIterator[None]:
        """The claim's own lock, dropped once nobody holds or waits for it."""
        lock, users = self._locks.get(uid, (asyncio.Lock(), 0))
        self._locks[uid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[uid]
            if users == 1:
                del self._locks[uid]
            else:
                self._locks[uid] = (lock, users - 1)

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """Each claim on its own: a slow API read of one delays no other, in this call or another."""
        results = await asyncio.gather(*(self._prepare_one(c) for c in claims))
        return {c.uid: r for c, r in zip(claims, results)}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for c in claims:
            async with self._lock(c.uid):
                try:
                    cdi.remove(self.cdi_dir, c.uid)
                    self.checkpoint.pop(c.uid)
                    out[c.uid] = None
                except OSError as err:
                    out[c.uid] = f"unprepare {c.namespace}/{c.name}: {err}"
        return out

    async def _prepare_one(self, ref: ClaimRef) -> PrepareResult:
        async with self._lock(ref.uid):
            return await self._prepare_locked(ref)

    async def _prepare_locked(self, ref: ClaimRef) -> PrepareResult:
        rec = self.checkpoint.claims.get(ref.uid)
        try:
            if rec is None:
                claim = await self._read(ref)
                plan = plan_claim(claim, ref.uid, self.node, self._lookup)
                rec = self._record(ref, plan)
                cdi.write(self.cdi_dir, self._spec(ref.uid, rec))
                self.checkpoint.put(ref.uid, rec)
                log.info("prepared claim=%s/%s uid=%s devices=%s admin=%s", ref.namespace, ref.name, ref.uid,
                         [d["device_name"] for d in rec["devices"]], plan.admin_access)
            else:
                cdi.write(self.cdi_dir, self._spec(ref.uid, rec))
        except (TimeSliceServerError, OSError) as err:
            message = f"prepare {ref.namespace}/{ref.name}: {err}"
            log.warning("%s", message)
            if self._events is not None:
                await self._events.claim_event(ref.namespace, ref.name, ref.uid, "PrepareFailed", str(err),
                                               warning=True)
            return PrepareResult(devices=[], error=message)
        return PrepareResult(devices=[PreparedDevice(request_names=d["request_names"], pool_name=d["pool_name"],
                                                     device_name=d["device_name"],
                                                     cdi_device_ids=d["cdi_device_ids"], share_id=None)
                                      for d in rec["devices"]], error=None)

    async def _read(self, ref: ClaimRef) -> dict[str, Any]:
        """The claim from the API server. Any failure of the read is this claim's alone (the
        other claims of the call go on): one that is not already ours becomes a one-line
        KubernetesApiError (retryable: the kubelet asks again)."""
        try:
            claim: dict[str, Any] = await self._read_claim(ref.namespace, ref.name)
            return claim
        except TimeSliceServerError:
            raise
        except Exception as err:
            raise api_error(err, f"read claim {ref.namespace}/{ref.name}") from err

    def _record(self, ref: ClaimRef, plan: ClaimPlan) -> dict[str, Any]:
        kind_id = cdi.ClaimSpec(ref.uid, ref.namespace, ref.name, ())
        return {
            "namespace": ref.namespace, "name": ref.name, "admin_access": plan.admin_access,
            "configs": {r: c.model_dump() for r, c in plan.configs.items()},
            "devices": [{"request_names": [d.request], "pool_name": d.pool, "device_name": d.device,
                         "cdi_device_ids": [kind_id.cdi_id(d.device)], "physical_gpu": d.physical_gpu,
                         "device_nodes": list(d.device_nodes)} for d in plan.devices],
        }

    def _spec(self, uid: str, rec: dict[str, Any]) -> cdi.ClaimSpec:
        nodes = {n for d in rec["devices"] for n in d["device_nodes"]}
        return cdi.ClaimSpec(
            claim_uid=uid, claim_namespace=rec["namespace"], claim_name=rec["name"],
            devices=tuple(cdi.CdiDevice(d["device_name"], d["physical_gpu"],
                                        tuple(n for n in d["device_nodes"] if _per_gpu_node(n)))
                          for d in rec["devices"]),
            orchestrator=self._orchestrator,
            shared_device_nodes=tuple(sorted(n for n in nodes if not _per_gpu_node(n))),
            admin_access=rec["admin_access"], mounts=self._driver_mounts + self._shim_mount(rec),
            env=self._shim_env(rec) + (tuple(f"{k}={v}" for k, v in names.NCCL_NO_PEER_MEMORY_ENV.items())
                                       if any(c.get("ncclPeerTransports") is False
                                              for c in rec["configs"].values()) else ()))

    def _shim_mount(self, rec: dict[str, Any]) -> tuple[tuple[str, str], ...]:
        """The timeslice-vmm shim, read-only, for a claim on backend `vmm` (its processes load it)."""
        on_vmm = any(c.get("backend") == names.BACKEND_VMM for c in rec["configs"].values())
        return (self._vmm_shim,) if self._vmm_shim is not None and on_vmm else ()

    def _shim_env(self, rec: dict[str, Any]) -> tuple[str, ...]:
        """LD_PRELOAD of the shim for a claim on backend `vmm` (it replaces the image's own LD_PRELOAD)."""
        return tuple(f"LD_PRELOAD={inside}" for _, inside in self._shim_mount(rec))


def _per_gpu_node(path: str) -> bool:
    """/dev/nvidia<N> belongs to one GPU; /dev/nvidiactl, /dev/nvidia-uvm... are shared."""
    tail = path.rsplit("/", 1)[-1]
    return tail.startswith("nvidia") and tail[len("nvidia"):].isdigit()

