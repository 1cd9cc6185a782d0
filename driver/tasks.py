"""`cancel_and_wait`: stop a background task for sure.

Owned by the driver package; used by the stop() of the kubelet plugin's publishers and the
controller's claim-status writer.
"""

from __future__ import annotations

import asyncio
from typing import Any

# Between cancels of a task that has not ended yet, seconds.
RESEND_SECONDS = 0.1


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` and wait until it has ended. A cancel can be lost: on Python 3.11
    `asyncio.wait_for` swallows one that arrives just as the call it waits on fails (CPython
    gh-86296, fixed in 3.12), and a retry loop then goes on for good; so the cancel is sent
    again every `RESEND_SECONDS` until the task ends. Its outcome is retrieved and dropped."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RESEND_SECONDS)
    if not task.cancelled():
        task.exception()
