"""ClusterState and its reflectors against a fake API server over real HTTP.

The `kubernetes.aio` client is real; the seam is the API server (tests/fake_apiserver.py),
so lists, watches, 410 Gone, errors, outages and missed events are all on the wire.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from kubernetes.aio import client as k8s
from timeslice.controller.cluster_state import ClusterState
from timeslice.controller.grouping import Snapshot
from timeslice.driver import names
from timeslice.driver.backoff import Backoff

from tests.cluster_objects import OTHER_DRIVER, World, slice_obj
from tests.conftest import eventually
from tests.fake_apiserver import FakeApiServer

FAST = Backoff(initial=0.01, maximum=0.05, jitter=0.0)


@pytest.fixture
async def apiserver() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def api(apiserver: FakeApiServer) -> AsyncIterator[k8s.ApiClient]:
    client = k8s.ApiClient(k8s.Configuration(host=apiserver.url))
    yield client
    await client.close()


class Recorder:
    def __init__(self) -> None:
        self.snapshots: list[Snapshot] = []

    def __call__(self, snap: Snapshot) -> None:
        self.snapshots.append(snap)

    @property
    def last(self) -> Snapshot:
        return self.snapshots[-1]


def two_jobs_on_one_gpu() -> World:
    w = World()
    w.node("node-a", gpus=2)
    a, b = w.pod("a-0", owner=("Job", "a")), w.pod("b-0", owner=("Job", "b"))
    w.claim(a, "gpu", [("node-a", "gpu-0-seat-0")])
    w.claim(b, "gpu", [("node-a", "gpu-0-seat-1")])
    return w


def load(server: FakeApiServer, w: World) -> None:
    for obj in (*w.slices, *w.claims, *w.pods):
        server.put(obj)


def state(api: k8s.ApiClient, rec: Recorder, **kw: object) -> ClusterState:
    opts: dict[str, object] = {"debounce_seconds": 0.01, "watch_seconds": 1, "backoff": FAST, **kw}
    return ClusterState(api, rec, **opts)  # type: ignore[arg-type]


async def test_first_snapshot_groups_and_caches_only_what_matters(apiserver, api) -> None:
    w = two_jobs_on_one_gpu()
    load(apiserver, w)
    stray = w.pod("no-claims")  # references no claim
    apiserver.put(stray)
    other = World()
    op = other.pod("other", ns="ns2")
    other.claim(op, "nic", [("node-a", "nic-0")], driver=OTHER_DRIVER)
    apiserver.put(other.claims[0])
    apiserver.put(slice_obj("node-a", driver=OTHER_DRIVER))
    rec = Recorder()
    async with state(api, rec) as cs:
        snap = await cs.wait_synced(10)
        assert [tuple(c.id for c in g.claim_sets) for g in snap.groups.values()] == [
            ("ns/job/a:gpu", "ns/job/b:gpu")]
        assert len(cs.claims.objects) == 2 and len(cs.slices.objects) == 1
        assert sorted(p["metadata"]["name"] for p in cs.pods.objects.values()) == ["a-0", "b-0"]
        assert rec.snapshots == [snap]
    # the API server filtered slices and pods; claims and pod contents were filtered here
    queries = {k: q for k, w_, q in apiserver.requests if not w_}
    assert queries["ResourceSlice"]["fieldSelector"] == f"spec.driver={names.DRIVER_NAME}"
    assert queries["Pod"]["fieldSelector"] == "status.phase!=Succeeded,status.phase!=Failed"


async def test_watch_events_update_the_snapshot_and_bursts_fold(apiserver, api) -> None:
    w = two_jobs_on_one_gpu()
    load(apiserver, w)
    rec = Recorder()
    async with state(api, rec, debounce_seconds=0.2) as cs:
        await cs.wait_synced(10)
        c = w.pod("c-0", owner=("Job", "c"))
        claim = w.claim(c, "gpu", [("node-a", "gpu-0-seat-2")])
        apiserver.put(claim)
        for i in range(5):  # a burst of pod updates within one debounce window
            c["metadata"]["labels"]["step"] = str(i)
            apiserver.put(c)
        await eventually(lambda: len(rec.last.claim_sets) == 3)
        assert len(rec.snapshots) == 2
        assert cs.claims.stats.events >= 1 and cs.pods.stats.events >= 5

        apiserver.delete(w.claims[0])
        await eventually(lambda: "ns/job/a:gpu" not in rec.last.claim_sets)
        assert len(rec.last.groups) == 1


async def test_unchanged_state_delivers_nothing(apiserver, api) -> None:
    w = two_jobs_on_one_gpu()
    load(apiserver, w)
    rec = Recorder()
    async with state(api, rec) as cs:
        await cs.wait_synced(10)
        w.pods[0]["metadata"]["labels"]["unrelated"] = "x"  # trimmed away: no change at all
        apiserver.put(w.pods[0])
        await eventually(lambda: cs.pods.stats.events >= 1)
        # A negative check, the point of the test: nothing is delivered, and no signal says
        # "decided not to deliver" (the event was counted in the same step as the cache found it
        # unchanged). The 0.1 s gives a wrong delivery ten debounce windows to show.
        await asyncio.sleep(0.1)
        assert len(rec.snapshots) == 1


async def test_410_gone_relists_and_sees_what_the_watch_missed(apiserver, api) -> None:
    w = two_jobs_on_one_gpu()
    load(apiserver, w)
    rec = Recorder()
    async with state(api, rec, watch_seconds=30) as cs:
        await cs.wait_synced(10)
        await eventually(lambda: apiserver.count("Pod", watch=True) >= 1)
        apiserver.delete(w.pods[1], silent=True)  # b's pod is gone, no event says so
        apiserver.compact()                        # and history is gone: open watches get 410
        await eventually(lambda: "ns/job/b:gpu" not in rec.last.claim_sets)
        assert cs.pods.stats.gone >= 1 and cs.pods.stats.lists >= 2
        assert cs.pods.stats.errors == 0


async def test_errors_back_off_and_no_partial_snapshot(apiserver, api, caplog) -> None:
    """Slices fail to list 4 times: nothing is delivered until they list, so the first
    snapshot already knows the physical GPUs (no claim looks alone on its seat)."""
    w = two_jobs_on_one_gpu()
    load(apiserver, w)
    apiserver.fail("ResourceSlice", 500, times=3)
    apiserver.fail("ResourceSlice", 403, times=1)
    rec = Recorder()
    async with state(api, rec) as cs:
        snap = await cs.wait_synced(10)
        assert len(snap.groups) == 1 and snap.warnings == ()
        assert rec.snapshots == [snap]
        assert cs.slices.stats.errors == 4 and cs.claims.stats.errors == 0
    assert "list/watch failed kind=resourceslices attempt=4" in caplog.text
    assert "status=403" in caplog.text


def test_backoff_grows_to_its_bound() -> None:
    b = Backoff(initial=0.5, maximum=4.0, factor=2.0, jitter=0.0)
    assert [b.delay(i) for i in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    j = Backoff(initial=1.0, jitter=0.2)
    assert all(0.8 <= j.delay(0) <= 1.2 for _ in range(100))
    capped = Backoff(initial=1.0, maximum=1.0, overshoot=False)  # the kubelet plugin's kind
    assert all(0.8 <= capped.delay(n) <= 1.0 for n in (0, 1, 5000))  # never above maximum, no overflow


async def test_api_server_outage_is_survived(apiserver, api) -> None:
    w = two_jobs_on_one_gpu()
    load(apiserver, w)
    rec = Recorder()
    async with state(api, rec) as cs:
        await cs.wait_synced(10)
        await apiserver.stop()
        await eventually(lambda: sum(r.stats.errors for r in cs.reflectors) >= 3)
        apiserver.delete(w.claims[1], silent=True)
        apiserver.compact()
        await apiserver.start()  # same port
        await eventually(lambda: "ns/job/b:gpu" not in rec.last.claim_sets, timeout=10)
        assert list(rec.last.claim_sets) == ["ns/job/a:gpu"]


async def test_periodic_resync_heals_a_missed_event(apiserver, api) -> None:
    w = two_jobs_on_one_gpu()
    load(apiserver, w)
    rec = Recorder()
    async with state(api, rec, resync_seconds=0.5, watch_seconds=30) as cs:
        await cs.wait_synced(10)
        del w.claims[0]["status"]["allocation"]
        apiserver.put(w.claims[0], silent=True)  # deallocated, the event was lost
        await eventually(lambda: "ns/job/a:gpu" not in rec.last.claim_sets, timeout=10)
        assert cs.claims.stats.lists >= 2 and cs.claims.stats.gone == 0


async def test_on_change_errors_are_logged_and_the_loop_goes_on(apiserver, api, caplog) -> None:
    w = two_jobs_on_one_gpu()
    load(apiserver, w)
    seen: list[Snapshot] = []

    async def on_change(snap: Snapshot) -> None:
        seen.append(snap)
        if len(seen) == 1:
            raise RuntimeError("wiring bug")

    async with ClusterState(api, on_change, debounce_seconds=0.01, watch_seconds=1, backoff=FAST) as cs:
        await cs.wait_synced(10)
        apiserver.delete(w.claims[0])
        await eventually(lambda: len(seen) == 2)
    assert "on_change failed" in caplog.text and "wiring bug" in caplog.text


async def test_large_list_is_paged(apiserver, api) -> None:
    w = World()
    w.node("node-a", gpus=8, seats=8)
    for i in range(64):
        p = w.pod(f"p{i}", job=f"j{i}")
        w.claim(p, "gpu", [("node-a", f"gpu-{i % 8}-seat-{i // 8}")])
    load(apiserver, w)
    rec = Recorder()
    cs = state(api, rec)
    for r in cs.reflectors:
        r._page_size = 10
    async with cs:
        snap = await cs.wait_synced(10)
    assert len(snap.claim_sets) == 64 and len(snap.groups) == 8
    assert sum(1 for k, watch, q in apiserver.requests if k == "Pod" and not watch and q.get("continue")) >= 6


async def test_node_agents_come_from_the_plugin_pods(apiserver, api) -> None:
    from tests.test_node_agents import plugin_pod

    load(apiserver, two_jobs_on_one_gpu())
    apiserver.put(plugin_pod("plugin-a", "node-a", ip="10.1.0.1"))
    apiserver.put(plugin_pod("elsewhere", "node-b", ns="default"))  # not in the agent namespace
    rec = Recorder()
    async with state(api, rec, agent_namespace="timeslice-system") as cs:
        snap = await cs.wait_synced(10)
        assert snap.node_agents == {"node-a": ("10.1.0.1:50052", None)}
        moved = plugin_pod("plugin-a2", "node-a", ip="10.1.0.9", created="2026-11-29T11:00:00Z")
        apiserver.put(moved)  # the plugin pod was replaced: the new address reaches the snapshot
        await eventually(lambda: rec.last.node_agents == {"node-a": ("10.1.0.9:50052", None)})
        moved["metadata"]["annotations"] = {names.AGENT_CERTIFICATE_ANNOTATION: "PEM"}
        apiserver.put(moved)  # the plugin published its certificate: it reaches the snapshot
        await eventually(lambda: rec.last.node_agents == {"node-a": ("10.1.0.9:50052", "PEM")})
    selectors = [q.get("labelSelector") for k, w_, q in apiserver.requests if k == "Pod"]
    assert "app.kubernetes.io/name=timeslice-kubelet-plugin" in selectors
