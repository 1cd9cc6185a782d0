"""One way to write a small state file so that a crash leaves the old or the new content.

Owned by the driver package; used by the node agent's records and the orchestrator's
epoch floors. Write to a temporary file in the same directory (a name no loader reads:
a leading dot and `.tmp`), fsync it, rename it over the target (POSIX `rename` is
atomic), fsync the directory. A failed write removes its temporary file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data`. Raises OSError (the target is left as it was)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dirfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)
