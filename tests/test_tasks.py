"""cancel_and_wait: a background task is stopped even when a cancel is lost."""

from __future__ import annotations

import asyncio

from timeslice.driver.tasks import cancel_and_wait


async def test_a_task_that_loses_a_cancel_is_cancelled_again_until_it_ends() -> None:
    """Issue 12, item 6: on Python 3.11 `asyncio.wait_for` can swallow a cancel that arrives
    as its call fails; the publisher's retry loop then went on and `stop()` waited forever.
    Modelled here by a loop that swallows the first cancel, as that one does."""
    swallowed = asyncio.Event()

    async def retry_loop() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed.is_set():
                    raise
                swallowed.set()  # lost: the loop goes on

    task = asyncio.create_task(retry_loop())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task), 10)
    assert swallowed.is_set() and task.cancelled()


async def test_a_finished_task_or_none_returns_at_once() -> None:
    async def fails() -> None:
        raise RuntimeError("its outcome is retrieved, not raised")

    task = asyncio.create_task(fails())
    await asyncio.wait({task})
    await cancel_and_wait(task)
    await cancel_and_wait(None)
