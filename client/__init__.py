"""timeslice: the client library of timeslice-dra.

A job marks its GPU phases so that independent jobs can time-share GPUs:

    from timeslice import TimeSliceOrchestratorClient

    client = TimeSliceOrchestratorClient()          # $TIMESLICE_ORCHESTRATOR, $TIMESLICE_JOB

    @client.on_accelerators(group_id="trainer")
    def train_step(batch): ...

Needs only `grpcio` and `protobuf`. The orchestrator API stubs live in `timeslice.v1`.
`__version__`: the installed distribution's version (`timeslice-dra`), "0+unknown" when it
is imported from a tree that was not installed.
"""

from importlib.metadata import PackageNotFoundError, version

from timeslice._rpc import Grant
from timeslice.aio import AsyncTimeSliceOrchestratorClient
from timeslice.client import TimeSliceOrchestratorClient
from timeslice.errors import (
    AccessDenied,
    AcquireTimeout,
    CheckpointLost,
    GroupNotFound,
    InvalidRequest,
    JobFailed,
    LeaseLost,
    NotHolding,
    OrchestratorUnavailable,
    SwitchFailed,
    TimeSliceError,
)
from timeslice.scope import AcceleratorScope

try:
    __version__ = version("timeslice-dra")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

__all__ = [
    "AcceleratorScope",
    "AccessDenied",
    "AcquireTimeout",
    "AsyncTimeSliceOrchestratorClient",
    "CheckpointLost",
    "Grant",
    "GroupNotFound",
    "InvalidRequest",
    "JobFailed",
    "LeaseLost",
    "NotHolding",
    "OrchestratorUnavailable",
    "SwitchFailed",
    "TimeSliceError",
    "TimeSliceOrchestratorClient",
    "__version__",
]
