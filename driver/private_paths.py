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

import os
import stat
from pathlib import Path

__all__ = ["private_dir"]


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
