from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetLiveJobsRequest(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[SwitchStepRequest]
    def __init__(self, jobs: _Optional[_Iterable[_Union[SwitchStepRequest, _Mapping]]] = ...) -> None: ...

class LiveJobs(_message.Message):
    __slots__ = ("live", "gone", "clientless")
    LIVE_FIELD_NUMBER: _ClassVar[int]
    GONE_FIELD_NUMBER: _ClassVar[int]
    CLIENTLESS_FIELD_NUMBER: _ClassVar[int]
    live: _containers.RepeatedScalarFieldContainer[str]
    gone: _containers.RepeatedScalarFieldContainer[str]
    clientless: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, live: _Optional[_Iterable[str]] = ..., gone: _Optional[_Iterable[str]] = ..., clientless: _Optional[_Iterable[str]] = ...) -> None: ...

class GetMemoryRequest(_message.Message):
    __slots__ = ("jobs", "watch_seconds", "low_free_bytes")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    WATCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOW_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[SwitchStepRequest]
    watch_seconds: float
    low_free_bytes: int
    def __init__(self, jobs: _Optional[_Iterable[_Union[SwitchStepRequest, _Mapping]]] = ..., watch_seconds: _Optional[float] = ..., low_free_bytes: _Optional[int] = ...) -> None: ...

class GpuMemory(_message.Message):
    __slots__ = ("uuid", "index", "total_bytes", "free_bytes", "exiting_bytes")
    UUID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXITING_BYTES_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    index: int
    total_bytes: int
    free_bytes: int
    exiting_bytes: int
    def __init__(self, uuid: _Optional[str] = ..., index: _Optional[int] = ..., total_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., exiting_bytes: _Optional[int] = ...) -> None: ...

class JobMemory(_message.Message):
    __slots__ = ("job_id", "device_bytes", "checkpointed_bytes", "peak_device_bytes", "processes")
    class DeviceBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class CheckpointedBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PeakDeviceBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    device_bytes: _containers.ScalarMap[str, int]
    checkpointed_bytes: _containers.ScalarMap[str, int]
    peak_device_bytes: _containers.ScalarMap[str, int]
    processes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., device_bytes: _Optional[_Mapping[str, int]] = ..., checkpointed_bytes: _Optional[_Mapping[str, int]] = ..., peak_device_bytes: _Optional[_Mapping[str, int]] = ..., processes: _Optional[_Iterable[str]] = ...) -> None: ...

class MemoryReport(_message.Message):
    __slots__ = ("gpus", "jobs", "host_available_bytes", "incarnation", "busy_jobs")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    HOST_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BUSY_JOBS_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuMemory]
    jobs: _containers.RepeatedCompositeFieldContainer[JobMemory]
    host_available_bytes: int
    incarnation: str
    busy_jobs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, gpus: _Optional[_Iterable[_Union[GpuMemory, _Mapping]]] = ..., jobs: _Optional[_Iterable[_Union[JobMemory, _Mapping]]] = ..., host_available_bytes: _Optional[int] = ..., incarnation: _Optional[str] = ..., busy_jobs: _Optional[_Iterable[str]] = ...) -> None: ...

class SwitchStepRequest(_message.Message):
    __slots__ = ("job_id", "backend", "timeout_seconds", "group_id", "claims", "pod_uids", "claim_name", "operation_id", "app")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    POD_UIDS_FIELD_NUMBER: _ClassVar[int]
    CLAIM_NAME_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    APP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    backend: str
    timeout_seconds: float
    group_id: str
    claims: _containers.RepeatedCompositeFieldContainer[ClaimRef]
    pod_uids: _containers.RepeatedScalarFieldContainer[str]
    claim_name: str
    operation_id: str
    app: AppEngine
    def __init__(self, job_id: _Optional[str] = ..., backend: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., group_id: _Optional[str] = ..., claims: _Optional[_Iterable[_Union[ClaimRef, _Mapping]]] = ..., pod_uids: _Optional[_Iterable[str]] = ..., claim_name: _Optional[str] = ..., operation_id: _Optional[str] = ..., app: _Optional[_Union[AppEngine, _Mapping]] = ...) -> None: ...

class AppEngine(_message.Message):
    __slots__ = ("engine", "url", "level", "timeout_seconds")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    engine: str
    url: str
    level: int
    timeout_seconds: float
    def __init__(self, engine: _Optional[str] = ..., url: _Optional[str] = ..., level: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class ClaimRef(_message.Message):
    __slots__ = ("namespace", "name")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ProcessState(_message.Message):
    __slots__ = ("pid", "state", "gpu_bytes")
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GPU_BYTES_FIELD_NUMBER: _ClassVar[int]
    pid: int
    state: str
    gpu_bytes: int
    def __init__(self, pid: _Optional[int] = ..., state: _Optional[str] = ..., gpu_bytes: _Optional[int] = ...) -> None: ...

class SwitchStepResponse(_message.Message):
    __slots__ = ("job_id", "processes", "bytes", "seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    processes: _containers.RepeatedCompositeFieldContainer[ProcessState]
    bytes: int
    seconds: float
    def __init__(self, job_id: _Optional[str] = ..., processes: _Optional[_Iterable[_Union[ProcessState, _Mapping]]] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GetJobStateRequest(_message.Message):
    __slots__ = ("job_id", "backend")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    backend: str
    def __init__(self, job_id: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class JobState(_message.Message):
    __slots__ = ("job_id", "backend", "state", "processes", "group_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    backend: str
    state: str
    processes: _containers.RepeatedCompositeFieldContainer[ProcessState]
    group_id: str
    def __init__(self, job_id: _Optional[str] = ..., backend: _Optional[str] = ..., state: _Optional[str] = ..., processes: _Optional[_Iterable[_Union[ProcessState, _Mapping]]] = ..., group_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobState]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobState, _Mapping]]] = ...) -> None: ...
