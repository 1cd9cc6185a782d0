"""Orchestrator semantics over a real gRPC server on loopback (backend `none`)."""

from __future__ import annotations

import asyncio
import signal

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from timeslice.v1 import orchestrator_pb2 as pb

from tests.conftest import eventually, python_child


def acquire(job: str, rid: str, group: str = "g", priority: int = 0, timeout: float = 0.0) -> pb.AcquireRequest:
    return pb.AcquireRequest(job_id=job, group_id=group, request_id=rid, priority=priority, timeout_seconds=timeout)


def release(job: str, grant: pb.AcquireResponse, group: str = "g") -> pb.ReleaseRequest:
    return pb.ReleaseRequest(job_id=job, group_id=group, lease_id=grant.lease_id, epoch=grant.epoch)


async def held_for(c, job: str, seconds: float, group: str = "g") -> None:
    """Wait until the group's status shows `job` holding for `seconds` (deadline: 30 s more);
    fail at once when it shows another holder or none (the hold ended before)."""
    async def check() -> bool:
        holder = (await c.status(group)).holder
        assert holder.job_id == job, f"{job}'s hold ended before {seconds} s: holder is {holder.job_id or 'nobody'}"
        return holder.held_seconds >= seconds

    await eventually(check, timeout=seconds + 30, what=f"{job} holding for {seconds} s")


async def test_fifo_within_priority_and_higher_priority_first(make_cluster) -> None:
    c = await make_cluster()
    first = await c.stub.Acquire(acquire("holder", "h"))
    order: list[str] = []

    async def wait(job: str, prio: int) -> None:
        g = await c.stub.Acquire(acquire(job, job, priority=prio))
        order.append(job)
        await c.stub.Release(release(job, g))

    tasks = []
    for job, prio in [("low-1", 0), ("low-2", 0), ("high", 5), ("low-3", 0)]:
        tasks.append(asyncio.create_task(wait(job, prio)))
        await eventually(lambda j=job: _waiting(c, j))
    await c.stub.Release(release("holder", first))
    await asyncio.gather(*tasks)
    assert order == ["high", "low-1", "low-2", "low-3"]


async def _waiting(c, job: str) -> bool:
    return job in [w.job_id for w in (await c.status()).waiters]


async def test_epoch_grows_and_stale_release_is_refused(make_cluster) -> None:
    c = await make_cluster()
    g1 = await c.stub.Acquire(acquire("a", "1"))
    await c.stub.Release(release("a", g1))
    g2 = await c.stub.Acquire(acquire("a", "2"))
    assert g2.epoch == g1.epoch + 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub.Release(release("a", g1))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"epoch {g1.epoch}" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub.Release(release("b", g2))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_lease_lapses_and_next_waiter_is_granted(make_cluster) -> None:
    c = await make_cluster(lease_seconds=0.3)
    g1 = await c.stub.Acquire(acquire("a", "1"))
    g2 = await asyncio.wait_for(c.stub.Acquire(acquire("b", "2")), 3)  # no keep-alive from a
    assert g2.epoch == g1.epoch + 1
    status = await c.status()
    assert status.lease_expiries == 1 and status.holder.job_id == "b"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub.KeepAlive(pb.KeepAliveRequest(job_id="a", group_id="g", lease_id=g1.lease_id, epoch=g1.epoch))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_keep_alive_holds_past_the_lease(make_cluster) -> None:
    c = await make_cluster(lease_seconds=0.3)
    client = c.client("a")
    await client.acquire()
    await held_for(c, "a", 1.0)  # more than three leases
    status = await c.status()
    assert status.holder.job_id == "a" and status.lease_expiries == 0
    await client.release()
    await client.close()


async def test_a_process_that_joins_its_jobs_hold_renews_the_lease() -> None:
    """`none` schedules seed 896: a job's process was killed while it held; the job's next
    process joined that hold phase after phase, each shorter than the client's keep-alive
    interval, so no keep-alive came, and the lease lapsed under it: the next job was granted
    and the joined process's release raised LeaseLost into the job. A caller that joins its
    job's hold shows the job alive: the lease runs again from then. Once the job stops
    joining, the dead caller's part lapses a lease later."""
    from timeslice.controller.orchestrator.config import GroupSpec
    from timeslice.controller.orchestrator.group import LockGroup
    from timeslice.controller.orchestrator.group_model import SwitchRecord

    async def switcher(spec, evict, incoming, restore):  # type: ignore[no-untyped-def]
        return SwitchRecord(None, incoming)

    lease = 2.0
    g = LockGroup(GroupSpec(id="g", lease_seconds=lease), switcher)
    try:
        stopped = await g.acquire("a", 0, "a-killed", None)  # never releases, never keeps alive
        b = asyncio.ensure_future(g.acquire("b", 0, "b-1", None))
        loop = asyncio.get_running_loop()
        until = loop.time() + 2.5 * lease
        i = 0
        while loop.time() < until:  # phases of a's next process, 0.2 s apart
            i += 1
            part = await g.acquire("a", 0, f"a-next-{i}", None)
            assert part.epoch == stopped.epoch
            await asyncio.sleep(0.1)
            g.release("a", part.lease_id, part.epoch, f"a-next-{i}")
            await asyncio.sleep(0.1)
            assert not b.done(), f"the lease lapsed under a's joined process (phase {i})"
        granted = await asyncio.wait_for(b, 10 * lease)  # a stopped joining: the dead caller's part lapses
        assert granted.epoch == stopped.epoch + 1
    finally:
        await g.close()


async def test_holder_killed_with_sigkill_loses_the_lock_after_the_lease(make_cluster, children) -> None:
    c = await make_cluster(lease_seconds=0.5)
    child = python_child(f"""
        from timeslice import TimeSliceOrchestratorClient
        import signal
        c = TimeSliceOrchestratorClient("{c.target}", "victim", "g")
        c.acquire()
        print("held", flush=True)
        signal.pause()  # holds until the test kills it
    """)
    children.append(child)
    assert await asyncio.to_thread(child.stdout.readline) == "held\n"
    await held_for(c, "victim", 0.8)  # longer than the lease: the child's keep-alives keep it
    child.send_signal(signal.SIGKILL)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    g = await asyncio.wait_for(c.stub.Acquire(acquire("next", "n")), 5)
    assert loop.time() - t0 < 1.5 and g.epoch == 2
    assert (await c.status()).lease_expiries == 1


async def test_cancelled_acquire_is_never_granted(make_cluster) -> None:
    c = await make_cluster()
    g1 = await c.stub.Acquire(acquire("a", "1"))
    call = c.stub.Acquire(acquire("gone", "2"))
    await eventually(lambda: _waiting(c, "gone"))
    call.cancel()
    await eventually(lambda: _not_waiting(c, "gone"))
    await c.stub.Release(release("a", g1))
    status = await c.status()
    assert status.phase == "idle" and not status.holder.job_id and status.grants == 1
    g3 = await c.stub.Acquire(acquire("c", "3"))
    assert g3.epoch == 2


async def _not_waiting(c, job: str) -> bool:
    return not await _waiting(c, job)


async def test_acquire_timeout_leaves_the_queue(make_cluster) -> None:
    c = await make_cluster()
    await c.stub.Acquire(acquire("a", "1"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub.Acquire(acquire("b", "2", timeout=0.2))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not (await c.status()).waiters
    with pytest.raises(grpc.aio.AioRpcError) as err:  # the client's own deadline: same outcome
        await c.stub.Acquire(acquire("b", "3"), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually(lambda: _not_waiting(c, "b"))


async def test_retried_acquire_joins_the_same_entry_and_gets_the_same_grant(make_cluster) -> None:
    c = await make_cluster()
    g1 = await c.stub.Acquire(acquire("a", "1"))
    first = asyncio.ensure_future(c.stub.Acquire(acquire("b", "same")))
    await eventually(lambda: _waiting(c, "b"))
    retry = asyncio.ensure_future(c.stub.Acquire(acquire("b", "same")))
    queue = c.orchestrator.group("g").queue
    await eventually(lambda: queue.by_request("b", "same").callers == 2, what="the retry joined b's entry")
    assert [w.job_id for w in (await c.status()).waiters] == ["b"]
    await c.stub.Release(release("a", g1))
    r1, r2 = await asyncio.gather(first, retry)
    assert (r1.lease_id, r1.epoch) == (r2.lease_id, r2.epoch)
    r3 = await c.stub.Acquire(acquire("b", "same"))  # a retry after the grant arrived
    assert (r3.lease_id, r3.epoch) == (r1.lease_id, r1.epoch)
    assert (await c.status()).grants == 2


async def test_release_without_waiter_keeps_holder_resident(make_cluster) -> None:
    c = await make_cluster(backend="cuda")
    for rid in ("1", "2", "3"):
        g = await c.stub.Acquire(acquire("a", rid))
        assert not g.restored and g.waited_seconds < 0.5
        r = await c.stub.Release(release("a", g))
        assert r.waiters == 0 and not r.switch_started
    assert c.calls == []  # no checkpoint, no restore
    assert (await c.status()).resident_job_id == "a"


@pytest.mark.parametrize(("request_", "field"), [
    (acquire("", "1"), "job_id is required"),
    (acquire("a", "1", group=""), "group_id is required"),
    (acquire("a b", "1"), "job_id 'a b' is invalid"),
    (acquire("a", "1", timeout=-1), "timeout_seconds must be"),
    (acquire("a", "1", timeout=float("nan")), "timeout_seconds must be"),
    (acquire("a", "x" * 200), "request_id must be"),
    (acquire("a", "*preempted*some-lease"), "not start with '*'"),
])
async def test_bad_arguments_give_invalid_argument(make_cluster, request_, field) -> None:
    c = await make_cluster()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub.Acquire(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


async def test_unknown_group_is_not_found_and_others_keep_serving(make_cluster) -> None:
    c = await make_cluster()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub.Acquire(acquire("a", "1", group="nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub.Release(pb.ReleaseRequest(job_id="a", group_id="g", lease_id="x", epoch=7))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (await c.stub.Acquire(acquire("a", "2"))).epoch == 1


async def test_health_and_list_groups(make_cluster) -> None:
    c = await make_cluster(groups=("g", "h"))
    async with grpc.aio.insecure_channel(c.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "timeslice.v1.Orchestrator"):
            r = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert r.status == health_pb2.HealthCheckResponse.SERVING
    groups = (await c.stub.ListGroups(pb.ListGroupsRequest())).groups
    assert [g.group_id for g in groups] == ["g", "h"]


async def test_status_never_carries_the_holders_lease_id(make_cluster) -> None:
    """Issue 10, item 14: status returned the holder's lease id, with which any caller of a
    static group could release or keep alive another job's hold."""
    c = await make_cluster()
    grant = await c.stub.Acquire(pb.AcquireRequest(job_id="a", group_id="g", request_id="r1"))
    status = await c.status()
    listed = (await c.stub.ListGroups(pb.ListGroupsRequest())).groups[0]
    assert status.holder.job_id == "a" and status.holder.lease_id == "" and listed.holder.lease_id == ""
    assert grant.lease_id not in str(status) + str(listed)
    with pytest.raises(grpc.aio.AioRpcError) as err:  # what status shows cannot release the hold
        await c.stub.Release(pb.ReleaseRequest(job_id="a", group_id="g", lease_id=status.holder.lease_id,
                                               epoch=status.holder.epoch))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
