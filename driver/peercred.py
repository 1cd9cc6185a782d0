"""Who is calling over a unix socket: the peer's credentials and the processes it stands for.

Owned by one-box mode (`timeslice serve`, `cli/serve.py`); read by the orchestrator's
peer authenticator (`controller/peer_auth.py`) and the node agent's one-box process
resolver (`kubelet_plugin/agent/host_processes.py`).

gRPC does not hand a servicer the socket of a call, so the kernel's `SO_PEERCRED` (pid,
uid, gid of the process that connected; socket(7), unix(7)) is read by `UnixFront`: it
accepts on the public unix socket (mode 0600 unless asked otherwise), reads the peer's
credentials, and splices the connection's bytes to the gRPC server on a loopback port.
Each spliced upstream connection has its own local port, and the servicer's
`context.peer()` ("ipv4:127.0.0.1:PORT") names it: `UnixFront.credentials(peer)` maps it
back. A call that reaches the loopback port without the front has no credentials and is
refused by the authenticator.

A job is the process group (`setpgid(2)`; a shell gives each pipeline its own) or the
cgroup (`/proc/PID/cgroup`, v2 unified line) of a calling process: `Scope`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from timeslice.driver.atomic import write_atomic
from timeslice.driver.errors import PermissionDenied, ProcessGone
from timeslice.driver.private_paths import free_socket_path, private_dir

_T = TypeVar("_T")

log = logging.getLogger("timeslice.serve")

ScopeKind = Literal["process-group", "cgroup"]
# The prefixes of the job ids serve gives callers that name none (`Scope.job_name`).
SCOPE_JOB_PREFIXES = ("pgid-", "cgroup-")
_CHUNK = 256 * 1024


@dataclass(frozen=True)
class PeerCredentials:
    """The process that connected (`SO_PEERCRED` at connect time)."""

    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class Scope:
    """The processes a caller stands for: `kind` "process-group" (`key`: the pgid) or
    "cgroup" (`key`: the cgroup v2 path, e.g. /user.slice/.../run-r1.scope)."""

    kind: ScopeKind
    key: str

    @property
    def job_name(self) -> str:
        """A job id for callers that name none: `pgid-<pgid>` or `cgroup-<last path part>`."""
        if self.kind == "process-group":
            return f"pgid-{self.key}"
        tail = "".join(c if c.isalnum() or c in "._-@" else "-" for c in self.key.rsplit("/", 1)[-1])
        return f"cgroup-{tail or 'root'}"[:253]

    def __str__(self) -> str:
        return f"{self.kind} {self.key}"


def scope_of(pid: int, kind: ScopeKind, proc: Path = Path("/proc")) -> Scope:
    """The scope `pid` belongs to now. Raises ProcessGone."""
    try:
        if kind == "process-group":
            return Scope(kind, str(_stat_pgid(pid, proc)))
        return Scope(kind, _cgroup(pid, proc))
    except (ProcessLookupError, FileNotFoundError):
        raise ProcessGone(f"process {pid} is gone") from None


SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "fish", "tcsh", "csh", "busybox"})


def led_by_a_shell(scope: Scope, caller: int, proc: Path = Path("/proc")) -> bool:
    """True when `scope` is a process group whose leader is a shell other than `caller`: a
    script, whose commands (jobs started with `&` among them) all share its group. The
    shell is known by its name or its program's: a script run as `./script.sh` (a shebang)
    is named `script.sh`, its program is `/bin/bash` (issue 23: two jobs of it became one)."""
    if scope.kind != "process-group" or scope.key == str(caller):
        return False
    try:
        argv0 = (proc / scope.key / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        return (proc / scope.key / "comm").read_text().strip() in SHELLS or os.path.basename(argv0) in SHELLS
    except OSError:  # the leader is gone
        return False


def session_leader(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether `pid` leads its session (started by `setsid`: its session id, /proc/<pid>/stat field 6,
    is its pid); False when it is gone."""
    try:
        return int(stat_fields(pid, proc)[3]) == pid
    except (OSError, IndexError, ValueError):
        return False


def members(scope: Scope, uid: int, proc: Path = Path("/proc"),
            elsewhere: Callable[[Scope], bool] = lambda _: False) -> list[int]:
    """Live PIDs in `scope` whose real uid is `uid` (any uid when `uid` is 0), ascending,
    never this process itself (the server) nor a zombie. For a process group, also their descendants
    that left it (a worker that called `setsid`, as SGLang's and several launchers' do: it
    kept computing while another job held), unless the group a descendant moved to is
    another job's (`elsewhere`); a process reparented away (a double fork) is not followed."""
    me = os.getpid()
    found: dict[int, tuple[int, str]] = {}  # pid -> (parent pid, its scope key)
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            fields = stat_fields(pid, proc)
            if fields[0] == b"Z" or (uid and _uid(pid, proc) != uid):  # (a zombie computes nothing)
                continue
            found[pid] = (int(fields[1]), str(int(fields[2]))) if scope.kind == "process-group" else \
                (0, _cgroup(pid, proc))
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    inside = {pid for pid, (_, key) in found.items() if key == scope.key}
    if scope.kind == "process-group":
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in found.items():
            children.setdefault(ppid, []).append(pid)
        todo = list(inside)
        while todo:
            for child in children.get(todo.pop(), []):
                key = found[child][1]
                if child not in inside and (key == scope.key or not elsewhere(Scope(scope.kind, key))):
                    inside.add(child)
                    todo.append(child)
    return sorted(inside)


def named(job: str, uid: int, proc: Path = Path("/proc"),
          elsewhere: Callable[[Scope], bool] = lambda _: False) -> list[int]:
    """Live PIDs whose real uid is `uid` (any uid when `uid` is 0) and whose environment, as
    they were started, has TIMESLICE_JOB=`job` (a job's client puts it there for every
    process it starts: `client/_rpc.grant_of`; for a job `uid<U>/<name>`, also `<name>`: what
    user U named it), unless their process group is another job's (`elsewhere`); never this
    process. They are the job's wherever they went: a worker that double-forked away from its
    job's tree and group."""
    me, want = os.getpid(), {job.encode(), job.removeprefix(f"uid{uid}/").encode()}
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            if (uid and _uid(pid, proc) != uid) or environ_value(pid, b"TIMESLICE_JOB", proc) not in want or \
                    elsewhere(Scope("process-group", str(_stat_pgid(pid, proc)))):
                continue
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
        found.append(pid)
    return sorted(found)


def stat_fields(pid: int, proc: Path = Path("/proc")) -> list[bytes]:
    """The fields of /proc/<pid>/stat after "pid (comm) ": state ppid pgrp ... (proc(5); comm
    may hold spaces and ')'). Raises OSError (gone)."""
    return (proc / str(pid) / "stat").read_bytes().rpartition(b")")[2].split()


def _stat_ppid_pgid(pid: int, proc: Path) -> tuple[int, int]:
    fields = stat_fields(pid, proc)
    return int(fields[1]), int(fields[2])


def start_time(pid: int, proc: Path = Path("/proc"), running: bool = False) -> int | None:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat field 22): with its
    PID, it names one process however PIDs are reused. None when it is gone or a zombie, and
    with `running` also when it is stopped (state and start time from one read)."""
    try:
        fields = stat_fields(pid, proc)
    except OSError:
        return None
    return None if fields[0] in ((b"T", b"t", b"Z") if running else (b"Z",)) else int(fields[19])


def ancestors(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """`pid`'s parent, its parent's parent, ... up to (not including) PID 1 or a process
    already gone; [] when `pid` itself is gone."""
    found: list[int] = []
    while True:
        try:
            pid = _stat_ppid_pgid(pid, proc)[0]
        except (OSError, ValueError, IndexError):
            return found
        if pid <= 1 or pid in found:
            return found
        found.append(pid)


def one_job(a: int, b: int, proc: Path = Path("/proc")) -> bool:
    """Whether processes `a` and `b` of one process group are one job's as far as their
    lineage tells: one started the other; both are ranks of one torchrun (one
    TORCHELASTIC_RUN_ID); or both are multiprocessing workers of one parent (`fork`: the
    parent's command line; `spawn`/`forkserver`: `--multiprocessing-fork`; torch's
    `mp.spawn` ranks). Else they may be two jobs one program started (a launcher's
    `subprocess.Popen` twice, `make -j`)."""
    if b in ancestors(a, proc) or a in ancestors(b, proc):
        return True
    run = environ_value(a, b"TORCHELASTIC_RUN_ID", proc)
    if run is not None and run == environ_value(b, b"TORCHELASTIC_RUN_ID", proc):
        return True
    parents = [ancestors(pid, proc)[:1] for pid in (a, b)]
    return bool(parents[0]) and parents[0] == parents[1] and all(_worker_of(pid, parents[0][0], proc) for pid in (a, b))


def _worker_of(pid: int, parent: int, proc: Path) -> bool:
    try:
        argv, parent_argv = ((proc / str(p) / "cmdline").read_bytes() for p in (pid, parent))
    except OSError:
        return False
    return argv == parent_argv or b"\0--multiprocessing-fork" in argv


def environ(pid: int, proc: Path = Path("/proc")) -> list[bytes]:
    """`pid`'s environment entries (`NAME=value`) as it was started (/proc/<pid>/environ); []
    when it is gone or not ours to read."""
    try:
        return (proc / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return []


def environ_value(pid: int, name: bytes, proc: Path = Path("/proc")) -> bytes | None:
    """The value of `name` in `pid`'s environment (`environ`); None when it has none, is gone, or
    is not ours to read."""
    prefix = name + b"="
    return next((e[len(prefix):] for e in environ(pid, proc) if e.startswith(prefix)), None)


def _stat_pgid(pid: int, proc: Path) -> int:
    return _stat_ppid_pgid(pid, proc)[1]


def _uid(pid: int, proc: Path) -> int:
    for line in (proc / str(pid) / "status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])  # real uid
    raise ValueError(f"no Uid line for {pid}")


def cgroup2_root(mountinfo: str | None = None) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted, from `mountinfo` (default: this process's,
    /proc/self/mountinfo; the mount whose filesystem type is cgroup2): /sys/fs/cgroup on a v2
    host, /sys/fs/cgroup/unified on a hybrid one (v1 controllers beside v2: Ubuntu 20.04,
    RHEL 8), where looking under /sys/fs/cgroup found no job's cgroup alive and every job
    had nothing to checkpoint. None: no cgroup v2 hierarchy is mounted."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    for line in mountinfo.splitlines():
        before, _, after = line.partition(" - ")
        if after.split()[:1] == ["cgroup2"] and len(before.split()) > 4:
            return Path(before.split()[4].replace("\\040", " "))
    return None


def _cgroup(pid: int, proc: Path) -> str:
    for line in (proc / str(pid) / "cgroup").read_text().splitlines():
        if line.startswith("0::"):  # the cgroup v2 unified hierarchy
            return line[3:]
    raise FileNotFoundError(f"process {pid} has no cgroup v2 entry")


class UnixFront:
    """The public unix socket of one-box mode: accepts, reads `SO_PEERCRED`, splices each
    connection to the gRPC server's loopback port. `mode` is the socket file's permission
    bits (0o600: only the owner's processes can connect). Use `bind()` (first: before
    anything else of the server starts, so that a second server on the path stops there),
    `splice_to(port)`, then `close()`."""

    def __init__(self, path: Path, mode: int = 0o600) -> None:
        self.path = path
        self._upstream = 0
        self._spliced = asyncio.Event()
        self._mode = mode
        self._by_port: dict[int, PeerCredentials] = {}
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def bind(self) -> None:
        """Bind the socket, removing a stale socket file (never any other file). Raises
        OSError (the directory cannot be made; a live server holds the path; the path is not
        a socket; its directory, or one above it, is another user's or writable by others:
        `private_paths.private_dir`). Connections wait until `splice_to`."""
        private_dir(self.path.parent, mode=0o755)
        free_socket_path(self.path)
        old = os.umask(0o777 & ~self._mode)  # the socket file is never reachable with wider bits
        try:
            self._server = await asyncio.start_unix_server(self._accepted, path=str(self.path), limit=_CHUNK)
        finally:
            os.umask(old)
        os.chmod(self.path, self._mode)

    def splice_to(self, upstream_port: int) -> None:
        """Splice connections to 127.0.0.1:`upstream_port` from now on."""
        self._upstream = upstream_port
        self._spliced.set()

    def credentials(self, peer: str) -> PeerCredentials | None:
        """The credentials behind a servicer's `context.peer()`; None for a call that did
        not come through this front."""
        host, _, port = peer.rpartition(":")
        if host not in ("ipv4:127.0.0.1", "ipv6:[::1]") or not port.isdigit():
            return None
        return self._by_port.get(int(port))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:  # ours: never the socket of a server that refused us the path
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            sock = writer.get_extra_info("socket")
            pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                struct.calcsize("3i")))
            await self._spliced.wait()
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream, limit=_CHUNK)
            port = up_writer.get_extra_info("sockname")[1]
            self._by_port[port] = PeerCredentials(pid, uid, gid)
            log.debug("connection pid=%d uid=%d port=%d", pid, uid, port)
            try:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            finally:
                del self._by_port[port]  # before the port can be reused by anyone
                up_writer.close()
        except OSError as err:  # the gRPC server is gone (stopping), or the peer's socket broke
            log.warning("connection not spliced: %s", err)
        except asyncio.CancelledError:  # close(): the server stops; this connection ends with it
            pass
        finally:
            writer.close()
            self._conns.discard(task)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then half-close `dst` (HTTP/2 ends with a GOAWAY anyway)."""
    try:
        while data := await src.read(_CHUNK):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (ConnectionError, OSError):
        dst.close()


# Jobs whose processes all ended that `PeerJobs.gone` still knows once their scopes are forgotten.
MAX_ENDED_JOBS = 1024


def _locked(method: Callable[..., _T]) -> Callable[..., _T]:
    """`method` run holding its `PeerJobs`'s lock."""
    @functools.wraps(method)
    def run(self: PeerJobs, *args: object, **kw: object) -> _T:
        with self._lock:
            return method(self, *args, **kw)
    return run


class PeerJobs:
    """Which scopes (process groups or cgroups) make up each job in one-box mode, and whose
    job it is: the one owner of these facts. The orchestrator's peer authenticator binds a
    caller's scope to the job it acts for; the node agent's resolver reads them.
    Bounded: scopes whose processes are all gone are forgotten at the next bind. With a
    `path` (`timeslice serve`'s state dir) the bindings are written there at each bind and
    read back at start, so that a restarted server knows which processes an adopted holder
    was (`gone`). Thread-safe: the orchestrator's authenticator binds on the event loop while
    the node agent resolves a job's processes in worker threads (a bind's forgetting of empty
    scopes ran beside a resolver's and raised "dictionary changed size during iteration")."""

    def __init__(self, path: Path | None = None) -> None:
        self._lock = threading.RLock()  # every method that reads or changes the bindings holds it
        self._job_of: dict[Scope, str] = {}
        self._owner: dict[str, int] = {}  # job -> uid
        self._born: dict[Scope, int | None] = {}  # a process group's leader's start time when bound
        self._callers: dict[Scope, dict[int, int | None]] = {}  # pid -> start time of who acted for the group's own job
        self._ended: dict[str, int] = {}  # job whose last scope was forgotten empty -> its owner, oldest first
        self._cgroup2 = cgroup2_root()  # where cgroup scopes are looked up (mounted once, read once)
        self._path = path
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        """The bindings an earlier server wrote to `path`; none when it is missing or unreadable
        (logged): then an adopted holder waits for its lease as before."""
        try:
            data = json.loads(path.read_text())
            for entry in data["bindings"]:
                scope = Scope(entry["kind"], str(entry["key"]))
                self._job_of[scope] = str(entry["job"])
                self._born[scope] = entry["born"]
                self._owner.setdefault(str(entry["job"]), int(entry["uid"]))
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("job bindings %s unreadable, starting without them: %s", path, err)
            self._job_of.clear()
            self._born.clear()
            self._owner.clear()

    def _save(self) -> None:
        if self._path is None:
            return
        data = {"bindings": [{"job": job, "kind": scope.kind, "key": scope.key, "born": self._born.get(scope),
                              "uid": self._owner.get(job, 0)} for scope, job in self._job_of.items()]}
        try:
            write_atomic(self._path, json.dumps(data).encode())
        except OSError as err:  # a restart then waits a lease for a holder that is gone, nothing worse
            log.warning("job bindings not written to %s: %s", self._path, err)

    @_locked
    def gone(self, job: str, proc: Path = Path("/proc")) -> bool:
        """Whether `job` had processes bound and none of its processes is alive now (a holder
        killed with its process group, a restarted server's adopted holder that exited: nothing
        of it can compute), also once its scopes were forgotten (another job's bind forgets
        empty scopes) until it binds again. Its processes are the ones `processes` finds: a
        worker that left its job's process group or double-forked, and a process group of a
        named job that never called, are the job's as long as TIMESLICE_JOB names it (a helper's
        attack on serve's dead-holder drop: the job was dropped while such a worker computed
        beside the next holder). Cheap while a bound scope lives (`killpg`); else a scan of /proc."""
        scopes = [s for s, j in self._job_of.items() if j == job]
        if not scopes and job not in self._ended:
            return False  # never bound here: not ours to call gone
        if any(self._alive(s) for s in scopes):
            return False
        return not self.processes(job, proc)

    @_locked
    def owners(self, job: str) -> set[int]:
        """The uids whose processes named by TIMESLICE_JOB=`job` are the job's: its owner's,
        also once its scopes were forgotten (`named`; 0: any uid's)."""
        if any(j == job for j in self._job_of.values()):
            return {self._owner.get(job, 0)}
        return {self._ended[job]} if job in self._ended else set()

    @_locked
    def processes(self, job: str, proc: Path = Path("/proc")) -> list[int]:
        """Live PIDs of `job`, ascending: those of its scopes (`members`: and their descendants
        that left them) and its owner's processes named by TIMESLICE_JOB=`job` (`named`),
        never another job's process group. The one definition of a job's processes in one-box
        mode: the node agent moves these (`PeerProcessResolver`), and `gone` is none of them."""
        def elsewhere(scope: Scope) -> bool:  # another job's scope: its processes are that job's
            return self._job_of.get(scope) not in (None, job)

        pids = {p for scope, uid in self.scopes(job) for p in members(scope, uid, proc, elsewhere)}
        pids |= {p for uid in self.owners(job) for p in named(job, uid, proc, elsewhere)}
        return sorted(pids)

    @_locked
    def bind(self, job: str, caller: PeerCredentials, scope: Scope) -> None:
        """`caller`, in `scope`, acts for `job`: the scope's processes become the job's.
        Raises PermissionDenied: the job is another uid's (root may act for any), or the
        scope already belongs to another job."""
        other = self._job_of.get(scope)
        if other == job and self._alive(scope):
            return
        self._forget_empty()
        owner = self._owner.get(job)
        if owner is not None and owner != caller.uid and caller.uid != 0:
            raise PermissionDenied(f"job {job!r} belongs to uid {owner}; process {caller.pid} (uid {caller.uid}) "
                                   "cannot act for it")
        other = self._job_of.get(scope)
        if other is not None:
            raise PermissionDenied(
                f"process {caller.pid} cannot act for job {job!r}: it is in {scope}, which belongs to job "
                f"{other!r}: one {scope.kind} cannot be two jobs (each job's processes are moved together). Start "
                "each job in its own process group (its own shell command line, or `setsid`) or its own cgroup "
                "(`systemd-run --user --scope`)")
        self._job_of[scope] = job
        self._ended.pop(job, None)
        self._born[scope] = start_time(int(scope.key)) if scope.kind == "process-group" else None
        self._owner.setdefault(job, caller.uid)
        self._save()
        log.info("job bound job=%s scope=%s uid=%d pid=%d", job, scope, caller.uid, caller.pid)

    @_locked
    def unrelated_caller(self, scope: Scope, caller: PeerCredentials) -> int | None:
        """`caller` acts for the job `scope` stands for when nobody names one (`pgid-<N>`):
        the PID of a live earlier caller of it that is not of one job with `caller`
        (`one_job`: two jobs of one launcher, `make -j` or `timeout` in one process group),
        else None, and then `caller` is recorded. Cgroup scopes: always None (a cgroup is
        made for a job: Slurm, `systemd-run --scope`)."""
        if scope.kind != "process-group":
            return None
        callers = self._callers.setdefault(scope, {})
        for pid, born in list(callers.items()):
            if start_time(pid) != born or born is None:
                del callers[pid]
        if caller.pid not in callers:
            other = next((pid for pid in callers if not one_job(caller.pid, pid)), None)
            if other is not None:
                return other
            callers[caller.pid] = start_time(caller.pid)
        return None

    @_locked
    def owned_by(self, job: str, uid: int) -> bool:
        """Whether `job` has live processes bound and belongs to `uid`."""
        return bool(self.scopes(job)) and self._owner.get(job) == uid

    @_locked
    def job_of(self, scope: Scope) -> str | None:
        """The job `scope` is bound to (None: none yet)."""
        return self._job_of.get(scope)

    @_locked
    def scopes(self, job: str) -> list[tuple[Scope, int]]:
        """[(scope, owner uid)] of `job` ([] when none is bound). Scopes whose processes
        are all gone are dropped first, so that a reused pgid is never taken for the job."""
        self._forget_empty()
        uid = self._owner.get(job, 0)
        return [(s, uid) for s, j in self._job_of.items() if j == job]

    @_locked
    def _forget_empty(self) -> None:
        for scope in [s for s in self._job_of if not self._alive(s)]:
            job = self._job_of.pop(scope)
            self._born.pop(scope, None)
            self._callers.pop(scope, None)
            if job not in self._job_of.values():
                if (owner := self._owner.pop(job, None)) is not None:
                    self._ended[job] = owner
                if len(self._ended) > MAX_ENDED_JOBS:  # (the oldest then waits for its lease, as before)
                    del self._ended[next(iter(self._ended))]

    def _alive(self, scope: Scope) -> bool:
        """Whether `scope` still holds the processes it was bound for. A process group whose
        number now leads a newer process (its old processes all gone, the PID reused: with
        `--socket-mode 660` another user's group took the victim's job binding, and the
        agent never moved the victim's processes) is not, nor one left with unreaped zombies only
        (killed with its group while its launcher waited for another job: `killpg` still finds
        them), nor a cgroup left empty (`cgroup.events` says `populated 0`: its processes were
        killed, and nothing removed it)."""
        if scope.kind == "process-group":
            try:
                os.killpg(int(scope.key), 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                pass
            born, now = self._born.get(scope), start_time(int(scope.key))
            if now is None:  # its leader ended (or is an unreaped zombie): alive while another member lives
                return bool(members(scope, 0, elsewhere=lambda _: True))
            return born is None or now == born
        if self._cgroup2 is None:
            return False
        path = self._cgroup2 / scope.key.lstrip("/")
        try:
            return b"populated 1" in (path / "cgroup.events").read_bytes()
        except OSError:  # (no such file: gone, or a hierarchy without it: its folder says)
            return path.is_dir()
