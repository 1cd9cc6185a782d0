"""Exceptions raised by the client library.

    TimeSliceError
    ├── OrchestratorUnavailable   the orchestrator could not be reached (retryable)
    ├── AcquireTimeout            no grant before the acquire timeout (retryable)
    ├── SwitchFailed              the switch to this job failed and was rolled back (retryable)
    ├── JobFailed                 the job failed for good (its GPU state is lost): restart it
    │   └── CheckpointLost        this process's checkpointed state is not intact: the job must restart
    ├── LeaseLost                 the lease lapsed or was taken over; the hold is gone
    ├── NotHolding                release() without a hold on that group
    ├── GroupNotFound             the orchestrator does not know the group
    ├── AccessDenied              no valid token, or the pod may not act for this claim
    └── InvalidRequest            the orchestrator refused the arguments (also a ValueError)

Each class carries `retryable`: whether calling again can succeed without a change.
`acquire()` itself retries `SwitchFailed` until its timeout (see `TimeSliceOrchestratorClient`),
never `JobFailed`.
gRPC errors are translated once, in `timeslice._rpc.translate`, with the original
`grpc.RpcError` kept as `__cause__`.
"""

from __future__ import annotations


class TimeSliceError(Exception):
    """Base of every error the client raises."""

    retryable = False


class OrchestratorUnavailable(TimeSliceError):
    """The orchestrator did not answer (gRPC UNAVAILABLE) for longer than the client retries."""

    retryable = True


class AcquireTimeout(TimeSliceError, TimeoutError):
    """`acquire()` waited `timeout` seconds without a grant; the queue entry was withdrawn."""

    retryable = True


class SwitchFailed(TimeSliceError):
    """The checkpoint/restore switch to this job failed and was rolled back (gRPC ABORTED).
    `acquire()` raises it only when built with `retry_failed_switches=False`: by default it
    asks again until its timeout."""

    retryable = True


class JobFailed(TimeSliceError):
    """The job failed for good: the orchestrator lost its GPU state (its restore failed
    again and again, or its checkpoint is gone). Every acquire of the job is refused the same
    way until the job is restarted (gRPC ABORTED with trailing metadata
    `timeslice-error-reason: JOB_FAILED`). Not a `SwitchFailed`: asking again cannot help."""


class CheckpointLost(JobFailed):
    """This process's state, checkpointed into the node's pinned pool, no longer matches its
    checksum (the pool was rewritten or corrupted): nothing was restored, and the job must
    restart. The orchestrator fails the job with the reason "checkpoint lost"."""


class LeaseLost(TimeSliceError):
    """The hold ended without `release()`: the lease lapsed or the epoch is stale.

    GPU work done after the loss may have overlapped another job's phase.
    """


class NotHolding(TimeSliceError):
    """`release()` for a group this client does not hold."""


class AccessDenied(TimeSliceError, PermissionError):
    """gRPC UNAUTHENTICATED / PERMISSION_DENIED: the ServiceAccount token is missing or
    invalid, or this pod holds no claim of that claim set."""


class GroupNotFound(TimeSliceError, LookupError):
    """The orchestrator has no group of that id (gRPC NOT_FOUND)."""


class InvalidRequest(TimeSliceError, ValueError):
    """The orchestrator rejected the request's arguments (gRPC INVALID_ARGUMENT)."""
