"""JobRecords: the processes this agent checkpointed, persisted across restarts.

Owned by the node agent. NVML cannot see checkpointed processes, so the agent must
remember them: which job, backend, PIDs and bytes. File format (JSON, written to a
temp file, fsynced and renamed):

    {"apiVersion": "timeslice.dev/agent-records/v1",
     "jobs": {"<job>": {"backend": "cuda", "group": "g", "pids": {"<pid>": <gpu bytes>},
                        "devices": {"<GPU uuid>": <bytes>}, "phase": "checkpointed",
                        "operation": "<operation id>", "app": {"engine": "vllm", "url": ...}}},
     "restored": {"<operation id>": "<job>"},
     "livePids": {"<pid>": <start time, clock ticks>}}

`devices` (optional): the checkpoint's bytes by GPU, for residency decisions. `phase`
(optional, default "checkpointed"): "checkpointing" is the write-ahead intent, written
before a checkpoint touches any process; a record still in that phase when the agent
starts belongs to a step it did not finish, which it undoes (`NodeAgent.recover`).
`operation` (optional, default ""): the orchestrator's operation id of the checkpoint
that wrote the record, so that a resend of that step after a restart is answered from
the record instead of being run again. `restored` (optional): the operation ids of the
last `MAX_RESTORED` restores that consumed a record, oldest first, written with the
record's removal, so that a resend of such a restore after a restart is not run again.
`app` (optional, backend `app` only): the job's engine (`AppEngine`), which a restore or
the undo at start wakes. `livePids` (optional): the processes the agent knew alive (NVML listed
them alive, or a report resolved them as a job's), with their start times (/proc/<pid>/stat
field 22): a restarted agent still counts what one of them holds after it ended as exiting
memory (`NodeAgent._exiting`; randomized schedules seed 310022, `cuda`: a job's process was
killed, the agent restarted before the GPU freed its 83 GB, and the job's next process was
placed on memory that was not free).

Compatible changes: new optional keys. Anything else needs a new apiVersion.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from timeslice.driver.app_engine import AppEngine
from timeslice.driver.atomic import write_atomic

log = logging.getLogger("timeslice.agent")
API_VERSION = "timeslice.dev/agent-records/v1"
CHECKPOINTING = "checkpointing"  # write-ahead: the step may have touched these processes
CHECKPOINTED = "checkpointed"
MAX_RESTORED = 128  # restores remembered by operation id (a resend comes within seconds)


@dataclass
class JobRecord:
    backend: str
    group: str
    pids: dict[int, int] = field(default_factory=dict)
    devices: dict[str, int] = field(default_factory=dict)
    phase: str = CHECKPOINTED
    operation: str = ""
    app: AppEngine | None = None

    @property
    def bytes(self) -> int:
        return sum(self.pids.values())


class JobRecords:
    """Checkpointed jobs by id. `path` None keeps them in memory only."""

    def __init__(self, path: Path | None = None) -> None:
        self._path = path
        self.jobs: dict[str, JobRecord] = {}
        self.restored: OrderedDict[str, str] = OrderedDict()  # operation id -> job
        self.live_pids: dict[int, int] = {}  # pid -> start time (clock ticks; 0: not read) of processes known alive
        self.clients: dict[str, set[int]] = {}  # job with an engine -> its processes last seen outside it
        if path is not None and path.exists():
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
            if data.get("apiVersion") != API_VERSION:
                raise ValueError(f"apiVersion {data.get('apiVersion')!r}, want {API_VERSION}")
            self.jobs = {job: JobRecord(r["backend"], r["group"], {int(p): int(b) for p, b in r["pids"].items()},
                                        {str(d): int(b) for d, b in r.get("devices", {}).items()},
                                        str(r.get("phase", CHECKPOINTED)), str(r.get("operation", "")),
                                        AppEngine.model_validate(r["app"]) if r.get("app") else None)
                         for job, r in data["jobs"].items()}
            self.restored = OrderedDict((str(op), str(job)) for op, job in data.get("restored", {}).items())
            self.live_pids = {int(p): int(t) for p, t in data.get("livePids", {}).items()}
            self.clients = {str(j): {int(p) for p in pids} for j, pids in data.get("clientPids", {}).items()}
        except (OSError, ValueError, KeyError, TypeError) as err:
            # A damaged file must not stop the agent; the processes stay as they are, and the file
            # is kept aside (the next save would overwrite it) for whoever puts them back.
            aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
            try:
                path.rename(aside)
                kept = f"kept as {aside}"
            except OSError as rename_err:
                kept = f"not moved aside: {rename_err}"
            log.error("ignoring unreadable records file path=%s (%s): %s. Processes this agent had frozen or "
                      "checkpointed may stay stopped: the file names them; `kill -CONT` a frozen one, end a "
                      "checkpointed one", path, kept, err)

    def put(self, job_id: str, record: JobRecord) -> None:
        """Persist `record` (fsync'd before this returns). Raises OSError, and then keeps
        what it held before."""
        before = self.jobs.get(job_id)
        self.jobs[job_id] = record
        try:
            self._save()
        except OSError:
            if before is None:
                del self.jobs[job_id]
            else:
                self.jobs[job_id] = before
            raise

    def pop(self, job_id: str, restored_by: str = "") -> JobRecord | None:
        """Forget a record (persisted; a failed write is logged: the record then comes back
        at the next start, where recovery settles it again). `restored_by`: the operation
        id of the restore that consumed it, remembered in the same write."""
        record = self.jobs.pop(job_id, None)
        if record is not None:
            if restored_by:
                self.restored[restored_by] = job_id
                while len(self.restored) > MAX_RESTORED:
                    self.restored.popitem(last=False)
            try:
                self._save()
            except OSError as err:
                log.error("records file not updated after forgetting job=%s: %s", job_id, err)
        return record

    def remember_live(self, pids: dict[int, int]) -> None:
        """Persist the processes known alive, pid -> start time (a failed write is logged: a
        restart then forgets those added since the last write)."""
        self.live_pids = dict(pids)
        try:
            self._save()
        except OSError as err:
            log.error("records file not updated with the processes known alive: %s", err)

    def remember_clients(self, clients: dict[str, set[int]]) -> None:
        """Persist the client processes last seen of each job with an inference engine (a failed
        write is logged: a restart then forgets those seen since the last write)."""
        self.clients = {j: set(p) for j, p in clients.items()}
        try:
            self._save()
        except OSError as err:
            log.error("records file not updated with the clients seen: %s", err)

    def _save(self) -> None:
        if self._path is None:
            return
        data: dict[str, object] = {"apiVersion": API_VERSION,
                                   "jobs": {j: _record_json(r) for j, r in self.jobs.items()}}
        if self.restored:
            data["restored"] = dict(self.restored)
        if self.live_pids:
            data["livePids"] = {str(p): t for p, t in self.live_pids.items()}
        if self.clients:
            data["clientPids"] = {j: sorted(p) for j, p in self.clients.items()}
        write_atomic(self._path, json.dumps(data).encode())


def _record_json(r: JobRecord) -> dict[str, object]:
    out: dict[str, object] = {**asdict(r), "pids": {str(p): b for p, b in r.pids.items()}}
    if r.app is None:
        del out["app"]
    else:
        out["app"] = r.app.model_dump()
    return out
