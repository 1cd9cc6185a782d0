"""Which host processes belong to a claim on this node (DESIGN.md, "Node agent").

Owned by the node agent; used when the orchestrator names claims instead of a static
job -> PID table. Chain: claim -> `status.reservedFor` pods -> pod UID -> host PIDs
(from /proc/<pid>/cgroup: `pod<uid>` under cgroupfs, `pod<uid with _>` under systemd)
-> processes with a CUDA context on the claim's GPUs (NVML). Where there is no NVML (a
GPU-less node with the `freeze` backend) a process opts in instead with the
environment variable TIMESLICE_ACCELERATOR_PROCESS=1 (any claim set of its pod) or
=<pod-level claim name> (that claim set only, e.g. `trainer` beside `sampler`), so the
job's own client process, which must keep running to ask for the lock again, is never
frozen.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from timeslice.driver import names
from timeslice.driver.errors import NotFound
from timeslice.driver.peercred import environ

log = logging.getLogger("timeslice.agent")
MARKER = b"TIMESLICE_ACCELERATOR_PROCESS="


def pod_pids(pod_uids: Iterable[str], proc: Path = Path("/proc")) -> dict[str, list[int]]:
    """{pod uid: host PIDs in that pod's cgroups}, from `proc`/<pid>/cgroup."""
    wanted = {uid: (f"pod{uid}", f"pod{uid.replace('-', '_')}") for uid in pod_uids}
    found: dict[str, list[int]] = {uid: [] for uid in wanted}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "cgroup").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for uid, marks in wanted.items():
            if any(m in text for m in marks):
                found[uid].append(int(entry.name))
                break
    return {uid: sorted(pids) for uid, pids in found.items()}


def marked(pid: int, claim_name: str = "", proc: Path = Path("/proc")) -> bool:
    """True when `pid` is marked TIMESLICE_ACCELERATOR_PROCESS=1, or =<claim_name>."""
    wanted = {MARKER + b"1"} | ({MARKER + claim_name.encode()} if claim_name else set())
    return any(e in wanted for e in environ(pid, proc))


def cuda_pids_on(gpu_uuids: set[str]) -> set[int] | None:
    """PIDs with a CUDA context on any of these GPUs (NVML); None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    pids: set[int] = set()
    for uuid in gpu_uuids:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        pids.update(p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
    return pids


class ClaimProcessResolver:
    """`read_claim(namespace, name)` returns a claim in API JSON form; `gpu_of(device)` the
    physical GPU UUID of a device this node publishes; `proc` is the /proc to read."""

    def __init__(self, node: str, read_claim: Callable[[str, str], Awaitable[dict[str, Any]]],
                 gpu_of: Callable[[str], str | None], proc: Path = Path("/proc"),
                 cuda_pids: Callable[[set[str]], set[int] | None] = cuda_pids_on) -> None:
        self._node = node
        self._read_claim = read_claim
        self._gpu_of = gpu_of
        self._proc = proc
        self._cuda_pids = cuda_pids

    async def pids(self, claims: Iterable[tuple[str, str]], pod_uids: Iterable[str] = (),
                   claim_name: str = "") -> list[int]:
        """PIDs of the claims' processes on this node; `pod_uids`, when given, narrows the
        pods (a shared claim can be reserved for pods of several jobs); `claim_name` is the
        claim set's pod-level claim name (for marked processes). Raises NotFound."""
        claims = list(claims)
        pods: set[str] = set()
        gpus: set[str] = set()
        for namespace, name in claims:
            claim = await self._read_claim(namespace, name)
            status = claim.get("status") or {}
            pods.update(r["uid"] for r in status.get("reservedFor", []) if r.get("resource") == "pods")
            for r in (status.get("allocation") or {}).get("devices", {}).get("results", []):
                if r.get("driver") == names.DRIVER_NAME and r.get("pool") == self._node:
                    gpu = self._gpu_of(r["device"])
                    if gpu:
                        gpus.add(gpu)
        narrow = set(pod_uids)
        if narrow:
            pods &= narrow
        candidates = sorted({pid for pids in pod_pids(pods, self._proc).values() for pid in pids})
        cuda = self._cuda_pids(gpus) if gpus else None
        chosen = [p for p in candidates if p in cuda] if cuda is not None else \
            [p for p in candidates if marked(p, claim_name, self._proc)]
        if not chosen:
            raise NotFound(f"no accelerator processes of claims {sorted(claims)} on node {self._node} "
                           f"(pods {sorted(pods)}, {len(candidates)} processes in their cgroups)")
        log.debug("resolved claims=%s pods=%s pids=%s", sorted(claims), sorted(pods), chosen)
        return chosen
