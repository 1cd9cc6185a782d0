#!/usr/bin/env python3
"""Local single-node Kubernetes cluster for timeslice-dra e2e tests.

Everything is built from source (Go module proxy) and runs as plain host
processes: no Docker, no kind, no downloaded binaries.  See hack/README.md.

Verbs:  build | images | up | down | env | status
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HACK = Path(__file__).resolve().parent
REPO = HACK.parent
TOOLS = HACK / "tools"


# --------------------------------------------------------------------------- config

def read_versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (HACK / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip().strip('"')
    for k in list(out):  # environment overrides, e.g. K8S_VERSION=... (needs regenerated modules)
        if os.environ.get(k):
            out[k] = os.environ[k]
    return out


V = read_versions()
K8S_VERSION = V["K8S_VERSION"]
ETCD_VERSION = V["ETCD_VERSION"]
CONTAINERD_VERSION = V["CONTAINERD_VERSION"]
PAUSE_IMAGE = V["PAUSE_IMAGE"]
BUSYBOX_IMAGE = V["BUSYBOX_IMAGE"]
PYTHON_IMAGE = V["PYTHON_IMAGE"]

CACHE = Path(os.environ.get("TIMESLICE_CACHE") or Path.home() / ".cache" / "timeslice-dra")
STATE = Path(os.environ.get("TIMESLICE_STATE") or "/var/lib/timeslice-dra")
RUN = Path(os.environ.get("TIMESLICE_RUN") or "/run/timeslice-dra")
LOGS = Path(os.environ.get("TIMESLICE_LOGS") or "/var/log/timeslice-dra")
KUBELET_ROOT = Path("/var/lib/kubelet")  # DRA drivers expect the standard plugin paths below it

K8S_BIN = CACHE / f"k8s-{K8S_VERSION}" / "bin"
ETCD_BIN = CACHE / f"etcd-{ETCD_VERSION}" / "bin"
CTRD_BIN = CACHE / f"containerd-{CONTAINERD_VERSION}" / "bin"
IMAGES = CACHE / "images"

NODE_NAME = "127.0.0.1"  # --hostname-override: apiserver reaches the kubelet on loopback
APISERVER_PORT = 6443
ETCD_PORT = 2379
ETCD_PEER_PORT = 2380
KUBELET_PORT = 10250
SERVICE_CIDR = "10.0.0.0/24"
POD_CIDR = "10.88.0.0/16"
CNI_BRIDGE = "tsdra0"
CNI_BIN_DIR = "/usr/lib/cni"
RUNC = "/usr/sbin/runc"

# DRA is GA (on by default) in 1.34; the alpha gates below let the driver's optional modes
# (consumable capacity, partitionable devices, taints, health) be exercised.
DEFAULT_FEATURE_GATES = ",".join([
    "DRAAdminAccess=true",
    "DRAPrioritizedList=true",
    "DRAResourceClaimDeviceStatus=true",
    "DRAConsumableCapacity=true",
    "DRAPartitionableDevices=true",
    "DRADeviceTaints=true",
    "ResourceHealthStatus=true",
    "DRAExtendedResource=true",
])
FEATURE_GATES = os.environ.get("TIMESLICE_FEATURE_GATES", DEFAULT_FEATURE_GATES)
# resource.k8s.io/v1 is served by default from 1.34; older versions for older clients,
# v1alpha3 for DeviceTaintRule (gate DRADeviceTaints).
RUNTIME_CONFIG = os.environ.get(
    "TIMESLICE_RUNTIME_CONFIG",
    "resource.k8s.io/v1=true,resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true,"
    "resource.k8s.io/v1alpha3=true",
)

APT_PACKAGES = {
    # package: a file it installs that we check for
    "runc": RUNC,
    "containernetworking-plugins": f"{CNI_BIN_DIR}/bridge",
    "iptables": "/usr/sbin/iptables",
    "busybox-static": "/bin/busybox",
    "catatonit": "/usr/bin/catatonit",
    "openssl": "/usr/bin/openssl",
    "debootstrap": "/usr/sbin/debootstrap",
    "iproute2": "/usr/sbin/ip",
    "procps": "/usr/sbin/sysctl",
    "mount": "/usr/bin/mount",
    "ca-certificates": "/etc/ssl/certs/ca-certificates.crt",
}


class Fail(Exception):
    """A step failed; message names the component."""


def log(msg: str) -> None:
    try:
        print(f"[local-cluster {time.strftime('%H:%M:%S')}] {msg}", flush=True)
    except (BrokenPipeError, OSError):
        pass  # a closed stdout (e.g. `| head`) must not abort `down` halfway


def tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(lines[-n:])


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    kw.setdefault("check", True)
    return subprocess.run(cmd, **kw)


# --------------------------------------------------------------------------- apt

def ensure_packages(names: list[str] | None = None) -> None:
    names = names or list(APT_PACKAGES)
    missing = [p for p in names if not Path(APT_PACKAGES[p]).exists()]
    if not missing:
        return
    if os.geteuid() != 0:
        raise Fail(f"apt: missing packages {missing} and not root")
    if shutil.which("apt-get") is None:
        raise Fail(f"apt: missing packages {missing} and no apt-get (Debian/Ubuntu expected)")
    log(f"apt-get install {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env=env,
           check=False).returncode != 0:
        run(["apt-get", "update", "-q"], env=env)
        run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env=env)
    still = [p for p in missing if not Path(APT_PACKAGES[p]).exists()]
    if still:
        raise Fail(f"apt: {still} did not provide {[APT_PACKAGES[p] for p in still]}")


# --------------------------------------------------------------------------- build

def _version_of(binary: Path, args: list[str]) -> str:
    try:
        p = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=30)
        return p.stdout + p.stderr
    except (OSError, subprocess.TimeoutExpired):
        return ""


def k8s_binaries_ok() -> bool:
    want = K8S_VERSION
    for b in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet"):
        if f"Kubernetes {want}" not in _version_of(K8S_BIN / b, ["--version"]):
            return False
    out = _version_of(K8S_BIN / "kubectl", ["version", "--client", "-o", "json"])
    return f'"gitVersion": "{want}"' in out


def etcd_binaries_ok() -> bool:
    return f"etcd Version: {ETCD_VERSION.lstrip('v')}" in _version_of(ETCD_BIN / "etcd", ["--version"])


def containerd_binaries_ok() -> bool:
    want = re.compile(rf"(^|\s){re.escape(CONTAINERD_VERSION)}(\s|$)", re.M)
    return all(want.search(_version_of(CTRD_BIN / b, [flag])) for b, flag in (
        ("containerd", "--version"), ("ctr", "--version"), ("containerd-shim-runc-v2", "-v")))


def _module_time(mod: str, version: str, cwd: Path) -> str:
    """Commit time of a module version from the proxy's .info (deterministic build date)."""
    p = subprocess.run(["go", "mod", "download", "-json", f"{mod}@{version}"], cwd=cwd,
                       capture_output=True, text=True, env=_go_env())
    try:
        info = json.loads(p.stdout)
        return json.loads(Path(info["Info"]).read_text())["Time"]
    except (ValueError, KeyError, OSError):
        return "1970-01-01T00:00:00Z"


def _go_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # Go caches stay in their default places (~/.cache/go-build, ~/go/pkg/mod).
    env.pop("GOFLAGS", None)
    env.setdefault("GOTOOLCHAIN", "local")
    env.update(extra)
    return env


def _go_build(name: str, moddir: Path, out: Path, pkgs: list[str], tags: str, ldflags: str,
              cgo: str = "0", single: str | None = None) -> None:
    if shutil.which("go") is None:
        raise Fail(f"build {name}: the go command is not in PATH")
    tmp = out.parent / (out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    blog = CACHE / f"build-{name}.log"
    cmd = ["go", "build", "-mod=readonly", "-trimpath", "-tags", tags, "-ldflags", ldflags,
           "-o", str(tmp / single) if single else str(tmp) + "/", *pkgs]
    log(f"building {name} (log: {blog})")
    t0 = time.monotonic()
    with open(blog, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        timev = ["/usr/bin/time", "-v"] if Path("/usr/bin/time").exists() else []
        rc = subprocess.run(timev + cmd, cwd=moddir, stdout=f, stderr=subprocess.STDOUT,
                            env=_go_env(CGO_ENABLED=cgo)).returncode
    dt = time.monotonic() - t0
    if rc != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise Fail(f"build {name} failed (exit {rc}) after {dt:.0f}s; last lines of {blog}:\n"
                   + tail(blog))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"built {name} in {dt:.0f}s")
    with open(CACHE / "build-times.log", "a") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {name} {dt:.0f}s\n")


def build_k8s(force: bool = False) -> None:
    if not force and k8s_binaries_ok():
        log(f"k8s {K8S_VERSION}: cached binaries in {K8S_BIN}")
        return
    moddir = TOOLS / "k8s"
    minor = K8S_VERSION.split(".")[1]
    date = _module_time("k8s.io/kubernetes", K8S_VERSION, moddir)
    x = {"gitVersion": K8S_VERSION, "gitMajor": "1", "gitMinor": minor, "gitCommit": "",
         "gitTreeState": "archive", "buildDate": date}
    ld = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        ld += [f"-X '{pkg}.{k}={v}'" for k, v in x.items()]
    cmds = ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl"]
    _go_build("k8s", moddir, K8S_BIN, [f"k8s.io/kubernetes/cmd/{c}" for c in cmds],
              "selinux,notest", " ".join(ld))
    if not k8s_binaries_ok():
        raise Fail(f"build k8s: built binaries do not report {K8S_VERSION}")


def build_etcd(force: bool = False) -> None:
    if not force and etcd_binaries_ok():
        log(f"etcd {ETCD_VERSION}: cached binary in {ETCD_BIN}")
        return
    moddir = TOOLS / "etcd"
    # package go.etcd.io/etcd/server/v3 is etcd's main; name the binary explicitly
    _go_build("etcd", moddir, ETCD_BIN, ["go.etcd.io/etcd/server/v3"], "",
              f"-s -w -X 'go.etcd.io/etcd/api/v3/version.GitSHA={ETCD_VERSION}'", single="etcd")
    if not etcd_binaries_ok():
        raise Fail(f"build etcd: built binary does not report {ETCD_VERSION}")


def build_containerd(force: bool = False) -> None:
    if not force and containerd_binaries_ok():
        log(f"containerd {CONTAINERD_VERSION}: cached binaries in {CTRD_BIN}")
        return
    moddir = TOOLS / "containerd"
    p = "github.com/containerd/containerd/v2"
    ld = (f"-s -w -X '{p}/version.Version={CONTAINERD_VERSION}' "
          f"-X '{p}/version.Revision=module-{CONTAINERD_VERSION}' -X '{p}/version.Package={p}'")
    _go_build("containerd", moddir, CTRD_BIN,
              [f"{p}/cmd/containerd", f"{p}/cmd/containerd-shim-runc-v2", f"{p}/cmd/ctr"],
              "no_btrfs,no_devmapper,no_zfs", ld)
    if not containerd_binaries_ok():
        raise Fail(f"build containerd: built binaries do not report {CONTAINERD_VERSION}")


def build_all(force: bool = False) -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    build_k8s(force)
    build_etcd(force)
    build_containerd(force)
    log(f"binaries ready ({time.monotonic() - t0:.0f}s)")


# --------------------------------------------------------------------------- images

def build_images(wheels: Path | None) -> dict[str, Path]:
    sys.path.insert(0, str(HACK))
    import images
    try:
        python_tar, python_layers = images.build_python(IMAGES, PYTHON_IMAGE, wheels, log=log)
        tars = {
            "pause": images.build_pause(IMAGES, PAUSE_IMAGE),
            "busybox": images.build_busybox(IMAGES, BUSYBOX_IMAGE),
            "python": python_tar,
        }
        images.prune(IMAGES, [*tars.values(), *python_layers])
        return tars
    except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
        raise Fail(f"images: {e}") from e


# --------------------------------------------------------------------------- paths

PKI = STATE / "pki"
KCFG = STATE / "kubeconfig"
CONF = STATE / "config"
PIDS = STATE / "pids"
ADMIN_KUBECONFIG = KCFG / "admin.kubeconfig"
CTRD_SOCK = RUN / "containerd" / "containerd.sock"
CNI_CONF_DIR = STATE / "cni" / "net.d"
POD_LOGS = STATE / "pod-logs"
KUBELET_MARKER = KUBELET_ROOT / ".timeslice-dra"
SYSCTL_SAVED = STATE / "sysctl.saved.json"
# Kernel settings the kubelet (and the CNI bridge) may change; restored by `down`.
SYSCTLS = ["vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
           "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes", "net.ipv4.ip_forward"]


# --------------------------------------------------------------------------- PKI

def _openssl(*args: str) -> None:
    p = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise Fail(f"pki: openssl {' '.join(args[:2])} failed:\n{p.stderr}")


def _key(path: Path, rsa: bool = False) -> None:
    if rsa:
        _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(path))
    else:
        _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
    path.chmod(0o600)


def _cert(name: str, subj: str, usage: str, sans: list[str] | None = None) -> None:
    key, csr, crt, ext = (PKI / f"{name}.{x}" for x in ("key", "csr", "crt", "ext"))
    _key(key)
    _openssl("req", "-new", "-key", str(key), "-subj", subj, "-out", str(csr))
    lines = ["basicConstraints=critical,CA:FALSE",
             "keyUsage=critical,digitalSignature,keyEncipherment",
             f"extendedKeyUsage={usage}"]
    if sans:
        lines.append("subjectAltName=" + ",".join(sans))
    ext.write_text("\n".join(lines) + "\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(PKI / "ca.crt"), "-CAkey", str(PKI / "ca.key"),
             "-CAcreateserial", "-days", "365", "-sha256", "-extfile", str(ext), "-out", str(crt))
    csr.unlink()
    ext.unlink()


def advertise_address() -> str:
    """IPv4 of the default-route interface (apiserver advertise address; never contacted)."""
    try:
        routes = json.loads(subprocess.run(["ip", "-j", "-4", "route", "show", "default"],
                                           capture_output=True, text=True).stdout or "[]")
        devs = [r["dev"] for r in routes if "dev" in r]
        addrs = json.loads(subprocess.run(["ip", "-j", "-4", "addr", "show"],
                                          capture_output=True, text=True).stdout or "[]")
    except (ValueError, OSError):
        devs, addrs = [], []
    cands = []
    for a in addrs:
        for ai in a.get("addr_info", []):
            if ai.get("scope") == "global" and not ai["local"].startswith("127."):
                cands.append((a["ifname"] not in devs, ai["local"]))
    if not cands:
        raise Fail("apiserver: no global IPv4 address for --advertise-address")
    return sorted(cands)[0][1]


def gen_pki(adv: str) -> None:
    PKI.mkdir(parents=True, exist_ok=True)
    _key(PKI / "ca.key")
    _openssl("req", "-x509", "-new", "-key", str(PKI / "ca.key"), "-subj", "/CN=timeslice-dra-local-ca",
             "-days", "3650", "-sha256", "-out", str(PKI / "ca.crt"),
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature")
    svc_ip = "10.0.0.1"
    _cert("apiserver", "/CN=kube-apiserver", "serverAuth",
          ["DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
           "DNS:kubernetes.default.svc.cluster.local", "IP:127.0.0.1", f"IP:{svc_ip}", f"IP:{adv}"])
    _cert("apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client", "clientAuth")
    _cert("admin", "/O=system:masters/CN=kubernetes-admin", "clientAuth")
    _cert("controller-manager", "/CN=system:kube-controller-manager", "clientAuth")
    _cert("scheduler", "/CN=system:kube-scheduler", "clientAuth")
    _cert("kubelet-client", f"/O=system:nodes/CN=system:node:{NODE_NAME}", "clientAuth")
    _cert("kubelet-serving", f"/O=system:nodes/CN=system:node:{NODE_NAME}", "serverAuth",
          [f"IP:{NODE_NAME}", "DNS:localhost"])
    _key(PKI / "sa.key", rsa=True)
    _openssl("pkey", "-in", str(PKI / "sa.key"), "-pubout", "-out", str(PKI / "sa.pub"))


def write_kubeconfig(name: str, cert: str) -> Path:
    import base64

    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()
    cfg = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "timeslice-local", "cluster": {
            "server": f"https://127.0.0.1:{APISERVER_PORT}",
            "certificate-authority-data": b64(PKI / "ca.crt")}}],
        "users": [{"name": name, "user": {
            "client-certificate-data": b64(PKI / f"{cert}.crt"),
            "client-key-data": b64(PKI / f"{cert}.key")}}],
        "contexts": [{"name": "timeslice-local", "context": {"cluster": "timeslice-local", "user": name}}],
        "current-context": "timeslice-local",
    }
    KCFG.mkdir(parents=True, exist_ok=True)
    path = KCFG / f"{name}.kubeconfig"
    path.write_text(json.dumps(cfg, indent=1) + "\n")  # JSON is YAML
    path.chmod(0o600)
    return path


# --------------------------------------------------------------------------- processes

def _proc_start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _pid_alive(rec: dict) -> bool:
    # a child that exited stays a zombie of this process until reaped: count it as dead
    return _proc_start_time(rec["pid"]) == rec["start"] and not _is_zombie(rec["pid"])


def start(name: str, argv: list[str], env: dict[str, str] | None = None) -> dict:
    LOGS.mkdir(parents=True, exist_ok=True)
    PIDS.mkdir(parents=True, exist_ok=True)
    logf = LOGS / f"{name}.log"
    with open(logf, "ab") as f:
        f.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
        f.flush()
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=env or _base_env(), cwd="/")
    rec = {"name": name, "pid": p.pid, "start": _proc_start_time(p.pid), "exe": argv[0]}
    (PIDS / f"{name}.json").write_text(json.dumps(rec))
    log(f"started {name} (pid {p.pid}, log {logf})")
    return rec


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBECONFIG", "CONTAINERD_"))}
    env["PATH"] = f"{CTRD_BIN}:{K8S_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return env


def pid_record(name: str) -> dict | None:
    try:
        return json.loads((PIDS / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def stop_pid(pid: int, name: str, grace: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or _is_zombie(pid):
            return
        time.sleep(0.1)
    log(f"{name} (pid {pid}) ignored SIGTERM for {grace:.0f}s, sending SIGKILL")
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def stop(name: str, grace: float = 10.0) -> None:
    rec = pid_record(name)
    if rec and _pid_alive(rec):
        log(f"stopping {name} (pid {rec['pid']})")
        stop_pid(rec["pid"], name, grace)
    (PIDS / f"{name}.json").unlink(missing_ok=True)


def _pids_with_exe(exe: Path) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.readlink(d / "exe") == str(exe):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


# --------------------------------------------------------------------------- readiness

def _ssl_ctx(client: str | None = "admin", verify: bool = True) -> ssl.SSLContext:
    if verify:
        ctx = ssl.create_default_context(cafile=str(PKI / "ca.crt"))
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if client:
        ctx.load_cert_chain(str(PKI / f"{client}.crt"), str(PKI / f"{client}.key"))
    return ctx


def http_get(url: str, ctx: ssl.SSLContext | None = None, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ssl.SSLError) as e:
        return 0, str(e)


def api_get(path: str) -> tuple[int, str]:
    return http_get(f"https://127.0.0.1:{APISERVER_PORT}{path}", _ssl_ctx())


def wait_for(name: str, check, timeout: float, what: str) -> None:
    """Poll check() until it returns True; fail naming `name` with its log tail."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        rec = pid_record(name)
        if rec is not None and not _pid_alive(rec):
            raise Fail(f"{name} exited while waiting for {what}; last lines of {LOGS / (name + '.log')}:\n"
                       + tail(LOGS / f"{name}.log"))
        try:
            res = check()
        except Exception as e:
            res = str(e)
        if res is True:
            return
        last = str(res)
        time.sleep(0.5)
    raise Fail(f"{name} did not become ready ({what}) within {timeout:.0f}s: {last[:300]}\n"
               f"last lines of {LOGS / (name + '.log')}:\n" + tail(LOGS / f"{name}.log"))


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) != 0


# --------------------------------------------------------------------------- components

def start_etcd() -> None:
    data = STATE / "etcd"
    data.mkdir(parents=True, exist_ok=True, mode=0o700)
    start("etcd", [str(ETCD_BIN / "etcd"), "--name=local", f"--data-dir={data}",
                   f"--listen-client-urls=http://127.0.0.1:{ETCD_PORT}",
                   f"--advertise-client-urls=http://127.0.0.1:{ETCD_PORT}",
                   f"--listen-peer-urls=http://127.0.0.1:{ETCD_PEER_PORT}",
                   f"--initial-advertise-peer-urls=http://127.0.0.1:{ETCD_PEER_PORT}",
                   f"--initial-cluster=local=http://127.0.0.1:{ETCD_PEER_PORT}",
                   "--unsafe-no-fsync=true", "--log-level=warn"])

    def ok():
        code, body = http_get(f"http://127.0.0.1:{ETCD_PORT}/health")
        return True if code == 200 and '"health":"true"' in body.replace(" ", "") else f"{code} {body}"
    wait_for("etcd", ok, 60, "GET /health")


def start_apiserver(adv: str) -> None:
    start("kube-apiserver", [
        str(K8S_BIN / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{ETCD_PORT}",
        "--bind-address=127.0.0.1", f"--secure-port={APISERVER_PORT}", f"--advertise-address={adv}",
        f"--tls-cert-file={PKI / 'apiserver.crt'}", f"--tls-private-key-file={PKI / 'apiserver.key'}",
        f"--client-ca-file={PKI / 'ca.crt'}",
        "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
        f"--service-account-key-file={PKI / 'sa.pub'}",
        f"--service-account-signing-key-file={PKI / 'sa.key'}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        f"--kubelet-client-certificate={PKI / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={PKI / 'apiserver-kubelet-client.key'}",
        f"--kubelet-certificate-authority={PKI / 'ca.crt'}",
        # The node is named 127.0.0.1 (its Hostname address): logs/exec go over loopback.
        "--kubelet-preferred-address-types=Hostname",
        "--allow-privileged=true",
        f"--feature-gates={FEATURE_GATES}", f"--runtime-config={RUNTIME_CONFIG}",
        "--profiling=false", "--v=1",
    ])

    def ok():
        code, body = api_get("/readyz")
        return True if code == 200 else f"{code} {body[-200:]}"
    wait_for("kube-apiserver", ok, 180, "GET /readyz")


def start_controller_manager() -> None:
    kc = write_kubeconfig("controller-manager", "controller-manager")
    start("kube-controller-manager", [
        str(K8S_BIN / "kube-controller-manager"),
        f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
        "--bind-address=127.0.0.1", "--secure-port=10257",
        f"--service-account-private-key-file={PKI / 'sa.key'}", f"--root-ca-file={PKI / 'ca.crt'}",
        "--use-service-account-credentials=true",
        f"--cluster-signing-cert-file={PKI / 'ca.crt'}", f"--cluster-signing-key-file={PKI / 'ca.key'}",
        "--controllers=*", "--leader-elect=false", f"--feature-gates={FEATURE_GATES}",
        "--profiling=false", "--v=1",
    ])
    wait_for("kube-controller-manager",
             lambda: http_get("https://127.0.0.1:10257/healthz", _ssl_ctx(None, verify=False))[0] == 200
             or "not healthy", 90, "GET :10257/healthz")


def start_scheduler() -> None:
    kc = write_kubeconfig("scheduler", "scheduler")
    CONF.mkdir(parents=True, exist_ok=True)
    cfg = CONF / "scheduler.json"
    cfg.write_text(json.dumps({
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(kc)},
        "leaderElection": {"leaderElect": False},
    }, indent=1))
    start("kube-scheduler", [
        str(K8S_BIN / "kube-scheduler"), f"--config={cfg}",
        f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
        "--bind-address=127.0.0.1", "--secure-port=10259", f"--feature-gates={FEATURE_GATES}",
        "--profiling=false", "--v=1",
    ])
    wait_for("kube-scheduler",
             lambda: http_get("https://127.0.0.1:10259/healthz", _ssl_ctx(None, verify=False))[0] == 200
             or "not healthy", 90, "GET :10259/healthz")


def containerd_config() -> str:
    rt = "plugins.'io.containerd.cri.v1.runtime'"
    return f"""# Generated by hack/local_cluster.py
version = 3
root = "{STATE / 'containerd' / 'root'}"
state = "{RUN / 'containerd' / 'state'}"
imports = []
required_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{CTRD_SOCK}"

[ttrpc]
  address = "{CTRD_SOCK}.ttrpc"

[debug]
  level = "info"

[plugins.'io.containerd.internal.v1.opt']
  path = "{STATE / 'containerd' / 'opt'}"

[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.image-verifier.v1.bindir']
  bin_dir = "{STATE / 'containerd' / 'image-verifier'}"

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[{rt}]
  enable_cdi = true
  # root here lacks CAP_SYS_RESOURCE (sandbox VM), so oom_score_adj can't go below our own
  # value; without this every pod sandbox fails ("failed to update /proc/self/oom_score_adj")
  restrict_oom_score_adj = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]

[{rt}.containerd]
  default_runtime_name = "runc"

[{rt}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{rt}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  BinaryName = "{RUNC}"
  Root = "{RUN / 'runc'}"

[{rt}.cni]
  bin_dirs = ["{CNI_BIN_DIR}"]
  conf_dir = "{CNI_CONF_DIR}"
  max_conf_num = 1

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{PAUSE_IMAGE}"
"""


def write_cni_config() -> None:
    CNI_CONF_DIR.mkdir(parents=True, exist_ok=True)
    # Pods that are not hostNetwork get an address on a private bridge with no gateway and no
    # default route: they can reach each other and nothing else.  The node becomes Ready
    # only once the runtime has a loadable CNI config.
    conf = {
        "cniVersion": "1.0.0", "name": "timeslice-local",
        "plugins": [{
            "type": "bridge", "bridge": CNI_BRIDGE, "isGateway": False, "ipMasq": False,
            "hairpinMode": True,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]],
                     "dataDir": str(STATE / "cni" / "networks")},
        }],
    }
    (CNI_CONF_DIR / "10-timeslice-local.conflist").write_text(json.dumps(conf, indent=1) + "\n")


def ctr(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(CTRD_BIN / "ctr"), "--address", str(CTRD_SOCK), *args],
                          capture_output=True, text=True, check=check, timeout=timeout)


def start_containerd() -> None:
    save_host_paths()
    write_cni_config()
    CONF.mkdir(parents=True, exist_ok=True)
    cfg = CONF / "containerd.toml"
    cfg.write_text(containerd_config())
    (RUN / "containerd").mkdir(parents=True, exist_ok=True)
    start("containerd", [str(CTRD_BIN / "containerd"), f"--config={cfg}"])

    def ok():
        p = ctr("version", check=False, timeout=10)
        return True if p.returncode == 0 else p.stderr.strip()
    wait_for("containerd", ok, 60, "ctr version")


def import_images(tars: dict[str, Path]) -> None:
    for name, tar in tars.items():
        t0 = time.monotonic()
        p = ctr("-n", "k8s.io", "images", "import", "--no-unpack=false", str(tar), check=False)
        if p.returncode != 0:
            p = ctr("-n", "k8s.io", "images", "import", str(tar), check=False)
        if p.returncode != 0:
            raise Fail(f"images: importing {name} ({tar}) failed:\n{p.stdout}\n{p.stderr}\n"
                       f"containerd log:\n{tail(LOGS / 'containerd.log', 20)}")
        log(f"imported {name} image ({time.monotonic() - t0:.1f}s)")
    refs = {"pause": PAUSE_IMAGE, "busybox": BUSYBOX_IMAGE, "python": PYTHON_IMAGE}
    for name in tars:
        # kubelet never garbage-collects pinned images (they cannot be pulled again)
        ctr("-n", "k8s.io", "images", "label", refs[name], "io.cri-containerd.pinned=pinned", check=False)


def save_sysctls() -> None:
    if SYSCTL_SAVED.exists():
        return
    vals = {}
    for k in SYSCTLS:
        try:
            vals[k] = Path("/proc/sys/" + k.replace(".", "/")).read_text().strip()
        except OSError:
            pass
    SYSCTL_SAVED.write_text(json.dumps(vals, indent=1))


def restore_sysctls() -> None:
    try:
        vals = json.loads(SYSCTL_SAVED.read_text())
    except (OSError, ValueError):
        return
    for k, v in vals.items():
        p = Path("/proc/sys/" + k.replace(".", "/"))
        try:
            if p.read_text().strip() != v:
                p.write_text(v)
                log(f"restored {k}={v}")
        except OSError as e:
            log(f"could not restore {k}={v}: {e}")


HOST_PATHS_SAVED = STATE / "host-paths.json"
IPTABLES_SAVED = STATE / "iptables-chains.json"
# Host paths that containerd, kubelet and CNI create whatever they are configured with
# (containerd's shim socket and fifo dirs, libcni's cache, kubelet's /var/log/containers).
# `down` removes those that did not exist before `up`.
HOST_PATHS = [Path("/run/containerd"), Path("/var/lib/cni"), Path("/var/log/containers"),
              Path("/var/run/nri")]


def save_host_paths() -> None:
    if not HOST_PATHS_SAVED.exists():
        HOST_PATHS_SAVED.write_text(json.dumps({str(p): p.exists() for p in HOST_PATHS}))


def remove_created_host_paths() -> None:
    try:
        existed = json.loads(HOST_PATHS_SAVED.read_text())
    except (OSError, ValueError):
        return
    for path, was in existed.items():
        p = Path(path)
        if was or not p.exists():
            continue
        if p == Path("/var/log/containers"):  # only our symlinks; keep anything else
            for f in p.glob("*.log"):
                if f.is_symlink() and os.readlink(f).startswith(str(POD_LOGS)):
                    f.unlink()
            try:
                p.rmdir()
            except OSError:
                log(f"kept {p}: not empty")
            continue
        _umount_under([p])
        shutil.rmtree(p, ignore_errors=True)


def _iptables_chains() -> dict[str, dict[str, list[str]]]:
    out: dict[str, dict[str, list[str]]] = {}
    for cmd in ("iptables", "ip6tables"):
        if not shutil.which(cmd):
            continue
        out[cmd] = {}
        for table in ("filter", "nat", "mangle"):
            p = subprocess.run([cmd, "-w", "-t", table, "-S"], capture_output=True, text=True)
            if p.returncode == 0:
                out[cmd][table] = [ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("-N ")]
    return out


def save_iptables() -> None:
    if not IPTABLES_SAVED.exists():
        IPTABLES_SAVED.write_text(json.dumps(_iptables_chains()))


def restore_iptables() -> None:
    """Remove the KUBE-* chains (and jumps to them) that the kubelet added."""
    try:
        before = json.loads(IPTABLES_SAVED.read_text())
    except (OSError, ValueError):
        return
    now = _iptables_chains()
    for cmd, tables in now.items():
        for table, chains in tables.items():
            new = [c for c in chains if c.startswith("KUBE-") and c not in before.get(cmd, {}).get(table, [])]
            if not new:
                continue
            rules = subprocess.run([cmd, "-w", "-t", table, "-S"], capture_output=True,
                                   text=True).stdout.splitlines()
            for r in rules:  # jumps into the new chains from other chains
                parts = r.split()
                if parts[:1] == ["-A"] and parts[1] not in new and any(
                        f"-j {c}" in r or f"-g {c}" in r for c in new):
                    subprocess.run([cmd, "-w", "-t", table, "-D", *parts[1:]], capture_output=True)
            for c in new:
                subprocess.run([cmd, "-w", "-t", table, "-F", c], capture_output=True)
            for c in new:
                subprocess.run([cmd, "-w", "-t", table, "-X", c], capture_output=True)
            log(f"removed {cmd} {table} chains {new}")


def restart_kubelet() -> None:
    """Stop and start the kubelet only (pods keep running): tests of restart safety."""
    if pid_record("kubelet") is None:
        raise Fail("kubelet: not running (run `up` first)")
    stop("kubelet")
    start_kubelet(restart=True)


def start_kubelet(restart: bool = False) -> None:
    if not restart and KUBELET_ROOT.exists() and not KUBELET_MARKER.exists() and any(KUBELET_ROOT.iterdir()):
        raise Fail(f"kubelet: {KUBELET_ROOT} exists and was not made by this tool; refusing to use it")
    KUBELET_ROOT.mkdir(parents=True, exist_ok=True)
    KUBELET_MARKER.write_text("created by timeslice-dra hack/local_cluster.py; removed by `down`\n")
    POD_LOGS.mkdir(parents=True, exist_ok=True)
    kc = write_kubeconfig("kubelet", "kubelet-client")
    gates = {}
    for g in FEATURE_GATES.split(","):
        if "=" in g:
            k, v = g.split("=", 1)
            gates[k.strip()] = v.strip().lower() == "true"
    cfg = CONF / "kubelet.json"
    cfg.write_text(json.dumps({
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": "127.0.0.1", "port": KUBELET_PORT, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
        "tlsCertFile": str(PKI / "kubelet-serving.crt"), "tlsPrivateKeyFile": str(PKI / "kubelet-serving.key"),
        "authentication": {"x509": {"clientCAFile": str(PKI / "ca.crt")},
                           "webhook": {"enabled": True}, "anonymous": {"enabled": False}},
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{CTRD_SOCK}",
        "cgroupDriver": "cgroupfs", "cgroupsPerQOS": True, "cgroupRoot": "/",
        "failSwapOn": False, "failCgroupV1": False,
        "protectKernelDefaults": False,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "nodefs.inodesFree": "1%", "imagefs.available": "1%",
                         "imagefs.inodesFree": "1%"},
        "evictionPressureTransitionPeriod": "10s",
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "imageMinimumGCAge": "24h",
        "serializeImagePulls": False,
        "podLogsDir": str(POD_LOGS),
        "featureGates": gates,
        "maxPods": 110,
        "shutdownGracePeriod": "0s",
        "staticPodPath": "",
    }, indent=1))
    if not restart:  # a restart must not record the kubelet's own settings as the originals
        save_sysctls()
        save_iptables()
    start("kubelet", [str(K8S_BIN / "kubelet"), f"--config={cfg}", f"--kubeconfig={kc}",
                      f"--hostname-override={NODE_NAME}", f"--root-dir={KUBELET_ROOT}", "--v=2"])
    wait_for("kubelet", lambda: http_get("http://127.0.0.1:10248/healthz")[0] == 200 or "not healthy",
             120, "GET :10248/healthz")

    def node_ready():
        code, body = api_get(f"/api/v1/nodes/{NODE_NAME}")
        if code != 200:
            return f"node: HTTP {code}"
        conds = {c["type"]: c for c in json.loads(body).get("status", {}).get("conditions", [])}
        r = conds.get("Ready", {})
        return True if r.get("status") == "True" else f"Ready={r.get('status')} {r.get('message', '')}"
    wait_for("kubelet", node_ready, 180, f"node {NODE_NAME} Ready")


def wait_default_serviceaccount() -> None:
    wait_for("kube-controller-manager",
             lambda: api_get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200
             or "no default serviceaccount yet", 60, "default/default ServiceAccount")


# --------------------------------------------------------------------------- up / down

COMPONENTS = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "containerd", "kubelet"]


def check_ports() -> None:
    busy = [f"{p} ({n})" for p, n in [(ETCD_PORT, "etcd"), (ETCD_PEER_PORT, "etcd peer"),
                                      (APISERVER_PORT, "kube-apiserver"), (10257, "kube-controller-manager"),
                                      (10259, "kube-scheduler"), (KUBELET_PORT, "kubelet"),
                                      (10248, "kubelet healthz")] if not port_free(p)]
    if busy:
        raise Fail(f"ports already in use on 127.0.0.1 by a process this tool did not start: {busy}")


def up(wheels: Path | None, no_build: bool) -> None:
    if os.geteuid() != 0:
        raise Fail("up must run as root (kubelet, containerd, mounts, cgroups)")
    t0 = time.monotonic()
    if STATE.exists() or RUN.exists() or KUBELET_MARKER.exists() or _leftover_pids():
        log("leftover state or processes from an earlier run: running `down` first")
        down()
    ensure_packages()
    if no_build:
        missing = [n for n, ok in (("k8s", k8s_binaries_ok), ("etcd", etcd_binaries_ok),
                                   ("containerd", containerd_binaries_ok)) if not ok()]
        if missing:
            raise Fail(f"--no-build: cached binaries missing or wrong version for {missing}")
    else:
        build_all()
    tars = build_images(wheels)
    t_built = time.monotonic()
    check_ports()
    for d in (STATE, RUN, LOGS):
        d.mkdir(parents=True, exist_ok=True)
    for f in LOGS.glob("*.log"):
        f.unlink()
    adv = advertise_address()
    gen_pki(adv)
    write_kubeconfig("admin", "admin")
    start_etcd()
    start_apiserver(adv)
    start_controller_manager()
    start_scheduler()
    start_containerd()
    import_images(tars)
    start_kubelet()
    wait_default_serviceaccount()
    t1 = time.monotonic()
    log(f"cluster up: node {NODE_NAME} Ready ({t1 - t_built:.0f}s to start, "
        f"{t1 - t0:.0f}s in total incl. build/image checks)")
    (STATE / "up-times.json").write_text(json.dumps(
        {"total_s": round(t1 - t0, 1), "start_s": round(t1 - t_built, 1)}))
    print(env_text())


def _cgroup_roots() -> list[Path]:
    roots = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if parts[2] in ("cgroup", "cgroup2"):
            roots.append(Path(parts[1]))
    return roots


def _kubepods_cgroups() -> list[Path]:
    out = []
    for r in _cgroup_roots():
        k = r / "kubepods"
        if k.is_dir():
            out.append(k)
    return out


def _kill_cgroup_procs() -> None:
    pids: set[int] = set()
    for k in _kubepods_cgroups():
        for procs in k.rglob("cgroup.procs"):
            try:
                pids.update(int(x) for x in procs.read_text().split())
            except OSError:
                pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if pids:
        log(f"killed {len(pids)} leftover container process(es)")
        time.sleep(0.5)


def _remove_cgroups() -> None:
    for k in _kubepods_cgroups():
        dirs = sorted((p for p in k.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for d in [*dirs, k]:
            for _ in range(20):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def _umount_under(paths: list[Path]) -> None:
    for _ in range(3):
        mounts = [line.split()[1].replace("\\040", " ")
                  for line in Path("/proc/self/mounts").read_text().splitlines()]
        todo = [m for m in mounts if any(m == str(p) or m.startswith(str(p) + "/") for p in paths)]
        if not todo:
            return
        for m in sorted(todo, key=len, reverse=True):
            if subprocess.run(["umount", m], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", m], capture_output=True)


def _cleanup_containers() -> None:
    rec = pid_record("containerd")
    if not (rec and _pid_alive(rec)):
        return
    try:
        tasks = ctr("-n", "k8s.io", "tasks", "ls", "-q", check=False, timeout=20).stdout.split()
        for t in tasks:
            ctr("-n", "k8s.io", "tasks", "kill", "-a", "-s", "SIGKILL", t, check=False, timeout=20)
        for t in tasks:
            ctr("-n", "k8s.io", "tasks", "rm", "-f", t, check=False, timeout=20)
        for c in ctr("-n", "k8s.io", "containers", "ls", "-q", check=False, timeout=20).stdout.split():
            ctr("-n", "k8s.io", "containers", "rm", c, check=False, timeout=20)
        if tasks:
            log(f"removed {len(tasks)} container task(s)")
    except subprocess.TimeoutExpired:
        log("containerd did not answer while removing containers; continuing")


def _our_binaries() -> list[Path]:
    return [*(K8S_BIN / n for n in ("kubelet", "kube-apiserver", "kube-controller-manager",
                                    "kube-scheduler")),
            ETCD_BIN / "etcd", CTRD_BIN / "containerd", CTRD_BIN / "containerd-shim-runc-v2"]


def _leftover_pids() -> list[int]:
    return [pid for b in _our_binaries() for pid in _pids_with_exe(b)]


def down() -> None:
    """Stop everything `up` started (by PID) and remove all state. Safe to repeat."""
    if os.geteuid() != 0:
        raise Fail("down must run as root")
    stop("kubelet", grace=15)
    _cleanup_containers()
    stop("containerd")
    for pid in _pids_with_exe(CTRD_BIN / "containerd-shim-runc-v2"):
        log(f"stopping leftover shim pid {pid}")
        stop_pid(pid, "containerd-shim-runc-v2", 5)
    _kill_cgroup_procs()
    for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
        stop(name)
    # any process still running one of our binaries was started by this tool (or a previous
    # run whose pid files are gone): stop it by pid
    for b in _our_binaries():
        for pid in _pids_with_exe(b):
            log(f"stopping leftover {b.name} pid {pid}")
            stop_pid(pid, b.name, 10)
    _umount_under([KUBELET_ROOT, STATE, RUN])
    _remove_cgroups()
    if Path(f"/sys/class/net/{CNI_BRIDGE}").exists():
        subprocess.run(["ip", "link", "del", CNI_BRIDGE], check=False)
    restore_sysctls()
    restore_iptables()
    remove_created_host_paths()
    for d in (STATE, RUN):
        shutil.rmtree(d, ignore_errors=True)
    if KUBELET_MARKER.exists() or (KUBELET_ROOT.is_dir() and not any(KUBELET_ROOT.iterdir())):
        shutil.rmtree(KUBELET_ROOT, ignore_errors=True)
    leftovers = [str(d) for d in (STATE, RUN) if d.exists()]
    if leftovers:
        raise Fail(f"down: could not remove {leftovers}")
    log(f"cluster down (logs kept in {LOGS})")


def env_text() -> str:
    lines = {
        "KUBECONFIG": ADMIN_KUBECONFIG,
        "PATH": f"{K8S_BIN}:{CTRD_BIN}:$PATH",
        "CONTAINERD_ADDRESS": CTRD_SOCK,
        "CONTAINERD_NAMESPACE": "k8s.io",
        "TIMESLICE_NODE_NAME": NODE_NAME,
        "TIMESLICE_CLUSTER_LOGS": LOGS,
        "TIMESLICE_PAUSE_IMAGE": PAUSE_IMAGE,
        "TIMESLICE_BUSYBOX_IMAGE": BUSYBOX_IMAGE,
        "TIMESLICE_PYTHON_IMAGE": PYTHON_IMAGE,
        "KUBELET_ROOT_DIR": KUBELET_ROOT,
    }
    return "\n".join(f'export {k}="{v}"' for k, v in lines.items())


def status() -> int:
    bad = 0
    for name in COMPONENTS:
        rec = pid_record(name)
        alive = bool(rec and _pid_alive(rec))
        bad += not alive
        print(f"{name:25s} {'running pid ' + str(rec['pid']) if alive else 'not running'}")
    if pid_record("kube-apiserver"):
        code, body = api_get(f"/api/v1/nodes/{NODE_NAME}")
        if code == 200:
            conds = {c["type"]: c["status"] for c in json.loads(body)["status"].get("conditions", [])}
            print(f"node {NODE_NAME}: Ready={conds.get('Ready')}")
            bad += conds.get("Ready") != "True"
        else:
            print(f"node {NODE_NAME}: API HTTP {code}")
            bad += 1
        code, _ = api_get("/apis/resource.k8s.io/v1")
        print(f"resource.k8s.io/v1 served: {code == 200}")
    return 0 if bad == 0 else 1


# --------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hack/local-cluster.sh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    u = sub.add_parser("up", help="build (or reuse) binaries and images, start the cluster")
    u.add_argument("--wheels", type=Path, default=os.environ.get("TIMESLICE_PY_WHEELS") or None,
                   help="directory of *.whl to pip-install into the python image "
                        "(default: $TIMESLICE_PY_WHEELS)")
    u.add_argument("--no-build", action="store_true", help="fail instead of building missing binaries")
    sub.add_parser("down", help="stop everything started by `up` and remove all state")
    sub.add_parser("env", help="print shell exports (eval \"$(hack/local-cluster.sh env)\")")
    sub.add_parser("status", help="show components and node readiness (exit 1 if not all fine)")
    sub.add_parser("restart-kubelet", help="stop and start the kubelet only; pods keep running")
    b = sub.add_parser("build", help="build (or reuse cached) binaries only")
    b.add_argument("--force", action="store_true", help="rebuild even if cached binaries match")
    i = sub.add_parser("images", help="build (or reuse cached) image tarballs only")
    i.add_argument("--wheels", type=Path, default=os.environ.get("TIMESLICE_PY_WHEELS") or None)
    args = ap.parse_args(argv)
    try:
        if args.verb == "build":
            build_all(args.force)
        elif args.verb == "images":
            ensure_packages(["busybox-static", "catatonit", "debootstrap"])
            for k, v in build_images(args.wheels).items():
                print(f"{k}: {v}")
        elif args.verb == "up":
            up(args.wheels, args.no_build)
        elif args.verb == "down":
            down()
        elif args.verb == "env":
            print(env_text())
        elif args.verb == "status":
            return status()
        elif args.verb == "restart-kubelet":
            restart_kubelet()
    except Fail as e:
        print(f"\nlocal-cluster: FAILED: {e}", file=sys.stderr, flush=True)
        if args.verb == "up":
            print(f"local-cluster: component logs are in {LOGS}; processes started so far keep "
                  "running: `hack/local-cluster.sh down` stops them (a new `up` does that first)",
                  file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        print(f"\nlocal-cluster: FAILED: {' '.join(map(str, e.cmd))} exited with {e.returncode}",
              file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("\nlocal-cluster: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
