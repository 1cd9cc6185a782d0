from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    JOB_FAILED: _ClassVar[ErrorReason]
ERROR_REASON_UNSPECIFIED: ErrorReason
JOB_FAILED: ErrorReason

class MemoryCommandsRequest(_message.Message):
    __slots__ = ("job_id", "group_id", "registered_bytes", "pid", "stream_id", "checkpoint")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    registered_bytes: int
    pid: int
    stream_id: str
    checkpoint: PoolCheckpoint
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., registered_bytes: _Optional[int] = ..., pid: _Optional[int] = ..., stream_id: _Optional[str] = ..., checkpoint: _Optional[_Union[PoolCheckpoint, _Mapping]] = ...) -> None: ...

class PoolCheckpoint(_message.Message):
    __slots__ = ("ranges", "bytes", "checksum")
    RANGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ranges: _containers.RepeatedCompositeFieldContainer[PoolRange]
    bytes: int
    checksum: int
    def __init__(self, ranges: _Optional[_Iterable[_Union[PoolRange, _Mapping]]] = ..., bytes: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class MemoryCommand(_message.Message):
    __slots__ = ("op_id", "kind", "pool_path", "pool_bytes", "timeout_seconds", "ranges")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    POOL_PATH_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    kind: str
    pool_path: str
    pool_bytes: int
    timeout_seconds: float
    ranges: _containers.RepeatedCompositeFieldContainer[PoolRange]
    def __init__(self, op_id: _Optional[str] = ..., kind: _Optional[str] = ..., pool_path: _Optional[str] = ..., pool_bytes: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., ranges: _Optional[_Iterable[_Union[PoolRange, _Mapping]]] = ...) -> None: ...

class PoolRange(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class MemoryCommandAck(_message.Message):
    __slots__ = ("job_id", "group_id", "op_id", "ok", "error", "bytes", "seconds", "pinned", "registered_bytes", "lost")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    op_id: str
    ok: bool
    error: str
    bytes: int
    seconds: float
    pinned: bool
    registered_bytes: int
    lost: bool
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., op_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., pinned: _Optional[bool] = ..., registered_bytes: _Optional[int] = ..., lost: _Optional[bool] = ...) -> None: ...

class MemoryCommandAckResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("job_id", "group_id", "priority", "request_id", "timeout_seconds", "memory_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    priority: int
    request_id: str
    timeout_seconds: float
    memory_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., priority: _Optional[int] = ..., request_id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "epoch", "lease_seconds", "waited_seconds", "restored", "switch_seconds", "job_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    SWITCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    epoch: int
    lease_seconds: float
    waited_seconds: float
    restored: bool
    switch_seconds: float
    job_id: str
    def __init__(self, lease_id: _Optional[str] = ..., epoch: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., waited_seconds: _Optional[float] = ..., restored: _Optional[bool] = ..., switch_seconds: _Optional[float] = ..., job_id: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("job_id", "group_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: str
    def __init__(self, result: _Optional[str] = ...) -> None: ...

class CancelAcquireRequest(_message.Message):
    __slots__ = ("job_id", "group_id", "request_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    request_id: str
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class CancelAcquireResponse(_message.Message):
    __slots__ = ("was",)
    WAS_FIELD_NUMBER: _ClassVar[int]
    was: str
    def __init__(self, was: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("job_id", "group_id", "lease_id", "epoch", "request_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    lease_id: str
    epoch: int
    request_id: str
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., epoch: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("waiters", "switch_started")
    WAITERS_FIELD_NUMBER: _ClassVar[int]
    SWITCH_STARTED_FIELD_NUMBER: _ClassVar[int]
    waiters: int
    switch_started: bool
    def __init__(self, waiters: _Optional[int] = ..., switch_started: _Optional[bool] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("job_id", "group_id", "lease_id", "epoch", "request_id", "confirm", "lost")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    lease_id: str
    epoch: int
    request_id: str
    confirm: bool
    lost: bool
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., epoch: _Optional[int] = ..., request_id: _Optional[str] = ..., confirm: _Optional[bool] = ..., lost: _Optional[bool] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_remaining_seconds",)
    LEASE_REMAINING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_remaining_seconds: float
    def __init__(self, lease_remaining_seconds: _Optional[float] = ...) -> None: ...

class GetGroupStatusRequest(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class ListGroupsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListGroupsResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupStatus]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupStatus, _Mapping]]] = ...) -> None: ...

class Holder(_message.Message):
    __slots__ = ("job_id", "lease_id", "epoch", "held_seconds", "lease_remaining_seconds", "kept_past_lease")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HELD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KEPT_PAST_LEASE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    lease_id: str
    epoch: int
    held_seconds: float
    lease_remaining_seconds: float
    kept_past_lease: str
    def __init__(self, job_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., epoch: _Optional[int] = ..., held_seconds: _Optional[float] = ..., lease_remaining_seconds: _Optional[float] = ..., kept_past_lease: _Optional[str] = ...) -> None: ...

class Waiter(_message.Message):
    __slots__ = ("job_id", "priority", "waiting_seconds", "position")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WAITING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    priority: int
    waiting_seconds: float
    position: int
    def __init__(self, job_id: _Optional[str] = ..., priority: _Optional[int] = ..., waiting_seconds: _Optional[float] = ..., position: _Optional[int] = ...) -> None: ...

class SwitchRecord(_message.Message):
    __slots__ = ("from_job_id", "to_job_id", "ok", "error", "checkpoint_seconds", "restore_seconds", "bytes_checkpointed", "bytes_restored", "finished_at_unix")
    FROM_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TO_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_CHECKPOINTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RESTORED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    from_job_id: str
    to_job_id: str
    ok: bool
    error: str
    checkpoint_seconds: float
    restore_seconds: float
    bytes_checkpointed: int
    bytes_restored: int
    finished_at_unix: float
    def __init__(self, from_job_id: _Optional[str] = ..., to_job_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., checkpoint_seconds: _Optional[float] = ..., restore_seconds: _Optional[float] = ..., bytes_checkpointed: _Optional[int] = ..., bytes_restored: _Optional[int] = ..., finished_at_unix: _Optional[float] = ...) -> None: ...

class GroupStatus(_message.Message):
    __slots__ = ("group_id", "backend", "holder", "waiters", "resident_job_id", "checkpointed_job_ids", "phase", "epoch", "grants", "switches", "failed_switches", "lease_expiries", "recent_switches", "agent_targets", "preemptions", "residency", "resident_job_ids", "jobs", "devices", "warnings")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    WAITERS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTED_JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    FAILED_SWITCHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    RECENT_SWITCHES_FIELD_NUMBER: _ClassVar[int]
    AGENT_TARGETS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    backend: str
    holder: Holder
    waiters: _containers.RepeatedCompositeFieldContainer[Waiter]
    resident_job_id: str
    checkpointed_job_ids: _containers.RepeatedScalarFieldContainer[str]
    phase: str
    epoch: int
    grants: int
    switches: int
    failed_switches: int
    lease_expiries: int
    recent_switches: _containers.RepeatedCompositeFieldContainer[SwitchRecord]
    agent_targets: _containers.RepeatedScalarFieldContainer[str]
    preemptions: int
    residency: str
    resident_job_ids: _containers.RepeatedScalarFieldContainer[str]
    jobs: _containers.RepeatedCompositeFieldContainer[JobResidency]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceMemory]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group_id: _Optional[str] = ..., backend: _Optional[str] = ..., holder: _Optional[_Union[Holder, _Mapping]] = ..., waiters: _Optional[_Iterable[_Union[Waiter, _Mapping]]] = ..., resident_job_id: _Optional[str] = ..., checkpointed_job_ids: _Optional[_Iterable[str]] = ..., phase: _Optional[str] = ..., epoch: _Optional[int] = ..., grants: _Optional[int] = ..., switches: _Optional[int] = ..., failed_switches: _Optional[int] = ..., lease_expiries: _Optional[int] = ..., recent_switches: _Optional[_Iterable[_Union[SwitchRecord, _Mapping]]] = ..., agent_targets: _Optional[_Iterable[str]] = ..., preemptions: _Optional[int] = ..., residency: _Optional[str] = ..., resident_job_ids: _Optional[_Iterable[str]] = ..., jobs: _Optional[_Iterable[_Union[JobResidency, _Mapping]]] = ..., devices: _Optional[_Iterable[_Union[DeviceMemory, _Mapping]]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class JobResidency(_message.Message):
    __slots__ = ("job_id", "state", "device_bytes", "peak_bytes", "checkpointed_bytes", "declared_bytes", "reserved_bytes", "settled")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECLARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: str
    device_bytes: int
    peak_bytes: int
    checkpointed_bytes: int
    declared_bytes: int
    reserved_bytes: int
    settled: bool
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[str] = ..., device_bytes: _Optional[int] = ..., peak_bytes: _Optional[int] = ..., checkpointed_bytes: _Optional[int] = ..., declared_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., settled: _Optional[bool] = ...) -> None: ...

class DeviceMemory(_message.Message):
    __slots__ = ("device", "total_bytes", "free_bytes", "age_seconds")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    device: str
    total_bytes: int
    free_bytes: int
    age_seconds: float
    def __init__(self, device: _Optional[str] = ..., total_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., age_seconds: _Optional[float] = ...) -> None: ...
