"""`timeslice acquire` / `timeslice release`: a hold that outlives one command, for shell scripts.

`acquire` starts a holder process (`python -m timeslice.cli.hold`, in the caller's process
group: in one-box mode, `timeslice serve`, that group is the job whose processes move) that
acquires the group with the client library and keeps the lease alive; `acquire` returns once
the grant came (or failed), having written the hold file: JSON {pid, group, job, epoch,
state}. `release` sends the holder SIGTERM and waits for it to end (a pidfd, Linux >= 5.3);
the holder releases, writes `state` ("released", or "lost" when the lease had lapsed), and
exits. The holder logs to the hold file's name with `.log`. Exit codes as `timeslice run`
(cli/run.py): 75 no grant within --timeout, 69 unavailable or the job failed, 70 the hold
was lost before `release`, 2 usage (no hold file, a hold already there, acquire run under a
wrapper such as `timeout` that would end the hold at once: `FORKING_WRAPPERS`).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

from timeslice.cli.run import EX_SOFTWARE, EX_TEMPFAIL, EX_UNAVAILABLE
from timeslice.cli.run import release as release_hold
from timeslice.driver.peercred import ancestors, stat_fields
from timeslice.driver.private_paths import private_dir

# Seconds `release` waits for the holder to release and end.
RELEASE_TIMEOUT = 60.0
# Commands that run their argument as a child and end with it: under one of them, the hold of
# `acquire` would end as soon as acquire returned (its owner is the process that ran it), and
# `timeout` also puts it in a process group of its own (another job in one-box mode).
FORKING_WRAPPERS = frozenset({"timeout", "flock", "time", "xargs", "strace", "ltrace", "sudo", "doas", "su",
                              "setsid", "watch", "parallel"})


def default_job(job: str | None, target: str | None) -> str | None:
    """The job a hold is for: `job`, else $TIMESLICE_JOB, else, in one-box mode (a `unix:`
    target: `timeslice serve`), the caller's process group `pgid-<N>` (a script and the
    commands it runs), named so that the holder, in the same group, acts for it."""
    job = job or os.environ.get("TIMESLICE_JOB")
    target = target or os.environ.get("TIMESLICE_ORCHESTRATOR") or ""
    return job or (f"pgid-{os.getpgrp()}" if target.startswith("unix:") else None)


def hold_file(group: str | None, job: str | None, path: str | None) -> Path:
    """`path`, else $XDG_RUNTIME_DIR (or /tmp)/timeslice-<uid>/hold-<job>@<group>.json."""
    if path:
        return Path(path)
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"timeslice-{os.getuid()}"
    group = group or os.environ.get("TIMESLICE_GROUP") or "default"
    job = job or os.environ.get("TIMESLICE_JOB") or "pod"
    return base / f"hold-{job}@{group}.json".replace("/", "_")


def _write(path: Path, state: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)


def _wrapper() -> str | None:
    """The name of this process's parent when it is a command that runs its argument as a
    child and ends with it (`timeout`, `flock`, ...), else None."""
    try:
        name = Path(f"/proc/{os.getppid()}/comm").read_text().strip()
    except OSError:
        return None
    return name if name in FORKING_WRAPPERS else None


def _owner(pid: int) -> int:
    """The process whose end ends the hold of an `acquire` run by `pid`: `pid`, or, when `pid`
    is a subshell, the shell it was forked from. A shell forks itself for `( ... )`, a function
    in a pipeline, or a command substitution of several commands; the subshell ends at its
    `)`, and the hold ended with it (a helper's attack on serve: in `(timeslice acquire; echo)`
    acquire returned 0, the script went on computing, and the next job was granted beside it).
    A fork has its parent's executable, command line and process group: those are walked up."""
    def fork_facts(p: int) -> tuple[str, bytes, bytes]:
        return os.readlink(f"/proc/{p}/exe"), Path(f"/proc/{p}/cmdline").read_bytes(), stat_fields(p)[2]
    try:
        facts = fork_facts(pid)
        for parent in ancestors(pid):
            if fork_facts(parent) != facts:
                break
            pid = parent
    except OSError:  # (a process that is gone, or not ours to read)
        pass
    return pid


def _claim(path: Path) -> bool:
    """Create the hold file exclusively ({pid: this acquire, state: "acquiring"}), so that of
    two acquires of one hold at once only one goes on (both went on: each started a holder,
    and `release` ended the one whose file was written last, leaving the group held). A file
    whose process has ended is left over (a killed acquire or holder): replaced. False: the
    hold is taken. Raises OSError (the file cannot be made; a symbolic link in its place)."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            try:
                pid = int(json.loads(path.read_text())["pid"])
                os.close(os.pidfd_open(pid))
                return False  # its process lives: the hold is taken (or being taken)
            except (ProcessLookupError, FileNotFoundError):
                path.unlink(missing_ok=True)  # left over: its process is gone
                continue
            except (OSError, ValueError, KeyError, TypeError):
                return False  # unreadable: never removed on a guess
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "state": "acquiring"}, f)
        return True
    return False


def acquire(path: Path, target: str | None, job: str | None, group: str | None, timeout: float | None,
            priority: int) -> int:
    wrapper = _wrapper()
    if wrapper is not None:
        print(f"timeslice acquire: it runs under `{wrapper}`, which ends as soon as acquire returns, and the hold "
              f"ends with the process that ran acquire (under `timeout` it would also be held for timeout's "
              f"process group, not the script's): run acquire from the script itself (--timeout bounds the wait)",
              file=sys.stderr)
        return 2
    named = os.environ.get("TIMESLICE_JOB")
    if job and named != job and not (target or os.environ.get("TIMESLICE_ORCHESTRATOR") or "").startswith("unix:"):
        # (a node agent finds a job's processes by TIMESLICE_JOB: the script's commands, not named, were never
        # stopped, and computed beside the next holder; serve knows the script's process group instead)
        print(f"timeslice acquire: warning: --job {job} holds for job {job!r}, but the commands this script runs "
              f"next carry {'TIMESLICE_JOB=' + named if named else 'no TIMESLICE_JOB'}: a node agent cannot stop "
              f"them while another job holds (after this hold's lease lapses, they would compute beside it). "
              f"`export TIMESLICE_JOB={job}` first (then --job is not needed)", file=sys.stderr)
    try:
        private_dir(path.parent)
        claimed = _claim(path)
    except OSError as err:
        print(f"timeslice acquire: {err}", file=sys.stderr)
        return 2
    if not claimed:
        print(f"timeslice acquire: {path} exists: this job already holds the group, or another acquire of it "
              "is under way", file=sys.stderr)
        return 2
    argv = [sys.executable, "-m", "timeslice.cli.hold", str(path), target or "", job or "", group or "",
            "" if timeout is None else str(timeout), str(priority), str(_owner(os.getppid()))]
    # its own log (next to the hold file): it must not keep the caller's terminal or pipes; it
    # stays in the caller's process group, so a Ctrl-C or hang-up of the script releases the hold
    with open(path.with_suffix(".log"), "ab") as log:
        holder = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True)
    assert holder.stdout is not None
    try:
        line = holder.stdout.readline().strip()  # "granted" or "<exit code> <message>"
    except KeyboardInterrupt:  # the caller gave up: no hold may be left behind
        holder.terminate()
        holder.wait()
        path.unlink(missing_ok=True)
        path.with_suffix(".log").unlink(missing_ok=True)
        return 130
    finally:
        holder.stdout.close()
    if line == "granted":
        return 0
    holder.wait()
    path.unlink(missing_ok=True)
    path.with_suffix(".log").unlink(missing_ok=True)  # what it said is in `line`
    code, _, message = line.partition(" ")
    print(f"timeslice acquire: {message or 'the holder ended without a grant'}", file=sys.stderr)
    return int(code) if code.isdigit() else EX_UNAVAILABLE


def release(path: Path) -> int:
    try:
        private_dir(path.parent)
    except OSError as err:
        print(f"timeslice release: {err}", file=sys.stderr)
        return 2
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        print(f"timeslice release: no hold file {path}: {err}", file=sys.stderr)
        return 2
    pid = int(state["pid"])
    if state.get("state") == "acquiring":
        print(f"timeslice release: {path}: an acquire (pid {pid}) is under way and holds nothing yet",
              file=sys.stderr)
        return 2
    try:
        fd = os.pidfd_open(pid)
        ours = str(path).encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (ProcessLookupError, FileNotFoundError):
        ours = False
    if not ours:  # gone (or its pid reused): never signal another process
        return _holder_gone(path, pid)
    try:
        os.kill(pid, signal.SIGTERM)
        if not _ended(fd, RELEASE_TIMEOUT):
            print(f"timeslice release: the holder (pid {pid}) did not end within {RELEASE_TIMEOUT:g} s",
                  file=sys.stderr)
            return EX_UNAVAILABLE
    finally:
        os.close(fd)
    state = json.loads(path.read_text())
    if state.get("state") == "held":  # it ended without releasing (killed)
        return _holder_gone(path, pid)
    path.unlink(missing_ok=True)
    path.with_suffix(".log").unlink(missing_ok=True)
    if state.get("state") == "lost":
        print("timeslice release: the hold was lost before release (its lease lapsed)", file=sys.stderr)
        return EX_SOFTWARE
    if state.get("state") == "unreachable":
        print(f"timeslice release: the orchestrator could not be reached to release {state.get('group')}; the hold "
              "ends when its lease lapses", file=sys.stderr)
    return 0


def _holder_gone(path: Path, pid: int) -> int:
    print(f"timeslice release: the holder (pid {pid}) ended without releasing: the hold ends when its lease "
          "lapses", file=sys.stderr)
    path.unlink(missing_ok=True)
    path.with_suffix(".log").unlink(missing_ok=True)
    return EX_SOFTWARE


def _hold(path: Path, target: str, job: str, group: str, timeout: str, priority: str, owner: str) -> int:
    """The holder process: acquire, tell `acquire` on stdout, hold until SIGTERM (or until
    `owner`, the process that ran `acquire`, a script, ends: a script that was killed
    cannot release), release."""
    from timeslice import TimeSliceOrchestratorClient
    from timeslice.errors import AcquireTimeout, TimeSliceError

    stop = threading.Event()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # until granted, a signal ends it (and its waiter with it)
    try:
        client = TimeSliceOrchestratorClient(target or None, job or None, group or None, priority=int(priority))
    except ValueError as err:
        print(f"2 {err}", flush=True)
        return 2
    try:
        try:
            grant = client.acquire(timeout=float(timeout) if timeout else None)
        except AcquireTimeout as err:
            print(f"{EX_TEMPFAIL} {err}", flush=True)
            return EX_TEMPFAIL
        except ValueError as err:  # e.g. no group named (as `timeslice run` says, with its exit status)
            print(f"2 {err}", flush=True)
            return 2
        except TimeSliceError as err:
            print(f"{EX_UNAVAILABLE} {err}", flush=True)
            return EX_UNAVAILABLE
        state: dict[str, object] = {"pid": os.getpid(), "group": grant.group_id, "job": client.job_id,
                                    "epoch": grant.epoch, "state": "held"}
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, lambda *_: stop.set())
        _write(path, state)
        try:
            print("granted", flush=True)
        except BrokenPipeError:  # `acquire` is gone (interrupted): nobody will release, release now
            path.unlink(missing_ok=True)
            release_hold(client, grant.group_id, "timeslice acquire")
            return 0
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # `acquire` has read its line and gone
        owner_ended = threading.Event()
        threading.Thread(target=_when_ended, args=(int(owner), stop, owner_ended), daemon=True).start()
        stop.wait()
        state["state"] = release_hold(client, grant.group_id, "timeslice release")  # released, lost, unreachable
        if owner_ended.is_set():  # nobody is left to `release`: no hold file either
            path.unlink(missing_ok=True)
            path.with_suffix(".log").unlink(missing_ok=True)
        else:
            _write(path, state)
        return 0
    finally:
        client.close()


def _ended(pidfd: int, timeout: float | None = None) -> bool:
    """True once the process of `pidfd` has ended, waiting at most `timeout` seconds (None:
    until it ends)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else timeout * 1000))


def _when_ended(pid: int, stop: threading.Event, ended: threading.Event) -> None:
    """Set `ended` and `stop` once `pid` has ended (a pidfd, Linux >= 5.3)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = -1
    if fd >= 0:
        _ended(fd)
        os.close(fd)
    if not stop.is_set():
        print(f"timeslice hold: process {pid}, which took the hold, ended without releasing it: released",
              file=sys.stderr, flush=True)
        ended.set()
        stop.set()


if __name__ == "__main__":
    sys.exit(_hold(Path(sys.argv[1]), *sys.argv[2:8]))
