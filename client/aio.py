"""`AsyncTimeSliceOrchestratorClient`: the asyncio twin of `TimeSliceOrchestratorClient`.

Owned by the client package; for workloads that run an event loop. Calls go over a
`grpc.aio` channel; while a group is held an asyncio task sends lease keep-alives.
Settings, requests and error translation are shared with the sync client (`_rpc`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from timeslice import _rpc
from timeslice.errors import AcquireTimeout, LeaseLost, NotHolding
from timeslice.scope import AcceleratorScope
from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

log = logging.getLogger("timeslice.client")


@dataclass
class _Hold:
    grant: _rpc.Grant
    keepalive: asyncio.Task[None] | None = None
    depth: int = 1
    lost: bool = False


class AsyncTimeSliceOrchestratorClient:
    """Asyncio client; same arguments, defaults and errors as `TimeSliceOrchestratorClient`.

    Create it inside a running event loop; `await client.close()` when done (or use
    `async with`).
    """

    def __init__(self, target: str | None = None, job_id: str | None = None,
                 group_id: str | None = None, *, priority: int = 0,
                 unavailable_timeout: float = 30.0, memory: str | int | None = None,
                 credentials: grpc.ChannelCredentials | None = None, retry_failed_switches: bool = True,
                 call_timeout: float = _rpc.CALL_TIMEOUT) -> None:
        self._s = _rpc.settings(target, job_id, group_id, priority, unavailable_timeout, memory,
                                retry_failed_switches, call_timeout)
        self._channel = (grpc.aio.secure_channel(self._s.target, credentials, _rpc.CHANNEL_OPTIONS) if credentials
                         else grpc.aio.insecure_channel(self._s.target, _rpc.CHANNEL_OPTIONS))
        self._stub = pb_grpc.OrchestratorStub(self._channel)
        self._holds: dict[str, _Hold] = {}
        self._held: set[str] = set()  # every group this client was granted: left at close()
        self._closed = False
        self._cancels: set[asyncio.Future[None]] = set()
        self._acquiring: dict[str, asyncio.Lock] = {}  # per group: one Acquire of this client at a time

    @property
    def job_id(self) -> str:
        return self._s.job_id

    @property
    def memory(self) -> int:
        """Bytes per GPU this job declares with every acquire (0: none; then the orchestrator
        runs it alone until it has seen its memory stop growing)."""
        return self._s.memory

    @memory.setter
    def memory(self, value: str | int) -> None:
        self._s = dataclasses.replace(self._s, memory=_rpc.memory_bytes(value))

    async def acquire(self, group_id: str | None = None, *, timeout: float | None = None,
                      priority: int | None = None, memory: str | int | None = None) -> _rpc.Grant:
        """See `TimeSliceOrchestratorClient.acquire` (tasks that acquire one group at once share
        one hold, as threads of the sync client do)."""
        group = _rpc.group_of(self._s, group_id)
        deadline = _rpc.deadline_of(timeout)
        gate = self._acquiring.setdefault(group, asyncio.Lock())
        try:
            await asyncio.wait_for(gate.acquire(), None if deadline is None else max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise AcquireTimeout(f"acquire {group}: no grant within {timeout:g} s (another task of this client "
                                 "was acquiring it all along)") from None
        try:
            return await self._acquire(group, priority, memory, deadline)
        finally:
            gate.release()

    async def _acquire(self, group: str, priority: int | None, memory: str | int | None,
                       deadline: float | None) -> _rpc.Grant:
        hold = self._holds.get(group)
        if hold is not None and not hold.lost:
            hold.depth += 1
            return hold.grant
        while True:
            grant, late = await self._grant(group, priority, memory, deadline)
            if not late or await self._confirmed(grant):
                break
            _rpc.warn_lapsed_unseen(grant)
        old = self._holds.get(group)
        if old is not None and old.keepalive is not None:  # (a lost one, superseded: see the sync client's `_hold`)
            old.keepalive.cancel()
        hold = _Hold(grant)
        hold.keepalive = asyncio.create_task(self._keep_alive(hold), name=f"timeslice-keepalive-{group}")
        self._holds[group] = hold
        self._held.add(group)
        return hold.grant

    async def _grant(self, group: str, priority: int | None, memory: str | int | None,
                     deadline: float | None) -> tuple[_rpc.Grant, bool]:
        """(the grant, whether this process saw it late: `_rpc.AcquireTries.grant`)."""
        tries = _rpc.AcquireTries(self._stub, self._s, group, priority, memory)
        try:
            resp = await self._retrying(f"acquire {group}", deadline, tries.send,
                                        retry_switches=self._s.retry_failed_switches)
        except BaseException as err:  # gave up (timeout, lost reply, cancelled): leave no grant behind
            if not _rpc.may_be_granted(err):
                raise
            task = asyncio.ensure_future(self._cancel(group, tries.request_id))  # runs on even if we are cancelled
            self._cancels.add(task)
            task.add_done_callback(self._cancels.discard)
            raise
        return tries.grant(resp)

    async def _confirmed(self, grant: _rpc.Grant) -> bool:
        """See `TimeSliceOrchestratorClient._confirmed`."""
        request = _rpc.keep_alive_request(self._s, grant, confirm=True)
        try:
            await self._retrying(f"keep-alive {grant.group_id}", None,
                                 lambda timeout: self._stub.KeepAlive(request, timeout=timeout,
                                                                      metadata=_rpc.call_metadata()),
                                 call_timeout=self._s.call_timeout)
            return True
        except LeaseLost:
            return False

    async def _cancel(self, group: str, request_id: str) -> None:
        try:
            await self._stub.CancelAcquire(_rpc.cancel_request(self._s, group, request_id),
                                           timeout=_rpc.CANCEL_TIMEOUT, metadata=_rpc.call_metadata())
        except grpc.RpcError as err:  # unreachable: its lease lapses on its own
            log.info("cancel of acquire %s failed: %s", group, err)

    async def release(self, group_id: str | None = None) -> int:
        """See `TimeSliceOrchestratorClient.release`."""
        group = _rpc.group_of(self._s, group_id)
        hold = self._holds.get(group)
        if hold is None:
            raise NotHolding(f"release {group}: this client holds no lease on it")
        hold.depth -= 1
        if hold.depth > 0:
            return 0
        del self._holds[group]
        if hold.keepalive is not None:
            hold.keepalive.cancel()
        request = _rpc.release_request(self._s, hold.grant)
        resp = await self._retrying(f"release {group}", None,
                                    lambda timeout: self._stub.Release(request, timeout=timeout,
                                                                       metadata=_rpc.call_metadata()),
                                    retried_ok=True, call_timeout=self._s.call_timeout)
        return int(resp.waiters) if resp is not None else 0

    def holding(self, group_id: str | None = None) -> _rpc.Grant | None:
        hold = self._holds.get(_rpc.group_of(self._s, group_id))
        return None if hold is None or hold.lost else hold.grant

    def on_accelerators(self, group_id: str | None = None, *, timeout: float | None = None,
                        priority: int | None = None, memory: str | int | None = None) -> AcceleratorScope:
        """`async with` / decorator for `async def` functions; see the sync client."""
        group = _rpc.group_of(self._s, group_id)

        def lost() -> bool:
            hold = self._holds.get(group)
            return hold is not None and hold.lost

        return AcceleratorScope(
            acquire=lambda: self.acquire(group, timeout=timeout, priority=priority, memory=memory),
            release=lambda: self.release(group), lost=lost, is_async_client=True)

    async def _retrying(self, what: str, deadline: float | None,
                        call: Callable[[float | None], Awaitable[Any]], retried_ok: bool = False,
                        retry_switches: bool = False, call_timeout: float | None = None) -> Any:
        retry = _rpc.Retry(what, deadline, self._s.unavailable_timeout, retried_ok, retry_switches, call_timeout)
        while True:
            remaining = retry.remaining()
            try:
                result = await call(remaining)
            except grpc.RpcError as err:
                pause = retry.pause_after(err, remaining)
                if pause is None:
                    return None
                await asyncio.sleep(pause)
            else:
                retry.succeeded()
                return result

    async def _keep_alive(self, hold: _Hold) -> None:
        """See `TimeSliceOrchestratorClient._keep_alive`."""
        interval = _rpc.keepalive_interval(hold.grant)
        request = _rpc.keep_alive_request(self._s, hold.grant)
        while True:
            await asyncio.sleep(interval)
            try:
                await self._stub.KeepAlive(request, timeout=interval, metadata=_rpc.call_metadata())
            except grpc.RpcError as err:
                lost, stop = _rpc.keep_alive_failed(err, hold.grant, hold.lost)
                if lost and not hold.lost:
                    hold.lost = True
                    request = _rpc.keep_alive_request(self._s, hold.grant, lost=True)
                if stop:
                    return

    async def close(self) -> None:
        """Release every hold (best effort), leave every group it held, close the channel.
        A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        for group in list(self._holds):
            try:
                while group in self._holds:
                    await self.release(group)
            except Exception as err:
                log.info("release on close failed group=%s: %s", group, err)
        if self._cancels:  # let pending cancels reach the server before the channel goes
            await asyncio.wait(self._cancels, timeout=_rpc.CANCEL_TIMEOUT)
        for group in sorted(self._held):  # see TimeSliceOrchestratorClient.close
            try:
                await self._stub.Leave(_rpc.leave_request(self._s, group), timeout=_rpc.CANCEL_TIMEOUT,
                                       metadata=_rpc.call_metadata())
            except grpc.RpcError as err:
                log.info("leave on close failed group=%s: %s", group, _rpc.code_of(err))
        await self._channel.close()

    async def __aenter__(self) -> AsyncTimeSliceOrchestratorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
