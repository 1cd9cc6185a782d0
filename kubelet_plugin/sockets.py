"""Where the kubelet plugin's unix sockets live, and their life cycle on disk.

Owned by the kubelet plugin; used by `plugin_server`. Conventions of the upstream Go
helper (reference/dra-protocol.md §2): the DRA service listens on
`<plugin data dir>/dra.sock` (default `/var/lib/kubelet/plugins/<driver>/dra.sock`),
registration on `<registry dir>/<driver>-reg.sock` (default registry dir
`/var/lib/kubelet/plugins_registry`, watched by kubelet). A file left by an earlier
process is removed before binding, and ours are removed when we stop. (gRPC itself
unlinks whatever socket is there before binding, a live server's too, but not a regular
file or a symlink; we remove leftovers explicitly so that none blocks a start.)

One plugin process per driver and node: a second one is refused while the first serves
(a socket a server answers on is never removed; the plugin also locks its state dir), so
it cannot take the first one's sockets from the kubelet (rolling updates with per-pod
socket names are not supported yet).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("timeslice.kubelet_plugin.sockets")

KUBELET_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
KUBELET_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
DRA_SOCKET_NAME = "dra.sock"
UNIX_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes with the trailing NUL


@dataclass(frozen=True)
class SocketPaths:
    dra: Path
    registration: Path


def socket_paths(driver_name: str, plugin_data_dir: Path | None = None,
                 registry_dir: Path | None = None) -> SocketPaths:
    """Absolute socket paths for `driver_name`; None picks the kubelet's directories."""
    data = Path(plugin_data_dir) if plugin_data_dir is not None else KUBELET_PLUGINS_DIR / driver_name
    registry = Path(registry_dir) if registry_dir is not None else KUBELET_REGISTRY_DIR
    return SocketPaths(dra=(data / DRA_SOCKET_NAME).absolute(),
                       registration=(registry / f"{driver_name}-reg.sock").absolute())


def prepare_socket(path: Path) -> str:
    """Make `path` ready to bind: parent created, a leftover file that is no socket removed
    (not a folder); returns the gRPC address. A socket there is `grpc_server.bind`'s to judge
    (`private_paths.free_socket_path`): one no server answers on is removed, and a live one
    refuses the bind with OSError (a second plugin on the node must not take the first one's
    socket from the kubelet).

    Raises ValueError when the path is too long for a unix socket or is a directory.
    """
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise ValueError(f"socket path {path} is longer than {UNIX_PATH_MAX} bytes")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise ValueError(f"socket path {path} is a directory")
    if path.is_symlink() or (path.exists() and not path.is_socket()):
        log.info("removing a leftover file at the socket path path=%s", path)
        path.unlink()
    return f"unix://{path}"


def remove_socket(path: Path) -> None:
    """Remove our socket file, if still there."""
    if path.is_socket():
        path.unlink(missing_ok=True)
