"""ClusterState against the real API server: the scheduler allocates seats from a
hand-written ResourceSlice of gpu.timeslice.dev, and the snapshot groups the claims.

No kubelet plugin runs for these devices, so the pods never start (the kubelet cannot
prepare the claims); allocation and reservation, all that grouping reads, are done by
the scheduler. The slice is `allNodes` in a pool of its own and a DeviceClass of this
test selects only its devices, so a kubelet plugin publishing for the node at the same
time neither sees these claims nor loses its slices (the kubelet wipes a driver's
slices of its node when the plugin goes).

Shape (the async-RL pattern): jobs a and b each hold a `trainer` seat of GPU 0; job a
also holds a `sampler` seat of GPU 1. Expected: one group {a:trainer, b:trainer} and
one lone group {a:sampler}; a second ClusterState (a restarted controller) derives the
same ids; when b's pod goes, b's claim set goes and the trainer group has a alone.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from kubernetes.aio import client as k8s
from kubernetes.aio import config as k8s_config
from timeslice.controller.cluster_state import ClusterState
from timeslice.controller.grouping import Snapshot, group_id
from timeslice.driver import names

pytestmark = pytest.mark.e2e


def _ours(snap: Snapshot | None, ns: str) -> dict[str, list[str]]:
    """Group id -> claim-set ids, for the claim sets of namespace `ns` only (other tests
    and sessions may hold claims of our driver too)."""
    if snap is None:
        return {}
    out: dict[str, list[str]] = {}
    for cs in snap.claim_sets.values():
        if cs.job.startswith(ns + "/"):
            out.setdefault(snap.group_of[cs.id], []).append(cs.id)
    return {g: sorted(v) for g, v in sorted(out.items())}


async def _eventually(check, what: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.2)


@pytest.fixture
async def api():
    cfg = k8s.Configuration()
    await k8s_config.load_kube_config(config_file=os.environ["KUBECONFIG"], client_configuration=cfg)
    client = k8s.ApiClient(cfg)
    yield client
    await client.close()


async def test_cluster_state_groups_scheduler_allocations(kube, namespace, api) -> None:
    ns = namespace
    cls, pool, slice_name = f"{ns}.cluster-state.timeslice.dev", f"{ns}-pool", f"{ns}-cluster-state"
    gpu = [f"GPU-{ns}-0", f"GPU-{ns}-1"]
    domain = names.DRIVER_NAME
    in_pool = f'"e2eRun" in device.attributes["{domain}"] && device.attributes["{domain}"].e2eRun == "{ns}"'

    def seat(g: int, k: int) -> dict:
        return {"name": f"gpu-{g}-seat-{k}", "attributes": {
            "physicalGpu": {"string": gpu[g]}, "seat": {"int": k}, "e2eRun": {"string": ns}}}

    def template(name: str, g: int) -> dict:
        sel = f'device.attributes["{domain}"].physicalGpu == "{gpu[g]}"'
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": cls, "selectors": [{"cel": {"expression": sel}}]}}]}}}}

    def pod(name: str, job: str, claim: str, tmpl: str) -> dict:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": ns, "labels": {names.JOB_LABEL: job}},
                "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                         "resourceClaims": [{"name": claim, "resourceClaimTemplateName": tmpl}],
                         "containers": [{"name": "main", "image": kube.busybox_image, "imagePullPolicy": "Never",
                                         "command": ["sleep", "3600"], "resources": {"claims": [{"name": claim}]}}]}}

    cluster_objs = [
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": cls},
         "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{domain}" && {in_pool}'}}]}},
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": slice_name},
         "spec": {"driver": domain, "allNodes": True,
                  "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
                  "devices": [seat(0, 0), seat(1, 0), seat(0, 1), seat(1, 1)]}},
    ]
    pods = [("a-trainer", "a", "trainer", "trainer"), ("b-trainer", "b", "trainer", "trainer"),
            ("a-sampler", "a", "sampler", "sampler")]
    seen: list[Snapshot] = []
    state = ClusterState(api, seen.append, debounce_seconds=0.1)
    try:
        for o in cluster_objs:
            await asyncio.to_thread(kube.apply, o)
        await asyncio.to_thread(kube.apply, template("trainer", 0))
        await asyncio.to_thread(kube.apply, template("sampler", 1))
        async with state:
            await state.wait_synced(60)
            assert _ours(state.snapshot, ns) == {}
            for name, job, claim, tmpl in pods:
                await asyncio.to_thread(kube.apply, pod(name, job, claim, tmpl))

            trainers, sampler = group_id([gpu[0]]), group_id([gpu[1]])
            want = {trainers: [f"{ns}/a:trainer", f"{ns}/b:trainer"], sampler: [f"{ns}/a:sampler"]}
            await _eventually(lambda: _ours(state.snapshot, ns) == want,
                              f"groups {want} (have {_ours(state.snapshot, ns)})")
            snap = state.snapshot
            assert snap is not None
            g = snap.groups[trainers]
            assert g.gpus == (gpu[0],) and g.nodes == (pool,)
            devices = sorted(d for cs in g.claim_sets for d in cs.devices)
            assert devices == [(pool, "gpu-0-seat-0"), (pool, "gpu-0-seat-1")]
            assert snap.claim_set(f"{ns}/a", "sampler").devices == ((pool, "gpu-1-seat-0"),)
            assert not [w for w in snap.warnings if w.claim.namespace == ns]

            # a restarted controller derives the same groups and ids from the cluster alone
            async with ClusterState(api, lambda s: None) as fresh:
                again = await fresh.wait_synced(60)
                assert _ours(again, ns) == want

            await asyncio.to_thread(kube.run, "delete", "pod", "-n", ns, "b-trainer", "--grace-period=0",
                                    "--force")
            await _eventually(lambda: _ours(state.snapshot, ns) == {trainers: [f"{ns}/a:trainer"],
                                                                     sampler: [f"{ns}/a:sampler"]},
                              f"b's claim set gone (have {_ours(state.snapshot, ns)})")
    finally:
        for name, *_ in pods:
            kube.run("delete", "pod", "-n", ns, name, "--grace-period=0", "--force", "--ignore-not-found",
                     check=False)
        kube.run("delete", "resourceslices.v1.resource.k8s.io", slice_name, "--ignore-not-found", check=False)
        kube.run("delete", "deviceclasses.v1.resource.k8s.io", cls, "--ignore-not-found", check=False)
