"""An API server outage pauses claim status writing, never a grant already decided.

The first test runs the controller path for real: `Controller` (ClusterState ->
Reconciler -> Orchestrator, ClaimStatusWriter, the orchestrator's gRPC server on a unix
socket) with the `kubernetes.aio` client against tests/fake_apiserver.py over HTTP, and
the jobs' clients (`AsyncTimeSliceOrchestratorClient` for job A,
`TimeSliceOrchestratorClient` in a thread for job B) over gRPC. The outage is either the
API server gone (`stop()`, then `start()` on the same port) or the API server answering
500 to claim status patches and Event creation. Hand-offs are only bounded by a generous
timeout (`HANDOFF`, seconds); nothing here asserts speed.

The others test the `ClaimStatusWriter`'s retry alone (Reconciler -> writer -> the fake
API server, no gRPC): a failed write is retried with backoff without a new change, and a
group removed meanwhile is never written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.aio import client as k8s
from timeslice import AsyncTimeSliceOrchestratorClient, TimeSliceOrchestratorClient
from timeslice.controller.app import Controller, ControllerConfig
from timeslice.controller.claim_status import ClaimStatusWriter
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.reconciler import Reconciler
from timeslice.driver import names
from timeslice.driver.backoff import Backoff
from timeslice.driver.events import EventRecorder

from tests.cluster_objects import World, gpu_uuid
from tests.conftest import eventually
from tests.fake_apiserver import FakeApiServer

HANDOFF = 10.0       # s: a hand-off, lock call or awaited status write taking longer counts as stuck
CATCH_UP = 30.0      # s: claim status must show the current holder this long after the outage
A, B = "ns/a:gpu", "ns/b:gpu"                 # the claim sets (lock members)
CLAIM = {A: "a-0-gpu", B: "b-0-gpu"}          # their claims, in namespace "ns"


def two_jobs_one_gpu(a_devices: tuple[str, ...] = ("gpu-0-seat-0",)) -> World:
    """Jobs a and b (pod label timeslice.dev/job) each hold a seat of node-a's GPU 0: one group."""
    w = World()
    w.node("node-a", gpus=2)
    w.claim(w.pod("a-0", job="a"), "gpu", [("node-a", d) for d in a_devices])
    w.claim(w.pod("b-0", job="b"), "gpu", [("node-a", "gpu-0-seat-1")])
    return w


@pytest.fixture
async def apiserver() -> AsyncIterator[FakeApiServer]:
    server, w = FakeApiServer(), two_jobs_one_gpu()
    for obj in (*w.slices, *w.claims, *w.pods):
        server.put(obj)
    await server.start()
    yield server
    await server.stop()


@contextlib.asynccontextmanager
async def serving(apiserver: FakeApiServer, listen: str) -> AsyncIterator[Controller]:
    """A leading `Controller` (no leader election, backend `none`: no node agents),
    stopped the way `timeslice.controller.app.run` stops it."""
    api = k8s.ApiClient(k8s.Configuration(host=apiserver.url))
    ctl = Controller(ControllerConfig(listen=listen, default_backend="none", identity="test"), api)
    ctl.state.start()
    task = asyncio.create_task(ctl.lead())
    try:
        yield ctl
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await ctl.state.stop()
        await ctl.writer.stop()
        await ctl.orchestrator.close()
        await api.close()


def status_requests(apiserver: FakeApiServer) -> int:
    return apiserver.count("ResourceClaim/status", watch=False)


def shown(apiserver: FakeApiServer, member: str) -> tuple[Any, ...] | None:
    """(LockHeld status, its reason, holder, epoch, queue position) as the member's claim
    status.devices shows it; None before the first write."""
    claim = apiserver.claim("ns", CLAIM[member]) or {}
    devices = (claim.get("status") or {}).get("devices") or []
    if not devices:
        return None
    ours = next((d for d in devices if d["driver"] == names.DRIVER_NAME and "data" in d), None)
    if ours is None:
        return None
    held = next(c for c in ours["conditions"] if c["type"] == "LockHeld")
    data = ours["data"]
    return held["status"], held["reason"], data["holder"], data["epoch"], data["queuePosition"]


def failures(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(1 for r in caplog.records if text in r.getMessage())


async def begin_outage(apiserver: FakeApiServer, mode: str) -> None:
    if mode == "down":
        await apiserver.stop()
    else:
        apiserver.fail("ResourceClaim/status", 500, times=None)
        apiserver.fail("Event", 500, times=None)


async def end_outage(apiserver: FakeApiServer, mode: str) -> None:
    if mode == "down":
        await apiserver.start()  # same port
    else:
        apiserver.heal("ResourceClaim/status")
        apiserver.heal("Event")


@pytest.mark.parametrize("mode", ["down", "5xx"])
async def test_hand_offs_go_on_during_an_api_outage_and_status_catches_up(
        apiserver: FakeApiServer, short_tmp: Path, caplog: pytest.LogCaptureFixture, mode: str) -> None:
    caplog.set_level(logging.INFO)
    target = f"unix://{short_tmp / 'orch.sock'}"
    async with serving(apiserver, target) as ctl:
        idle = ("False", "Idle", "", 0, -1)
        await eventually(lambda: shown(apiserver, A) == idle and shown(apiserver, B) == idle, timeout=HANDOFF)
        (group,) = ctl.orchestrator.groups()
        a = AsyncTimeSliceOrchestratorClient(target, "ns/a", "gpu")
        b = TimeSliceOrchestratorClient(target, "ns/b", "gpu")
        try:
            first = await asyncio.wait_for(a.acquire(), HANDOFF)
            b_granted = asyncio.ensure_future(asyncio.to_thread(b.acquire, timeout=HANDOFF))
            # status works before the outage: A holds (epoch 1), B waits first in line
            await eventually(lambda: shown(apiserver, A) == ("True", "Holder", A, 1, -1)
                             and shown(apiserver, B) == ("False", "Waiting", A, 1, 0), timeout=HANDOFF)
            patches, events = len(apiserver.status_patches), len(apiserver.events)
            assert patches >= 4 and events >= 1  # idle + held + waiting on two claims; LockGranted

            await begin_outage(apiserver, mode)
            await a.release()                                  # A -> B
            second = await asyncio.wait_for(b_granted, HANDOFF)
            a_granted = asyncio.ensure_future(a.acquire(timeout=HANDOFF))
            await eventually(lambda: [w.job_id for w in group.view().waiters] == [A], timeout=HANDOFF)
            await asyncio.to_thread(b.release)                 # B -> A
            third = await asyncio.wait_for(a_granted, HANDOFF)
            assert (first.epoch, second.epoch, third.epoch) == (1, 2, 3)
            assert (group.holder.job_id, group.epoch, len(group.queue)) == (A, 3, 0)

            # the writer tried to show the new holder after the last grant, and failed
            tried = failures(caplog, "claim status not written")
            await eventually(lambda: failures(caplog, "claim status not written") > tried, timeout=HANDOFF)
            assert ctl.writer.pending().get(group.id, 0) >= 1
            assert failures(caplog, "could not record event") >= 2  # LockGranted to B, then to A
            assert len(apiserver.status_patches) == patches and len(apiserver.events) == events
            assert shown(apiserver, A) == ("True", "Holder", A, 1, -1)  # stale: still epoch 1

            await end_outage(apiserver, mode)
            # no lock event from here on: the writer must retry by itself
            await eventually(lambda: shown(apiserver, A) == ("True", "Holder", A, 3, -1)
                             and shown(apiserver, B) == ("False", "Idle", A, 3, -1), timeout=CATCH_UP)
            assert group.epoch == 3 and group.counters.grants == 3
            assert ctl.writer.pending() == {}
            assert a.holding() is not None and a.holding().epoch == 3
        finally:
            await a.close()
            await asyncio.to_thread(b.close)


@contextlib.asynccontextmanager
async def writing(apiserver: FakeApiServer, retry: Backoff) -> AsyncIterator[tuple[Reconciler, ClaimStatusWriter]]:
    """A ClaimStatusWriter fed by a Reconciler (as `Controller` wires them), writing through
    the real client; snapshots are applied by the test."""
    api = k8s.ApiClient(k8s.Configuration(host=apiserver.url))
    writer = ClaimStatusWriter(k8s.ResourceV1Api(api), EventRecorder(k8s.CoreV1Api(api), "test"),
                               lambda: reconciler.snapshot, interval=0.01, retry=retry)
    orchestrator = Orchestrator(observer=writer.observe)
    reconciler = Reconciler(orchestrator, default_backend="none", on_group_set=writer.mark)
    writer.start()
    try:
        yield reconciler, writer
    finally:
        await writer.stop()
        await orchestrator.close()
        await api.close()


async def test_a_failed_write_is_retried_with_backoff_without_a_new_change(apiserver) -> None:
    """One change (the group appears), three 500s: the writer retries on its own, waiting
    the backoff between attempts, and stops once the status is written."""
    retry = Backoff(initial=0.2, maximum=0.4, jitter=0.0)
    apiserver.fail("ResourceClaim/status", 500, times=3)
    async with writing(apiserver, retry) as (reconciler, writer):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await reconciler.apply(two_jobs_one_gpu().snapshot())  # the only change
        (gid,) = reconciler.snapshot.groups
        await eventually(lambda: writer.pending() == {gid: 3}, timeout=HANDOFF)
        idle = ("False", "Idle", "", 0, -1)
        await eventually(lambda: shown(apiserver, A) == idle and shown(apiserver, B) == idle, timeout=HANDOFF)
        assert loop.time() - t0 >= 0.2 + 0.4 + 0.4  # backed off, did not hammer the API server
        assert writer.pending() == {}
        assert status_requests(apiserver) == 3 + 2  # three failed, then one per claim
        await asyncio.sleep(0.5)
        assert status_requests(apiserver) == 5      # written: no more retries


async def test_a_group_removed_while_its_write_fails_is_not_written_later(apiserver) -> None:
    """The group's GPUs change during an outage (a's claim now also holds GPU 1): the old
    group is removed, the new one takes over the same claims. Once the API server is back
    only the new group's status is written; the old group's pending retry must not
    overwrite it with stale data."""
    apiserver.fail("ResourceClaim/status", 500, times=None)
    async with writing(apiserver, Backoff(initial=0.3, maximum=0.3, jitter=0.0)) as (reconciler, writer):
        await reconciler.apply(two_jobs_one_gpu().snapshot())
        (old,) = reconciler.snapshot.groups
        await eventually(lambda: writer.pending().get(old, 0) >= 1, timeout=HANDOFF)
        await reconciler.apply(two_jobs_one_gpu(a_devices=("gpu-0-seat-0", "gpu-1-seat-0")).snapshot())
        (new,) = reconciler.snapshot.groups
        assert new != old
        apiserver.heal("ResourceClaim/status")
        await eventually(lambda: writer.pending() == {}, timeout=HANDOFF)
        await asyncio.sleep(0.5)  # longer than the old group's retry delay
        written = {d["data"]["groupId"] for _, _, body in apiserver.status_patches for d in body["status"]["devices"]}
        assert written == {new}
        for m in (A, B):
            (device,) = apiserver.claim("ns", CLAIM[m])["status"]["devices"]
            assert device["data"]["groupId"] == new and shown(apiserver, m) == ("False", "Idle", "", 0, -1)
            # issue 12, item 12: the GPU as the peer drivers describe it, from the ResourceSlice
            assert (device["data"]["uuid"], device["data"]["productName"], device["data"]["driverVersion"]) == (
                gpu_uuid("node-a", 0), "NVIDIA H200", "580.159.4")


async def test_configuration_warnings_become_warning_events_on_their_claims_once(short_tmp) -> None:
    """Issue 11, item 5: the grouping computed configuration warnings (here two claims of one
    group asking for different backends) and nobody published them. The leader records each
    as a Warning Event on its claim, once while it lasts."""
    from tests.cluster_objects import ts_config

    w = World()
    w.node("node-a", gpus=2)
    w.claim(w.pod("a-0", job="a"), "gpu", [("node-a", "gpu-0-seat-0")], config=[ts_config(backend="none")])
    w.claim(w.pod("b-0", job="b"), "gpu", [("node-a", "gpu-0-seat-1")], config=[ts_config(backend="freeze")])
    server = FakeApiServer()
    for obj in (*w.slices, *w.claims, *w.pods):
        server.put(obj)
    await server.start()
    try:
        async with serving(server, f"unix://{short_tmp / 'o.sock'}") as ctl:
            def warnings() -> list[dict]:
                return [e for e in server.events if e["type"] == "Warning"]

            await eventually(lambda: warnings(), timeout=HANDOFF)
            (event,) = warnings()
            assert event["involvedObject"]["name"] == "b-0-gpu" and event["reason"] == "ConflictingGroupConfig"
            assert "backend" in event["message"]
            assert ctl.warnings.publish(ctl.reconciler.snapshot.warnings) == 0  # the same again: no second Event
    finally:
        await server.stop()


async def test_status_writes_keep_other_drivers_entries_and_conditions(apiserver) -> None:
    """Issue 12, item 2: a claim with one of our seats and another driver's NIC, whose status
    has that driver's entry and a foreign condition on our entry. Our write used to leave only
    our entry with our two conditions (a merge patch replaces the list). Now only ours change."""
    nic = {"driver": "nic.example.com", "pool": "node-a", "device": "eth1",
           "conditions": [{"type": "Ready", "status": "True", "reason": "Up", "message": "",
                           "lastTransitionTime": "2026-01-01T00:00:00Z"}], "data": {"mac": "aa"}}
    foreign = {"type": "Monitored", "status": "True", "reason": "Probe", "message": "",
               "lastTransitionTime": "2026-01-01T00:00:00Z"}
    world = two_jobs_one_gpu()
    for c in world.claims:
        c["status"]["devices"] = [nic, *({"driver": r["driver"], "pool": r["pool"], "device": r["device"],
                                          "conditions": [foreign]}
                                         for r in c["status"]["allocation"]["devices"]["results"])]
        apiserver.put(c)
    async with writing(apiserver, Backoff(initial=0.2, maximum=0.4, jitter=0.0)) as (reconciler, _):
        await reconciler.apply(world.snapshot())
        await eventually(lambda: all(shown(apiserver, m) == ("False", "Idle", "", 0, -1) for m in (A, B)),
                         timeout=HANDOFF)
        for m in (A, B):
            devices = apiserver.claim("ns", CLAIM[m])["status"]["devices"]
            def plain(d: dict) -> dict:  # times come back as +00:00 through the client's round trip
                return {**d, "conditions": [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                                            for c in d["conditions"]]}

            assert plain(devices[0]) == plain(nic) and len(devices) == 2
            assert [c["type"] for c in devices[1]["conditions"]] == ["Monitored", "LockHeld", "Resident"]
        assert all("resourceVersion" in body["metadata"] for _, _, body in apiserver.status_patches)
