"""Jobs frozen by backend `freeze` stay frozen until their restore.

A SIGSTOP is undone by anyone's SIGCONT: a shell's `fg` or `bg` after a Ctrl-Z, `kill -CONT`,
a supervisor. A job the agent froze and someone else continued computes beside the holder (a
helper's attack on `timeslice serve`: a holder paused past its lease was frozen when its lease
lapsed, then its user's `fg` let it finish its phase beside the next holder, 1.6 s of double
compute). While the agent keeps a job frozen (its record `checkpointed` under `freeze`), its
processes are looked at every `REFREEZE_SECONDS` and one found running is stopped again, with
a log line, by the agent's own `freeze` backend (a `FreezeBackend`: another object offered
under that name, a test's fake, is left to itself); a step on the job (its restore) is never
raced (the job's lock), the agent's own process is never stopped, and a PID is stopped only
while it names the process it named when the watch first saw it frozen (its start time: a PID
the kernel gave to another process since is left alone).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from timeslice.driver import names
from timeslice.driver.errors import ProcessGone, TimeSliceServerError
from timeslice.driver.peercred import start_time
from timeslice.kubelet_plugin.agent.backends.base import CHECKPOINTED
from timeslice.kubelet_plugin.agent.backends.freeze import FreezeBackend
from timeslice.kubelet_plugin.agent.records import JobRecord, JobRecords

log = logging.getLogger("timeslice.agent")

# How often (seconds) the processes of frozen jobs are looked at: the most a job continued by
# someone else computes before it is stopped again.
REFREEZE_SECONDS = 0.2


class FrozenWatch:
    """Keeps `records`' frozen jobs stopped with `freeze()` (the agent's `freeze` backend;
    None: it offers none); `lock(job)` is the job's step lock (held while a step runs on it);
    `timeout`: seconds for one SIGSTOP to take effect."""

    def __init__(self, records: JobRecords, lock: Callable[[str], asyncio.Lock], timeout: float,
                 freeze: Callable[[], object], every: float = REFREEZE_SECONDS) -> None:
        self._records = records
        self._lock = lock
        self._timeout = timeout
        self._backend = freeze
        self._every = every
        self._task: asyncio.Task[None] | None = None
        self._starts: dict[int, int | None] = {}  # pid -> its start time when first seen frozen

    def start(self) -> None:
        """Watch while a job is frozen (called after each freeze checkpoint and at the agent's
        start; the watch ends by itself once none is)."""
        if (self._task is None or self._task.done()) and self._frozen():
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="frozen-watch")

    @property
    def watching(self) -> bool:
        """Whether the watch runs (a job is frozen, or was at its last look)."""
        return self._task is not None and not self._task.done()

    def _frozen(self) -> list[tuple[str, JobRecord]]:
        if not isinstance(self._backend(), FreezeBackend):
            return []
        return [(j, r) for j, r in self._records.jobs.items()
                if r.backend == names.BACKEND_FREEZE and r.phase == CHECKPOINTED]

    async def _watch(self) -> None:
        while frozen := self._frozen():
            pids = {p for _, r in frozen for p in r.pids}
            self._starts = {p: t for p, t in self._starts.items() if p in pids}
            for job_id, record in frozen:
                try:
                    await self.keep(job_id, record)
                except Exception:  # (a bug here must not end the watch of the other jobs)
                    log.exception("frozen watch failed job=%s", job_id)
            await asyncio.sleep(self._every)

    async def keep(self, job_id: str, record: JobRecord) -> list[int]:
        """Stop again the processes of `job_id` (frozen, `record`) that run; returns their PIDs.
        Nothing when a step runs on the job or its record changed."""
        lock = self._lock(job_id)
        if lock.locked():
            return []
        async with lock:
            if self._records.jobs.get(job_id) is not record:
                return []
            for pid in record.pids:
                if pid not in self._starts:
                    self._starts[pid] = start_time(pid)
            running = [p for p in record.pids
                       if p != os.getpid() and self._starts[p] is not None
                       and start_time(p, running=True) == self._starts[p]]
            if not running:
                return []
            log.warning("frozen job=%s: processes %s were continued by someone else (kill -CONT, a shell's fg) "
                        "while it is checkpointed: stopped again", job_id, running)
            freeze = self._backend()
            assert isinstance(freeze, FreezeBackend)  # (`_frozen`)
            for pid in running:
                try:
                    await freeze.checkpoint([pid], self._timeout)
                except ProcessGone:
                    pass
                except TimeSliceServerError as err:
                    log.error("could not stop job=%s pid=%d again: %s", job_id, pid, err)
            return running

