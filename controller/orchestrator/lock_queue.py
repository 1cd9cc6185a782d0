"""LockQueue: the waiters of one group, in grant order.

Owned by `LockGroup`. Higher priority first; FIFO among equal priorities (by arrival
sequence). Pure data structure: no I/O, no clock. Sized for a few dozen waiters per
group: insertion is O(n) with `bisect`.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Waiter:
    """One queued Acquire. `callers` counts RPCs awaiting it (a retry joins the first)."""

    request_id: str
    job_id: str
    priority: int
    seq: int
    enqueued_at: float
    future: asyncio.Future[Any] = field(repr=False)
    callers: int = 1
    owner: Any = field(default=None, repr=False)  # the LockGroup whose queue holds it (it moves on a re-formation)
    timeout: float | None = None  # seconds its first caller waits (None: no limit)

    @property
    def key(self) -> tuple[int, int]:
        return (-self.priority, self.seq)


class LockQueue:
    def __init__(self) -> None:
        self._waiters: list[Waiter] = []
        self._keys: list[tuple[int, int]] = []
        self._by_request: dict[tuple[str, str], Waiter] = {}  # (job, request id): ids are the job's own
        self._seq = itertools.count()

    def push(self, request_id: str, job_id: str, priority: int, now: float,
             future: asyncio.Future[Any], timeout: float | None = None) -> Waiter:
        w = Waiter(request_id, job_id, priority, next(self._seq), now, future, timeout=timeout)
        i = bisect.bisect(self._keys, w.key)
        self._keys.insert(i, w.key)
        self._waiters.insert(i, w)
        self._by_request[(job_id, request_id)] = w
        return w

    def adopt(self, w: Waiter) -> None:
        """Queue a waiter taken from another group's queue: behind the waiters of its priority
        already here (callers adopt several in their old order)."""
        w.seq = next(self._seq)
        i = bisect.bisect(self._keys, w.key)
        self._keys.insert(i, w.key)
        self._waiters.insert(i, w)
        self._by_request[(w.job_id, w.request_id)] = w

    def remove(self, w: Waiter) -> bool:
        """Take `w` out; False when it was not queued."""
        i = bisect.bisect_left(self._keys, w.key)
        if i < len(self._waiters) and self._waiters[i] is w:
            del self._keys[i], self._waiters[i]
            del self._by_request[(w.job_id, w.request_id)]
            return True
        return False

    def head(self) -> Waiter | None:
        return self._waiters[0] if self._waiters else None

    def pop_job(self, job_id: str) -> list[Waiter]:
        """Remove and return every waiter of `job_id` (they are granted or failed together)."""
        taken = [w for w in self._waiters if w.job_id == job_id]
        for w in taken:
            self.remove(w)
        return taken

    def by_request(self, job_id: str, request_id: str) -> Waiter | None:
        """The waiter of `job_id`'s request `request_id` (a request id means nothing across jobs:
        another job's equal id must not join, and so receive, this job's grant)."""
        return self._by_request.get((job_id, request_id))

    def __len__(self) -> int:
        return len(self._waiters)

    def __iter__(self) -> Iterator[Waiter]:
        return iter(list(self._waiters))
