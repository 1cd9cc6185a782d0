"""Server-side exception tree of timeslice-dra, and its mapping to gRPC status codes.

    TimeSliceServerError            (grpc: INTERNAL)
    ├── InvalidArgument             bad request field or config       INVALID_ARGUMENT
    ├── Unauthenticated             no or invalid client token        UNAUTHENTICATED
    ├── PermissionDenied            the caller may not act for this   PERMISSION_DENIED
    ├── NotFound                    unknown group, job or processes   NOT_FOUND
    ├── FailedPrecondition          wrong state for the call          FAILED_PRECONDITION
    │   ├── StaleLease              not the holder, or an old epoch
    │   └── GpuDiscoveryError       NVML missing or failing
    ├── StepTimeout (retryable)     a backend step passed its bound   DEADLINE_EXCEEDED
    ├── AcquireTimeout (retryable)  no grant within the timeout       DEADLINE_EXCEEDED
    ├── SwitchFailed (retryable)    a switch failed and rolled back   ABORTED
    │   └── JobFailed               the job's state is lost for good  ABORTED + reason JOB_FAILED
    ├── BackendError (retryable)    a checkpoint backend failed       INTERNAL
    │   └── ProcessGone             a target process vanished         NOT_FOUND
    └── KubernetesApiError (retryable)  API server unreachable, conflict, 5xx  UNAVAILABLE
        └── KubernetesApiRejected   the API server refused the request  FAILED_PRECONDITION

Foreign errors (`grpc.RpcError`, CUDA `CUresult`, `OSError`, NVML errors, `kubernetes`
`ApiException`) are translated once, at the boundary that sees them, with `raise ... from`.
Servicers turn these into a gRPC status (`grpc_server.rpc_method`); `retryable` says whether
the same call can succeed later. Where the code alone does not say it, `reason` (a name of
the orchestrator API's `ErrorReason` enum) goes with the status as the trailing metadata
`REASON_METADATA`.
"""

from __future__ import annotations

import grpc

# Trailing metadata key of an error's `reason` (timeslice.v1 `ErrorReason`, by name).
REASON_METADATA = "timeslice-error-reason"


class TimeSliceServerError(Exception):
    code = grpc.StatusCode.INTERNAL
    retryable = False
    reason = ""  # an `ErrorReason` name sent as `REASON_METADATA` ("": none)


class InvalidArgument(TimeSliceServerError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(TimeSliceServerError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(TimeSliceServerError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(TimeSliceServerError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(TimeSliceServerError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleLease(FailedPrecondition):
    """The caller is not the holder, or names an epoch that is no longer current."""


class GpuDiscoveryError(FailedPrecondition):
    """NVML is not installed or not working, so the node's GPUs are unknown."""


class StepTimeout(TimeSliceServerError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    retryable = True


class AcquireTimeout(TimeSliceServerError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    retryable = True


class SwitchFailed(TimeSliceServerError):
    code = grpc.StatusCode.ABORTED
    retryable = True


class JobFailed(SwitchFailed):
    """The job failed for good: its state is lost (its restore failed `MAX_RESTORE_FAILURES`
    times or more in a row over `RESTORE_FAILURE_SECONDS`: controller/orchestrator/switch_outcome.py;
    or its checkpoint is gone). Its acquires are refused until it is
    restarted; a client must not retry. Still ABORTED on the wire (older clients see a
    failed switch), told apart by its `reason`."""

    retryable = False
    reason = "JOB_FAILED"


class Unavailable(TimeSliceServerError):
    """A peer the call needs (a node agent) is not there; a later retry can find it."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class OutcomeUnknown(TimeSliceServerError):
    """A step may have touched processes although it failed: its reply was lost (`no_reply`:
    the agent died or was unreachable, the call timed out or was cut) or the agent failed
    in an unexpected way. The caller must ask, or undo, never assume it did nothing."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str, no_reply: bool) -> None:
        super().__init__(message)
        self.no_reply = no_reply


class BackendError(TimeSliceServerError):
    retryable = True


class ProcessGone(BackendError):
    code = grpc.StatusCode.NOT_FOUND
    retryable = False


class KubernetesApiError(TimeSliceServerError):
    """A Kubernetes API call failed in a way a later retry can fix (no connection, timeout,
    409 conflict, 429, 5xx). `status` is the HTTP status, 0 without a response."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


class KubernetesApiRejected(KubernetesApiError):
    """The API server refused the request itself (400 bad request, 403, 404, 422 invalid):
    the same request fails again."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    retryable = False


def error_from_status(code: grpc.StatusCode | None, message: str) -> TimeSliceServerError:
    """Map a gRPC status received from a peer back to the tree (the inverse of `.code`)."""
    for cls in (InvalidArgument, Unauthenticated, PermissionDenied, NotFound, FailedPrecondition, StepTimeout,
                SwitchFailed):
        if cls.code == code:
            return cls(message)
    return BackendError(message)
