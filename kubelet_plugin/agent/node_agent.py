"""NodeAgent: checkpoint and restore of whole jobs on this node, and its memory report.

Owned by the agent server; called by its gRPC servicer. Resolves a job to PIDs,
serializes steps per job, runs the named backend, and records what it checkpointed
(`JobRecords`) so that restore finds the same PIDs even when NVML cannot see them.
A step that names an operation id runs once (`steps.Operations`): a resend joins it or
gets its outcome again, and after a restart the records answer it (a checkpoint recorded
under that id, a restore that consumed a record under it) instead of running it again.
A checkpoint into host memory (`cuda`, `cuda-checkpoint`) is refused before anything is
touched when the host lacks memory for it (MemAvailable minus `host_memory.RESERVE_BYTES`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from uuid import uuid4

from timeslice import host_memory
from timeslice.driver import names
from timeslice.driver.app_engine import AppEngine
from timeslice.driver.errors import (
    BackendError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    TimeSliceServerError,
)
from timeslice.driver.peercred import start_time
from timeslice.kubelet_plugin.agent import procfs
from timeslice.kubelet_plugin.agent.backends import make_backend
from timeslice.kubelet_plugin.agent.backends.base import CHECKPOINTED, GONE, RUNNING, STOPPED, Backend, ProcState
from timeslice.kubelet_plugin.agent.frozen_watch import FrozenWatch
from timeslice.kubelet_plugin.agent.gpu_memory import GpuInfo, gpus
from timeslice.kubelet_plugin.agent.pod_processes import ClaimProcessResolver
from timeslice.kubelet_plugin.agent.processes import ProcessResolver
from timeslice.kubelet_plugin.agent.procfs import exit_state
from timeslice.kubelet_plugin.agent.records import CHECKPOINTING, JobRecord, JobRecords
from timeslice.kubelet_plugin.agent.steps import JobRef, Operations, StepOutcome, StepRequest

__all__ = ["JobRef", "MemoryView", "NodeAgent", "StepOutcome", "StepRequest", "job_state", "live_pids"]

log = logging.getLogger("timeslice.agent")
# A memory watch (`memory(watch_seconds=...)`) samples NVML this often, seconds: a job that
# grows faster than idle residents can leave is not saved by sampling more often.
WATCH_INTERVAL_SECONDS = 0.1
MAX_WATCH_SECONDS = 30.0  # bound on one watch (the orchestrator's call deadline is set from it)
# The jobs a memory report named within this many seconds are sampled every
# WATCH_INTERVAL_SECONDS also between reports (`_sample`): a phase that began and ended while
# no watch was in flight (the orchestrator stopped for 1.8 s, schedules seed 2289 on a 16-core
# host: a 14 GB KV cache in no report, the job settled without it, then ran out of memory
# beside another) still enters the next report's peaks.
KEEP_SAMPLING_SECONDS = 30.0
# Two samples further apart than this, while jobs are sampled, leave a gap a phase may have
# peaked in unseen (the agent was stopped, or its event loop stalled: a SIGSTOP of 1.5 s gave
# reports that looked whole): the agent then answers as a new `incarnation`, so the
# orchestrator counts the holds in progress as unobserved (they settle no job), seconds.
SAMPLE_GAP_SECONDS = 1.0
# A memory report waits this long for host memory being freed (the orchestrator's deadline for it is 5 s).
MEMORY_SETTLE_SECONDS = 1.0
# The most jobs the agent remembers having seen processes of (`live_jobs`), the oldest forgotten first.
MAX_SEEN_JOBS = 4096
FORK_ROUNDS = 8  # times a freeze lists its job's processes again for those forked during the step
# Backends whose checkpoint lands in host memory the agent can count.
HOST_MEMORY_BACKENDS = (names.BACKEND_CUDA, names.BACKEND_CUDA_CHECKPOINT, names.BACKEND_VMM)


@dataclass
class MemoryView:
    """`GetMemory`'s answer: the GPUs, per job its bytes per GPU uuid now and checkpointed,
    and the host memory available (bytes); `incarnation`: the answering agent's run of
    samples (new after a restart or a gap in its sampling, `SAMPLE_GAP_SECONDS`)."""

    gpus: list[GpuInfo]
    device_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    checkpointed_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    host_available: int = 0
    peak_bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # over a watch's samples
    incarnation: str = ""
    processes: dict[str, list[str]] = field(default_factory=dict)  # job -> its processes' names (`_names`)
    # GPU uuid -> bytes NVML still lists for processes that ended (`NodeAgent._exiting`): no job's any more
    exiting_bytes: dict[str, int] = field(default_factory=dict)
    busy_jobs: list[str] = field(default_factory=list)  # `NodeAgent.busy`


def _per_device(gpu_list: Sequence[GpuInfo], pids: Iterable[int]) -> dict[str, int]:
    wanted = set(pids)
    out: dict[str, int] = {}
    for g in gpu_list:
        n = sum(b for p, b in g.processes.items() if p in wanted)
        if n:
            out[g.uuid] = n
    return out


def _names(pids: Iterable[int]) -> list[str]:
    """Each of `pids` still running named apart from any later process given its pid:
    "<pid>:<start time>" (`peercred.start_time`), sorted."""
    return sorted(f"{pid}:{born}" for pid in pids if (born := start_time(pid)) is not None)


def _raise(peak: dict[str, int], sample: Mapping[str, int]) -> None:
    """Raise `peak` (GPU uuid -> bytes) to at least `sample`, uuid by uuid."""
    for uuid, b in sample.items():
        peak[uuid] = max(peak.get(uuid, 0), b)


def job_state(processes: list[ProcState]) -> str:
    """"checkpointed" when every process is checkpointed/stopped, "running" when none is."""
    if not processes:
        return "unknown"
    moved = [p.state in (CHECKPOINTED, STOPPED) for p in processes]
    return "checkpointed" if all(moved) else ("mixed" if any(moved) else "running")


async def _listens(engine: AppEngine) -> bool:
    """Whether something accepts a connection at `engine`'s URL (within 1 s)."""
    parts = urlsplit(engine.url)
    try:
        async with asyncio.timeout(1.0):
            _, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def _engine_not_the_jobs(job_id: str, engine: AppEngine) -> str:
    """The error of a step of `job_id` whose engine listens while no process of the job runs
    here (one-box mode, where this agent is the only one: `timeslice serve`). Its engine was
    never put to sleep, and the other engines woke beside it (a helper's attack)."""
    return (f"{engine.describe()} listens, but no process of job {job_id} runs on this node, so its engine "
            f"cannot be put to sleep and checked: start the engine as one of the job's processes "
            f"(TIMESLICE_JOB={job_id} in its environment; on a machine without NVML also "
            f"TIMESLICE_ACCELERATOR_PROCESS=1)")


def live_pids(job_id: str, pids: list[int]) -> list[int]:
    """The PIDs that still run; vanished ones are logged and skipped (their state is gone
    with them). Raises NotFound when none is left."""
    live = [p for p in pids if procfs.alive(p)]
    if len(live) < len(pids):
        log.warning("skipping vanished processes job=%s pids=%s", job_id, sorted(set(pids) - set(live)))
    if not live:
        raise NotFound(f"no live processes for job {job_id!r} on this node (pids {pids} are gone)")
    return live


async def _states(backend: Backend, pids: list[int]) -> list[ProcState]:
    """The processes' states for a step's report; [] when the backend cannot tell (a report
    only: a resend that found its step done must not fail on it)."""
    try:
        return await backend.state(pids) if pids else []
    except TimeSliceServerError as err:
        log.warning("state of pids=%s unknown: %s", pids, err)
        return []



class NodeAgent:
    """`backends`: what this node offers, by name (built on first use) or as ready
    `Backend` objects; other names are refused with INVALID_ARGUMENT. `groups`: group id ->
    backend of every group the agent serves, given where its only orchestrator starts and stops
    with it (`timeslice serve`), so that `recover` puts back what no group would restore."""

    def __init__(self, resolver: ProcessResolver, backends: Iterable[str | Backend] = (names.BACKEND_FREEZE,
                 names.BACKEND_NONE), records_path: Path | None = None,
                 default_timeout: float = names.DEFAULT_STEP_TIMEOUT_SECONDS,
                 lock_timeout: float = names.DEFAULT_LOCK_TIMEOUT_SECONDS,
                 claim_resolver: ClaimProcessResolver | None = None,
                 memory_probe: Callable[[], list[GpuInfo]] = gpus,
                 host_probe: Callable[[], int] = host_memory.available_bytes,
                 groups: Mapping[str, str] | None = None) -> None:
        self.resolver = resolver
        # group id -> its backend, where this agent's caller is its only orchestrator and starts with
        # it (serve): a record of another group, or made with another backend, is nobody's to restore
        self.groups = dict(groups) if groups is not None else None
        self.claim_resolver = claim_resolver
        given = list(backends)
        self._backends: dict[str, Backend] = {b.name: b for b in given if isinstance(b, Backend)}
        self.enabled = tuple(b if isinstance(b, str) else b.name for b in given)
        unknown = [b for b in self.enabled if b not in names.BACKENDS]
        if unknown:
            raise ValueError(f"unknown backends {unknown}; known: {', '.join(names.BACKENDS)}")
        self.records = JobRecords(records_path)
        self.default_timeout = default_timeout
        self.lock_timeout = lock_timeout
        self.frozen_watch = FrozenWatch(self.records, self._lock, default_timeout,  # frozen jobs stay frozen
                                        lambda: self.backend(names.BACKEND_FREEZE)
                                        if names.BACKEND_FREEZE in self.enabled else None)
        # one lock per job while a step runs (weak: an id seen once costs nothing afterwards)
        self._job_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._memory_probe = memory_probe
        # job -> GPU uuid -> the most it held in any sample (of any report or watch) since a
        # report of it last answered: a watch in flight shares its samples with plain reports
        self._peaks: dict[str, dict[str, int]] = {}
        self._sampled: dict[str, tuple[list[int], float]] = {}  # job -> (its pids, when a report named it)
        self._sampler: asyncio.Task[None] | None = None
        # PIDs known alive in this namespace (`_exiting`): NVML listed them while /proc showed
        # them alive, or a report resolved them as a job's; pid -> start time, persisted
        # (`JobRecords.live_pids`): those an earlier run knew, unless their PID now names another process
        self._seen_live: dict[int, int] = {p: t for p, t in self.records.live_pids.items()
                                           if start_time(p) in (None, t)}
        self._gone_since: dict[int, float] = {}  # known PIDs found gone (monotonic seconds), not yet forgotten
        self._busy: dict[str, int] = {}  # job -> its steps running or waiting for its lock (`busy`)
        # names this run of samples in the agent's memory reports: a restart loses `_peaks`,
        # a gap (`SAMPLE_GAP_SECONDS`) misses what happened in it
        self.incarnation = uuid4().hex
        self._last_sample: float | None = None  # monotonic seconds; None: nothing is sampled
        self._background: set[asyncio.Task[None]] = set()
        self._host_probe = host_probe
        self.operations = Operations()
        # jobs (not named by claims) this run saw processes of, least recently seen first (`live_jobs`)
        self._seen_jobs: dict[str, None] = {}
        # jobs with an engine -> their processes last seen live outside it, its clients (`live_jobs`),
        # persisted: a client killed while the agent restarted left a job that looked live for good
        self._clients_seen: dict[str, set[int]] = dict(self.records.clients)
        # backends built only to put back what an earlier run recorded with a backend this run
        # does not offer (`recovery_backend`): never used for a checkpoint
        self._recovering: dict[str, Backend] = {}

    def backend(self, name: str) -> Backend:
        """The backend of that name; InvalidArgument when not offered, FailedPrecondition
        when this node cannot run it."""
        if name not in self.enabled:
            raise InvalidArgument(f"backend {name!r} is not offered by this node agent; "
                                  f"offered: {', '.join(self.enabled)}")
        backend = self._backends.get(name)
        if backend is None:
            try:
                backend = self._backends[name] = make_backend(name, self.lock_timeout, self._memory_probe)
            except BackendError as err:
                raise FailedPrecondition(f"backend {name} unavailable on this node: {err}") from err
        return backend

    def recovery_backend(self, record: JobRecord) -> Backend:
        """The backend that puts `record`'s processes back, bound to its engine: the record's
        own backend as offered, or, when this run does not offer it (the node's configuration
        changed since the checkpoint: serve restarted with the group on another backend, an agent
        restarted with other `--backends`), an instance of it built for putting back only (a
        `vmm` one without a pinned pool of its own), since no step naming an offered backend can
        undo it. Raises FailedPrecondition when this node cannot run it (`cuda` without its
        driver bindings, `cuda-checkpoint` without its binary, `app` without the job's engine)."""
        name = record.backend
        if name in self.enabled:
            return self.backend(name).bind(record.app)
        backend = self._recovering.get(name)
        if backend is None:
            try:
                if name == names.BACKEND_VMM:
                    from timeslice.kubelet_plugin.agent.backends.vmm import VmmBackend
                    backend = VmmBackend(self.lock_timeout, self._memory_probe, pool_bytes=0)
                else:
                    backend = make_backend(name, self.lock_timeout, self._memory_probe)
            except (BackendError, InvalidArgument) as err:
                raise FailedPrecondition(f"backend {name} (not offered by this node agent now) cannot be built "
                                         f"here to put its checkpoint back: {err}") from err
            self._recovering[name] = backend
        try:
            return backend.bind(record.app)
        except InvalidArgument as err:
            raise FailedPrecondition(f"backend {name}: {err}") from err

    async def _pids(self, job: JobRef) -> list[int]:
        if not job.claims:
            pids = await self.resolver.pids(job.job_id)
            self._seen(job.job_id)
            return pids
        if self.claim_resolver is None:
            raise InvalidArgument("this node agent has no cluster access: name the job only, not claims")
        return await self.claim_resolver.pids(job.claims, job.pod_uids, job.claim_name)

    async def checkpoint(self, req: StepRequest) -> StepOutcome:
        """Move `req.job`'s processes off the GPU with `req.backend` and record them. On
        failure every process touched is put back and the record dropped. With an operation
        id: once per id (`_once`); a caller that goes away leaves the step to finish and
        keeps its record (its resend gets the outcome, its undo is a restore)."""
        return await self._once("checkpoint", req, self._checkpoint)

    async def restore(self, req: StepRequest) -> StepOutcome:
        """Bring `req.job`'s processes back (those its record names, else those it has now)
        and drop its record. With an operation id: once per id (`_once`; the records keep the
        ids of recent restores that consumed a record, for resends after a restart)."""
        return await self._once("restore", req, self._restore)

    async def _once(self, kind: str, req: StepRequest,
                    step: Callable[[StepRequest], Coroutine[Any, Any, StepOutcome]]) -> StepOutcome:
        """`step(req)`, run once per operation id: a resend while it runs awaits the same
        task, one after it ended gets its outcome (or error) again. No id: run it here, as
        part of the call (a caller that goes away cancels it)."""
        if not req.operation_id:
            return await self._in_flight(req.job_id, step(req))
        task = self.operations.find(kind, req)
        if task is None:
            task = self.operations.start(kind, req, self._in_flight(req.job_id, step(req)))
        else:
            log.info("%s resent job=%s operation=%s: %s", kind, req.job_id, req.operation_id,
                     "its outcome again" if task.done() else "joined the running step")
        return await asyncio.shield(task)

    async def _in_flight(self, job_id: str, step: Coroutine[Any, Any, StepOutcome]) -> StepOutcome:
        """`step`, counted in `busy` while it runs or waits for its job's lock."""
        self._busy[job_id] = self._busy.get(job_id, 0) + 1
        try:
            return await step
        finally:
            self._busy[job_id] -= 1
            if not self._busy[job_id]:
                del self._busy[job_id]

    @property
    def busy(self) -> list[str]:
        """The jobs with a checkpoint or restore step running or waiting for its job's lock here,
        sorted: one whose caller gave up on it (no reply in time) may still run, and change
        where the job's state is, after the caller moved on (`MemoryReport.busy_jobs`)."""
        return sorted(self._busy)

    async def _checkpoint(self, req: StepRequest) -> StepOutcome:
        job_id, backend_name, group_id, timeout = req.job_id, req.backend, req.group_id, req.timeout
        backend = self.backend(backend_name).bind(req.app)
        async with self._lock(job_id):
            t0 = time.monotonic()
            done = self.records.jobs.get(job_id)
            if req.operation_id and done is not None and done.operation == req.operation_id and \
                    done.phase != CHECKPOINTING:  # a resend to a restarted agent: its record answers
                procs = [ProcState(st.pid, st.state, done.pids.get(st.pid, 0))
                         for st in await _states(backend, [p for p in done.pids if procfs.alive(p)])]
                log.info("checkpoint resent job=%s operation=%s: done before (its record), not run again", job_id,
                         req.operation_id)
                return StepOutcome(job_id, procs, done.bytes, time.monotonic() - t0)
            pids = await self._live(req.job)
            if not pids:
                if req.app is not None and self.groups is not None and await _listens(req.app):
                    raise FailedPrecondition(_engine_not_the_jobs(job_id, req.app))
                log.info("nothing to checkpoint job=%s group=%s: no live processes on this node", job_id, group_id)
                return StepOutcome(job_id, [], 0, time.monotonic() - t0)
            on_gpus: dict[str, int] = {}
            if backend_name in HOST_MEMORY_BACKENDS:  # (freeze and none move no GPU memory: no NVML call)
                on_gpus = _per_device(await asyncio.to_thread(self._memory_probe), pids)
                await self._check_host_room(job_id, backend, pids, sum(on_gpus.values()),
                                            timeout or self.default_timeout)
            prior = self.records.jobs.get(job_id)  # checkpointed already (a repeated step): kept as it is
            if prior is None:  # write-ahead: a crash from here on is undone at start
                self._write_ahead(req, pids, on_gpus, "nothing was touched")
            step = asyncio.ensure_future(self._checkpoint_all(req, backend, pids, prior))
            try:
                procs = await asyncio.shield(step)
            except asyncio.CancelledError:  # a caller without operation id is gone (it will assume nothing),
                # or the agent stops: finish, then undo
                self._in_background(self._undo_cancelled(job_id, backend, pids, step, prior))
                raise
            except BaseException:
                if prior is None:
                    self.records.pop(job_id)  # the backend put every process back
                raise
            if prior is None:
                await self._undo_if_a_process_ended(job_id, backend, procs, timeout or self.default_timeout)
            record = JobRecord(backend_name, group_id,
                               {**(prior.pids if prior else {}), **{p.pid: p.gpu_bytes for p in procs}},
                               on_gpus or (prior.devices if prior else {}), operation=req.operation_id,
                               app=req.app or (prior.app if prior else None))
            try:
                self._write(job_id, record, "the checkpoint was undone")
            except FailedPrecondition:
                await backend.restore(pids, timeout or self.default_timeout)
                self.records.pop(job_id)
                raise
            seconds = time.monotonic() - t0
            log.info("checkpointed job=%s group=%s backend=%s pids=%s bytes=%d seconds=%.3f operation=%s", job_id,
                     group_id, backend_name, pids, record.bytes, seconds, req.operation_id)
            self.frozen_watch.start()
            return StepOutcome(job_id, procs, record.bytes, seconds)

    async def _checkpoint_all(self, req: StepRequest, backend: Backend, pids: list[int],
                              prior: JobRecord | None) -> list[ProcState]:
        """The backend's checkpoint of `pids`, then of the processes forked meanwhile (`_stop_forked`)."""
        procs = await backend.checkpoint(pids, req.timeout or self.default_timeout)
        return procs + await self._stop_forked(req, backend, pids, procs, prior)

    async def _stop_forked(self, req: StepRequest, backend: Backend, pids: list[int], procs: list[ProcState],
                           prior: JobRecord | None) -> list[ProcState]:
        """Backend `freeze`: the processes of the job that were forked while its step ran (after
        its processes were listed, before their SIGSTOP took effect; a helper's attack on `serve`:
        children of a frozen job computed beside the holder for their whole life). The job's
        processes are listed again, and the new ones stopped, until none is new: a stopped
        process forks no more (at most `FORK_ROUNDS` rounds). Each round's processes are in the
        write-ahead record before they are stopped (an agent that dies meanwhile continues them
        at its start). Returns their states (those that ended since are left out); raises what
        a step raises, what this step stopped continued (a repeated step's job stays frozen)."""
        if backend.name != names.BACKEND_FREEZE:
            return []
        seen: set[int] = set(pids)
        stopped: list[ProcState] = []
        timeout = req.timeout or self.default_timeout
        for _ in range(FORK_ROUNDS):
            new = [p for p in await self._live(req.job) if p not in seen]
            if not new:
                return stopped
            seen.update(new)
            log.info("checkpoint job=%s: processes %s were forked during the step: stopped too", req.job_id, new)
            if prior is None:
                self._write_ahead(req, sorted(seen), {}, "nothing more was stopped")
            try:
                stopped += [st for st in await backend.checkpoint(new, timeout) if st.state != GONE]
            except TimeSliceServerError:
                undo = stopped if prior is not None else [*procs, *stopped]  # (a repeated step's job was frozen)
                with contextlib.suppress(TimeSliceServerError):
                    await backend.restore([p.pid for p in undo if p.state != GONE], timeout)
                if prior is None:
                    self.records.pop(req.job_id)
                raise
        log.warning("checkpoint job=%s: its processes were still forking after %d rounds: those forked since run on",
                    req.job_id, FORK_ROUNDS)
        return stopped

    async def _undo_if_a_process_ended(self, job_id: str, backend: Backend, procs: list[ProcState],
                                       timeout: float) -> None:
        """A process of a multi-process job that ended during its checkpoint (a rank that
        crashed, or was killed) leaves a job that cannot go on as it was (its peers wait on
        it in a collective): the job's other processes are put back and the step fails, so
        that the switch rolls back for every rank and the job stays where it was, running,
        for its launcher to end or restart (issue 14, item 3). Raises BackendError."""
        gone = [p.pid for p in procs if p.state == GONE]
        moved = [p.pid for p in procs if p.state != GONE]
        if not gone or not moved:  # none ended, or all did (the job is gone: nothing to put back)
            return
        try:
            await backend.restore(moved, timeout)
            undone = f"its other processes {moved} were put back"
        except TimeSliceServerError as err:
            undone = f"putting back its other processes {moved} FAILED: {err}"
            log.error("checkpoint job=%s: %s", job_id, undone)
        finally:
            self.records.pop(job_id)
        raise BackendError(f"checkpoint of job {job_id}: process(es) {gone} ended during the step; {undone} (a "
                           "job's processes move together, and one that lost a process cannot go on as it was)")

    async def _restore(self, req: StepRequest) -> StepOutcome:
        job_id, backend_name, group_id, timeout = req.job_id, req.backend, req.group_id, req.timeout
        record = self.records.jobs.get(job_id)
        if record is not None and record.backend == backend_name and backend_name not in self.enabled:
            backend = self.recovery_backend(record)  # a record an earlier run left: its own backend puts it back
        else:
            backend = self.backend(backend_name).bind(req.app or (record.app if record else None))
        async with self._lock(job_id):
            t0 = time.monotonic()
            if req.operation_id and self.records.restored.get(req.operation_id) == job_id:
                log.info("restore resent job=%s operation=%s: done before (it consumed the record), not run again",
                         job_id, req.operation_id)  # a resend to a restarted agent
                return StepOutcome(job_id, await _states(backend, await self._live(req.job)), 0,
                                   time.monotonic() - t0)
            record = self.records.jobs.get(job_id)
            if record is not None and record.backend != backend_name:
                raise FailedPrecondition(f"job {job_id} was checkpointed by backend {record.backend}: restore it "
                                         f"with that backend, not {backend_name} (its processes stay as they are)")
            if record is not None:
                pids = [p for p in record.pids if procfs.alive(p)]
                if not pids:  # a job that ended while checkpointed (its pods deleted): nothing to restore
                    log.info("restore job=%s: its checkpointed processes %s are gone, their state with them",
                             job_id, sorted(record.pids))
                    self.records.pop(job_id)
            else:
                pids = await self._live(req.job)
            if not pids:
                log.info("nothing to restore job=%s group=%s on this node", job_id, group_id)
                return StepOutcome(job_id, [], 0, time.monotonic() - t0)
            procs = await backend.restore(pids, timeout or self.default_timeout)
            self.records.pop(job_id, restored_by=req.operation_id)
            moved = record.bytes if record else 0
            seconds = time.monotonic() - t0
            log.info("restored job=%s group=%s backend=%s pids=%s bytes=%d seconds=%.3f operation=%s", job_id,
                     group_id, backend_name, pids, moved, seconds, req.operation_id)
            return StepOutcome(job_id, procs, moved, seconds)

    def _in_background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _undo_cancelled(self, job_id: str, backend: Backend, pids: list[int], step: asyncio.Future[Any],
                              prior: JobRecord | None) -> None:
        """A checkpoint whose caller went away (its switch gave up, or stopped): let the step
        end, then put the processes back and drop its record (the caller undoes what it did
        not hear about, and this does it first). A step that repeated an earlier checkpoint
        leaves that one alone."""
        async with self._lock(job_id):
            moved: Sequence[int] = pids  # (a step that failed put its processes back: restoring them again is a no-op)
            with contextlib.suppress(Exception):
                moved = [p.pid for p in await step if p.state != GONE]  # (with those forked during it: freeze)
            if prior is not None:
                return
            try:
                await backend.restore(moved, self.default_timeout)
            except TimeSliceServerError as err:  # its record stays: a restore or the next start settles it
                log.error("undo of a cancelled checkpoint failed job=%s: %s", job_id, err)
                return
            self.records.pop(job_id)
            log.warning("undid a checkpoint whose caller went away job=%s pids=%s", job_id, moved)

    def _write_ahead(self, req: StepRequest, pids: Sequence[int], devices: dict[str, int], then: str) -> None:
        """Record `req`'s checkpoint of `pids` as under way (`CHECKPOINTING`) before it touches
        them: `recover` undoes it after a crash. Raises FailedPrecondition (`_write`)."""
        self._write(req.job_id, JobRecord(req.backend, req.group_id, dict.fromkeys(pids, 0), devices, CHECKPOINTING,
                                          req.operation_id, req.app), then)

    def _write(self, job_id: str, record: JobRecord, then: str) -> None:
        """Persist a record; raises FailedPrecondition (naming the file's error and `then`)."""
        try:
            self.records.put(job_id, record)
        except OSError as err:
            raise FailedPrecondition(f"node agent cannot write its records ({err}): {then}; job {job_id} stays "
                                     "as it was") from err

    async def recover(self) -> None:
        """At start, make the records match the processes: undo the checkpoints a previous run
        of this agent began and did not finish (write-ahead records still `checkpointing`:
        their processes are restored, the records dropped), and drop the record of a restore
        that finished but was not recorded (every process of it runs). A record no restore step
        would come for (`_orphaned`: its backend is not offered now, or, with `groups`, its
        group is gone or on another backend: the configuration changed since) is put back now
        with its own backend (`recovery_backend`), or, where it cannot be, kept with an error
        line naming the job and the way out. No
        process stays stopped without a record, and no record names running processes."""
        for job_id, record in list(self.records.jobs.items()):
            pids = [p for p in record.pids if procfs.alive(p)]
            orphaned = self._orphaned(record)
            if orphaned:
                await self._put_back_orphan(job_id, record, pids, orphaned)
                continue
            if record.phase != CHECKPOINTING:
                try:
                    states = await self.backend(record.backend).bind(record.app).state(pids) if pids else []
                except TimeSliceServerError as err:
                    log.warning("cannot check the processes of job=%s at start: %s (record kept)", job_id, err)
                    continue
                if all(st.state == RUNNING for st in states):
                    log.warning("dropping the record of job=%s: its processes %s run (an unrecorded restore, or "
                                "they are gone)", job_id, pids)
                    self.records.pop(job_id)
                continue
            log.warning("undoing an interrupted checkpoint job=%s backend=%s pids=%s", job_id, record.backend, pids)
            await self._put_back(job_id, record, "undoing an interrupted checkpoint")
        self.frozen_watch.start()

    def _orphaned(self, record: JobRecord) -> str:
        """Why no restore step will come for `record` (an earlier run's), "" when one may: its
        backend is not offered now (a step naming another backend is refused for it), or, with
        `groups`, its group is gone or on another backend now."""
        if record.backend not in self.enabled:
            return f"backend {record.backend} is not offered by this node agent now (offered: " \
                f"{', '.join(self.enabled)})"
        if self.groups is None:
            return ""
        now = self.groups.get(record.group)
        if now is None:
            return f"its group {record.group} is gone"
        return f"its group {record.group} is on backend {now} now" if now != record.backend else ""

    async def _put_back_orphan(self, job_id: str, record: JobRecord, pids: list[int], why: str) -> None:
        """Put back at start a job an earlier run checkpointed that no restore step would put
        back (`_orphaned`: `why`), with its own backend (`recovery_backend`). Where that fails,
        its record is kept (a restore step naming that backend may still put it back: `_restore`)
        and an error line says what the user must do."""
        if not pids:
            log.info("dropping the record of job=%s: its processes %s are gone (%s)", job_id, sorted(record.pids), why)
            self.records.pop(job_id)
            return
        left = "frozen" if record.backend == names.BACKEND_FREEZE else "checkpointed"
        log.warning("job=%s group=%s was left %s by backend %s and %s: putting its processes %s back now, as no "
                    "restore step would", job_id, record.group, left, record.backend, why, pids)
        if await self._put_back(job_id, record, why):
            log.info("restored job=%s pids=%s at start with backend %s", job_id, pids, record.backend)
            return
        way_out = f"`kill -CONT {' '.join(map(str, pids))}`" if record.backend == names.BACKEND_FREEZE else \
            "end its processes"
        log.error("job=%s pids=%s stays %s by backend %s, and nobody will restore it (%s). Put group %s back on "
                  "backend %s (serve: its config; node-agent and kubelet plugin: --backends %s offered) and restart, "
                  "or %s", job_id, pids, left, record.backend, why, record.group, record.backend, record.backend,
                  way_out)

    async def restore_all(self, why: str) -> None:
        """Restore every job this agent holds checkpointed or frozen and drop its record: for
        one-box mode's stop (`timeslice serve`), where the orchestrator stops with the agent
        and nobody would ask for those jobs, so that no process stays stopped. A restore that
        fails is logged and its record kept (the next start tries the job again). An `app`
        engine is left asleep, its record kept: a sleeping engine is no stopped process, and
        its wake beside the awake one could run the GPU out of memory (a helper's attack: each
        stop of `serve` woke the asleep engine while the other job held, 6 of 6); the job's
        next grant under the next `serve` wakes it."""
        for job_id, record in list(self.records.jobs.items()):
            if record.backend == names.BACKEND_APP:
                log.info("left asleep job=%s engine=%s: %s (a sleeping engine is no stopped process: its job's next "
                         "grant wakes it)", job_id, record.app.url if record.app else "?", why)
            elif await self._put_back(job_id, record, why):
                log.info("restored job=%s pids=%s: %s", job_id, list(record.pids), why)

    async def _put_back(self, job_id: str, record: JobRecord, why: str) -> bool:
        """Restore the live processes of `record` with its own backend (`recovery_backend`) and
        drop it; False (logged, record kept) when the restore fails."""
        pids = [p for p in record.pids if procfs.alive(p)]
        try:
            if pids:
                await self.recovery_backend(record).restore(pids, self.default_timeout)
        except TimeSliceServerError as err:
            log.error("could not restore job=%s (%s): %s (record kept)", job_id, why, err)
            return False
        self.records.pop(job_id)
        return True

    def _lock(self, job_id: str) -> asyncio.Lock:
        lock = self._job_locks.get(job_id)
        if lock is None:
            lock = self._job_locks[job_id] = asyncio.Lock()
        return lock

    async def _live(self, job: JobRef) -> list[int]:
        """The job's live processes on this node; [] when it has none (not started yet, or
        exited): a job with nothing to move is a valid member, its steps succeed and say so."""
        try:
            return live_pids(job.job_id, await self._pids(job))
        except NotFound as err:
            log.debug("no processes job=%s: %s", job.job_id, err)
            return []

    async def _host_settled(self, wait: float) -> None:
        """Once what the backends' answered steps still release is released
        (`Backend.host_memory_settled`), or `wait` seconds have passed (logged)."""
        settled = await asyncio.gather(*(b.host_memory_settled(wait) for b in self._backends.values()))
        if not all(settled):
            log.warning("host memory read while a checkpoint's host buffer is still being freed (waited %g s)", wait)

    async def _host_available(self, wait: float) -> int:
        """The host's memory available for checkpoints in bytes (MemAvailable, and what the
        backends' pinned pools have free of the memory they already took: `Backend.pinned_free_bytes`),
        once settled (`_host_settled`)."""
        await self._host_settled(wait)
        return await asyncio.to_thread(self._host_probe) + sum(b.pinned_free_bytes() for b in self._backends.values())

    async def _check_host_room(self, job_id: str, backend: Backend, pids: Sequence[int], need: int,
                               wait: float) -> None:
        """Raise FailedPrecondition when the host cannot take `need` more bytes of the checkpoint of
        `pids` by `backend` (after up to `wait` seconds for memory being freed): MemAvailable and the
        part of that backend's pool the checkpoint lands in (`Backend.pinned_free_for`; another
        backend's pool takes none of it)."""
        await self._host_settled(wait)
        available = await asyncio.to_thread(self._host_probe) + await backend.pinned_free_for(pids)
        if need > available - host_memory.RESERVE_BYTES:
            raise FailedPrecondition(
                f"no host memory for the checkpoint of job {job_id}: it holds {need / 1e9:.2f} GB on the GPUs, "
                f"the node has {available / 1e9:.2f} GB available and keeps {host_memory.RESERVE_BYTES / 1e9:.2f} GB "
                "for its other processes; nothing was touched, the job stays on the GPUs")

    async def live_jobs(self, jobs: Sequence[JobRef], engines: Mapping[str, AppEngine] | None = None
                        ) -> tuple[list[str], list[str], list[str]]:
        """(live, gone, clientless) among `jobs` (`GetLiveJobs`): live, a process of the job
        runs here (any, with a GPU context or not: `ProcessResolver.alive`); gone, none does
        and the job had processes here, as the resolver knows (serve's bindings) or this run of
        the agent saw (a report, a step, an earlier look). Others are neither: never seen
        here, or named by claims (a cluster's pods: not looked at; their lease decides).
        clientless: a job with an inference engine (`engines`, by job: backend app) whose live
        processes all serve the engine's port (`procfs.serving`), once processes of it outside
        them were seen live and none of those last seen so is left: its client is gone and its
        engine runs on (an engine outlives its client; a helper's attack: a killed client's job,
        its engine up, was kept as holder for as long as the engine ran). A job whose client is
        its engine's own process is not so, even one that listened only after it was seen (a
        review's finding), unless a short-lived process of the job was seen since: /proc cannot
        tell a client from it, so the orchestrator drops a clientless job only once no client of
        it called for half a lease (`gone_holders`)."""
        named = sorted({j.job_id for j in jobs if not j.claims})
        alive = await self.resolver.alive(named) if named else {}
        live = [j for j in named if alive.get(j)]
        gone = [j for j in named if alive.get(j) is False or (alive.get(j) is None and j in self._seen_jobs)]
        engines = engines or {}
        clientless = [j for j in live if j in engines and not await self._client_lives(j, engines[j])]
        for j in live:
            self._seen(j)
        return [j for j in live if j not in clientless], gone, clientless

    async def _client_lives(self, job_id: str, engine: AppEngine) -> bool:
        """Whether `job_id`'s client may live (`live_jobs`): a live process of it runs outside
        its engine's processes, or one of those last seen so is still a process of the job (the
        engine's own process, listening since), or none ever did here (its client may be the
        engine's own process), or none of it runs."""
        pids = await self.resolver.processes(job_id)
        port = urlsplit(engine.url).port or 80
        serving = await asyncio.to_thread(procfs.serving, pids, port)
        clients = {p for p in pids if p not in serving}
        if clients:  # (the latest seen, most recent last: a later look asks whether any of them is left)
            changed = self._clients_seen.pop(job_id, None) != clients
            self._clients_seen[job_id] = clients
            if changed:
                while len(self._clients_seen) > MAX_SEEN_JOBS:
                    del self._clients_seen[next(iter(self._clients_seen))]
                self.records.remember_clients(self._clients_seen)
            return True
        seen = self._clients_seen.get(job_id)
        return not seen or not pids or bool(seen & set(pids))

    def _seen(self, job_id: str) -> None:
        self._seen_jobs.pop(job_id, None)
        self._seen_jobs[job_id] = None
        if len(self._seen_jobs) > MAX_SEEN_JOBS:
            del self._seen_jobs[next(iter(self._seen_jobs))]

    async def memory(self, jobs: Sequence[JobRef], watch_seconds: float = 0.0, low_free: int = 0) -> MemoryView:
        """The node's GPUs and host memory, and where each job's memory is. A job whose
        processes cannot be resolved (gone, not started) has no device bytes; `processes`
        names the processes each job's bytes were counted from (`_names`).
        `watch_seconds` > 0: sample the GPUs every `WATCH_INTERVAL_SECONDS` for that long
        (bounded by `MAX_WATCH_SECONDS`), or until a GPU has less than `low_free` bytes free,
        then answer with the last sample; `peak_bytes` is the most each job held over the
        samples, and over those of any other call (a watch in flight) or of the sampling
        between reports (`KEEP_SAMPLING_SECONDS`) since a report of it last answered (the
        orchestrator watches a holder's growth this way, and a plan made when a hold ends
        before its watch answers still learns the hold's peak). `exiting_bytes`: per GPU, what
        processes that ended still hold (nobody's; freed as the driver tears them down)."""
        taken = time.monotonic()  # when the sample in `view.gpus` was asked for
        gpu_list, host = await asyncio.gather(asyncio.to_thread(self._memory_probe),
                                              self._host_available(MEMORY_SETTLE_SECONDS))
        if self._last_sample is not None:  # jobs are sampled: this sample may be the first after a gap
            self._sampled_now()
        view = MemoryView(gpu_list, host_available=host, incarnation=self.incarnation)
        pids_of: dict[str, list[int]] = {}
        for job in jobs:
            record = self.records.jobs.get(job.job_id)
            if record is not None:
                view.checkpointed_bytes[job.job_id] = dict(record.devices) or (
                    {gpu_list[0].uuid: record.bytes} if len(gpu_list) == 1 and record.bytes else {})
            try:
                pids_of[job.job_id] = list(await self._pids(job))
                view.processes[job.job_id] = _names(pids_of[job.job_id])
            except TimeSliceServerError as err:
                log.debug("memory report: no processes for job=%s: %s", job.job_id, err)
        self._note_live(p for pids in pids_of.values() for p in pids)
        if names.BACKEND_VMM in self.enabled and pids_of:  # (its shims register the pool before a switch needs it)
            self.backend(names.BACKEND_VMM).seen([p for pids in pids_of.values() for p in pids])
        asked = time.monotonic()
        self._sampled.update({job_id: (pids, asked) for job_id, pids in pids_of.items()})
        if pids_of and (self._sampler is None or self._sampler.done()):
            self._sampler = asyncio.get_running_loop().create_task(self._sample(), name="memory-sampler")
        deadline = time.monotonic() + min(max(0.0, watch_seconds), MAX_WATCH_SECONDS)
        while True:
            for job_id, pids in pids_of.items():
                now = view.device_bytes[job_id] = _per_device(view.gpus, pids)
                _raise(view.peak_bytes.setdefault(job_id, {}), now)
                _raise(self._peaks.setdefault(job_id, {}), now)
            if time.monotonic() >= deadline or any(g.free < low_free for g in view.gpus):
                for job_id in pids_of:
                    _raise(view.peak_bytes[job_id], self._peaks.pop(job_id, {}))
                view.incarnation = self.incarnation
                view.exiting_bytes = self._exiting(view.gpus, taken)
                view.busy_jobs = self.busy
                return view
            await asyncio.sleep(WATCH_INTERVAL_SECONDS)
            taken = time.monotonic()
            view.gpus = await asyncio.to_thread(self._memory_probe)
            self._sampled_now()

    async def _sample(self) -> None:
        """Sample the GPUs every `WATCH_INTERVAL_SECONDS` into `_peaks` for the jobs a report
        named within `KEEP_SAMPLING_SECONDS` (by the pids it resolved); ends when there are none."""
        while True:
            now = time.monotonic()
            self._sampled = {j: v for j, v in self._sampled.items() if now - v[1] < KEEP_SAMPLING_SECONDS}
            if not self._sampled:
                self._last_sample = None
                return
            try:
                taken = time.monotonic()
                gpus = await asyncio.to_thread(self._memory_probe)
                self._sampled_now()
            except Exception as err:  # NVML failing: no sample, so the next one finds the gap
                log.debug("memory sample failed: %s", err)
                gpus = []
            for job_id, (pids, _) in self._sampled.items():
                _raise(self._peaks.setdefault(job_id, {}), _per_device(gpus, pids))
            if gpus:
                self._exiting(gpus, taken)  # (notes the processes alive now)
            await asyncio.sleep(WATCH_INTERVAL_SECONDS)

    def _exiting(self, gpus: Sequence[GpuInfo], taken: float) -> dict[str, int]:
        """Per GPU uuid, the bytes NVML lists for processes that ended (`procfs.exit_state`): a
        zombie or exiting one, or one gone from /proc that a sample saw alive or a report resolved
        as a job's (a job's process killed between two samples: schedules seed 5, `cuda`). A PID
        never known alive may be another PID namespace's, or a test's stand-in: not counted. A
        known PID is forgotten once it is gone and a sample asked for after that (`taken`:
        monotonic seconds) does not list it: a sample asked for while it still lived, before it
        allocated, is no proof that its memory is freed (a report resolved it, the sampler's
        sample predated its allocation, and it was killed before that sample was read: its
        memory then went uncounted, `tests/test_schedules.py`)."""
        out: dict[str, int] = {}
        listed: set[int] = set()
        live: list[int] = []
        for g in gpus:
            n = 0
            for pid, b in g.processes.items():
                listed.add(pid)
                state = exit_state(pid)
                if state == "live":
                    live.append(pid)
                elif state == "ending" or pid in self._seen_live:
                    n += b
            if n:
                out[g.uuid] = n
        self._note_live(live)
        now, keep = time.monotonic(), {}
        for p, t in self._seen_live.items():
            if p in listed or exit_state(p) == "live":
                keep[p] = t
                self._gone_since.pop(p, None)
            elif taken < self._gone_since.setdefault(p, now):
                keep[p] = t  # this sample may predate its end
            else:
                del self._gone_since[p]
        self._seen_live = keep
        return out

    def _note_live(self, pids: Iterable[int]) -> None:
        """`pids` are known alive; new ones are persisted, in one write (a restarted agent still
        knows them)."""
        new = [p for p in pids if p not in self._seen_live]
        if new:
            self._seen_live.update((p, start_time(p) or 0) for p in new)
            self.records.remember_live(self._seen_live)

    def _sampled_now(self) -> None:
        """A sample was taken: after a gap (`SAMPLE_GAP_SECONDS`) the reports answer as a new
        incarnation from now on."""
        now = time.monotonic()
        if self._last_sample is not None and now - self._last_sample > SAMPLE_GAP_SECONDS:
            self.incarnation = uuid4().hex
            log.warning("memory sampling had a gap of %.1f s (the agent was stopped or busy): the holds in "
                        "progress count as unobserved", now - self._last_sample)
        self._last_sample = now

    async def state(self, job_id: str, backend_name: str) -> list[ProcState]:
        record = self.records.jobs.get(job_id)
        backend = self.backend(backend_name or (record.backend if record else names.BACKEND_NONE))
        if record is not None and record.app is not None:
            backend = backend.bind(record.app)
        pids = list(record.pids) if record else await self.resolver.pids(job_id)
        return await backend.state(pids)
