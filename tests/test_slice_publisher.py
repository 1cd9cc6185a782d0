"""SlicePublisher's loop against an in-memory `SliceStore` (the seam to the API server).

The store keeps objects, resourceVersions and a watch log like the API server, and can
fail calls on purpose. The same publisher runs against a real API server in
e2e/test_resourceslices.py.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from timeslice.driver.backoff import Backoff
from timeslice.driver.errors import KubernetesApiError, KubernetesApiRejected
from timeslice.driver.names import DRIVER_NAME
from timeslice.kubelet_plugin.devices import discover_gpus
from timeslice.kubelet_plugin.resourceslices import CONSUMABLE, build_devices
from timeslice.kubelet_plugin.slice_publisher import SlicePublisher, api_error

from tests.conftest import eventually

NODE, NODE_UID = "node-a", "uid-node-a"
FAST = Backoff(initial=0.01, maximum=0.05, overshoot=False)


@dataclass
class MemorySliceStore:
    """ResourceSlices in memory, with API-server semantics the publisher relies on:
    increasing resourceVersions, 409 on create of an existing name or a stale update,
    field selection by driver and node, a watch from a resourceVersion."""

    node_uids: dict[str, str] = field(default_factory=lambda: {NODE: NODE_UID})
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    log: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    rv: int = 100
    fail: list[tuple[str, Exception]] = field(default_factory=list)  # (call or "*", error) for the next calls
    gate_off: bool = False  # DRAConsumableCapacity off: drop its fields as a 1.34 API server does
    calls: list[str] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def _maybe_fail(self, call: str) -> None:
        self.calls.append(call)
        if self.fail and self.fail[0][0] in (call, "*"):
            raise self.fail.pop(0)[1]

    async def _record(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Give `obj` the next resourceVersion, store or drop it, log the event, wake watchers."""
        self.rv += 1
        obj = copy.deepcopy(obj)
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.objects.pop(name, None)
        else:
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.objects[name] = obj
        self.log.append((self.rv, kind, copy.deepcopy(obj)))
        async with self.changed:
            self.changed.notify_all()
        return copy.deepcopy(obj)

    def _mine(self, obj: dict[str, Any], driver: str, node: str) -> bool:
        return obj["spec"]["driver"] == driver and obj["spec"].get("nodeName") == node

    # -- SliceStore ----------------------------------------------------------------------
    async def node_uid(self, node: str) -> str:
        self._maybe_fail("node_uid")
        if node not in self.node_uids:
            raise KubernetesApiRejected(f"get node {node}: HTTP 404: nodes \"{node}\" not found", 404)
        return self.node_uids[node]

    async def list(self, driver: str, node: str) -> tuple[list[dict[str, Any]], str]:
        self._maybe_fail("list")
        return ([copy.deepcopy(o) for n, o in sorted(self.objects.items()) if self._mine(o, driver, node)],
                str(self.rv))

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        self._maybe_fail("create")
        name = body["metadata"]["name"]
        if name in self.objects:
            raise KubernetesApiError(f"create {name}: HTTP 409: already exists", 409)
        return await self._store(body)

    async def replace(self, body: dict[str, Any]) -> dict[str, Any]:
        self._maybe_fail("replace")
        name = body["metadata"]["name"]
        if name not in self.objects:
            raise KubernetesApiRejected(f"update {name}: HTTP 404", 404)
        if body["metadata"].get("resourceVersion") != self.objects[name]["metadata"]["resourceVersion"]:
            raise KubernetesApiError(f"update {name}: HTTP 409: the object has been modified", 409)
        return await self._store(body)

    async def _store(self, body: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(body)
        for d in obj["spec"]["devices"] if self.gate_off else []:
            d.pop("allowMultipleAllocations", None)
            for capacity in d.get("capacity", {}).values():
                capacity.pop("requestPolicy", None)
        return await self._record("MODIFIED" if obj["metadata"]["name"] in self.objects else "ADDED", obj)

    async def delete(self, name: str) -> None:
        self._maybe_fail("delete")
        if name in self.objects:
            await self._record("DELETED", self.objects[name])

    async def watch(self, driver: str, node: str, resource_version: str,
                    timeout_seconds: float) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        self._maybe_fail("watch")
        seen = int(resource_version)
        deadline = asyncio.get_running_loop().time() + timeout_seconds
        while True:
            for rv, kind, obj in list(self.log):
                if rv > seen:
                    seen = rv
                    if self._mine(obj, driver, node):
                        yield kind, copy.deepcopy(obj)
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            async with self.changed:
                try:
                    await asyncio.wait_for(self.changed.wait_for(lambda s=seen: self.rv > s), left)
                except asyncio.TimeoutError:
                    return

    # -- what "someone else" does ------------------------------------------------------------
    async def someone_deletes(self, name: str) -> None:
        await self.delete(name)

    async def someone_edits(self, name: str, edit) -> None:
        obj = copy.deepcopy(self.objects[name])
        edit(obj)
        await self._store(obj)

    def pool(self) -> list[dict[str, Any]]:
        return [o for _, o in sorted(self.objects.items())]


def devices(spec: str = "4xH200", mode: str = "seats", seats: int = 4) -> list[dict[str, Any]]:
    return build_devices(discover_gpus(spec, node=NODE), mode, seats)


def device_names(store: MemorySliceStore) -> list[str]:
    return [d["name"] for o in store.pool() for d in o["spec"]["devices"]]


def generations(store: MemorySliceStore) -> set[int]:
    return {o["spec"]["pool"]["generation"] for o in store.pool()}


@pytest.fixture
async def store() -> MemorySliceStore:
    return MemorySliceStore()


@pytest.fixture
async def publisher(store: MemorySliceStore) -> AsyncIterator[SlicePublisher]:
    pub = SlicePublisher(store, NODE, backoff=FAST, resync_seconds=5)
    yield pub
    await pub.stop()


async def test_publish_creates_the_pool(store: MemorySliceStore, publisher: SlicePublisher) -> None:
    await asyncio.wait_for(publisher.publish(devices()), 5)
    (s,) = store.pool()
    assert s["metadata"]["name"] == f"{NODE}-{DRIVER_NAME}-000"
    assert s["metadata"]["ownerReferences"][0]["uid"] == NODE_UID
    assert s["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert device_names(store) == [d["name"] for d in devices()]
    assert publisher.generation == 1 and publisher.slices == store.pool()


async def test_deleted_slices_come_back_with_a_higher_generation(store: MemorySliceStore,
                                                                 publisher: SlicePublisher) -> None:
    await publisher.publish(devices())
    await store.someone_deletes(f"{NODE}-{DRIVER_NAME}-000")
    await eventually(lambda: store.pool() and generations(store) == {2})
    assert device_names(store) == [d["name"] for d in devices()]


async def test_foreign_edits_are_undone(store: MemorySliceStore, publisher: SlicePublisher) -> None:
    await publisher.publish(devices())
    await store.someone_edits(f"{NODE}-{DRIVER_NAME}-000", lambda o: o["spec"]["devices"].pop())
    await eventually(lambda: generations(store) == {2} and len(device_names(store)) == 16)


async def test_foreign_slices_of_our_driver_and_node_are_deleted(store: MemorySliceStore,
                                                                  publisher: SlicePublisher) -> None:
    await publisher.publish(devices())
    stray = copy.deepcopy(store.pool()[0])
    stray["metadata"] = {"name": "stray"}
    await store.create(stray)
    await eventually(lambda: "stray" not in store.objects)
    other = copy.deepcopy(stray)
    other["spec"]["driver"] = "other.example.com"
    await store.create(other)  # another driver's slice is not ours to touch
    await asyncio.sleep(0.2)
    assert "stray" in store.objects


async def test_new_devices_bump_the_generation_same_devices_do_not(store: MemorySliceStore,
                                                                    publisher: SlicePublisher) -> None:
    await publisher.publish(devices())
    writes = len([c for c in store.calls if c in ("create", "replace", "delete")])
    await publisher.publish(devices())
    assert generations(store) == {1}
    assert len([c for c in store.calls if c in ("create", "replace", "delete")]) == writes
    await publisher.publish(devices("2xH200"))
    assert generations(store) == {2} and len(device_names(store)) == 8
    await publisher.publish(devices("2xH200", CONSUMABLE))
    assert generations(store) == {3} and device_names(store) == ["gpu-0", "gpu-1"]


async def test_split_grow_and_shrink(store: MemorySliceStore, publisher: SlicePublisher) -> None:
    await publisher.publish(devices("40xH100"))  # 160 seats
    assert [len(o["spec"]["devices"]) for o in store.pool()] == [128, 32]
    assert {(o["spec"]["pool"]["generation"], o["spec"]["pool"]["resourceSliceCount"]) for o in store.pool()} == {
        (1, 2)}
    await publisher.publish(devices("4xH100"))
    assert [o["metadata"]["name"] for o in store.pool()] == [f"{NODE}-{DRIVER_NAME}-000"]
    assert store.pool()[0]["spec"]["pool"] == {"name": NODE, "generation": 2, "resourceSliceCount": 1}


async def test_a_new_publisher_adopts_a_current_pool(store: MemorySliceStore) -> None:
    async with SlicePublisher(store, NODE, backoff=FAST) as first:
        await first.publish(devices())
    writes = len(store.log)
    async with SlicePublisher(store, NODE, backoff=FAST) as second:
        await second.publish(devices())
        assert second.generation == 1 and len(store.log) == writes
        await second.publish(devices("1xH200"))
        assert second.generation == 2


async def test_a_new_publisher_goes_above_the_stored_generation(store: MemorySliceStore) -> None:
    async with SlicePublisher(store, NODE, backoff=FAST) as first:
        for spec in ("1xH200", "2xH200", "3xH200"):
            await first.publish(devices(spec))
    async with SlicePublisher(store, NODE, backoff=FAST) as second:
        await second.publish(devices("4xH200"))
        assert generations(store) == {4}


async def test_api_errors_are_retried_with_backoff(store: MemorySliceStore, publisher: SlicePublisher,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    store.fail = [("list", KubernetesApiError("list resourceslices: ClientConnectorError: refused")),
                  ("list", RuntimeError("a bug")),
                  ("create", KubernetesApiError("create: HTTP 500: etcdserver: leader changed", 500)),
                  ("create", KubernetesApiRejected("create: HTTP 422: spec.devices: Too many", 422))]
    with caplog.at_level(logging.INFO, logger="timeslice.kubelet_plugin.slices"):
        await asyncio.wait_for(publisher.publish(devices()), 5)
    assert generations(store) == {3}  # two failed creates used generations 1 and 2
    assert publisher.failures == 0 and publisher.last_error is None
    levels = [(r.levelname, r.getMessage()) for r in caplog.records if "failed" in r.getMessage()
              or "unexpected" in r.getMessage()]
    assert [lv for lv, _ in levels] == ["WARNING", "ERROR", "WARNING", "ERROR"], levels
    assert "HTTP 422" in levels[3][1] and "a bug" in caplog.text


async def test_missing_node_is_retried_until_it_exists(store: MemorySliceStore, publisher: SlicePublisher) -> None:
    del store.node_uids[NODE]
    task = asyncio.create_task(publisher.publish(devices()))
    await eventually(lambda: publisher.failures >= 2)
    assert isinstance(publisher.last_error, KubernetesApiRejected) and not store.objects
    store.node_uids[NODE] = "uid-2"
    await asyncio.wait_for(task, 5)
    assert store.pool()[0]["metadata"]["ownerReferences"][0]["uid"] == "uid-2"


async def test_a_recreated_node_gets_new_owner_references(store: MemorySliceStore,
                                                          publisher: SlicePublisher) -> None:
    await publisher.publish(devices())
    store.node_uids[NODE] = "uid-new"
    await store.someone_deletes(f"{NODE}-{DRIVER_NAME}-000")  # what the garbage collector does
    await eventually(lambda: store.pool() and store.pool()[0]["metadata"]["ownerReferences"][0]["uid"] == "uid-new")


async def test_watch_failures_fall_back_to_listing(store: MemorySliceStore, publisher: SlicePublisher) -> None:
    await publisher.publish(devices())
    calls = len(store.calls)
    store.fail = [("watch", KubernetesApiError("watch resourceslices: HTTP 410: Expired", 410))]
    publisher._wake.set()  # a resync, as after a periodic timeout
    await eventually(lambda: store.calls[calls:].count("watch") >= 2)
    await store.someone_deletes(f"{NODE}-{DRIVER_NAME}-000")
    await eventually(lambda: store.pool() and generations(store) == {2})


async def test_dropped_fields_are_reported_once_and_not_fought(store: MemorySliceStore,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    store.gate_off = True
    async with SlicePublisher(store, NODE, backoff=FAST, resync_seconds=0.05) as pub:
        with caplog.at_level(logging.INFO, logger="timeslice.kubelet_plugin.slices"):
            await pub.publish(devices("2xH200", CONSUMABLE))
            await asyncio.sleep(0.5)  # several periodic resyncs
    assert generations(store) == {1}
    dropped = [r for r in caplog.records if "without some fields" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].levelname == "ERROR"
    assert "DRAConsumableCapacity" in dropped[0].getMessage()
    assert dropped[0].getMessage().endswith(  # as a v1.34.4 API server with the gate off did
        "dropped=spec.devices[*].allowMultipleAllocations,spec.devices[*].capacity.memory.requestPolicy")


async def test_stop_cancels_the_loop_and_can_delete(store: MemorySliceStore) -> None:
    pub = SlicePublisher(store, NODE, backoff=FAST)
    await pub.publish(devices("40xH200"))
    assert len(store.pool()) == 2
    await pub.stop()
    await store.someone_deletes(f"{NODE}-{DRIVER_NAME}-000")
    await asyncio.sleep(0.1)
    assert len(store.pool()) == 1  # nobody re-creates it
    await pub.stop(delete_slices=True)
    assert store.pool() == []
    with pytest.raises(RuntimeError, match="stopped"):
        await pub.publish(devices())


async def test_waiters_are_released_by_stop(store: MemorySliceStore, publisher: SlicePublisher) -> None:
    del store.node_uids[NODE]
    task = asyncio.create_task(publisher.publish(devices()))
    await eventually(lambda: publisher.failures >= 1)
    await publisher.stop()
    with pytest.raises(RuntimeError, match="stopped before"):
        await task


async def test_bad_devices_are_refused_before_any_call(store: MemorySliceStore, publisher: SlicePublisher) -> None:
    bad = devices()
    bad[0]["attributes"]["physical-gpu"] = {"string": "x"}
    with pytest.raises(ValueError, match="qualified name"):
        await publisher.publish(bad)
    assert store.calls == []


def test_api_error_translation() -> None:
    from kubernetes.aio.client.exceptions import ApiException

    err = ApiException(status=422, reason="Unprocessable Entity")
    err.body = '{"kind":"Status","message":"ResourceSlice \\"x\\" is invalid: spec.devices: Too many"}'
    got = api_error(err, "create resourceslice x")
    assert isinstance(got, KubernetesApiRejected) and not got.retryable and got.status == 422
    assert str(got) == 'create resourceslice x: HTTP 422: ResourceSlice "x" is invalid: spec.devices: Too many'
    for status in (409, 429, 500, 503):
        e = api_error(ApiException(status=status, reason="r"), "w")
        assert type(e) is KubernetesApiError and e.retryable
    conn = api_error(OSError("connection refused"), "list")
    assert type(conn) is KubernetesApiError and conn.status == 0 and "connection refused" in str(conn)
