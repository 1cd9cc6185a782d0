"""CDI specs: one file per prepared claim, written atomically under the CDI spec dir.

Owned by the kubelet plugin; called by the claim preparer. Format: Container Device
Interface spec 0.6.0 (keys `cdiVersion`, `kind`, `devices[].name`,
`devices[].containerEdits{env, deviceNodes}`, top-level `containerEdits{env, deviceNodes,
mounts}`; see reference/dra-protocol.md section 4). The top-level mounts are the driver's
libraries (`driver_root.py`), read-only binds.) Kind `timeslice.dev/gpu`; device names carry the
claim UID (runtimes cache specs), so CDI ids are `timeslice.dev/gpu=<claim uid>-<device>`.

Env keys never collide between CDI devices (runtimes keep the last value of a repeated
key): per device `TIMESLICE_DEVICE_<DEVICE>`, per claim `TIMESLICE_CLAIM_<UID>`; the
only shared key, `TIMESLICE_ORCHESTRATOR`, has the same value everywhere. No job
identity is injected: one claim can be shared by pods of different jobs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from timeslice.driver.atomic import write_atomic

CDI_VERSION = "0.6.0"
VENDOR = "timeslice.dev"
CLASS = "gpu"
KIND = f"{VENDOR}/{CLASS}"
DEFAULT_SPEC_DIR = Path("/var/run/cdi")


def env_key(*parts: str) -> str:
    """`TIMESLICE_` + parts upper-cased, every non-alphanumeric character as `_`."""
    return "TIMESLICE_" + "_".join(re.sub(r"[^A-Za-z0-9]", "_", p).upper() for p in parts)


@dataclass(frozen=True)
class CdiDevice:
    """One allocated device of a claim: `device` is the DRA device name, `physical_gpu`
    its GPU's UUID, `device_nodes` host paths to pass through (empty for fake GPUs)."""

    device: str
    physical_gpu: str
    device_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClaimSpec:
    claim_uid: str
    claim_namespace: str
    claim_name: str
    devices: tuple[CdiDevice, ...]
    orchestrator: str = ""
    shared_device_nodes: tuple[str, ...] = field(default=())
    admin_access: bool = False
    env: tuple[str, ...] = ()  # more KEY=VALUE for every container of the claim
    mounts: tuple[tuple[str, str], ...] = ()  # (host path, container path), read-only binds: the driver's libraries

    def cdi_id(self, device: str) -> str:
        return f"{KIND}={self.claim_uid}-{device}"


def spec_path(spec_dir: Path, claim_uid: str) -> Path:
    return spec_dir / f"{VENDOR}-{CLASS}_{claim_uid}.json"


def _nodes(paths: Sequence[str]) -> list[dict[str, str]]:
    return [{"path": p} for p in paths]


def render(spec: ClaimSpec) -> dict[str, object]:
    """The CDI spec for one claim, as a JSON-ready dict."""
    claim_env = [f"{env_key('CLAIM', spec.claim_uid)}={spec.claim_namespace}/{spec.claim_name}"]
    if spec.orchestrator:
        claim_env.append(f"TIMESLICE_ORCHESTRATOR={spec.orchestrator}")
    if spec.admin_access:
        claim_env.append(f"{env_key('ADMIN_ACCESS', spec.claim_uid)}=true")
    claim_env.extend(spec.env)
    edits: dict[str, object] = {"env": claim_env}
    if spec.shared_device_nodes:
        edits["deviceNodes"] = _nodes(spec.shared_device_nodes)
    if spec.mounts:
        edits["mounts"] = [{"hostPath": host, "containerPath": inside, "options": ["ro", "nosuid", "nodev", "bind"]}
                           for host, inside in spec.mounts]
    devices = []
    for d in spec.devices:
        dev_edits: dict[str, object] = {"env": [f"{env_key('DEVICE', d.device)}={d.physical_gpu}"]}
        if d.device_nodes:
            dev_edits["deviceNodes"] = _nodes(d.device_nodes)
        devices.append({"name": f"{spec.claim_uid}-{d.device}", "containerEdits": dev_edits})
    return {"cdiVersion": CDI_VERSION, "kind": KIND, "devices": devices, "containerEdits": edits}


def write(spec_dir: Path, spec: ClaimSpec) -> Path:
    """Write (or replace) the claim's spec atomically; returns its path."""
    path = spec_path(spec_dir, spec.claim_uid)
    # the temporary name ends in .tmp: the runtime's CDI loader reads *.json and *.yaml only
    write_atomic(path, json.dumps(render(spec), indent=1).encode())
    return path


def remove(spec_dir: Path, claim_uid: str) -> None:
    spec_path(spec_dir, claim_uid).unlink(missing_ok=True)


def remove_leftovers(spec_dir: Path) -> list[str]:
    """Delete the temporary files of our spec writes that a crash left behind
    (`.<spec name>.<random>.tmp`, `driver/atomic.py`; other writers' files are not
    touched); returns their names. Run at start, before any write."""
    if not spec_dir.is_dir():
        return []
    gone = []
    for p in spec_dir.glob(f".{VENDOR}-{CLASS}_*.json.*.tmp"):
        p.unlink(missing_ok=True)
        gone.append(p.name)
    return gone
