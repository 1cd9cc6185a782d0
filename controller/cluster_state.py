"""ClusterState: the controller's live model of claims, pods and slices, grouped.

Owned by the controller process (one per replica; it reads only, so followers may keep
it warm); its `on_change(snapshot)` callback feeds the orchestrator wiring. One
`Reflector` per kind keeps trimmed copies in memory:

    ResourceClaims  all namespaces; kept when allocated with a result of gpu.timeslice.dev
    Pods            all namespaces, not finished (field selector on status.phase); kept
                    when they reference a claim (`spec.resourceClaims`) or kube-scheduler
                    made one for their extended resources (`status.extendedResourceClaimStatus`)
    ResourceSlices  field selector spec.driver=gpu.timeslice.dev
    plugin pods     label app.kubernetes.io/name=timeslice-kubelet-plugin in
                    `agent_namespace` (unless None): the node agents (`node_agents`:
                    target and published TLS certificate)

After any change, and once all three kinds have listed once (a partial cache would
look like claim sets gone), `grouping.compute` runs at most once per `debounce_seconds`:
the first change opens a window, changes within it are folded in, so a burst of events
costs one computation and a steady stream cannot postpone it. `on_change` (sync or
async) gets the new `Snapshot` only when it differs from the last one; its errors are
logged and the loop goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes.aio import client as k8s
from timeslice.controller import grouping, jobs, node_agents
from timeslice.controller.grouping import Snapshot
from timeslice.controller.reflector import DEFAULT_BACKOFF, WATCH_SECONDS, Obj, Reflector
from timeslice.driver import names
from timeslice.driver.backoff import Backoff
from timeslice.driver.tasks import cancel_and_wait

log = logging.getLogger("timeslice.controller.cluster_state")

OnChange = Callable[[Snapshot], "Awaitable[None] | None"]
POD_FIELD_SELECTOR = ",".join(f"status.phase!={p}" for p in grouping.FINISHED_PHASES)
SLICE_FIELD_SELECTOR = f"spec.driver={names.DRIVER_NAME}"


def _pick(obj: Obj | None, *keys: str) -> Obj:
    return {k: obj[k] for k in keys if obj and obj.get(k) is not None}


def trim_claim(claim: Obj) -> Obj | None:
    """The fields `grouping` reads, for claims allocated (in part) by our driver."""
    status = claim.get("status") or {}
    devices = (status.get("allocation") or {}).get("devices") or {}
    if not any(r.get("driver") == names.DRIVER_NAME for r in devices.get("results") or ()):
        return None
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ()
    return {
        "metadata": _pick(claim.get("metadata"), "name", "namespace", "uid", "creationTimestamp"),
        "spec": {"devices": {"requests": [
            {"name": r.get("name"), "exactly": _pick(r.get("exactly"), "adminAccess")} for r in requests]}},
        "status": {"allocation": {"devices": _pick(devices, "results", "config")},
                   "reservedFor": status.get("reservedFor") or []},
    }


def trim_pod(pod: Obj) -> Obj | None:
    """The fields `grouping` and `jobs` read, for unfinished pods that reference claims."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    if not (spec.get("resourceClaims") or status.get("extendedResourceClaimStatus")) or \
            status.get("phase") in grouping.FINISHED_PHASES:
        return None
    meta = pod.get("metadata") or {}
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k in jobs.IDENTITY_LABELS}
    return {
        "metadata": {**_pick(meta, "name", "namespace", "uid", "ownerReferences"), "labels": labels},
        "spec": _pick(spec, "nodeName", "resourceClaims"),
        "status": _pick(status, "phase", "resourceClaimStatuses", "extendedResourceClaimStatus"),
    }


def trim_slice(slice_: Obj) -> Obj | None:
    """Pool, node and each device's GPU identity (uuid, product, driver version), for slices of our driver."""
    spec = slice_.get("spec") or {}
    if spec.get("driver") != names.DRIVER_NAME:
        return None
    keep = tuple(k for a in ("physicalGpu", "uuid", "productName", "driverVersion")
                 for k in (a, f"{names.DRIVER_NAME}/{a}"))
    devices = [{"name": d.get("name"), "attributes": _pick(d.get("attributes"), *keep)}
               for d in spec.get("devices") or ()]
    return {"metadata": _pick(slice_.get("metadata"), "name", "uid"),
            "spec": {**_pick(spec, "driver", "nodeName", "pool"), "devices": devices}}


class ClusterState:
    """`api`: a `kubernetes.aio.client.ApiClient` (the caller owns and closes it);
    `agent_namespace`: where the node-plugin pods run (None: node agents are not looked up)."""

    def __init__(self, api: k8s.ApiClient, on_change: OnChange, *, agent_namespace: str | None = None,
                 debounce_seconds: float = 0.1, resync_seconds: float = 300.0, watch_seconds: int = WATCH_SECONDS,
                 backoff: Backoff = DEFAULT_BACKOFF) -> None:
        resource, core = k8s.ResourceV1Api(api), k8s.CoreV1Api(api)
        common: dict[str, Any] = {"on_change": self._changed, "resync_seconds": resync_seconds,
                                  "watch_seconds": watch_seconds, "backoff": backoff}
        self.claims = Reflector("resourceclaims", resource.list_resource_claim_for_all_namespaces, trim_claim,
                                **common)
        self.pods = Reflector("pods", core.list_pod_for_all_namespaces, trim_pod,
                              field_selector=POD_FIELD_SELECTOR, **common)
        self.slices = Reflector("resourceslices", resource.list_resource_slice, trim_slice,
                                field_selector=SLICE_FIELD_SELECTOR, **common)
        self.agents = None if agent_namespace is None else Reflector(
            "plugin-pods", core.list_pod_for_all_namespaces,
            functools.partial(node_agents.trim_plugin_pod, namespace=agent_namespace),
            label_selector=node_agents.PLUGIN_SELECTOR, **common)
        self._on_change = on_change
        self._debounce = debounce_seconds
        self._dirty = asyncio.Event()
        self._delivered = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.snapshot: Snapshot | None = None
        self.updates = 0

    @property
    def reflectors(self) -> tuple[Reflector, ...]:
        return (self.claims, self.pods, self.slices) + ((self.agents,) if self.agents else ())

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The reflectors' and the emit loop's tasks (empty before `start()`), for liveness checks."""
        return list(self._tasks)

    def start(self) -> None:
        if self._tasks:
            return
        self._tasks = [asyncio.create_task(r.run(), name=f"reflector-{r.kind}") for r in self.reflectors]
        self._tasks.append(asyncio.create_task(self._emit_loop(), name="cluster-state-emit"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            await cancel_and_wait(t)  # (a cancel swallowed by 3.11's wait_for is sent again)
        self._tasks = []

    async def __aenter__(self) -> ClusterState:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_synced(self, timeout: float | None = None) -> Snapshot:
        """The first snapshot of the whole cluster (after every kind listed once)."""
        await asyncio.wait_for(self._delivered.wait(), timeout)
        assert self.snapshot is not None
        return self.snapshot

    def compute(self) -> Snapshot:
        gpus = grouping.physical_gpus(self.slices.objects.values())
        snap = grouping.compute(self.claims.objects.values(), self.pods.objects.values(), gpus)
        if self.agents is None:
            return snap
        return dataclasses.replace(snap, node_agents=node_agents.agent_endpoints(self.agents.objects.values()))

    def _changed(self) -> None:
        self._dirty.set()

    async def _emit_loop(self) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(self._debounce)
            self._dirty.clear()
            if not all(r.synced.is_set() for r in self.reflectors):
                continue
            t0 = time.monotonic()
            try:
                snap = self.compute()
            except Exception:
                log.exception("grouping failed claims=%d pods=%d slices=%d", len(self.claims.objects),
                              len(self.pods.objects), len(self.slices.objects))
                continue
            if snap == self.snapshot:
                continue
            self.snapshot = snap
            self.updates += 1
            log.info("cluster state groups=%d claim_sets=%d warnings=%d claims=%d pods=%d slices=%d seconds=%.4f",
                     len(snap.groups), len(snap.claim_sets), len(snap.warnings), len(self.claims.objects),
                     len(self.pods.objects), len(self.slices.objects), time.monotonic() - t0)
            self._delivered.set()
            try:
                result = self._on_change(snap)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("on_change failed groups=%d", len(snap.groups))
