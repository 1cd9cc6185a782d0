"""Builders of Kubernetes objects in API JSON form (pods, ResourceClaims, ResourceSlices).

Used by the grouping and cluster-state tests: `World` allocates seats like the scheduler
does after the fact (claim status with results, `reservedFor`, the pod's
`resourceClaimStatuses`), so tests describe clusters in a few lines.
"""

from __future__ import annotations

import itertools
from typing import Any

from timeslice.controller.grouping import Snapshot, compute, physical_gpus
from timeslice.driver import names

Obj = dict[str, Any]
OTHER_DRIVER = "gpu.example.com"


def gpu_uuid(node: str, index: int) -> str:
    return f"GPU-fake-{node}-{index}"


def slice_obj(node: str, gpus: int = 2, seats: int = 4, driver: str = names.DRIVER_NAME, generation: int = 1,
              attribute: str = "physicalGpu", name: str | None = None) -> Obj:
    """Seats `gpu-<i>-seat-<k>` of `gpus` GPUs, seat-major, as the kubelet plugin publishes them."""
    devices = [{"name": f"gpu-{i}-seat-{k}",
                "attributes": {attribute: {"string": gpu_uuid(node, i)}, "seat": {"int": k},
                               "productName": {"string": "NVIDIA H200"}, "driverVersion": {"version": "580.159.4"}}}
               for k in range(seats) for i in range(gpus)]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name or f"{node}-{driver}-{generation}", "uid": f"slice-{node}-{driver}-{generation}"},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                     "devices": devices}}


def ts_config(requests: list[str] | None = None, **values: Any) -> Obj:
    """One `status.allocation.devices.config` entry holding a TimeSliceConfig."""
    return {"source": "FromClaim", "requests": requests or [],
            "opaque": {"driver": names.DRIVER_NAME, "parameters": {
                "apiVersion": names.CONFIG_API_VERSION, "kind": names.CONFIG_KIND, **values}}}


class World:
    """A cluster state under construction; `snapshot()` groups it."""

    def __init__(self) -> None:
        self.claims: list[Obj] = []
        self.pods: list[Obj] = []
        self.slices: list[Obj] = []
        self._seq = itertools.count(1)

    def node(self, name: str, gpus: int = 2, seats: int = 4) -> None:
        self.slices.append(slice_obj(name, gpus, seats))

    def pod(self, name: str, ns: str = "ns", job: str | None = None, owner: tuple[str, str] | None = None,
            node: str = "node-a", phase: str = "Running", labels: dict[str, str] | None = None) -> Obj:
        meta: Obj = {"name": name, "namespace": ns, "uid": f"uid-pod-{ns}-{name}", "labels": dict(labels or {})}
        if job:
            meta["labels"][names.JOB_LABEL] = job
        if owner:
            meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": owner[0], "name": owner[1],
                                        "uid": f"uid-{owner[1]}", "controller": True}]
        p = {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
             "spec": {"nodeName": node, "resourceClaims": [], "containers": [{"name": "main"}]},
             "status": {"phase": phase, "resourceClaimStatuses": []}}
        self.pods.append(p)
        return p

    def claim(self, pod: Obj, pod_claim: str, devices: list[tuple[str, str]], driver: str = names.DRIVER_NAME,
              config: list[Obj] | None = None, admin: bool = False, name: str | None = None,
              request: str = "gpu", template: str | None = None) -> Obj:
        """A claim generated for `pod` from `template` (default: named like `pod_claim`) under
        `pod_claim`, allocated `devices` ((pool, device) pairs) and reserved for the pod."""
        ns = pod["metadata"]["namespace"]
        name = name or f"{pod['metadata']['name']}-{pod_claim}"
        n = next(self._seq)
        results = [{"request": request, "driver": driver, "pool": pool, "device": device}
                   for pool, device in devices]
        if admin:
            for r in results:
                r["adminAccess"] = True
        c = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": name, "namespace": ns, "uid": f"uid-claim-{ns}-{name}",
                          "creationTimestamp": f"2025-01-01T00:{n // 60:02d}:{n % 60:02d}Z"},
             "spec": {"devices": {"requests": [
                 {"name": request, "exactly": {"deviceClassName": driver, "count": len(devices),
                                               **({"adminAccess": True} if admin else {})}}]}},
             "status": {"allocation": {"devices": {"results": results, "config": config or []}},
                        "reservedFor": []}}
        self.claims.append(c)
        pod["spec"]["resourceClaims"].append({"name": pod_claim, "resourceClaimTemplateName": template or pod_claim})
        pod["status"]["resourceClaimStatuses"].append({"name": pod_claim, "resourceClaimName": name})
        self.reserve(c, pod)
        return c

    def extended_claim(self, pod: Obj, resource: str, devices: list[tuple[str, str]]) -> Obj:
        """The claim kube-scheduler makes for the extended `resource` the pod's container
        asks for (KEP-5004): no entry in `spec.resourceClaims`, the pod's
        `status.extendedResourceClaimStatus` names it."""
        request = "container-0-request-0"
        c = self.claim(pod, "-", devices, name=f"{pod['metadata']['name']}-extended-resources-x1", request=request)
        pod["spec"]["resourceClaims"].pop()
        pod["status"]["resourceClaimStatuses"].pop()
        c["metadata"]["annotations"] = {"resource.kubernetes.io/extended-resource-claim": "true"}
        pod["status"]["extendedResourceClaimStatus"] = {
            "resourceClaimName": c["metadata"]["name"],
            "requestMappings": [{"containerName": "main", "resourceName": resource, "requestName": request}]}
        return c

    def share(self, claim: Obj, pod: Obj, pod_claim: str) -> None:
        """`pod` uses the existing `claim` by name under `pod_claim` (a shared claim)."""
        pod["spec"]["resourceClaims"].append({"name": pod_claim, "resourceClaimName": claim["metadata"]["name"]})
        self.reserve(claim, pod)

    @staticmethod
    def reserve(claim: Obj, pod: Obj) -> None:
        claim["status"]["reservedFor"].append(
            {"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]})

    def snapshot(self) -> Snapshot:
        return compute(self.claims, self.pods, physical_gpus(self.slices))
