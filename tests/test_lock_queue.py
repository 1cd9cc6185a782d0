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
    assert q.by_request("r2") is ws[2]
    assert q.remove(ws[2]) and not q.remove(ws[2])
    assert q.by_request("r2") is None
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
