"""A new leader's takeover: the resident job is a presumptive holder (LockGroup.adopt)."""

from __future__ import annotations

import asyncio

import pytest
from timeslice.driver.errors import StaleLease
from timeslice.v1 import orchestrator_pb2 as pb

from tests.conftest import eventually


async def test_presumptive_holder_keeps_its_lock_with_its_old_lease(make_cluster) -> None:
    c = await make_cluster(backend="cuda", lease_seconds=0.5)
    group = c.orchestrator.group("g")
    group.adopt("a", {"b"}, epoch=7)
    status = await c.status()
    assert status.holder.job_id == "a" and status.resident_job_id == "a" and list(status.checkpointed_job_ids) == ["b"]
    with pytest.raises(StaleLease):  # another job cannot use it ...
        group.release("b", "whatever", 7)
    group.keep_alive("b", "whatever", 7)  # (b's lease from the earlier leader queues it: see test_max_hold)
    assert group.holder.job_id == "a" and [w.job_id for w in group.queue] == ["b"]
    assert group.keep_alive("a", "old-lease", 7) > 0  # the old lease is adopted ...
    with pytest.raises(StaleLease):
        group.release("a", "other-lease", 7)  # ... and from then on it is the only one
    waiter = asyncio.ensure_future(c.stub.Acquire(pb.AcquireRequest(job_id="b", group_id="g", request_id="r")))
    await eventually(lambda: len(group.queue) == 2)
    group.release("a", "old-lease", 7)
    grant = await waiter
    assert grant.epoch == 8 and grant.restored  # b was checkpointed: the switch restored it


async def test_presumptive_holder_that_was_idle_lapses_after_one_lease(make_cluster) -> None:
    c = await make_cluster(backend="cuda", lease_seconds=0.3)
    c.orchestrator.group("g").adopt("a", set(), epoch=3)
    grant = await asyncio.wait_for(c.stub.Acquire(pb.AcquireRequest(job_id="b", group_id="g", request_id="r")), 3)
    assert grant.epoch == 4 and (await c.status()).lease_expiries == 1
