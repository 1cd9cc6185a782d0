"""`on_accelerators(...)`: one object that is a decorator and a context manager.

Owned by the client package; returned by `TimeSliceOrchestratorClient.on_accelerators`
and `AsyncTimeSliceOrchestratorClient.on_accelerators`. Entering acquires the group,
leaving releases it (also when the body raises). A lease lost while inside raises
`LeaseLost` on exit, unless the body already raised.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from timeslice.errors import LeaseLost

F = TypeVar("F", bound=Callable[..., Any])


class AcceleratorScope:
    """Hold `group_id` for the duration of a block or a call.

    `acquire`/`release`/`lost` are the owning client's bound operations; when the
    client is synchronous, `async with` and `async def` functions run them in a
    worker thread so the event loop keeps running while the acquire waits.
    """

    def __init__(self, *, acquire: Callable[[], Any], release: Callable[[], Any],
                 lost: Callable[[], bool], is_async_client: bool) -> None:
        self._acquire = acquire
        self._release = release
        self._lost = lost
        self._async_client = is_async_client

    # -- synchronous ---------------------------------------------------------
    def __enter__(self) -> AcceleratorScope:
        if self._async_client:
            raise TypeError("an AsyncTimeSliceOrchestratorClient scope needs `async with`")
        self._acquire()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        lost = self._lost()
        self._release_quietly(exc is not None)
        if lost and exc is None:
            raise LeaseLost("lease lost while inside on_accelerators(); work may have overlapped")

    def _release_quietly(self, body_failed: bool) -> None:
        try:
            self._release()
        except LeaseLost:
            if not body_failed:
                raise

    # -- asyncio -------------------------------------------------------------
    async def _call(self, fn: Callable[[], Any]) -> Any:
        if self._async_client:
            return await fn()
        return await asyncio.to_thread(fn)

    async def __aenter__(self) -> AcceleratorScope:
        await self._call(self._acquire)
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        lost = self._lost()
        try:
            await self._call(self._release)
        except LeaseLost:
            if exc is None:
                raise
        if lost and exc is None:
            raise LeaseLost("lease lost while inside on_accelerators(); work may have overlapped")

    # -- decorator -----------------------------------------------------------
    def __call__(self, fn: F) -> F:
        if self._async_client and not inspect.iscoroutinefunction(fn):
            raise TypeError(f"{fn.__qualname__} is not `async def`; use TimeSliceOrchestratorClient")
        return decorate(self, fn)


def decorate(scope: Any, fn: F) -> F:
    """`fn` run inside `scope`: `async with scope` for an `async def`, else `with scope`."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            async with scope:
                return await fn(*args, **kwargs)
        return run_async  # type: ignore[return-value]

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with scope:
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]


