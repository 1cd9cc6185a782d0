"""`Leave` (client close()): a job done with a group is never stranded off the GPUs.

Seen on two H200s (issue 14, backend cuda, residency exclusive): a job was checkpointed for
the other job right after its last release; its process then blocked in its CUDA teardown
for good, because nothing restores a job that neither holds nor waits. Now the client's
close() sends Leave: the job is dropped like a job that is gone, so if it is off the GPUs
(or leaving them) it is restored once the group is idle, then forgotten; if it is on them,
it is never moved again. Real orchestrator and node-agent servers, a scripted backend.
"""

from __future__ import annotations

import asyncio

from tests.conftest import eventually


def restores_of(c, pid: int) -> int:
    return sum(1 for _, step, pids in c.calls if step == "restore" and pid in pids)


async def test_a_job_checkpointed_after_its_last_release_is_restored_once_it_left_and_the_group_is_idle(
        make_cluster) -> None:
    c = await make_cluster(backend="cuda")
    (pa,), (pb,) = await c.resolvers["node-0"].pids("a"), await c.resolvers["node-0"].pids("b")
    a, b = c.client("a"), c.client("b")
    await a.acquire()
    await a.release()  # a's last phase
    await b.acquire()  # a is checkpointed for b ...
    assert (await c.status()).checkpointed_job_ids == ["a"]
    await a.close()  # ... and a ends: its processes must run again to exit
    assert restores_of(c, pa) == 0  # not while b holds
    await b.release()
    await eventually(lambda: restores_of(c, pa) == 1)  # the group is idle: a is restored, then forgotten
    status = await c.status()
    assert "a" not in status.checkpointed_job_ids and status.resident_job_id != "a"
    await b.acquire()  # b goes on, and a is not moved for it again
    await b.release()
    assert [s for _, s, pids in c.calls if pa in pids] == ["checkpoint", "restore"]
    await b.close()
    assert restores_of(c, pb) == 0  # b left on the GPUs: nothing to bring back


async def test_a_job_that_leaves_while_it_is_being_checkpointed_is_restored_when_idle(make_cluster) -> None:
    c = await make_cluster(backend="cuda")
    c.backends["node-0"].delay = 0.5  # the checkpoint of a takes a while
    (pa,) = await c.resolvers["node-0"].pids("a")
    a, b = c.client("a"), c.client("b")
    await a.acquire()
    await a.release()
    granted = asyncio.create_task(b.acquire())
    await eventually(lambda: ("checkpoint", (pa,)) in c.backends["node-0"].started)
    await a.close()  # a ends while the switch moves it off
    await asyncio.wait_for(granted, 10)
    await b.release()
    await eventually(lambda: restores_of(c, pa) == 1)
    await b.close()


async def test_leave_of_a_job_that_holds_or_waits_changes_nothing(make_cluster) -> None:
    from timeslice.v1 import orchestrator_pb2 as pb

    c = await make_cluster(backend="cuda")
    a = c.client("a")
    await a.acquire()
    left = await c.stub.Leave(pb.LeaveRequest(job_id="a", group_id="g"))  # another process of a is done
    assert left.result == "busy" and (await c.status()).holder.job_id == "a"
    await a.release()
    await a.close()
