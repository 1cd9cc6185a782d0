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
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from timeslice.errors import LeaseLost

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("timeslice.client")


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
        if self._async_client:
            await self._acquire()
            return self
        # The synchronous client's acquire runs in a worker thread, which cancelling the caller
        # (`asyncio.wait_for` around a step) does not stop: a grant it gets after its caller
        # went away is released at once, never left held by nobody (a new user's steps under
        # wait_for held the group for good once one timed out while waiting).
        acquiring = asyncio.ensure_future(asyncio.to_thread(self._acquire))
        try:
            await asyncio.shield(acquiring)
        except asyncio.CancelledError:
            acquiring.add_done_callback(self._release_unused)
            raise
        return self

    def _release_unused(self, acquiring: asyncio.Future[Any]) -> None:
        """On the loop: a grant nobody waits for any more is released, in a worker thread."""
        if acquiring.cancelled() or acquiring.exception() is not None:
            return

        def release() -> None:
            try:
                self._release()
            except Exception as err:  # (nobody is left to raise it to)
                log.warning("release of a grant whose caller was cancelled failed: %s", err)
        asyncio.get_running_loop().run_in_executor(None, release)

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
    """`fn` run inside `scope`: `async with scope` for an `async def`, else `with scope`.
    Raises TypeError for a generator function (plain or async): calling one returns at once,
    before its body runs, so the scope would end before the body computes; enter the scope
    inside it instead (`with client.on_accelerators(): ...`)."""
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(f"{fn.__qualname__} is a generator function: its body runs after the call returns, outside "
                        "the hold; use `with client.on_accelerators():` (or `async with`) inside it")
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


