"""Container images for the local cluster, built without Docker or a registry.

Each image is written as a docker-archive tarball (manifest.json + config +
uncompressed layer tars), which `ctr images import` accepts:

  pause    catatonit (static, Debian) as /pause, run with -P (pause mode)
  busybox  busybox-static plus one symlink per applet
  python   a Debian rootfs made with debootstrap (minbase + python3), plus an
           optional second layer holding wheels installed with pip --target

Tarballs are cached under <cache>/images/ keyed by their inputs.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

EPOCH = "1970-01-01T00:00:00Z"
BASE_RECIPE = "r1"  # bump when the python base recipe changes
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


def _sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_docker_archive(out: Path, ref: str, layers: list[Path], config: dict) -> None:
    """Assemble a docker-archive tarball for `ref` from uncompressed layer tars."""
    diff_ids = [_sha256_file(layer) for layer in layers]
    cfg = {
        "architecture": ARCH,
        "os": "linux",
        "created": EPOCH,
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for d in diff_ids]},
        "history": [{"created": EPOCH, "created_by": "timeslice-dra hack/images.py"} for _ in layers],
    }
    cfg_bytes = json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()
    cfg_name = hashlib.sha256(cfg_bytes).hexdigest() + ".json"
    manifest = [{"Config": cfg_name, "RepoTags": [ref],
                 "Layers": [f"{d}/layer.tar" for d in diff_ids]}]
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as t:
        def add_bytes(name: str, data: bytes) -> None:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mode = 0o644
            t.addfile(ti, io.BytesIO(data))
        add_bytes(cfg_name, cfg_bytes)
        for d, layer in zip(diff_ids, layers):
            ti = t.gettarinfo(str(layer), arcname=f"{d}/layer.tar")
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            ti.mtime = 0
            with open(layer, "rb") as f:
                t.addfile(ti, f)
        add_bytes("manifest.json", json.dumps(manifest).encode())
    tmp.rename(out)


class _LayerWriter:
    """Small helper to write a layer tar entry by entry (root-owned, mtime 0)."""

    def __init__(self, path: Path):
        self.t = tarfile.open(path, "w", format=tarfile.PAX_FORMAT)

    def _ti(self, name: str, type_: bytes, mode: int) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type = type_
        ti.mode = mode
        ti.uid = ti.gid = 0
        ti.mtime = 0
        return ti

    def dir(self, name: str, mode: int = 0o755) -> None:
        self.t.addfile(self._ti(name, tarfile.DIRTYPE, mode))

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        ti = self._ti(name, tarfile.REGTYPE, mode)
        ti.size = len(data)
        self.t.addfile(ti, io.BytesIO(data))

    def symlink(self, name: str, target: str) -> None:
        ti = self._ti(name, tarfile.SYMTYPE, 0o777)
        ti.linkname = target
        self.t.addfile(ti)

    def close(self) -> None:
        self.t.close()


def _base_dirs(w: _LayerWriter) -> None:
    for d in ("dev", "proc", "sys", "etc", "root", "var", "run"):
        w.dir(d, 0o700 if d == "root" else 0o755)
    w.dir("tmp", 0o1777)
    w.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    w.file("etc/group", b"root:x:0:\nnogroup:x:65534:\n")


def build_pause(out: Path, ref: str, catatonit: str = "/usr/bin/catatonit") -> Path:
    key = hashlib.sha256((ref + _sha256_file(Path(catatonit))).encode()).hexdigest()[:16]
    tar = out / f"pause-{key}.tar"
    if tar.exists():
        return tar
    out.mkdir(parents=True, exist_ok=True)
    layer = out / "pause-layer.tar"
    w = _LayerWriter(layer)
    _base_dirs(w)
    w.file("pause", Path(catatonit).read_bytes(), 0o755)
    w.close()
    write_docker_archive(tar, ref, [layer], {"Entrypoint": ["/pause", "-P"], "WorkingDir": "/"})
    layer.unlink()
    return tar


def build_busybox(out: Path, ref: str, busybox: str = "/bin/busybox") -> Path:
    key = hashlib.sha256((ref + _sha256_file(Path(busybox))).encode()).hexdigest()[:16]
    tar = out / f"busybox-{key}.tar"
    if tar.exists():
        return tar
    out.mkdir(parents=True, exist_ok=True)
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    layer = out / "busybox-layer.tar"
    w = _LayerWriter(layer)
    _base_dirs(w)
    w.dir("bin")
    w.file("bin/busybox", Path(busybox).read_bytes(), 0o755)
    for a in sorted(set(applets)):
        if a != "busybox" and "/" not in a:
            w.symlink(f"bin/{a}", "busybox")
    w.close()
    write_docker_archive(tar, ref, [layer], {
        "Env": ["PATH=/bin"], "Cmd": ["sh"], "WorkingDir": "/"})
    layer.unlink()
    return tar


def _debian_mirror() -> str:
    for src in sorted(Path("/etc/apt").glob("sources.list.d/*.sources")):
        m = re.search(r"^URIs:\s*(\S+)", src.read_text(), re.M)
        if m and "security" not in m.group(1):
            return m.group(1)
    sl = Path("/etc/apt/sources.list")
    if sl.exists():
        m = re.search(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s", sl.read_text(), re.M)
        if m:
            return m.group(1)
    return "http://deb.debian.org/debian"


def _suite() -> str:
    m = re.search(r"^VERSION_CODENAME=(\S+)", Path("/etc/os-release").read_text(), re.M)
    return m.group(1) if m else "bookworm"


def _umount_below(root: Path) -> None:
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for m in sorted((m for m in mounts if m.startswith(str(root) + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], check=False)


def _python_base_layer(out: Path, log) -> Path:
    """Debian minbase + python3 rootfs as an uncompressed layer tar (cached)."""
    suite = _suite()
    layer = out / f"python-base-{suite}-{ARCH}-{BASE_RECIPE}.layer.tar"
    if layer.exists():
        return layer
    rootfs = out / "python-rootfs.tmp"
    if rootfs.exists():
        _umount_below(rootfs)
        shutil.rmtree(rootfs)
    mirror = _debian_mirror()
    blog = out / "debootstrap.log"
    log(f"debootstrap {suite} (minbase + python3) from {mirror} (log: {blog})")
    t0 = time.monotonic()
    with open(blog, "w") as f:
        rc = subprocess.run(
            ["debootstrap", "--variant=minbase", "--include=python3,ca-certificates",
             f"--arch={ARCH}", suite, str(rootfs), mirror],
            stdout=f, stderr=subprocess.STDOUT).returncode
    _umount_below(rootfs)
    if rc != 0:
        lines = blog.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"debootstrap failed (exit {rc}); last lines of {blog}:\n" + "\n".join(lines))
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
                 "usr/share/info", "var/log", "var/cache/debconf"):
        p = rootfs / junk
        if p.is_dir():
            for child in p.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                elif child.name != "lock":
                    child.unlink()
    for d in ("dev", "proc", "sys"):
        p = rootfs / d
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(mode=0o755)
    (rootfs / "etc/resolv.conf").unlink(missing_ok=True)
    (rootfs / "etc/hostname").unlink(missing_ok=True)
    tmp = layer.with_suffix(".tmp")
    entries = sorted(os.listdir(rootfs))
    subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "--sort=name", "--mtime=@0",
                    "-cf", str(tmp), *entries], check=True)
    tmp.rename(layer)
    shutil.rmtree(rootfs)
    log(f"python base layer ready ({time.monotonic() - t0:.0f}s, "
        f"{layer.stat().st_size >> 20} MiB)")
    return layer


def _image_python_version(base_layer: Path) -> str:
    with tarfile.open(base_layer) as t:
        for name in t.getnames():
            m = re.fullmatch(r"usr/bin/python(3\.\d+)", name)
            if m:
                return m.group(1)
    raise RuntimeError("no usr/bin/python3.X in the python base layer")


def _with_extras(wheel: Path) -> str:
    """`<wheel>[extras]` for our own wheel: $TIMESLICE_PY_EXTRAS (default `server,kubernetes`),
    so the image runs the node plugin and the controller as well as the client."""
    extras = os.environ.get("TIMESLICE_PY_EXTRAS", "server,kubernetes")
    return f"{wheel}[{extras}]" if wheel.name.startswith("timeslice_dra-") and extras else str(wheel)


def _wheels_layer(out: Path, wheels: Path, pyver: str, log) -> Path:
    files = sorted(wheels.glob("*.whl"))
    if not files:
        raise RuntimeError(f"no *.whl files in {wheels}")
    h = hashlib.sha256((pyver + os.environ.get("TIMESLICE_PY_EXTRAS", "server,kubernetes")).encode())
    for f in files:
        h.update(f.name.encode() + _sha256_file(f).encode())
    key = h.hexdigest()[:16]
    layer = out / f"python-wheels-{key}.layer.tar"
    if layer.exists():
        return layer
    host = f"{sys.version_info.major}.{sys.version_info.minor}"
    if host != pyver:
        raise RuntimeError(f"host Python {host} differs from the image's Python {pyver}; "
                           "run the image build with a matching python3")
    stage = out / "python-wheels.tmp"
    shutil.rmtree(stage, ignore_errors=True)
    target = stage / f"usr/local/lib/python{pyver}/dist-packages"
    target.mkdir(parents=True)
    log(f"pip install {len(files)} wheel(s) from {wheels} into the python image")
    # Dependencies not present in the wheel directory come from PyPI. --no-warn-conflicts: pip
    # checks the new packages against those of the Python running it (the host's, which the
    # image does not get) and printed an ERROR about them (issue 12, item 14); what goes into
    # the target is resolved together by this one install.
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--no-warn-conflicts",
                    "--disable-pip-version-check", "--root-user-action=ignore", "--target", str(target),
                    "--find-links", str(wheels), *(_with_extras(f) for f in files)], check=True)
    bindir = target / "bin"
    if bindir.is_dir():  # console scripts: move to /usr/local/bin, fix the shebang
        dst = stage / "usr/local/bin"
        dst.mkdir(parents=True, exist_ok=True)
        for s in bindir.iterdir():
            data = s.read_bytes()
            if data.startswith(b"#!"):
                data = b"#!/usr/bin/python3" + data[data.index(b"\n"):]
            (dst / s.name).write_bytes(data)
            (dst / s.name).chmod(0o755)
        shutil.rmtree(bindir)
    tmp = layer.with_suffix(".tmp")
    subprocess.run(["tar", "-C", str(stage), "--numeric-owner", "--owner=0", "--group=0",
                    "--sort=name", "--mtime=@0", "-cf", str(tmp), "usr"], check=True)
    tmp.rename(layer)
    shutil.rmtree(stage)
    return layer


def build_python(out: Path, ref: str, wheels: Path | None, log=print) -> tuple[Path, list[Path]]:
    """Return the image tarball and the layer files it was made from."""
    out.mkdir(parents=True, exist_ok=True)
    base = _python_base_layer(out, log)
    layers = [base]
    pyver = _image_python_version(base)
    if wheels:
        layers.append(_wheels_layer(out, wheels, pyver, log))
    key = hashlib.sha256((ref + "".join(p.name for p in layers)).encode()).hexdigest()[:16]
    tar = out / f"python-{key}.tar"
    if not tar.exists():
        write_docker_archive(tar, ref, layers, {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "LANG=C.UTF-8", "PYTHONUNBUFFERED=1"],
            "Cmd": ["python3"], "WorkingDir": "/"})
    return tar, layers


def prune(out: Path, keep: list[Path]) -> None:
    """Remove image tarballs and wheel layers of earlier inputs (the base layer stays)."""
    keep_names = {p.name for p in keep}
    for pattern in ("pause-*.tar", "busybox-*.tar", "python-*.tar", "python-wheels-*.layer.tar"):
        for p in out.glob(pattern):
            if p.name not in keep_names and not p.name.startswith("python-base-"):
                p.unlink(missing_ok=True)
