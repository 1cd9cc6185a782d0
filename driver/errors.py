"""Server-side exception tree of timeslice-dra, and its mapping to gRPC status codes.

    TimeSliceServerError            (grpc: INTERNAL)
    ├── InvalidArgument             bad request field or config       INVALID_ARGUMENT
    ├── NotFound                    unknown group, job or processes   NOT_FOUND
    ├── FailedPrecondition          wrong state for the call          FAILED_PRECONDITION
    │   └── StaleLease              not the holder, or an old epoch
    ├── StepTimeout (retryable)     a backend step passed its bound   DEADLINE_EXCEEDED
    ├── AcquireTimeout (retryable)  no grant within the timeout       DEADLINE_EXCEEDED
    ├── SwitchFailed (retryable)    a switch failed and rolled back   ABORTED
    └── BackendError (retryable)    a checkpoint backend failed       INTERNAL
        └── ProcessGone             a target process vanished         NOT_FOUND

Foreign errors (`grpc.RpcError`, CUDA `CUresult`, `OSError`) are translated once, at
the boundary that sees them, with `raise ... from`. Servicers turn these into a gRPC
status with `abort_with`; `retryable` says whether the same call can succeed later.
"""

from __future__ import annotations

import grpc


class TimeSliceServerError(Exception):
    code = grpc.StatusCode.INTERNAL
    retryable = False


class InvalidArgument(TimeSliceServerError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(TimeSliceServerError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(TimeSliceServerError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleLease(FailedPrecondition):
    """The caller is not the holder, or names an epoch that is no longer current."""


class StepTimeout(TimeSliceServerError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    retryable = True


class AcquireTimeout(TimeSliceServerError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    retryable = True


class SwitchFailed(TimeSliceServerError):
    code = grpc.StatusCode.ABORTED
    retryable = True


class BackendError(TimeSliceServerError):
    retryable = True


class ProcessGone(BackendError):
    code = grpc.StatusCode.NOT_FOUND
    retryable = False


def error_from_status(code: grpc.StatusCode | None, message: str) -> TimeSliceServerError:
    """Map a gRPC status received from a peer back to the tree (the inverse of `.code`)."""
    for cls in (InvalidArgument, NotFound, FailedPrecondition, StepTimeout, SwitchFailed):
        if cls.code == code:
            return cls(message)
    return BackendError(message)
