"""Where the timeslice-vmm shim is (`shim/timeslice_vmm.c`, backend `vmm`), and how a process loads it.

The shim is built when the package is installed (a setuptools extension module of no Python:
`pip install` compiles it with the machine's C compiler; it needs no CUDA headers) and lands
beside this module. A job's processes load it with `LD_PRELOAD` (`preload_env`): `timeslice
serve` prints it in its ready line for groups on `vmm`, the kubelet plugin puts it in the
container through the claim's CDI device.
"""

from __future__ import annotations

import os
from pathlib import Path

LIBRARY_NAME = "libtimeslice_vmm.so"
DIR_ENV = "TIMESLICE_VMM_DIR"  # where the shim's control sockets are: <dir>/<pid>.sock


def default_dir(uid: int) -> str:
    """The shim's socket folder when DIR_ENV is unset: one per user (a folder of one user's
    would keep every other user's shim from listening)."""
    return f"/tmp/timeslice-vmm-{uid}"


def library() -> Path:
    """The installed shim (an absolute path). Raises FileNotFoundError when this install has
    none (it was built without a C compiler)."""
    here = Path(__file__).resolve().parent
    for found in sorted(here.glob("_timeslice_vmm*.so")):
        return found
    raise FileNotFoundError(f"the timeslice-vmm shim is not installed in {here} (reinstall with a C compiler)")


def preload_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the shim added in front of its LD_PRELOAD."""
    out = dict(os.environ if env is None else env)
    lib = str(library())
    rest = [p for p in out.get("LD_PRELOAD", "").split() if p and p != lib]
    out["LD_PRELOAD"] = " ".join([lib, *rest])
    return out


CONTAINER_PATH = "/usr/local/lib/timeslice/" + LIBRARY_NAME  # where a claim's containers see it (CDI mount)


def install_for_containers(state_dir: Path) -> tuple[str, str]:
    """Copy the installed shim to `state_dir`/LIBRARY_NAME (the kubelet plugin's state folder, the same
    path on the host as in the plugin's pod), atomically, for the container runtime to bind-mount into
    the containers of claims on backend `vmm`. Returns (host path, container path): a CDI mount.
    Raises FileNotFoundError (no shim installed) or OSError (the copy failed)."""
    src = library()
    dest = state_dir / LIBRARY_NAME
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    tmp.write_bytes(src.read_bytes())
    tmp.chmod(0o755)
    os.replace(tmp, dest)
    return str(dest), CONTAINER_PATH
