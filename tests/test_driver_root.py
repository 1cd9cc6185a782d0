"""The NVIDIA driver under a driver root (kubelet_plugin/driver_root.py, issue 24 item 2): the
libraries are found as the loader would (links followed inside the root, an absolute link read
under it, as in the GPU operator's driver container), claims' CDI specs bind-mount them by their
node path, and `timeslice kubelet-plugin` refuses a node without the driver in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from timeslice.driver.errors import GpuDiscoveryError
from timeslice.kubelet_plugin import cdi
from timeslice.kubelet_plugin.driver_root import CONTAINER_LIB_DIR, DriverRoot


def driver_tree(root: Path) -> None:
    """A driver as distributions and the GPU operator lay it out (files are stand-ins)."""
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "usr/lib64").mkdir(parents=True)
    (root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.65").write_bytes(b"elf")
    (root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.580.65")
    (root / "usr/lib64/libcuda.so.580.65").write_bytes(b"elf")
    (root / "usr/lib64/libcuda.so.1").symlink_to("/usr/lib64/libcuda.so.580.65")  # absolute: the root's own /
    (root / "usr/lib64/libnvidia-nvvm.so.4").symlink_to("../../../outside.so")  # out of the root: skipped


def test_libraries_are_found_as_the_loader_would_inside_the_root(tmp_path: Path) -> None:
    driver_tree(tmp_path / "root")
    root = DriverRoot(tmp_path / "root", Path("/run/nvidia/driver"))
    assert root.libraries() == {"libnvidia-ml.so.1": Path("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.65"),
                                "libcuda.so.1": Path("usr/lib64/libcuda.so.580.65")}
    assert root.mounts() == (("/run/nvidia/driver/usr/lib64/libcuda.so.580.65", f"{CONTAINER_LIB_DIR}/libcuda.so.1"),
                             ("/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.65",
                              f"{CONTAINER_LIB_DIR}/libnvidia-ml.so.1"))


def test_claims_cdi_specs_bind_mount_the_libraries_read_only(tmp_path: Path) -> None:
    driver_tree(tmp_path / "root")
    mounts = DriverRoot(tmp_path / "root", Path("/")).mounts()
    spec = cdi.ClaimSpec("uid-1", "ns", "c", (cdi.CdiDevice("gpu-0", "GPU-x", ("/dev/nvidia0",)),), mounts=mounts)
    edits = json.loads(cdi.write(tmp_path / "cdi", spec).read_text())["containerEdits"]
    assert edits["mounts"] == [
        {"hostPath": "/usr/lib64/libcuda.so.580.65", "containerPath": "/usr/local/nvidia/lib64/libcuda.so.1",
         "options": ["ro", "nosuid", "nodev", "bind"]},
        {"hostPath": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.65",
         "containerPath": "/usr/local/nvidia/lib64/libnvidia-ml.so.1", "options": ["ro", "nosuid", "nodev", "bind"]}]
    assert "mounts" not in cdi.render(cdi.ClaimSpec("uid-2", "ns", "c", ()))["containerEdits"]  # none given


def test_a_root_without_the_driver_is_refused_naming_what_was_searched(tmp_path: Path) -> None:
    with pytest.raises(GpuDiscoveryError, match=r"no NVIDIA driver under the driver root /host .*libnvidia-ml\.so\.1"):
        DriverRoot(tmp_path, Path("/host")).load()


def test_the_kubelet_plugin_refuses_a_node_without_the_driver_in_one_line(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "timeslice.cli.main", "kubelet-plugin", "--node-name", "n",
                        "--driver-root", str(tmp_path), "--driver-root-host", "/", "--state-dir", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("timeslice kubelet-plugin: error: no NVIDIA driver under the driver root / ")
    assert "Traceback" not in p.stderr and "nodeSelector" in p.stderr


def test_a_linked_directory_on_the_way_is_the_roots_not_the_plugins(tmp_path: Path) -> None:
    """The GPU operator's driver root links directories absolutely (usr/lib/x86_64-linux-gnu ->
    /usr/lib64): read under the root, never in the plugin's own file system (review, issue 24)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "usr/lib64").mkdir(parents=True)
    (root / "usr/lib64/libnvidia-ml.so.1").write_bytes(b"elf")
    (root / "usr/lib").mkdir()
    outside.mkdir()
    (outside / "libcuda.so.1").write_bytes(b"not the driver's")
    (root / "usr/lib/x86_64-linux-gnu").symlink_to("/usr/lib64")
    (root / "usr/lib/aarch64-linux-gnu").symlink_to(outside)  # absolute, to a place outside the root
    (root / "lib64").symlink_to("../../..")  # relative, above the root: clamped to it
    libs = DriverRoot(root, Path("/run/nvidia/driver")).libraries()
    assert libs == {"libnvidia-ml.so.1": Path("usr/lib64/libnvidia-ml.so.1")}
