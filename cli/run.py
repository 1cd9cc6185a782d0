"""`timeslice run -- CMD`: run a command while this job holds a group, like flock(1).

Acquires the group (the client library: keep-alive while CMD runs, `Leave` at the end),
starts CMD with the caller's environment, forwards SIGINT and SIGTERM to it, releases when
it ends, and exits with CMD's status. Processes CMD leaves running (a worker started with
`&`, a daemon) are its job's too (`TIMESLICE_JOB`): the hold lasts until they have ended as
well, as flock(1)'s lock lasts while they hold its descriptor (they are reparented to `run`,
a child subreaper: prctl(2) PR_SET_CHILD_SUBREAPER), and SIGINT and SIGTERM go to them then.
Released while they ran, they computed beside the next holder and the job was forgotten, never
stopped again (a helper's attack). Exit codes besides CMD's own (sysexits.h):

    75  EX_TEMPFAIL     no grant within --timeout seconds (failed switches are asked again
                        until then; the message names the last one)
    69  EX_UNAVAILABLE  the orchestrator is unreachable, the group unknown, or the job failed
                        for good (its state is lost: JobFailed; the message says which)
    70  EX_SOFTWARE     CMD succeeded but the hold was lost while it ran (its lease lapsed):
                        another job may have computed beside it
A release that cannot reach the orchestrator (it was stopped meanwhile) is said in one line,
and CMD's status stands: the hold ends when its lease lapses.
    2                   usage: no CMD, no orchestrator address or job id
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

EX_TEMPFAIL, EX_UNAVAILABLE, EX_SOFTWARE = 75, 69, 70
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def run(cmd: Sequence[str], target: str | None, job: str | None, group: str | None, timeout: float | None,
        priority: int) -> int:
    """Returns the exit status for the `timeslice run` process (see the module docstring).
    Raises ValueError for a missing address or job id."""
    from timeslice import TimeSliceOrchestratorClient
    from timeslice.errors import AcquireTimeout, TimeSliceError

    if shutil.which(cmd[0]) is None:  # before the grant: a command that cannot start holds nothing
        print(f"timeslice run: cannot start {cmd[0]}: not an executable file (nor found in PATH)", file=sys.stderr)
        return 127
    client = TimeSliceOrchestratorClient(target, job, group, priority=priority)
    try:
        try:
            grant = client.acquire(timeout=timeout)
        except KeyboardInterrupt:  # Ctrl-C while waiting: the client already withdrew the request
            return 130
        except AcquireTimeout as err:
            print(f"timeslice run: {err}", file=sys.stderr)
            return EX_TEMPFAIL
        except TimeSliceError as err:
            print(f"timeslice run: {err}", file=sys.stderr)
            return EX_UNAVAILABLE
        _subreaper()  # (before CMD starts: what it leaves running is reparented here)
        try:  # the command and what it starts are the job's (`TIMESLICE_JOB`: how node agents find them)
            child = subprocess.Popen(list(cmd), env={**os.environ, "TIMESLICE_JOB": grant.job_id})
        except OSError as err:
            print(f"timeslice run: cannot start {cmd[0]}: {err}", file=sys.stderr)
            release(client, grant.group_id, "timeslice run")
            return 127
        forward = _forward_signals(child.send_signal)
        try:
            status = child.wait()
        finally:
            forward()
        _wait_for_what_it_left(grant.job_id)
        if release(client, grant.group_id, "timeslice run") == "lost":  # another job may have computed beside it
            return status if status > 0 else EX_SOFTWARE
        return status if status >= 0 else 128 - status  # killed by a signal: as a shell reports it
    finally:
        client.close()


def release(client: Any, group: str, who: str) -> str:
    """Release `group` for `client` (a `TimeSliceOrchestratorClient`): "released"; "lost"
    (`LeaseLost`: the lease had lapsed, said on stderr); or "unreachable" (the orchestrator
    did not answer within the client's retries, e.g. `timeslice serve` was stopped: said on
    stderr in one line; the hold ends when its lease lapses). Never raises a TimeSliceError:
    a finished command's work is not failed for a release nobody can take."""
    from timeslice.errors import LeaseLost, TimeSliceError

    try:
        client.release(group)
    except LeaseLost as err:
        print(f"{who}: {err}: the hold was lost while the command ran", file=sys.stderr)
        return "lost"
    except TimeSliceError as err:
        print(f"{who}: the release of {group} did not reach the orchestrator ({err}); the hold ends when its "
              "lease lapses", file=sys.stderr)
        return "unreachable"
    return "released"


def _subreaper() -> None:
    """Make this process a child subreaper (Linux 3.4, prctl(2)): CMD's orphans become its
    children. Elsewhere nothing is done (they are not waited for)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _children() -> list[int]:
    """This process's live children (/proc/self/task/*/children, Linux 3.5)."""
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.scandir("/proc/self/task"):
            with contextlib.suppress(OSError):
                pids += [int(p) for p in Path(task.path, "children").read_text().split()]
    return pids


def _wait_for_what_it_left(job: str) -> None:
    """Wait, holding, until the processes CMD left running (reparented here) have ended;
    SIGINT and SIGTERM go to them meanwhile."""
    left = _children()
    if not left:
        return
    print(f"timeslice run: the command left processes {left} of job {job} running: the hold lasts until they "
          "end (Ctrl-C sends them SIGINT)", file=sys.stderr, flush=True)

    def send(sig: int) -> None:
        for pid in _children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    forward = _forward_signals(send)
    try:
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return
    finally:
        forward()


def _forward_signals(send_signal: Callable[[int], None]) -> Callable[[], None]:
    """SIGINT and SIGTERM go to `send_signal` (CMD's, which decides how to end); returns the
    restorer."""
    def send(sig: int, _frame: FrameType | None) -> None:
        send_signal(sig)

    old = {s: signal.signal(s, send) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)
    return restore
