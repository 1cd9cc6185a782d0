from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AcquireRequest(_message.Message):
    __slots__ = ("job_id", "group_id", "priority", "request_id", "timeout_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    priority: int
    request_id: str
    timeout_seconds: float
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., priority: _Optional[int] = ..., request_id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "epoch", "lease_seconds", "waited_seconds", "restored", "switch_seconds")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    SWITCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    epoch: int
    lease_seconds: float
    waited_seconds: float
    restored: bool
    switch_seconds: float
    def __init__(self, lease_id: _Optional[str] = ..., epoch: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., waited_seconds: _Optional[float] = ..., restored: _Optional[bool] = ..., switch_seconds: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("job_id", "group_id", "lease_id", "epoch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    lease_id: str
    epoch: int
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("waiters", "switch_started")
    WAITERS_FIELD_NUMBER: _ClassVar[int]
    SWITCH_STARTED_FIELD_NUMBER: _ClassVar[int]
    waiters: int
    switch_started: bool
    def __init__(self, waiters: _Optional[int] = ..., switch_started: _Optional[bool] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("job_id", "group_id", "lease_id", "epoch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    lease_id: str
    epoch: int
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("job_id", "lease_id", "epoch", "held_seconds", "lease_remaining_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HELD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    lease_id: str
    epoch: int
    held_seconds: float
    lease_remaining_seconds: float
    def __init__(self, job_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., epoch: _Optional[int] = ..., held_seconds: _Optional[float] = ..., lease_remaining_seconds: _Optional[float] = ...) -> None: ...

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
    __slots__ = ("group_id", "backend", "holder", "waiters", "resident_job_id", "checkpointed_job_ids", "phase", "epoch", "grants", "switches", "failed_switches", "lease_expiries", "recent_switches", "agent_targets", "preemptions")
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
    def __init__(self, group_id: _Optional[str] = ..., backend: _Optional[str] = ..., holder: _Optional[_Union[Holder, _Mapping]] = ..., waiters: _Optional[_Iterable[_Union[Waiter, _Mapping]]] = ..., resident_job_id: _Optional[str] = ..., checkpointed_job_ids: _Optional[_Iterable[str]] = ..., phase: _Optional[str] = ..., epoch: _Optional[int] = ..., grants: _Optional[int] = ..., switches: _Optional[int] = ..., failed_switches: _Optional[int] = ..., lease_expiries: _Optional[int] = ..., recent_switches: _Optional[_Iterable[_Union[SwitchRecord, _Mapping]]] = ..., agent_targets: _Optional[_Iterable[str]] = ..., preemptions: _Optional[int] = ...) -> None: ...
