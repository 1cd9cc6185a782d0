"""What the sync and asyncio clients share: settings, requests, error translation.

Owned by the client package; called by `timeslice.client` and `timeslice.aio`.
Imports only `grpc`, `protobuf` and the generated `timeslice.v1` stubs.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import grpc
from timeslice.errors import (
    AccessDenied,
    AcquireTimeout,
    GroupNotFound,
    InvalidRequest,
    JobFailed,
    LeaseLost,
    OrchestratorUnavailable,
    SwitchFailed,
    TimeSliceError,
)
from timeslice.quantity import bare_number, parse_bytes
from timeslice.v1 import orchestrator_pb2 as pb

log = logging.getLogger("timeslice.client")

ENV_TARGET = "TIMESLICE_ORCHESTRATOR"
ENV_JOB = "TIMESLICE_JOB"
ENV_GROUP = "TIMESLICE_GROUP"
ENV_TOKEN_FILE = "TIMESLICE_TOKEN_FILE"
ENV_MEMORY = "TIMESLICE_MEMORY"
# Where the example manifests mount the projected ServiceAccount token (audience timeslice.dev).
DEFAULT_TOKEN_FILE = "/var/run/secrets/timeslice.dev/token"

# Channel options: reconnect quickly after an orchestrator restart (gRPC's default
# backoff grows to 120 s), and ping a connection that carries a long-blocked Acquire
# so a vanished orchestrator is noticed (the server permits these pings:
# timeslice.driver.grpc_server.SERVER_OPTIONS).
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 20000),
    ("grpc.keepalive_timeout_ms", 10000),
]

# Codes retried with the same request id: UNAVAILABLE, and CANCELLED, which only the server
# side sends these blocking calls (a stopping leader's in-flight Acquire, a dropped stream):
# a caller's own cancel surfaces as an exception of its own, not as this status.
RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
# Bound on one try of a call the orchestrator answers at once (Release, the KeepAlive that
# confirms a grant), seconds (`Settings.call_timeout`). Such a call whose answer did not come in
# time (DEADLINE_EXCEEDED: the orchestrator paused, e.g. `timeslice serve` stopped with Ctrl-Z,
# or starved) is asked again like an UNAVAILABLE one (`Retry`), never raised as the caller's
# own timeout: a release or keep-alive has none.
CALL_TIMEOUT = 10.0
# Retry pacing on UNAVAILABLE: exponential from BACKOFF_FIRST to BACKOFF_MAX seconds.
BACKOFF_FIRST = 0.05
BACKOFF_MAX = 2.0
# An Acquire answered SwitchFailed (ABORTED) is asked again (`Settings.retry_failed_switches`)
# after a pause growing from SWITCH_BACKOFF_FIRST to SWITCH_BACKOFF_MAX seconds: each try may
# run a switch (checkpoint others, restore this job), so not faster than that.
SWITCH_BACKOFF_FIRST = 0.25
SWITCH_BACKOFF_MAX = 5.0
# Trailing metadata that tells apart errors of one status code (orchestrator.proto's
# `ErrorReason`, by name), and the class each reason raises.
REASON_METADATA = "timeslice-error-reason"
REASONS: dict[str, type[TimeSliceError]] = {pb.ErrorReason.Name(pb.JOB_FAILED): JobFailed}


@dataclass(frozen=True)
class Grant:
    """A held lock: returned by `acquire()`.

    `lease_id` and `epoch` (the fencing token, growing by one per grant of the group)
    identify the hold; `lease_seconds` is how long it survives without keep-alive;
    `waited_seconds` the time spent queued (switch included); `restored` whether the
    job's GPU state had to be restored, taking `switch_seconds`. `request_id`: this
    caller's Acquire (its release ends only its part of a hold shared by several callers
    of the job, e.g. the pods of one unit).
    """

    group_id: str
    job_id: str
    lease_id: str
    epoch: int
    lease_seconds: float
    waited_seconds: float
    restored: bool
    switch_seconds: float
    request_id: str = ""


@dataclass(frozen=True)
class Settings:
    target: str
    job_id: str
    group_id: str | None
    priority: int
    unavailable_timeout: float
    memory: int = 0  # bytes per GPU this job declares it holds at most while it computes; 0: none
    retry_failed_switches: bool = True  # acquire() asks again after SwitchFailed (`Retry`)
    call_timeout: float = CALL_TIMEOUT  # seconds per try of a call answered at once (`CALL_TIMEOUT`)


def memory_bytes(memory: str | int | None) -> int:
    """Bytes per GPU of a `memory=` argument (a quantity such as "57Gi", or an int of bytes),
    else of $TIMESLICE_MEMORY; 0 when neither is set. Raises ValueError for a malformed value,
    and for a string that is a bare number other than 0 ("57" was 57 bytes, meant as GB)."""
    what = "memory"
    if memory is None:
        memory, what = os.environ.get(ENV_MEMORY) or 0, f"${ENV_MEMORY}"
    if isinstance(memory, str) and bare_number(memory):  # an int is bytes: the Python API's type says so
        raise ValueError(f"{what} {memory!r}: a bare number is ambiguous; give its unit (\"{memory.strip()}Gi\", "
                         f"\"{memory.strip()}G\", or \"{memory.strip()}B\" for bytes)")
    return parse_bytes(memory, what)


def settings(target: str | None, job_id: str | None, group_id: str | None, priority: int,
             unavailable_timeout: float, memory: str | int | None = None,
             retry_failed_switches: bool = True, call_timeout: float = CALL_TIMEOUT) -> Settings:
    """Fill unset arguments from TIMESLICE_ORCHESTRATOR / TIMESLICE_JOB / TIMESLICE_GROUP /
    TIMESLICE_MEMORY (`memory_bytes`).
    Without a job id, a client that has a token (`call_metadata`: in a cluster pod) sends
    none and the orchestrator takes the job from the pod the token is bound to; so does a
    client of a `unix:` target (one-box mode, `timeslice serve`: the job of the calling
    process's process group, from the socket's peer credentials).

    A target that is an absolute path is that unix socket's (`address`). Raises
    ValueError when the target is set nowhere, the job id is set nowhere and there is no
    token, the memory is malformed, or a timeout is out of range.
    """
    target = target or os.environ.get(ENV_TARGET)
    job_id = job_id or os.environ.get(ENV_JOB)
    group_id = group_id or os.environ.get(ENV_GROUP) or None
    if not target:
        raise ValueError(f"no orchestrator address: pass target= (`--target` of the timeslice commands) or set "
                         f"{ENV_TARGET}")
    target = address(target)
    if not job_id and call_metadata() is None and not target.startswith("unix:"):
        raise ValueError(f"no job id: pass job_id= (`--job` of the timeslice commands) or set {ENV_JOB} (in a "
                         f"cluster pod, mount the projected token (audience timeslice.dev) at {DEFAULT_TOKEN_FILE} "
                         f"or ${ENV_TOKEN_FILE} instead: the orchestrator then takes the job from the pod)")
    if unavailable_timeout < 0:
        raise ValueError("unavailable_timeout must be >= 0 seconds")
    if not call_timeout > 0:
        raise ValueError("call_timeout must be > 0 seconds")
    return Settings(target, job_id or "", group_id, priority, unavailable_timeout, memory_bytes(memory),
                    retry_failed_switches, call_timeout)


def address(target: str) -> str:
    """`target` as gRPC takes it: an absolute path is that unix socket's (`unix://PATH`, as
    `timeslice serve --socket` names it)."""
    return f"unix://{target}" if target.startswith("/") else target


def call_metadata() -> tuple[tuple[str, str], ...] | None:
    """`authorization: Bearer <token>` from $TIMESLICE_TOKEN_FILE or the default projected
    token path, read on every call (the kubelet rotates it); None when there is none."""
    path = os.environ.get(ENV_TOKEN_FILE) or DEFAULT_TOKEN_FILE
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError:
        return None
    return (("authorization", f"Bearer {token}"),) if token else None


def group_of(s: Settings, group_id: str | None) -> str:
    """The group a call names: `group_id`, else the client's default; "" in a cluster pod that
    sends a token (the orchestrator takes the calling pod's only claim of this driver, DESIGN.md
    "lock group"). Raises ValueError when none is named and no token is sent."""
    group = group_id or s.group_id
    if not group and call_metadata() is None:
        raise ValueError(f"no group id: name one (`--group` on the command line, `group_id=` in Python) or "
                         f"set {ENV_GROUP}")
    return group or ""


def acquire_request(s: Settings, group: str, priority: int | None, remaining: float | None,
                    request_id: str, memory: str | int | None = None) -> pb.AcquireRequest:
    return pb.AcquireRequest(job_id=s.job_id, group_id=group,
                             priority=s.priority if priority is None else priority,
                             request_id=request_id, timeout_seconds=remaining or 0.0,
                             memory_bytes=s.memory if memory is None else parse_bytes(memory))


def deadline_of(timeout: float | None) -> float | None:
    """The monotonic deadline (seconds) of an acquire `timeout` in seconds: None (no bound) for
    None or infinity (`math.inf`, `--timeout inf`: a deadline past the clock's range raised
    OverflowError); a negative one is past already. Raises ValueError for NaN."""
    if timeout is None or timeout == math.inf:
        return None
    if math.isnan(timeout):
        raise ValueError("timeout is NaN: give seconds, or None (or math.inf) for no bound")
    return time.monotonic() + timeout


def new_request_id() -> str:
    return uuid.uuid4().hex


def grant_of(s: Settings, group: str, r: pb.AcquireResponse, request_id: str) -> Grant:
    """The grant of an Acquire's response. A client of one-box mode that named no job learns
    the one it acts for (`pgid-<N>`) and puts it in its environment as $TIMESLICE_JOB, so
    that every process it starts from now on is that job's wherever it goes (a worker that
    double-forks or calls `setsid`; `timeslice serve` finds them by it)."""
    job = s.job_id or r.job_id
    if not s.job_id and r.job_id and s.target.startswith("unix:"):
        os.environ.setdefault(ENV_JOB, r.job_id)
    return Grant(group_id=group, job_id=job, lease_id=r.lease_id, epoch=r.epoch,
                 lease_seconds=r.lease_seconds, waited_seconds=r.waited_seconds,
                 restored=r.restored, switch_seconds=r.switch_seconds, request_id=request_id)


def release_request(s: Settings, g: Grant) -> pb.ReleaseRequest:
    return pb.ReleaseRequest(job_id=s.job_id, group_id=g.group_id, lease_id=g.lease_id, epoch=g.epoch,
                             request_id=g.request_id)


def leave_request(s: Settings, group: str) -> pb.LeaveRequest:
    return pb.LeaveRequest(job_id=s.job_id, group_id=group)


def keep_alive_request(s: Settings, g: Grant, confirm: bool = False, lost: bool = False) -> pb.KeepAliveRequest:
    """`confirm`: the keep-alive confirms a grant before its first use (accepted only while its
    lease is the holder's: orchestrator.proto's `KeepAliveRequest.confirm`). `lost`: the lease
    was lost and the hold not yet released; the call only says that the job's client lives
    (`KeepAliveRequest.lost`)."""
    return pb.KeepAliveRequest(job_id=s.job_id, group_id=g.group_id, lease_id=g.lease_id, epoch=g.epoch,
                               request_id=g.request_id, confirm=confirm, lost=lost)


def keep_alive_failed(err: grpc.RpcError, g: Grant, lost: bool) -> tuple[bool, bool]:
    """What a failed KeepAlive of the hold `g` means, for both clients' keep-alive loops
    (`lost`: its lease was lost before): (its lease is lost, stop calling). Refused
    (FAILED_PRECONDITION: revoked, lapsed): lost, and the loop goes on with `lost` set
    (`keep_alive_request`) until the hold is released, so that the orchestrator knows a client
    of the job lives (an `app` engine is not slept under it). No such group (NOT_FOUND): lost,
    stop. Anything else: tried again. Logs the loss once."""
    code = code_of(err)
    if code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
        if not lost:
            log.info("keep-alive failed group=%s (will retry): %s", g.group_id, err)
        return lost, False
    if not lost:
        log.warning("lease lost group=%s job=%s epoch=%d: %s", g.group_id, g.job_id, g.epoch, details_of(err))
    return True, code == grpc.StatusCode.NOT_FOUND


class AcquireTries:
    """The tries of one Acquire request (the same request id each time), shared by the sync and
    asyncio clients: `send(remaining)` sends one on `stub` (its reply, or the awaitable of it)
    and notes when; `grant(reply)` is (the grant, whether this process saw it late)."""

    def __init__(self, stub: Any, s: Settings, group: str, priority: int | None,
                 memory: str | int | None) -> None:
        self._stub, self._s, self._group, self._priority, self._memory = stub, s, group, priority, memory
        self.request_id = new_request_id()
        self._sent_at = 0.0

    def send(self, remaining: float | None) -> Any:
        self._sent_at = time.monotonic()
        return self._stub.Acquire(acquire_request(self._s, self._group, self._priority, remaining, self.request_id,
                                                  self._memory), timeout=remaining, metadata=call_metadata())

    def grant(self, r: pb.AcquireResponse) -> tuple[Grant, bool]:
        """The grant `r` (`grant_of`), and whether it may have lapsed before this process saw it:
        the last try took longer than the orchestrator kept it queued (`waited_seconds`) by over
        a quarter of the lease, so the answer waited unread (the process was stopped or starved)
        past the point where the first keep-alive (a third of the lease after it is seen) still
        comes in time. Durations only: no clock is compared across hosts. Such a grant is
        confirmed before its use."""
        late = time.monotonic() - self._sent_at - r.waited_seconds > r.lease_seconds / 4
        return grant_of(self._s, self._group, r, self.request_id), late


def warn_lapsed_unseen(g: Grant) -> None:
    """The log line of a grant whose confirmation was refused (it lapsed before it was seen)."""
    log.warning("grant of group %s (epoch %d) lapsed before this process saw it (it was paused or starved for over "
                "its %g s lease): its state stays where the orchestrator put it; asking again", g.group_id, g.epoch,
                g.lease_seconds)


class Retry:
    """The retry policy of one logical call, shared by the sync and asyncio clients.

    UNAVAILABLE and CANCELLED are retried (the caller resends the same request, so the same request id)
    with exponential backoff for `unavailable_timeout` seconds from the first failure (the first
    UNAVAILABLE of a call is logged as a warning: a command retrying in silence looked hung);
    `deadline` (monotonic seconds, or None) bounds the whole call with AcquireTimeout. With
    `call_timeout` (a call the orchestrator answers at once: Release, KeepAlive), each try is
    bounded by that many seconds (`remaining`), and a try whose answer did not come in time
    (DEADLINE_EXCEEDED) is retried the same way, its first one logged as a warning: the call
    returns, or raises OrchestratorUnavailable naming it, within `call_timeout +
    unavailable_timeout` seconds (40 s by default; tries and pauses after the first failure are
    cut to the window left). With `retried_ok` (a Release), a FAILED_PRECONDITION after a failed
    try means an earlier try did succeed: the orchestrator refuses a second Release of a hold the
    first one ended (StaleLease), and one of a caller's part it already ended ends nothing more. With
    `retry_switches` (an Acquire), SwitchFailed is asked again until the deadline (the
    server dropped the failed request: the same id queues afresh), pausing
    SWITCH_BACKOFF_FIRST doubling to SWITCH_BACKOFF_MAX seconds, its reason logged once;
    JobFailed is raised at once. An AcquireTimeout after failed switches names the last one
    (and has it as `__cause__`).
    """

    def __init__(self, what: str, deadline: float | None, unavailable_timeout: float,
                 retried_ok: bool = False, retry_switches: bool = False, call_timeout: float | None = None) -> None:
        self.what = what
        self._deadline = deadline
        self._call_timeout = call_timeout
        self._unavailable_timeout = unavailable_timeout
        self._retried_ok = retried_ok
        self._retry_switches = retry_switches
        self._since: float | None = None
        self._delay = BACKOFF_FIRST
        self._switch_delay = SWITCH_BACKOFF_FIRST
        self.switch_failures = 0
        self.last_switch_failure: SwitchFailed | None = None

    def remaining(self) -> float | None:
        """Seconds the next try may take (None: no bound): until the deadline (past it, raises
        AcquireTimeout); with `call_timeout`, at most that, and after a failure at most what is
        left of the retry window."""
        left = None
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise self._timed_out(AcquireTimeout(f"{self.what}: no grant before the timeout"))
        if self._call_timeout is not None:
            bound = self._call_timeout if self._since is None else \
                max(0.0, min(self._call_timeout, self._window_left()))
            left = bound if left is None else min(left, bound)
        return left

    def _window_left(self) -> float:
        assert self._since is not None
        return self._since + self._unavailable_timeout - time.monotonic()

    def pause_after(self, err: grpc.RpcError, remaining: float | None) -> float | None:
        """Seconds to wait before the next attempt; None when an earlier attempt succeeded.
        Raises the translated error when retrying cannot help."""
        code = code_of(err)
        if self._retried_ok and self._since is not None and code == grpc.StatusCode.FAILED_PRECONDITION:
            return None
        if self._retry_switches and code == grpc.StatusCode.ABORTED:
            failed = translate(err, self.what)
            if not isinstance(failed, SwitchFailed):
                raise failed from err
            return self._switch_pause(failed, remaining)
        now = time.monotonic()
        first = self._since is None
        self._since = self._since or now
        unanswered = code == grpc.StatusCode.DEADLINE_EXCEEDED and self._call_timeout is not None
        if (code not in RETRIED and not unanswered) or socket_refused(err) \
                or now - self._since >= self._unavailable_timeout:
            translated = self._no_answer(err) if unanswered else translate(err, self.what)
            final = self._timed_out(translated)
            raise final from (err if final is translated else final.__cause__)
        if first and code == grpc.StatusCode.UNAVAILABLE:  # say so once: a silent retry looked like a hang
            details = details_of(err)
            log.warning("%s: the orchestrator is unreachable (%s): trying again for up to %g s", self.what, details,
                        self._unavailable_timeout)
        if first and unanswered:
            log.warning("%s: no answer from the orchestrator within %g s (it may be paused or overloaded): trying "
                        "again for up to %g s", self.what, self._call_timeout, self._unavailable_timeout)
        if code == grpc.StatusCode.CANCELLED:  # rare: e.g. a server past its pending-call limit (issue 10, item 15)
            details = details_of(err)
            log.info("%s: CANCELLED by the server side (%s): retrying with the same request id", self.what, details)
        pause = self._delay if remaining is None else max(0.0, min(self._delay, remaining))
        if self._call_timeout is not None:
            pause = max(0.0, min(pause, self._window_left()))
        self._delay = next_backoff(self._delay)
        return pause

    def _no_answer(self, err: grpc.RpcError) -> TimeSliceError:
        """The error of a call answered at once whose tries went unanswered for the whole window."""
        details = details_of(err)
        return OrchestratorUnavailable(f"{self.what}: no answer from the orchestrator within {self._call_timeout:g} s "
                                       f"per try, tried for {self._unavailable_timeout:g} s more "
                                       f"(DEADLINE_EXCEEDED: {details})")

    def _switch_pause(self, failed: SwitchFailed, remaining: float | None) -> float:
        """The pause before asking again after the switch to this job failed."""
        if self.last_switch_failure is None:
            log.warning("%s; asking again %s (logged once per acquire)", failed,
                        "until granted" if self._deadline is None else "until the acquire's timeout")
        self.switch_failures += 1
        self.last_switch_failure = failed
        self._since, self._delay = None, BACKOFF_FIRST  # it answered: a later outage gets its whole window
        pause = self._switch_delay if remaining is None else max(0.0, min(self._switch_delay, remaining))
        self._switch_delay = min(self._switch_delay * 2.0, SWITCH_BACKOFF_MAX)
        return pause

    def _timed_out(self, err: TimeSliceError) -> TimeSliceError:
        """An AcquireTimeout `err` naming the last failed switch, if any, as its cause (other
        errors as they are)."""
        last = self.last_switch_failure
        if last is None or not isinstance(err, AcquireTimeout):
            return err
        timeout = AcquireTimeout(f"{err} ({self.switch_failures} switch(es) to this job failed meanwhile; the "
                                 f"last: {last})")
        timeout.__cause__ = last
        return timeout

    def succeeded(self) -> None:
        """The call returned: say so when it took failed switches."""
        if self.switch_failures:
            log.warning("%s: granted after %d failed switch(es)", self.what, self.switch_failures)


# Bound on the CancelAcquire a client sends when it gives up an Acquire, seconds.
CANCEL_TIMEOUT = 5.0


def may_be_granted(err: BaseException) -> bool:
    """An Acquire that ended with `err` may still have been granted on the server: a timeout,
    a lost reply, an interrupt; not a refusal (no access, no group, a bad request, a failed
    switch), which the server answered without granting."""
    return not isinstance(err, AccessDenied | GroupNotFound | InvalidRequest | SwitchFailed | JobFailed | LeaseLost)


def cancel_request(s: Settings, group: str, request_id: str) -> pb.CancelAcquireRequest:
    return pb.CancelAcquireRequest(job_id=s.job_id, group_id=group, request_id=request_id)


def keepalive_interval(g: Grant) -> float:
    """Seconds between keep-alives: a third of the lease, so two may be lost."""
    return max(g.lease_seconds / 3.0, 0.05)


def next_backoff(delay: float) -> float:
    return min(delay * 2.0, BACKOFF_MAX)


def code_of(err: grpc.RpcError) -> grpc.StatusCode | None:
    code = getattr(err, "code", None)
    return code() if callable(code) else None


def details_of(err: grpc.RpcError) -> str:
    """The status details of `err` (its text when it carries none: a non-call error)."""
    return err.details() if callable(getattr(err, "details", None)) else str(err)


def reason_of(err: grpc.RpcError) -> str:
    """The orchestrator's `ErrorReason` name in `err`'s trailing metadata ("": none)."""
    trailing = getattr(err, "trailing_metadata", None)
    pairs = trailing() if callable(trailing) else None
    for key, value in pairs or ():
        if key == REASON_METADATA:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


def translate(err: grpc.RpcError, what: str) -> TimeSliceError:
    """Map a gRPC error to the client's exception tree (see `timeslice.errors`); statuses the
    orchestrator does not send on purpose (UNKNOWN, INTERNAL, UNIMPLEMENTED, DATA_LOSS, ...)
    stay the base `TimeSliceError`, with the status named in the message. A known
    `ErrorReason` in the trailing metadata (`REASON_METADATA`) picks its own class
    (ABORTED + JOB_FAILED: JobFailed)."""
    code = code_of(err)
    details = details_of(err)
    message = f"{what}: {details}" if code is None or details == code.name else f"{what}: {code.name}: {details}"
    mapping: dict[grpc.StatusCode, type[TimeSliceError]] = {
        grpc.StatusCode.UNAVAILABLE: OrchestratorUnavailable,
        grpc.StatusCode.CANCELLED: OrchestratorUnavailable,  # only the server side cancels these calls
        grpc.StatusCode.RESOURCE_EXHAUSTED: OrchestratorUnavailable,
        grpc.StatusCode.DEADLINE_EXCEEDED: AcquireTimeout,
        grpc.StatusCode.ABORTED: SwitchFailed,
        grpc.StatusCode.FAILED_PRECONDITION: LeaseLost,
        grpc.StatusCode.NOT_FOUND: GroupNotFound,
        grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
        grpc.StatusCode.UNAUTHENTICATED: AccessDenied,
        grpc.StatusCode.PERMISSION_DENIED: AccessDenied,
    }
    if socket_refused(err):
        return AccessDenied(f"{message} (the orchestrator's unix socket does not let this user in: ask its owner, "
                            "e.g. `timeslice serve --socket-mode 660` and a shared group)")
    if not code:
        return TimeSliceError(message)
    return REASONS.get(reason_of(err), mapping.get(code, TimeSliceError))(message)


def socket_refused(err: grpc.RpcError) -> bool:
    """A connection to a unix socket refused by its file permissions (EACCES): gRPC reports
    it as UNAVAILABLE, but waiting cannot help."""
    details = details_of(err)
    return code_of(err) == grpc.StatusCode.UNAVAILABLE and "Permission denied" in (details or "")
