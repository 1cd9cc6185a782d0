"""`TimeSliceOrchestratorClient`: the synchronous client a job uses to mark GPU phases.

Owned by the client package; used inside workload containers. Blocking calls on a
`grpc` channel; while a group is held a daemon thread sends lease keep-alives.
Thread-safe: several threads may acquire different groups through one client.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from timeslice import _rpc
from timeslice.errors import AcquireTimeout, LeaseLost, NotHolding, TimeSliceError
from timeslice.memory_commands import MemoryCommandLoop, StateStore
from timeslice.scope import AcceleratorScope
from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

log = logging.getLogger("timeslice.client")


@dataclass
class _Hold:
    grant: _rpc.Grant
    depth: int = 1
    stop: threading.Event = field(default_factory=threading.Event)
    lost: threading.Event = field(default_factory=threading.Event)


class TimeSliceOrchestratorClient:
    """Acquire and release GPU groups on the timeslice orchestrator.

    Args:
        target: orchestrator address (`host:port`, `unix:///path`); default
            `$TIMESLICE_ORCHESTRATOR`.
        job_id: this workload's job id; default `$TIMESLICE_JOB`; in a cluster pod with its
            token mounted, none: the orchestrator takes the job from the pod; with a
            `unix:` target (`timeslice serve`), none: the job of this process's process group.
        group_id: default group for calls that name none; default `$TIMESLICE_GROUP`.
        priority: queue priority, higher first, FIFO among equals.
        unavailable_timeout: seconds to keep retrying (same request id) while the
            orchestrator answers UNAVAILABLE, or does not answer a release or keep-alive within
            `call_timeout`, before raising `OrchestratorUnavailable`.
        call_timeout: seconds one try of a call the orchestrator answers at once (release, the
            keep-alive that confirms a grant) may take; one not answered in time is asked again
            (see `unavailable_timeout`), never raised as a timeout of the job's own.
        memory: the most GPU memory this job holds while it computes, per GPU, in bytes or
            as a quantity ("57Gi", "60G"); default `$TIMESLICE_MEMORY`; sent with every
            acquire (`acquire(memory=)` overrides it once). The orchestrator reserves
            max(this, what it saw the job use) beside other jobs; a job that declares
            nothing runs alone until its memory stopped growing.
        credentials: TLS channel credentials; plaintext when None.
        retry_failed_switches: an acquire whose switch failed (`SwitchFailed`: rolled back,
            e.g. no room yet, a checkpoint step that failed) asks again until its timeout,
            pausing 0.25 s doubling to 5 s, the reason logged once per acquire (default), so a
            failed switch costs a wait, never the job; False raises `SwitchFailed` at once.
            `JobFailed` is never retried.

    Raises ValueError when the target or job id is set nowhere, or the memory is malformed.
    """

    def __init__(self, target: str | None = None, job_id: str | None = None,
                 group_id: str | None = None, *, priority: int = 0,
                 unavailable_timeout: float = 30.0, memory: str | int | None = None,
                 credentials: grpc.ChannelCredentials | None = None, retry_failed_switches: bool = True,
                 call_timeout: float = _rpc.CALL_TIMEOUT) -> None:
        self._s = _rpc.settings(target, job_id, group_id, priority, unavailable_timeout, memory,
                                retry_failed_switches, call_timeout)
        self._channel = (grpc.secure_channel(self._s.target, credentials, _rpc.CHANNEL_OPTIONS) if credentials
                         else grpc.insecure_channel(self._s.target, _rpc.CHANNEL_OPTIONS))
        self._stub = pb_grpc.OrchestratorStub(self._channel)
        self._holds: dict[str, _Hold] = {}
        self._held: set[str] = set()  # every group this client was granted: left at close()
        self._closed = False
        self._lock = threading.Lock()
        self._acquiring: dict[str, threading.Lock] = {}  # per group: one Acquire of this client at a time
        self._pid = os.getpid()
        self._memory_loops: list[MemoryCommandLoop] = []

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

    def acquire(self, group_id: str | None = None, *, timeout: float | None = None,
                priority: int | None = None, memory: str | int | None = None) -> _rpc.Grant:
        """Block until this job holds the group and its state is on the GPUs.

        `timeout` is in seconds (None or `math.inf` waits without bound), failed switches
        included (they are asked again, see `retry_failed_switches`). A grant is confirmed with a keep-alive
        before it is used where it may have lapsed unseen: on a group whose state this process
        serves (`serve_memory_commands`), and wherever its answer waited unread for over a
        quarter of its lease (the process was stopped or starved while it waited: `_rpc.AcquireTries`);
        a grant whose lease lapsed before this process saw it is asked again, never used.
        Nested acquires of a held group return the same grant and need as many releases; so
        do acquires of one group by several threads of this client at once: the later ones
        wait (within their own timeout) for the first one's grant and share its hold.
        Raises AcquireTimeout (naming the last failed switch, if any), JobFailed (the job's
        state is lost: restart it), GroupNotFound, InvalidRequest, AccessDenied,
        OrchestratorUnavailable; SwitchFailed only with `retry_failed_switches=False`;
        TimeSliceError in a forked child of the process that made the client (`_check_process`).
        """
        self._check_process()
        group = _rpc.group_of(self._s, group_id)
        deadline = _rpc.deadline_of(timeout)
        with self._lock:
            gate = self._acquiring.setdefault(group, threading.Lock())
        if not gate.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            raise AcquireTimeout(f"acquire {group}: no grant within {timeout:g} s (another thread of this client "
                                 "was acquiring it all along)")
        try:
            return self._acquire(group, priority, memory, deadline)
        finally:
            gate.release()

    def _acquire(self, group: str, priority: int | None, memory: str | int | None,
                 deadline: float | None) -> _rpc.Grant:
        with self._lock:
            hold = self._holds.get(group)
            if hold is not None and not hold.lost.is_set():
                hold.depth += 1
                return hold.grant
        while True:
            tries = _rpc.AcquireTries(self._stub, self._s, group, priority, memory)
            pending: _Hold | None = None
            try:
                resp = self._retrying(f"acquire {group}", deadline, tries.send,
                                      retry_switches=self._s.retry_failed_switches)
                grant, late = tries.grant(resp)
                pending = _Hold(grant)
                if self._state_back(pending, late):
                    return pending.grant
            except BaseException as err:  # gave up (timeout, lost reply, interrupt): leave no grant behind
                if pending is not None:
                    self._unhold(pending)
                if _rpc.may_be_granted(err):
                    self._cancel(group, tries.request_id)
                raise
            self._unhold(pending)
            _rpc.warn_lapsed_unseen(pending.grant)

    def _hold(self, hold: _Hold) -> None:
        """Record `hold` (from now on the group's memory commands find this job inside its
        phase) and start its keep-alives; once per hold."""
        group = hold.grant.group_id
        with self._lock:
            old = self._holds.get(group)
            if old is hold:
                return
            if old is not None:  # (a lost one, superseded: its keep-alives, which say it lives, stop)
                old.stop.set()
            self._holds[group] = hold
            self._held.add(group)
        threading.Thread(target=self._keep_alive, args=(hold,), daemon=True,
                         name=f"timeslice-keepalive-{group}").start()

    def _unhold(self, hold: _Hold) -> None:
        """Forget `hold` (a grant not used) and stop its keep-alives."""
        hold.stop.set()
        with self._lock:
            if self._holds.get(hold.grant.group_id) is hold:
                del self._holds[hold.grant.group_id]

    def _state_back(self, hold: _Hold, late: bool) -> bool:
        """Record `hold` once its grant may be used. For a group whose state this process
        serves (`serve_memory_commands`), that is once a keep-alive confirmed the grant's
        lease, under the command loops' lock (no checkpoint runs in between, and none after:
        the hold is recorded before the lock is let go); then the state is brought back if
        it is still out (the orchestrator restores before it grants, so normally nothing is
        restored here; a restore command it gave up on may have finished since). False when
        the lease had lapsed before this process saw its grant (issue 22, case 4: the
        orchestrator may have moved this job out and granted another since): nothing is
        restored. Other groups' grants are used at once, unless seen `late`: then once a
        keep-alive confirmed them (a job that had not computed under a lapsed grant may have
        had nothing for its node agent to stop: no CUDA context, backend `none`). Raises
        CheckpointLost, OrchestratorUnavailable."""
        grant = hold.grant
        loops = [loop for loop in self._memory_loops if loop.group == grant.group_id]
        if not loops:
            if late and not self._confirmed(grant):
                return False
            self._hold(hold)
            return True
        checked: list[bool] = []

        def lease_live() -> bool:  # one keep-alive per grant, whichever loop asks first
            if not checked:
                checked.append(self._confirmed(grant))
            if checked[0]:
                self._hold(hold)
            return checked[0]

        for loop in loops:
            restored = loop.restore_for_grant(lease_live)
            if restored is None:
                return False
            if restored:
                log.warning("state of group %s restored by the client at its grant (a command had timed out)",
                            grant.group_id)
        return True

    def _confirmed(self, grant: _rpc.Grant) -> bool:
        """Whether a confirming keep-alive finds `grant`'s lease the holder's (False: refused,
        LeaseLost). It has its own window (`unavailable_timeout`), not the acquire's: the grant
        exists already. Raises OrchestratorUnavailable."""
        request = _rpc.keep_alive_request(self._s, grant, confirm=True)
        try:
            self._retrying(f"keep-alive {grant.group_id}", None,
                           lambda timeout: self._stub.KeepAlive(request, timeout=timeout,
                                                                metadata=_rpc.call_metadata()),
                           call_timeout=self._s.call_timeout)
            return True
        except LeaseLost:
            return False

    def _check_process(self) -> None:
        """Raise TimeSliceError in a process forked from the one that made this client: it
        inherited the parent's holds (its acquires would return at once, its releases end the
        parent's hold) and a gRPC channel that does not survive fork()."""
        if os.getpid() != self._pid:
            raise TimeSliceError(f"this timeslice client was made in process {self._pid}; process {os.getpid()} "
                                 "is a fork of it and may not use it (its holds are the parent's, its gRPC channel "
                                 "does not survive fork): make a client in the child, or start it with the 'spawn' "
                                 "method")

    def _cancel(self, group: str, request_id: str) -> None:
        """Best effort: the server may have granted the request just as this client gave up."""
        try:
            self._stub.CancelAcquire(_rpc.cancel_request(self._s, group, request_id), timeout=_rpc.CANCEL_TIMEOUT,
                                     metadata=_rpc.call_metadata())
        except grpc.RpcError as err:  # unreachable: its lease lapses on its own
            log.info("cancel of acquire %s failed: %s", group, err)

    def release(self, group_id: str | None = None) -> int:
        """End the hold; returns the number of jobs that were waiting (0: nothing moved).

        A Release whose answer does not come within `call_timeout` (the orchestrator paused
        or overloaded) is asked again, like one refused UNAVAILABLE, for `unavailable_timeout`
        seconds (so it returns or raises within their sum, 40 s by default); a repeated Release
        that finds the hold already ended by an earlier try counts as done.
        Raises NotHolding without a hold, LeaseLost when the hold had already ended
        (lease lapsed or epoch taken over), OrchestratorUnavailable (unreachable, or no
        answer); TimeSliceError in a forked child (`_check_process`).
        """
        self._check_process()
        group = _rpc.group_of(self._s, group_id)
        with self._lock:
            hold = self._holds.get(group)
            if hold is None:
                raise NotHolding(f"release {group}: this client holds no lease on it")
            hold.depth -= 1
            if hold.depth > 0:
                return 0
            del self._holds[group]
        hold.stop.set()
        for loop in self._memory_loops:  # its state as this phase left it, for the orchestrator's next plan
            if loop.group == group:
                loop.measure()
        request = _rpc.release_request(self._s, hold.grant)
        resp = self._retrying(f"release {group}", None,
                              lambda timeout: self._stub.Release(request, timeout=timeout,
                                                                 metadata=_rpc.call_metadata()),
                              retried_ok=True, call_timeout=self._s.call_timeout)
        return int(resp.waiters) if resp is not None else 0

    def _retrying(self, what: str, deadline: float | None, call: Callable[[float | None], Any],
                  retried_ok: bool = False, retry_switches: bool = False, call_timeout: float | None = None) -> Any:
        """Run `call(seconds_this_try_may_take)` under `_rpc.Retry`; None when a retried call had
        already succeeded."""
        retry = _rpc.Retry(what, deadline, self._s.unavailable_timeout, retried_ok, retry_switches, call_timeout)
        while True:
            remaining = retry.remaining()
            try:
                result = call(remaining)
            except grpc.RpcError as err:
                pause = retry.pause_after(err, remaining)
                if pause is None:
                    return None
                time.sleep(pause)
            else:
                retry.succeeded()
                return result

    def holding(self, group_id: str | None = None) -> _rpc.Grant | None:
        """The current grant on the group, or None (also after a lost lease)."""
        with self._lock:
            hold = self._holds.get(_rpc.group_of(self._s, group_id))
        return None if hold is None or hold.lost.is_set() else hold.grant

    def on_accelerators(self, group_id: str | None = None, *, timeout: float | None = None,
                        priority: int | None = None, memory: str | int | None = None) -> AcceleratorScope:
        """Decorator and context manager: hold `group_id` around a call or a block.

        Works on plain and `async def` functions, with `with` and `async with`.
        `group_id` names the claim set (the pod-level claim name); it may be
        omitted when `$TIMESLICE_GROUP` or the client's default names it, or in a cluster
        pod with a single claim of this driver (the orchestrator takes it from the pod's token).
        """
        group = _rpc.group_of(self._s, group_id)
        return AcceleratorScope(
            acquire=lambda: self.acquire(group, timeout=timeout, priority=priority, memory=memory),
            release=lambda: self.release(group),
            lost=lambda: self._is_lost(group), is_async_client=False)

    def _is_lost(self, group: str) -> bool:
        with self._lock:
            hold = self._holds.get(group)
        return hold is not None and hold.lost.is_set()

    def _keep_alive(self, hold: _Hold) -> None:
        """Renew `hold`'s lease until it ends; once lost, say that the client lives until it is
        released (`_rpc.keep_alive_failed`)."""
        interval = _rpc.keepalive_interval(hold.grant)
        request = _rpc.keep_alive_request(self._s, hold.grant)
        while not hold.stop.wait(interval):
            try:
                self._stub.KeepAlive(request, timeout=interval, metadata=_rpc.call_metadata())
            except grpc.RpcError as err:
                lost, stop = _rpc.keep_alive_failed(err, hold.grant, hold.lost.is_set())
                if lost and not hold.lost.is_set():
                    hold.lost.set()
                    request = _rpc.keep_alive_request(self._s, hold.grant, lost=True)
                if stop:
                    return

    def serve_memory_commands(self, store: StateStore, group_id: str | None = None) -> MemoryCommandLoop:
        """Let the orchestrator move `store` off the GPU while this job does not hold
        `group_id` (the `cooperative` backend): a daemon thread keeps a command stream open
        until `close()`. Usually called through `timeslice.torch.register`."""
        group = _rpc.group_of(self._s, group_id)
        loop = MemoryCommandLoop(self._stub, self._s, group, store, in_hold=lambda: group in self._holds)
        self._memory_loops.append(loop)
        return loop

    def close(self) -> None:
        """Release every hold (best effort), stop the memory-command threads, tell the
        orchestrator this process is done with each group it held (`Leave`: a job whose
        state was moved off the GPUs after its last release is brought back, so that its
        processes can end), close the channel. A second call does nothing; so does a call in a
        forked child (the holds and the job's groups are the parent's)."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        for loop in self._memory_loops:
            loop.close()
        for group in list(self._holds):
            try:
                while group in self._holds:
                    self.release(group)
            except Exception as err:  # closing must not fail on a lost lease
                log.info("release on close failed group=%s: %s", group, err)
        for group in sorted(self._held):
            try:
                self._stub.Leave(_rpc.leave_request(self._s, group), timeout=_rpc.CANCEL_TIMEOUT,
                                 metadata=_rpc.call_metadata())
            except grpc.RpcError as err:  # best effort: an orchestrator away restores orphans by itself
                log.info("leave on close failed group=%s: %s", group, _rpc.code_of(err))
        self._channel.close()

    def __enter__(self) -> TimeSliceOrchestratorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
