"""DriverRoot: the NVIDIA driver's user-space libraries under a driver root.

Owned by the kubelet plugin (`--driver-root`). The plugin image carries no driver: the
node's is mounted at `path` (the chart's `driver.root`: `/` for a driver installed on the
host, `/run/nvidia/driver` for the GPU operator's driver container). At start the plugin
loads `libnvidia-ml.so.1` (and `libcuda.so.1`, for the checkpoint backends) from there by
full path, so NVML (`nvidia-ml-py` opens the bare soname) and cuda-bindings find them; a
node without them is refused at start with what was searched, rather than failing at the
first claim. Each prepared claim's CDI spec bind-mounts the libraries a CUDA workload opens
(those of NVIDIA's container toolkit for the `compute` and `utility` capabilities:
`nvidia-container-toolkit`, `internal/discover` and its CDI generator) read-only into
`CONTAINER_LIB_DIR`, `/usr/local/nvidia/lib64`, which the images built on `nvidia/cuda`
(PyTorch's, vLLM's, SGLang's) already list in `LD_LIBRARY_PATH`; other images add it.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from timeslice.driver.errors import GpuDiscoveryError

log = logging.getLogger("timeslice.kubelet_plugin")

# Where distributions and the driver's own installer put its libraries, relative to the root.
LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "lib64", "usr/lib")
NVML = "libnvidia-ml.so.1"
CUDA = "libcuda.so.1"
# What a CUDA workload opens: the driver API, NVML (nvidia-smi, PyTorch's memory queries), the
# PTX JIT (kernels built for another architecture), NVVM (Triton, numba) and the debugger
# back-end; libraries of the driver absent here are skipped.
WORKLOAD_LIBRARIES = (CUDA, NVML, "libnvidia-ptxjitcompiler.so.1", "libnvidia-nvvm.so.4", "libcudadebugger.so.1")
CONTAINER_LIB_DIR = "/usr/local/nvidia/lib64"


@dataclass(frozen=True)
class DriverRoot:
    """`path`: the driver root as this process sees it; `host_path`: the same directory on
    the node (what a CDI mount's `hostPath` names; the container runtime reads it there)."""

    path: Path
    host_path: Path

    def libraries(self) -> dict[str, Path]:
        """Soname -> the file it resolves to, relative to the root (a symlink within the root
        followed, as the loader would), for each of `WORKLOAD_LIBRARIES` found in `LIB_DIRS`
        (the first directory holding it wins)."""
        found: dict[str, Path] = {}
        for name in WORKLOAD_LIBRARIES:
            for d in LIB_DIRS:
                rel = self._resolve(Path(d) / name)
                if rel is not None:
                    found[name] = rel
                    break
        return found

    def _resolve(self, rel: Path) -> Path | None:
        """`rel` resolved inside the root as the kernel would inside a chroot there: component by
        component, each symlink followed (an absolute one from the root, `..` never above it),
        so a linked directory on the way is the root's, never this container's. Returns the
        path relative to the root, with no link left in it, when it names a file; else None."""
        todo, cur, hops = list(rel.parts), Path(), 0
        while todo:
            part = todo.pop(0)
            if part in ("", ".", "/"):
                continue
            if part == "..":
                cur = cur.parent
                continue
            nxt = cur / part
            full = self.path / nxt
            if full.is_symlink():
                hops += 1
                if hops > 40:  # the kernel's own bound on links followed (MAXSYMLINKS)
                    return None
                target = Path(os.readlink(full))
                if target.is_absolute():
                    cur = Path()
                todo = [*target.parts, *todo]
                continue
            cur = nxt
        return cur if (self.path / cur).is_file() else None

    def load(self) -> None:
        """Load NVML and the CUDA driver library from the root (RTLD_GLOBAL: later opens of
        their sonames get these). Raises GpuDiscoveryError naming what was searched when NVML
        is not there (no driver on this node, or a wrong `driver.root`)."""
        libs = self.libraries()
        if NVML not in libs:
            searched = ", ".join(str(self.path / d) for d in LIB_DIRS)
            raise GpuDiscoveryError(
                f"no NVIDIA driver under the driver root {self.host_path} (mounted at {self.path}): {NVML} is in none "
                f"of {searched}. On a node without NVIDIA GPUs, keep the plugin off it (the chart's "
                "kubeletPlugin.nodeSelector); with the GPU operator's driver container, set driver.root to "
                "/run/nvidia/driver")
        for name in (NVML, CUDA):
            if name in libs:
                ctypes.CDLL(str(self.path / libs[name]), mode=ctypes.RTLD_GLOBAL)
        log.info("driver root %s: %s", self.host_path, " ".join(f"{n}={p}" for n, p in sorted(libs.items())))

    def mounts(self) -> tuple[tuple[str, str], ...]:
        """(host path, container path) of each library to bind-mount into a claim's containers."""
        return tuple((str(self.host_path / rel), f"{CONTAINER_LIB_DIR}/{name}")
                     for name, rel in sorted(self.libraries().items()))
