"""Local directories that no other user can swap or plant files in.

Owned by the driver package; used where one-box mode keeps files other local users must not
reach: `timeslice serve`'s socket, `timeslice acquire`'s hold files. Without
`$XDG_RUNTIME_DIR` their default place is `/tmp/timeslice-<uid>`, a name another user can
create first: with a symbolic link planted there `timeslice acquire` overwrote the victim's
own file, and with a socket planted there a fake orchestrator received a job's checkpointed
state (issue 23). The rule is OpenSSH's for its key files: the directory and every directory
above it must be owned by this user or root, and writable by no one else unless sticky (as
`/tmp` is: others cannot remove or rename what they do not own there).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

__all__ = ["free_socket_path", "lock_state_dir", "private_dir"]


def private_dir(path: Path, mode: int = 0o700) -> Path:
    """Make directory `path` (its missing parents too; `mode` for those made) once the
    directories above it pass the rule above, then check it and them again. Returns `path`.
    Raises OSError naming the first directory that fails the rule and what to do (remove
    it, or choose another place), or when it cannot be made; nothing is made then below a
    directory that fails."""
    path = Path(os.path.abspath(path))
    missing = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    _check(missing[-1].parent if missing else path)
    for p in reversed(missing):
        try:
            os.mkdir(p, mode)
        except FileExistsError:  # made meanwhile: checked below like any other
            pass
    _check(path)
    return path


def _check(path: Path) -> None:
    """Raise OSError unless `path` and every directory above it follow the rule."""
    me = os.geteuid()
    for p in (path, *path.parents):
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode) and p == path:
            raise OSError(f"{p} is a symbolic link: remove it (another user may have planted it), or choose "
                          "another place")
        if stat.S_ISLNK(st.st_mode):
            st = os.stat(p)  # a link above (/var/run -> /run): the directory it names is checked
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(f"{p} is not a directory")
        if st.st_uid not in (me, 0):
            raise OSError(f"{p} belongs to uid {st.st_uid}, not to this user (uid {me}) or root: another user "
                          "could swap what is in it; remove it, or choose another place (for example set "
                          "XDG_RUNTIME_DIR)")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise OSError(f"{p} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): they could swap "
                          "what is in it; chmod go-w it, or choose another place")


def free_socket_path(path: Path) -> None:
    """Make `path` free for a unix socket server to bind: a socket file no server answers on (a
    leftover of one that is gone) is removed. Raises OSError when a live server listens there
    (binding would take its path over: a second `timeslice node-agent` on the default socket
    did, and removed it on exit, and the first one could no longer be reached) or the path is
    not a socket."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise OSError(f"{path} exists and is not a socket: remove it or choose another path")
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(path))
            raise OSError(f"{path}: another server is listening there: stop it, or choose another path")
        except ConnectionRefusedError:  # a leftover of a server that is gone
            path.unlink()
        finally:
            probe.close()


@contextlib.contextmanager
def lock_state_dir(state_dir: Path, command: str = "serve") -> Iterator[None]:
    """Hold an exclusive lock (`flock`, released by the kernel however the process ends) on
    `state_dir`/<command>.lock while `timeslice <command>` serves. Raises OSError when another
    holds it: two serves (or node agents) on one state dir share its agent's records, and the
    second one's stop thawed the first one's frozen job while another job held (a new user's
    trial: two serves, other sockets, the default state dir)."""
    fd = os.open(state_dir / f"{command}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(f"{state_dir}: another timeslice {command} uses this state dir (its jobs' records): stop "
                          "it, or give this one --state-dir") from None
        yield
    finally:
        os.close(fd)
