"""SlicePublisher against the real API server: server-side validation, watch, generations,
and the scheduler allocating the published seats in seat-major order; the controller's
claim status write on those allocations, beside another driver's entry.

The publisher runs in the test process with fake GPUs (`4xH200`) for the cluster's node;
everything is checked through kubectl, as a user would see it. The kubelet has no
`gpu.timeslice.dev` plugin registered here, so pods that get our devices are allocated
and reserved by the scheduler but never start; the tests look at the claims only.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

kubernetes_aio = pytest.importorskip("kubernetes.aio", reason="needs the kubernetes extra (kubernetes>=37)")

from timeslice.controller.claim_status import condition, write_claim  # noqa: E402
from timeslice.controller.grouping import physical_gpus  # noqa: E402
from timeslice.driver.backoff import Backoff  # noqa: E402
from timeslice.driver.names import DRIVER_NAME  # noqa: E402
from timeslice.kubelet_plugin.devices import discover_gpus  # noqa: E402
from timeslice.kubelet_plugin.resourceslices import CONSUMABLE, build_devices  # noqa: E402
from timeslice.kubelet_plugin.slice_publisher import ApiSliceStore, SlicePublisher  # noqa: E402

SLICES = "resourceslices.v1.resource.k8s.io"


async def kubectl_json(kube, *args: str) -> dict[str, Any]:
    return await asyncio.to_thread(kube.json, *args)


async def our_slices(kube, node: str) -> list[dict[str, Any]]:
    got = await kubectl_json(kube, "get", SLICES, "--field-selector",
                             f"spec.driver={DRIVER_NAME},spec.nodeName={node}")
    return sorted(got["items"], key=lambda s: s["metadata"]["name"])


async def wait_for(check, what: str, timeout: float = 30.0) -> Any:
    """Poll the async `check()` until it returns something truthy; fail naming `what`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.3)
    raise AssertionError(f"{what}: not within {timeout} s (last: {json.dumps(last)[:1500]})")


def pool_of(slices: list[dict[str, Any]]) -> set[tuple[int, int]]:
    return {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices}


def device_names(slices: list[dict[str, Any]]) -> list[str]:
    return [d["name"] for s in slices for d in s["spec"]["devices"]]


def skip_without_consumable_capacity(stored: dict[str, Any]) -> None:
    if "allowMultipleAllocations" not in stored["spec"]["devices"][0]:
        pytest.skip("the API server dropped allowMultipleAllocations: gate DRAConsumableCapacity is off "
                    "(alpha in 1.34; hack/local-cluster.sh turns it on)")


@pytest.fixture
async def api(kube) -> AsyncIterator[Any]:
    client = await kubernetes_aio.config.new_client_from_config(config_file=os.environ["KUBECONFIG"])
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def publisher(kube, api, node_name: str) -> AsyncIterator[SlicePublisher]:
    pub = SlicePublisher(ApiSliceStore(api), node_name, resync_seconds=30, backoff=Backoff(0.2, 2.0, overshoot=False))
    try:
        yield pub
    finally:
        await pub.stop(delete_slices=True)
        left = await our_slices(kube, node_name)
        assert left == [], f"slices left after stop(delete_slices=True): {[s['metadata']['name'] for s in left]}"


async def test_publish_4xh200_seats(kube, publisher: SlicePublisher, node_name: str) -> None:
    gpus = discover_gpus("4xH200", node=node_name)
    devices = build_devices(gpus)
    await asyncio.wait_for(publisher.publish(devices), 30)

    (s,) = await our_slices(kube, node_name)
    node = await kubectl_json(kube, "get", "node", node_name)
    assert s["metadata"]["name"] == f"{node_name}-{DRIVER_NAME}-000"
    assert s["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": node_name,
                                                 "uid": node["metadata"]["uid"], "controller": True}]
    assert s["spec"]["driver"] == DRIVER_NAME and s["spec"]["nodeName"] == node_name
    assert s["spec"]["pool"] == {"name": node_name, "generation": publisher.generation, "resourceSliceCount": 1}
    # stored exactly as sent: server-side validation accepted every attribute, nothing dropped
    assert s["spec"]["devices"] == devices
    assert device_names([s])[:5] == ["gpu-0-seat-0", "gpu-1-seat-0", "gpu-2-seat-0", "gpu-3-seat-0", "gpu-0-seat-1"]
    assert len(s["spec"]["devices"]) == 16
    seat = s["spec"]["devices"][1]
    assert seat["attributes"]["uuid"] == {"string": f"GPU-fake-{node_name}-1"}
    assert seat["attributes"]["fake"] == {"bool": True}
    assert seat["attributes"]["cudaComputeCapability"] == {"version": "9.0.0"}
    assert seat["capacity"]["memory"]["value"] == str(143771 * 2**20)


async def test_deleted_slices_are_republished_with_a_higher_generation(kube, publisher: SlicePublisher,
                                                                       node_name: str) -> None:
    await asyncio.wait_for(publisher.publish(build_devices(discover_gpus("4xH200", node=node_name))), 30)
    (before,) = await our_slices(kube, node_name)
    gen = before["spec"]["pool"]["generation"]

    # what the kubelet does when it starts: delete the node's slices
    await asyncio.to_thread(kube.run, "delete", SLICES, "--field-selector", f"spec.nodeName={node_name}",
                            "--wait=false")

    async def republished():
        slices = await our_slices(kube, node_name)
        return slices if slices and pool_of(slices) == {(gen + 1, 1)} else None

    (after,) = await wait_for(republished, "slices re-created with generation + 1")
    assert after["metadata"]["uid"] != before["metadata"]["uid"]
    assert after["spec"]["devices"] == before["spec"]["devices"]
    assert publisher.generation == gen + 1


async def test_foreign_edit_is_undone(kube, publisher: SlicePublisher, node_name: str) -> None:
    await asyncio.wait_for(publisher.publish(build_devices(discover_gpus("2xH200", node=node_name))), 30)
    (s,) = await our_slices(kube, node_name)
    gen = s["spec"]["pool"]["generation"]
    patch = json.dumps([{"op": "remove", "path": "/spec/devices/0"}])
    await asyncio.to_thread(kube.run, "patch", SLICES, s["metadata"]["name"], "--type=json", "-p", patch)

    async def restored():
        slices = await our_slices(kube, node_name)
        return slices if pool_of(slices) == {(gen + 1, 1)} and len(device_names(slices)) == 8 else None

    await wait_for(restored, "edited slice rewritten with generation + 1")


async def test_changed_devices_bump_the_generation_and_split_at_128(kube, publisher: SlicePublisher,
                                                                    node_name: str) -> None:
    await asyncio.wait_for(publisher.publish(build_devices(discover_gpus("4xH200", node=node_name))), 30)
    gen = publisher.generation

    await asyncio.wait_for(publisher.publish(build_devices(discover_gpus("40xH100", node=node_name))), 30)
    slices = await our_slices(kube, node_name)
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 32]
    assert pool_of(slices) == {(gen + 1, 2)}
    assert device_names(slices) == [d["name"] for d in build_devices(discover_gpus("40xH100", node=node_name))]

    await asyncio.wait_for(publisher.publish(build_devices(discover_gpus("2xH200", node=node_name))), 30)
    slices = await our_slices(kube, node_name)
    assert [s["metadata"]["name"] for s in slices] == [f"{node_name}-{DRIVER_NAME}-000"]
    assert pool_of(slices) == {(gen + 2, 1)} and len(device_names(slices)) == 8

    # the same devices again: nothing written, no new generation
    rv = slices[0]["metadata"]["resourceVersion"]
    await asyncio.wait_for(publisher.publish(build_devices(discover_gpus("2xH200", node=node_name))), 30)
    assert (await our_slices(kube, node_name))[0]["metadata"]["resourceVersion"] == rv


async def test_consumable_mode_is_accepted(kube, publisher: SlicePublisher, node_name: str) -> None:
    devices = build_devices(discover_gpus("2xH200", node=node_name), CONSUMABLE)
    await asyncio.wait_for(publisher.publish(devices), 30)
    (s,) = await our_slices(kube, node_name)
    skip_without_consumable_capacity(s)
    assert s["spec"]["devices"] == devices


async def test_a_second_publisher_adopts_the_pool(kube, api, publisher: SlicePublisher, node_name: str) -> None:
    devices = build_devices(discover_gpus("4xH200", node=node_name))
    await asyncio.wait_for(publisher.publish(devices), 30)
    rv = (await our_slices(kube, node_name))[0]["metadata"]["resourceVersion"]
    await publisher.stop()  # the plugin restarts ...
    async with SlicePublisher(ApiSliceStore(api), node_name) as again:  # ... and finds its pool in place
        await asyncio.wait_for(again.publish(devices), 30)
        assert again.generation == publisher.generation
    (s,) = await our_slices(kube, node_name)
    assert s["metadata"]["resourceVersion"] == rv


# -- the scheduler on top of the published pool ----------------------------------------------


def claim_template(name: str, device_class: str, count: int = 1,
                   constraints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class,
                                                                        "count": count}}]}
    if constraints:
        devices["constraints"] = constraints
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": devices}}}


def pod_with_claim(name: str, template: str, image: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "terminationGracePeriodSeconds": 0,
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never", "command": ["sleep", "3600"],
                        "resources": {"claims": [{"name": "gpu"}]}}]}}


async def allocated_devices(kube, ns: str, pod: str) -> list[str]:
    """The devices the scheduler allocated to the pod's claim (waits for the allocation)."""
    async def allocation():
        p = await kubectl_json(kube, "get", "pod", "-n", ns, pod)
        statuses = p.get("status", {}).get("resourceClaimStatuses") or []
        if not statuses or not statuses[0].get("resourceClaimName"):
            return None
        claim = await kubectl_json(kube, "get", "resourceclaims.v1.resource.k8s.io", "-n", ns,
                                   statuses[0]["resourceClaimName"])
        return claim.get("status", {}).get("allocation")

    alloc = await wait_for(allocation, f"claim of pod {ns}/{pod} allocated", timeout=60)
    results = alloc["devices"]["results"]
    assert {r["driver"] for r in results} == {DRIVER_NAME}, results
    return [r["device"] for r in results]


@pytest.fixture
def device_class(kube, namespace: str):
    """A DeviceClass for this test run only (the shipped one lives in manifests/)."""
    name = f"{namespace}.{DRIVER_NAME}"
    kube.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
                "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER_NAME}'"}}]}})
    yield name
    kube.run("delete", "deviceclasses.v1.resource.k8s.io", name, "--ignore-not-found", check=False)


async def delete_pods(kube, ns: str, pods: list[str]) -> None:
    if pods:
        await asyncio.to_thread(kube.run, "delete", "pod", "-n", ns, *pods, "--grace-period=0", "--force",
                                "--ignore-not-found", check=False)


async def test_scheduler_spreads_claims_over_gpus_seat_major(kube, publisher: SlicePublisher, node_name: str,
                                                             namespace: str, device_class: str) -> None:
    """Independent claims land on idle GPUs first (gpu-0, gpu-1, ...); a multi-GPU request
    with matchAttribute on `seat` gets seats of distinct GPUs."""
    await asyncio.wait_for(publisher.publish(build_devices(discover_gpus("4xH200", node=node_name))), 30)
    kube.apply({**claim_template("one-seat", device_class), "metadata": {"name": "one-seat", "namespace": namespace}})
    two = claim_template("two-gpus", device_class, count=2,
                         constraints=[{"requests": ["gpu"], "matchAttribute": f"{DRIVER_NAME}/seat"}])
    two["metadata"]["namespace"] = namespace
    kube.apply(two)
    pods: list[str] = []
    try:
        got = []
        for i in range(2):  # one at a time: the allocator is first-fit over the published order
            pods.append(f"seat-{i}")
            kube.apply({**pod_with_claim(pods[-1], "one-seat", kube.busybox_image),
                        "metadata": {"name": pods[-1], "namespace": namespace}})
            got.append(await allocated_devices(kube, namespace, pods[-1]))
        assert got == [["gpu-0-seat-0"], ["gpu-1-seat-0"]]

        pods.append("two-gpus")
        kube.apply({**pod_with_claim("two-gpus", "two-gpus", kube.busybox_image),
                    "metadata": {"name": "two-gpus", "namespace": namespace}})
        pair = await allocated_devices(kube, namespace, "two-gpus")
        assert pair == ["gpu-2-seat-0", "gpu-3-seat-0"], pair  # same seat index => two different GPUs
    finally:
        await delete_pods(kube, namespace, pods)


async def test_scheduler_shares_a_consumable_gpu(kube, publisher: SlicePublisher, node_name: str,
                                                 namespace: str, device_class: str) -> None:
    """Consumable mode: claims that ask for no memory consume none, so many share one GPU."""
    await asyncio.wait_for(publisher.publish(build_devices(discover_gpus("1xH200", node=node_name), CONSUMABLE)),
                           30)
    skip_without_consumable_capacity((await our_slices(kube, node_name))[0])
    kube.apply({**claim_template("shared", device_class), "metadata": {"name": "shared", "namespace": namespace}})
    pods = [f"shared-{i}" for i in range(3)]
    try:
        for p in pods:
            kube.apply({**pod_with_claim(p, "shared", kube.busybox_image),
                        "metadata": {"name": p, "namespace": namespace}})
        got = [await allocated_devices(kube, namespace, p) for p in pods]
        assert got == [["gpu-0"]] * 3
    finally:
        await delete_pods(kube, namespace, pods)


# -- claim status on the real API server (issue 12, items 2 and 12) --------------------------

NIC_DRIVER = "nic.e2e.example.com"


@pytest.fixture
def nic(kube, namespace: str, node_name: str):
    """Another driver on the node: a ResourceSlice with one NIC and a DeviceClass for it
    (no plugin: claims get it allocated, nothing prepares it)."""
    name = f"{namespace}.{NIC_DRIVER}"
    kube.apply({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
                "spec": {"driver": NIC_DRIVER, "nodeName": node_name,
                         "pool": {"name": node_name, "generation": 1, "resourceSliceCount": 1},
                         "devices": [{"name": "nic-0"}]}})
    kube.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
                "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{NIC_DRIVER}'"}}]}})
    yield name
    kube.run("delete", "deviceclasses.v1.resource.k8s.io", name, "--ignore-not-found", check=False)
    kube.run("delete", SLICES, name, "--ignore-not-found", check=False)


@pytest.mark.parametrize("mode", ["seats", CONSUMABLE])
async def test_claim_status_is_written_beside_another_drivers_entry(kube, api, publisher: SlicePublisher,
                                                                    node_name: str, namespace: str,
                                                                    device_class: str, nic: str, mode: str) -> None:
    """A claim with one of our devices and another driver's NIC, that driver's status entry
    written first: the controller's status write (`write_claim`) is accepted by the API
    server in both modes (consumable: keyed by the allocation's shareID; before, HTTP 422 on
    every retry), keeps the other driver's entry and the other writer's condition on ours,
    and says which GPU it is (uuid, product, driver version)."""
    await asyncio.wait_for(publisher.publish(build_devices(discover_gpus("1xH200", node=node_name), mode)), 30)
    slices = await our_slices(kube, node_name)
    if mode == CONSUMABLE:
        skip_without_consumable_capacity(slices[0])
    template = claim_template("gpu-and-nic", device_class)
    template["spec"]["spec"]["devices"]["requests"].append({"name": "nic", "exactly": {"deviceClassName": nic}})
    kube.apply({**template, "metadata": {"name": "gpu-and-nic", "namespace": namespace}})
    pod = f"status-{mode}"
    kube.apply({**pod_with_claim(pod, "gpu-and-nic", kube.busybox_image),
                "metadata": {"name": pod, "namespace": namespace}})
    resource = kubernetes_aio.client.ResourceV1Api(api)
    try:
        async def claim_name():
            statuses = (await kubectl_json(kube, "get", "pod", "-n", namespace, pod)).get("status", {}).get(
                "resourceClaimStatuses") or []
            return statuses[0].get("resourceClaimName") if statuses else None

        name = await wait_for(claim_name, f"claim of pod {pod} created", timeout=60)

        async def claim():
            c = await kubectl_json(kube, "get", "resourceclaims.v1.resource.k8s.io", "-n", namespace, name)
            return c if c.get("status", {}).get("allocation") else None

        results = (await wait_for(claim, f"claim {name} allocated", timeout=60))["status"]["allocation"][
            "devices"]["results"]
        (ours,) = [r for r in results if r["driver"] == DRIVER_NAME]
        assert bool(ours.get("shareID")) == (mode == CONSUMABLE), ours
        theirs = {"driver": NIC_DRIVER, "pool": node_name, "device": "nic-0",
                  "conditions": [{"type": "Ready", "status": "True", "reason": "LinkUp", "message": "",
                                  "lastTransitionTime": "2026-11-30T00:00:00Z"}],
                  "networkData": {"interfaceName": "eth1"}}
        await asyncio.to_thread(kube.run, "patch", "resourceclaims.v1.resource.k8s.io", "-n", namespace, name,
                                "--subresource=status", "--type=merge", "-p",
                                json.dumps({"status": {"devices": [theirs]}}))

        gpus = physical_gpus(slices)
        now = "2026-11-30T00:00:01Z"
        await write_claim(resource, namespace, name, [condition("LockHeld", True, "Holder", "g: holder a", now)],
                          {"groupId": "g"}, gpus)
        devices = (await kubectl_json(kube, "get", "resourceclaims.v1.resource.k8s.io", "-n", namespace,
                                      name))["status"]["devices"]
        (kept,) = [d for d in devices if d["driver"] == NIC_DRIVER]
        assert kept == theirs
        (mine,) = [d for d in devices if d["driver"] == DRIVER_NAME]
        assert (mine["device"], mine.get("shareID")) == (ours["device"], ours.get("shareID"))
        assert [c["type"] for c in mine["conditions"]] == ["LockHeld"]
        assert mine["data"] == {"groupId": "g", "uuid": f"GPU-fake-{node_name}-0", "productName": "NVIDIA H200",
                                "driverVersion": mine["data"]["driverVersion"]} and mine["data"]["driverVersion"]

        # another writer's condition on our entry outlives our next write
        foreign = {"type": "example.com/Checked", "status": "True", "reason": "Checked", "message": "",
                   "lastTransitionTime": now}
        await asyncio.to_thread(kube.run, "patch", "resourceclaims.v1.resource.k8s.io", "-n", namespace, name,
                                "--subresource=status", "--type=merge", "-p", json.dumps(
                                    {"status": {"devices": [theirs, {**mine, "conditions": [
                                        *mine["conditions"], foreign]}]}}))
        await write_claim(resource, namespace, name, [condition("LockHeld", False, "Idle", "g: holder none", now)],
                          {"groupId": "g"}, gpus)
        devices = (await kubectl_json(kube, "get", "resourceclaims.v1.resource.k8s.io", "-n", namespace,
                                      name))["status"]["devices"]
        assert [d for d in devices if d["driver"] == NIC_DRIVER] == [theirs]
        (mine,) = [d for d in devices if d["driver"] == DRIVER_NAME]
        assert [(c["type"], c["status"]) for c in mine["conditions"]] == [("example.com/Checked", "True"),
                                                                           ("LockHeld", "False")]
    finally:
        await delete_pods(kube, namespace, [pod])
