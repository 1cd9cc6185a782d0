"""Unit tests of LockQueue ordering and bookkeeping."""

import asyncio

from timeslice.controller.orchestrator.lock_queue import LockQueue


async def test_priority_then_fifo() -> None:
    q = LockQueue()
    loop = asyncio.get_running_loop()
    for i, (job, prio) in enumerate([("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", -1)]):
        q.push(f"r{i}", job, prio, float(i), loop.create_future())
    assert [w.job_id for w in q] == ["b", "d", "a", "c", "e"]


async def test_remove_and_lookup() -> None:
    q = LockQueue()
    loop = asyncio.get_running_loop()
    ws = [q.push(f"r{i}", f"j{i}", 0, 0.0, loop.create_future()) for i in range(4)]
    assert q.by_request(ws[2].job_id, "r2") is ws[2] and q.by_request("another-job", "r2") is None
    assert q.remove(ws[2]) and not q.remove(ws[2])
    assert q.by_request(ws[2].job_id, "r2") is None
    assert [w.job_id for w in q] == ["j0", "j1", "j3"]
    assert q.head() is ws[0]


async def test_pop_job_takes_every_entry_of_the_job() -> None:
    q = LockQueue()
    loop = asyncio.get_running_loop()
    q.push("1", "a", 0, 0.0, loop.create_future())
    q.push("2", "b", 0, 0.0, loop.create_future())
    q.push("3", "a", 0, 0.0, loop.create_future())
    assert [w.request_id for w in q.pop_job("a")] == ["1", "3"]
    assert [w.job_id for w in q] == ["b"] and len(q) == 1


async def test_two_jobs_with_one_request_id_get_their_own_grants() -> None:
    """Issue 10, item 7: job b sent job a's request id while both waited, joined a's queue
    entry, and so received a's grant while a held."""
    from timeslice.controller.orchestrator.config import GroupSpec
    from timeslice.controller.orchestrator.group import LockGroup
    from timeslice.controller.orchestrator.group_model import SwitchRecord

    async def switcher(spec, evict, incoming, restore):
        return SwitchRecord(None, incoming)

    g = LockGroup(GroupSpec(id="g"), switcher)
    holder = await g.acquire("h", 0, "h-1", None)
    a = asyncio.ensure_future(g.acquire("a", 0, "same", None))
    b = asyncio.ensure_future(g.acquire("b", 0, "same", None))
    await asyncio.sleep(0)
    assert len(g.queue) == 2
    g.release("h", holder.lease_id, holder.epoch)
    grant_a = await a
    assert not b.done() and g.holder is not None and g.holder.job_id == "a"
    g.release("a", grant_a.lease_id, grant_a.epoch)
    grant_b = await b
    assert grant_b.epoch == grant_a.epoch + 1 and grant_b.lease_id != grant_a.lease_id
    await g.close()
