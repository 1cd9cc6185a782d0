"""maxHoldSeconds and configured priorities (controller/orchestrator/group.py), over a
real orchestrator and node agents (FakeBackend at the seam)."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest
from timeslice.controller.orchestrator.config import GroupSpec, MemberSpec
from timeslice.v1 import orchestrator_pb2 as pb

from tests.conftest import eventually
from tests.test_orchestrator import acquire, held_for, release


def set_group(c, **changes) -> None:
    spec = c.orchestrator.group("g").spec
    c.orchestrator.add_group(GroupSpec(**{**spec.model_dump(), **changes}))


def keep_alive(job: str, grant: pb.AcquireResponse) -> pb.KeepAliveRequest:
    return pb.KeepAliveRequest(job_id=job, group_id="g", lease_id=grant.lease_id, epoch=grant.epoch)


async def _waiting(c, job: str) -> bool:
    return job in [w.job_id for w in (await c.status()).waiters]


async def test_holder_past_max_hold_is_checkpointed_requeued_and_restored_with_its_lease(make_cluster) -> None:
    c = await make_cluster(backend="cuda", lease_seconds=10.0)
    set_group(c, max_hold_seconds=0.3)
    ga = await c.stub.Acquire(acquire("a", "a1"))
    await held_for(c, "a", 0.5)  # past the limit: no waiter, no limit
    t0 = asyncio.get_running_loop().time()
    gb = await asyncio.wait_for(c.stub.Acquire(acquire("b", "b1")), 5)
    assert asyncio.get_running_loop().time() - t0 >= 0.25  # counted from b's arrival
    status = await c.status()
    assert status.preemptions == 1 and status.holder.job_id == "b" and [w.job_id for w in status.waiters] == ["a"]
    assert ("node-0", "checkpoint", tuple(c.resolvers["node-0"]._jobs["a"])) in c.calls
    # a's code never noticed: its keep-alives stay valid while it waits (and its lease does not lapse)
    assert (await c.stub.KeepAlive(keep_alive("a", ga))).lease_remaining_seconds == 10.0
    await c.stub.Release(release("b", gb))
    await eventually(lambda: _holder(c, "a"))
    status = await c.status()
    assert status.holder.epoch == gb.epoch + 1 and status.resident_job_id == "a"
    assert ("node-0", "restore", tuple(c.resolvers["node-0"]._jobs["a"])) in c.calls
    await c.stub.KeepAlive(keep_alive("a", ga))  # the old epoch of the same lease is accepted
    await c.stub.Release(release("a", ga))
    assert (await c.status()).phase == "idle"


async def _not_waiting(c, job: str) -> bool:
    return not await _waiting(c, job)


async def _holder(c, job: str) -> bool:
    return (await c.status()).holder.job_id == job


async def test_waiters_that_leave_stop_the_clock(make_cluster) -> None:
    c = await make_cluster(backend="cuda")
    set_group(c, max_hold_seconds=0.4)
    await c.stub.Acquire(acquire("a", "a1"))
    loop = asyncio.get_running_loop()
    with pytest.raises(grpc.aio.AioRpcError):
        await c.stub.Acquire(acquire("b", "b1", timeout=0.2))  # gives up before the limit
    await eventually(lambda: _not_waiting(c, "b"))  # b left the queue
    assert (await c.status()).holder.job_id == "a"
    t0 = loop.time()  # >= 0.2 s after b's first arrival: the limit counts from this one
    await asyncio.wait_for(c.stub.Acquire(acquire("b", "b2")), 5)
    assert loop.time() - t0 >= 0.35
    assert (await c.status()).preemptions == 1


async def test_preempted_holder_that_releases_leaves_the_queue_checkpointed(make_cluster) -> None:
    c = await make_cluster(backend="cuda")
    set_group(c, max_hold_seconds=0.2)
    ga = await c.stub.Acquire(acquire("a", "a1"))
    gb = await asyncio.wait_for(c.stub.Acquire(acquire("b", "b1")), 5)
    await c.stub.Release(release("a", ga))  # a's phase ended while it was preempted
    status = await c.status()
    assert not status.waiters and status.checkpointed_job_ids == ["a"]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub.KeepAlive(keep_alive("a", ga))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await c.stub.Release(release("b", gb))


async def test_with_backend_none_the_lease_is_revoked(make_cluster) -> None:
    c = await make_cluster(backend="none")
    set_group(c, max_hold_seconds=0.2)
    ga = await c.stub.Acquire(acquire("a", "a1"))
    await asyncio.wait_for(c.stub.Acquire(acquire("b", "b1")), 5)
    status = await c.status()
    assert status.preemptions == 1 and not status.waiters
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub.KeepAlive(keep_alive("a", ga))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_members_queue_at_their_configured_priority_and_limit(make_cluster) -> None:
    """In a cluster the claim set's TimeSliceConfig decides: a client asking for a higher
    priority does not jump the queue, and a member's maxHoldSeconds applies to it."""
    c = await make_cluster(backend="cuda")
    target = c.orchestrator.group("g").spec.agents[0]
    members = tuple(MemberSpec(claim_set=j, claims_by_agent={target: ()}, priority=p, max_hold_seconds=m)
                    for j, p, m in (("a", 0, 0.2), ("b", 0, None), ("c", 5, None)))
    set_group(c, members=members)
    ga = await c.stub.Acquire(acquire("a", "a1"))
    order: list[str] = []

    async def take(job: str, prio: int) -> pb.AcquireResponse:
        g = await c.stub.Acquire(acquire(job, job, priority=prio))
        order.append(job)
        return g

    tb = asyncio.create_task(take("b", 100))  # asks 100, configured 0
    await eventually(lambda: _waiting(c, "b"))
    tc = asyncio.create_task(take("c", 0))    # asks 0, configured 5
    await eventually(lambda: _waiting(c, "c"))
    assert [(w.job_id, w.priority) for w in (await c.status()).waiters] == [("c", 5), ("b", 0)]
    gc = await asyncio.wait_for(tc, 5)  # a was preempted after 0.2 s
    assert order == ["c"] and (await c.status()).preemptions == 1
    await c.stub.Release(release("c", gc))
    gb = await asyncio.wait_for(tb, 5)  # b before a: a was re-queued behind the waiting jobs
    assert [w.job_id for w in (await c.status()).waiters] == ["a"]
    await c.stub.Release(release("b", gb))
    await eventually(lambda: _holder(c, "a"))
    await c.stub.Release(release("a", ga))


async def test_a_new_leader_queues_a_preempted_holder_again_when_it_keeps_alive(make_cluster) -> None:
    """After a leader change the new orchestrator only knows that `a` is checkpointed
    (node agents' records) and `b` resident; `a`'s client, stopped mid-phase, keeps its
    lease alive: `a` is queued again and restored when `b` releases."""
    c = await make_cluster(backend="cuda")
    group = c.orchestrator.group("g")
    group.adopt("b", {"a"}, epoch=7)  # as Controller.take_over does
    old_a = pb.AcquireResponse(lease_id="lease-of-a", epoch=6)
    assert (await c.stub.KeepAlive(keep_alive("a", old_a))).lease_remaining_seconds == 10.0
    assert [w.job_id for w in (await c.status()).waiters] == ["a"]
    gb = pb.AcquireResponse(lease_id="lease-of-b", epoch=7)
    await c.stub.Release(release("b", gb))  # the presumptive holder shows its lease and releases
    await eventually(lambda: _holder(c, "a"))
    assert ("node-0", "restore", tuple(c.resolvers["node-0"]._jobs["a"])) in c.calls
    await c.stub.Release(release("a", old_a))
    # a lease from the future, or of a job that is not checkpointed, is refused as before
    for job, grant in (("a", pb.AcquireResponse(lease_id="x", epoch=99)), ("b", gb)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.KeepAlive(keep_alive(job, grant))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
