"""Claim -> pods -> PIDs on a fake /proc tree (the seam is the /proc root)."""

from __future__ import annotations

from pathlib import Path

import pytest
from timeslice.driver.errors import NotFound
from timeslice.kubelet_plugin.agent.pod_processes import ClaimProcessResolver, pod_pids

POD_A = "1111aaaa-0000-0000-0000-000000000001"
POD_B = "2222bbbb-0000-0000-0000-000000000002"


def fake_proc(root: Path) -> Path:
    procs = {
        10: (f"12:cpu:/kubepods/besteffort/pod{POD_A}/c1\n", b"PATH=/bin\0TIMESLICE_ACCELERATOR_PROCESS=1\0"),
        11: (f"12:cpu:/kubepods/besteffort/pod{POD_A}/c1\n", b"PATH=/bin\0"),  # the client: not marked
        20: (f"0::/kubepods.slice/kubepods-pod{POD_B.replace('-', '_')}.slice/cri-x\n",
             b"TIMESLICE_ACCELERATOR_PROCESS=1\0"),
        30: ("0::/system.slice/other\n", b"TIMESLICE_ACCELERATOR_PROCESS=1\0"),
    }
    for pid, (cgroup, environ) in procs.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cgroup").write_text(cgroup)
        (root / str(pid) / "environ").write_bytes(environ)
    (root / "self").mkdir()
    return root


def claim(pods: list[str], devices: list[tuple[str, str]]) -> dict:
    return {"status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": u} for u in pods],
                       "allocation": {"devices": {"results": [
                           {"driver": "gpu.timeslice.dev", "pool": pool, "device": dev, "request": "gpu"}
                           for pool, dev in devices]}}}}


def test_pod_pids_matches_cgroupfs_and_systemd_paths(tmp_path) -> None:
    proc = fake_proc(tmp_path)
    assert pod_pids([POD_A, POD_B], proc) == {POD_A: [10, 11], POD_B: [20]}


async def test_resolver_without_nvml_takes_marked_processes_of_the_claims_pods(tmp_path) -> None:
    proc = fake_proc(tmp_path)
    claims = {("ns", "c1"): claim([POD_A, POD_B], [("node-1", "gpu-0-seat-0")])}

    async def read(ns: str, name: str) -> dict:
        return claims[(ns, name)]

    r = ClaimProcessResolver("node-1", read, lambda d: "GPU-0", proc, cuda_pids=lambda gpus: None)
    assert await r.pids([("ns", "c1")]) == [10, 20]
    assert await r.pids([("ns", "c1")], pod_uids=[POD_B]) == [20]  # narrowed to one job's pods


async def test_resolver_with_nvml_takes_cuda_processes_on_the_claims_gpus(tmp_path) -> None:
    proc = fake_proc(tmp_path)

    async def read(ns: str, name: str) -> dict:
        return claim([POD_A], [("node-1", "gpu-0-seat-0"), ("other-node", "gpu-3-seat-0")])

    seen: list[set[str]] = []

    def cuda(gpus: set[str]) -> set[int]:
        seen.append(gpus)
        return {11, 99}

    r = ClaimProcessResolver("node-1", read, lambda d: {"gpu-0-seat-0": "GPU-0"}.get(d), proc, cuda_pids=cuda)
    assert await r.pids([("ns", "c1")]) == [11]
    assert seen == [{"GPU-0"}]  # only this node's devices


async def test_no_processes_is_not_found(tmp_path) -> None:
    async def read(ns: str, name: str) -> dict:
        return claim([], [])

    r = ClaimProcessResolver("node-1", read, lambda d: None, fake_proc(tmp_path), cuda_pids=lambda g: None)
    with pytest.raises(NotFound, match="no accelerator processes"):
        await r.pids([("ns", "c1")])


async def test_processes_marked_with_a_claim_name_belong_to_that_claim_set_only(tmp_path) -> None:
    proc = fake_proc(tmp_path)
    (proc / "12").mkdir()
    (proc / "12" / "cgroup").write_text(f"12:cpu:/kubepods/besteffort/pod{POD_A}/c1\n")
    (proc / "12" / "environ").write_bytes(b"TIMESLICE_ACCELERATOR_PROCESS=sampler\0")
    (proc / "10" / "environ").write_bytes(b"TIMESLICE_ACCELERATOR_PROCESS=trainer\0")

    async def read(ns: str, name: str) -> dict:
        return claim([POD_A], [("node-1", "gpu-0-seat-0")])

    r = ClaimProcessResolver("node-1", read, lambda d: "GPU-0", proc, cuda_pids=lambda gpus: None)
    assert await r.pids([("ns", "c")], claim_name="trainer") == [10]
    assert await r.pids([("ns", "c")], claim_name="sampler") == [12]
