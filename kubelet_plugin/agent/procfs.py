"""Process facts from /proc: used by the node agent and its `freeze` backend."""

from __future__ import annotations

import os

from timeslice.driver.errors import BackendError, ProcessGone
from timeslice.driver.peercred import stat_fields


def proc_state(pid: int) -> str:
    """The one-letter state of `pid` from /proc (R, S, D, T, t, Z, ...); raises ProcessGone."""
    try:
        return stat_fields(pid)[0].decode()
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessGone(f"process {pid} does not exist") from None


def alive(pid: int) -> bool:
    """Whether `pid` runs: in /proc and not a zombie."""
    try:
        return proc_state(pid) != "Z"
    except ProcessGone:
        return False


PF_EXITING = 0x4  # include/linux/sched.h: the process is in do_exit (proc(5), /proc/<pid>/stat field 9 `flags`)


def exit_state(pid: int) -> str:
    """"live", "ending" (a zombie, or exiting: `PF_EXITING`, the kernel tears it down, closing its
    files and with them its CUDA contexts, whose device memory the driver frees only then) or
    "gone" (not in /proc: ended, or never in this PID namespace). On the H200 a killed job's
    process still held its memory 1.4-9.6 s after its last line."""
    try:
        fields = stat_fields(pid)
    except OSError:
        return "gone"
    return "ending" if fields[0] == b"Z" or int(fields[6]) & PF_EXITING else "live"


def gone_or_failed(pid: int, message: str) -> ProcessGone | BackendError:
    """The error for a step on `pid` that its backend reports as if the process were gone
    (CUDA_ERROR_OPERATING_SYSTEM from the driver, "No such process" from cuda-checkpoint):
    ProcessGone only when /proc shows it gone (absent, or a zombie); a live process gets
    BackendError, so a restore that failed for another reason is never read as "nothing
    left to restore" (issue 22: a restore answered with CUDA error 304 granted the waiter
    while its state was still checkpointed)."""
    return BackendError(f"{message} (the process is alive)") if alive(pid) else ProcessGone(message)


def descendants(pid: int) -> list[int]:
    """The live descendants of `pid`, parents first: the children every thread of it
    started (/proc/PID/task/TID/children, Linux >= 3.5 with CONFIG_PROC_CHILDREN), then
    theirs. A process that exits meanwhile is left out; [] when `pid` is gone."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop(0)
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                continue
            for kid in kids:
                if kid not in out:
                    out.append(kid)
                    todo.append(kid)
    return out


def _listening_inodes(pid: int, port: int) -> set[str]:
    """Inodes of the TCP sockets listening on `port` in `pid`'s network namespace
    (/proc/PID/net/tcp and tcp6: field 2 `local_address` ADDR:PORT in hex, field 4 `st`,
    0A = LISTEN, field 10 the inode; proc(5))."""
    out: set[str] = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
                out.add(fields[9])
    return out


def serving(pids: list[int], port: int) -> set[int]:
    """Those of `pids` that serve TCP `port`: a process holding a socket that listens on it
    (in its own network namespace), and its descendants (an inference engine's workers).
    Processes that cannot be read (gone, another user's) are left out."""
    out: set[int] = set()
    listening: dict[int, set[str]] = {}  # network namespace (its inode) -> its sockets listening on `port`
    for pid in pids:
        if pid in out:
            continue
        try:
            ns = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            continue
        if ns not in listening:  # (the tables are the namespace's: read once, not once per process)
            listening[ns] = _listening_inodes(pid, port)
        inodes = listening[ns]
        if not inodes:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                out.add(pid)
                out.update(descendants(pid))
                break
    return out
