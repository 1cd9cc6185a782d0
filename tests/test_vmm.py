"""Backend `vmm` on a CPU: the real timeslice-vmm shim in real job processes, over a fake driver.

The shim (shim/timeslice_vmm.c, as installed: `vmm_shim.library()`) is preloaded into
bench/fake_cuda/vmm/job.py, whose "device" memory is the fake driver's (fake_libcuda.c: memfds
mapped into reserved address ranges, so memory that is checkpointed is really unmapped and a
restore must put its bytes back at the same addresses). The node agent's `VmmBackend` drives it
through the shim's socket; faults are the fake driver's (an error, a hang, a process that dies
in the middle of a copy) and real kills.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc.aio
import pytest
from timeslice import host_memory
from timeslice.driver import vmm_shim
from timeslice.driver.agentapi.v1 import agent_pb2 as apb
from timeslice.driver.agentapi.v1 import agent_pb2_grpc as apb_grpc
from timeslice.driver.errors import BackendError, ProcessGone, StepTimeout
from timeslice.kubelet_plugin.agent.backends import make_backend
from timeslice.kubelet_plugin.agent.backends.base import CHECKPOINTED, GONE, NO_CONTEXT, RUNNING
from timeslice.kubelet_plugin.agent.backends.vmm import VmmBackend, socket_path
from timeslice.kubelet_plugin.agent.gpu_memory import GpuInfo
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.server import create_server

from tests.conftest import eventually

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "bench" / "fake_cuda" / "vmm"
MIB = 1 << 20
SIZES = [3 * MIB, 2 * MIB + 12345, 5 * MIB, 4096]  # the last stays the runtime's (under 1 MiB)
SHIM_BYTES = 3 * MIB + (2 * MIB + 65536) + 5 * MIB  # rounded to the fake's 64 KiB granularity


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the fake driver")
    out = tmp_path_factory.mktemp("fake") / "libfakecuda.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(FAKE / "fake_libcuda.c")], check=True)
    return out


class Job:
    def __init__(self, proc: asyncio.subprocess.Process, used: Path, faults: Path, addresses: list[int]) -> None:
        self.proc, self.used, self.faults, self.addresses = proc, used, faults, addresses

    @property
    def pid(self) -> int:
        return self.proc.pid

    def used_bytes(self) -> int:
        return int(self.used.read_text())

    def fault(self, text: str) -> None:
        self.faults.write_text(text)

    async def verify(self) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"verify\n")
        await self.proc.stdin.drain()
        return (await asyncio.wait_for(self.proc.stdout.readline(), 30)).decode().strip()


@pytest.fixture
async def start_job(fake_lib: Path, tmp_path: Path) -> AsyncIterator[Callable[..., object]]:
    jobs: list[Job] = []

    async def start(name: str = "a", preload: bool = True) -> Job:
        used, faults = tmp_path / f"{name}.used", tmp_path / f"{name}.faults"
        faults.write_text("")
        env = vmm_shim.preload_env() if preload else dict(os.environ)
        env.update({"TIMESLICE_VMM_LIBCUDA": str(fake_lib), vmm_shim.DIR_ENV: str(tmp_path / "vmm"),
                    "TIMESLICE_FAKE_VMM_USED": str(used), "TIMESLICE_FAKE_VMM_FAULTS": str(faults),
                    "TIMESLICE_VMM_CHUNK_BYTES": str(2 * MIB)})  # buffers span chunks: copies are split
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(FAKE / "job.py"), str(fake_lib), *map(str, SIZES),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line.startswith("ready "), line
        job = Job(proc, used, faults, json.loads(line.split(" ", 1)[1]))
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        if job.proc.returncode is None:
            job.proc.kill()
        await job.proc.wait()


async def test_checkpoint_and_restore_keep_bytes_and_addresses(start_job, caplog):
    job = await start_job()
    backend = VmmBackend(lock_timeout=10)
    assert job.used_bytes() == SHIM_BYTES
    with caplog.at_level(logging.INFO, logger="timeslice.agent"):
        [st] = await backend.checkpoint([job.pid], timeout=30)
    assert (st.state, st.gpu_bytes) == (CHECKPOINTED, SHIM_BYTES)
    # the time its copies waited for the host buffer (faulted in and registered meanwhile) is logged
    assert re.search(rf"vmm checkpoint pid={job.pid}: {SHIM_BYTES} bytes in [0-9.]+ s \([0-9.]+ s of it waiting "
                     rf"for host memory\), {SHIM_BYTES} of them in the node's pool", caplog.text), caplog.text
    assert job.used_bytes() == 0  # the physical memory is released, the addresses stay reserved
    assert [s.state for s in await backend.state([job.pid])] == [CHECKPOINTED]
    [st] = await backend.checkpoint([job.pid], timeout=30)  # idempotent
    assert st.state == CHECKPOINTED
    [st] = await backend.restore([job.pid], timeout=30)
    assert (st.state, job.used_bytes()) == (RUNNING, SHIM_BYTES)
    assert await job.verify() == "verified ok"  # the same bytes at the same addresses
    for _ in range(10):
        await backend.checkpoint([job.pid], timeout=30)
        await backend.restore([job.pid], timeout=30)
    assert await job.verify() == "verified ok"


def _limit_address_space(pid: int, room: int) -> None:
    """Let `pid` map at most `room` more bytes (RLIMIT_AS)."""
    import resource

    size = int(re.search(r"VmSize:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())[1]) * 1024
    resource.prlimit(pid, resource.RLIMIT_AS, (size + room, size + room))


def _maps_pool(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "memfd:timeslice-vmm-pool" in f.read()


async def test_checkpoints_go_to_the_nodes_pool_and_what_it_lacks_to_the_shims_own(start_job, monkeypatch):
    """The node's pinned pool (a memfd the agent hands to each shim, registered once, in the
    background) takes what it has room for; the rest of a checkpoint goes to a buffer of the
    shim's own. Its ranges are the job's until its restore answers, come back when a checkpoint
    fails, when one that timed out has been undone, and when a checkpointed process is killed; a
    restarted agent's new pool is taken by a shim checkpointed in the old one, which restores from
    the old. Bytes and addresses kept every time."""
    pool_bytes = SHIM_BYTES + SHIM_BYTES // 2  # one job's state and half of another's
    monkeypatch.setenv("TIMESLICE_VMM_POOL_BYTES", str(pool_bytes))
    a, b, c = await start_job("a"), await start_job("b"), await start_job("c")
    backend = VmmBackend(10)
    backend.seen([a.pid, b.pid])  # a memory report's processes: handed the pool before any step
    await eventually(lambda: _maps_pool(a.pid) and _maps_pool(b.pid), 30, what="the shims map the pool")
    await eventually(lambda: backend.pinned_free_bytes() == pool_bytes, 30, what="the pool's pages taken")
    for _ in range(3):
        await backend.checkpoint([a.pid], timeout=30)
        assert backend.pinned_free_bytes() == pool_bytes - SHIM_BYTES
        await backend.checkpoint([b.pid], timeout=30)  # half in the pool, half in its shim's own buffer
        assert backend.pinned_free_bytes() == 0
        assert a.used_bytes() == b.used_bytes() == 0
        await backend.restore([a.pid], timeout=30)
        assert backend.pinned_free_bytes() == pool_bytes - SHIM_BYTES // 2
        await backend.restore([b.pid], timeout=30)
        assert backend.pinned_free_bytes() == pool_bytes
        assert [await a.verify(), await b.verify()] == ["verified ok"] * 2
    assert not _maps_pool(c.pid)  # (a process is handed the pool at its first step)
    c.fault("dtoh error")
    with pytest.raises(BackendError):
        await backend.checkpoint([c.pid], timeout=30)
    assert _maps_pool(c.pid) and backend.pinned_free_bytes() == pool_bytes
    c.fault("dtoh hang 1.5")
    with pytest.raises(StepTimeout):
        await backend.checkpoint([c.pid], timeout=0.3)
    assert backend.pinned_free_bytes() == pool_bytes - SHIM_BYTES  # the shim still copies, then undoes
    await eventually(lambda: backend.pinned_free_bytes() == pool_bytes, 30, what="the undone checkpoint's ranges")
    c.fault("")
    await backend.checkpoint([c.pid], timeout=30)
    c.proc.kill()
    await c.proc.wait()
    await backend.checkpoint([a.pid], timeout=30)  # c's ranges came back first
    assert backend.pinned_free_bytes() == pool_bytes - SHIM_BYTES
    restarted = VmmBackend(10)
    restarted.seen([a.pid])  # a new pool for a process checkpointed in the old one
    await eventually(lambda: restarted.pinned_free_bytes() == pool_bytes, 30, what="the new pool's pages taken")
    await restarted.restore([a.pid], timeout=30)
    assert await a.verify() == "verified ok"
    await restarted.checkpoint([a.pid], timeout=30)
    assert restarted.pinned_free_bytes() == pool_bytes - SHIM_BYTES
    await restarted.restore([a.pid], timeout=30)
    assert await a.verify() == "verified ok"


async def test_a_timed_out_checkpoint_the_shim_cannot_undo_keeps_its_pool_ranges(start_job, monkeypatch):
    """A checkpoint that timed out and whose undo failed (or whose answer came after the
    agent's deadline) leaves the job checkpointed in its pool ranges: they stay the job's, and
    the next job's checkpoint gets other bytes (found by the review: they went back to the pool,
    the next checkpoint wrote over them, and the first job restored another's bytes)."""
    monkeypatch.setenv("TIMESLICE_VMM_POOL_BYTES", str(2 * SHIM_BYTES))
    a, b = await start_job("a"), await start_job("b")
    backend = VmmBackend(10)
    a.fault("dtoh hang 0.5\nhtod error\n")  # a copy out hangs past the step's deadline, then the undo's copy back fails
    with pytest.raises(StepTimeout):
        await backend.checkpoint([a.pid], timeout=0.3)
    await eventually(lambda: backend.host_memory_settled(0.1), 30, what="the shim's answer after its undo")
    assert [st.state for st in await backend.state([a.pid])] == [CHECKPOINTED]
    assert backend.pinned_free_bytes() == SHIM_BYTES  # a's ranges stay a's
    await backend.checkpoint([b.pid], timeout=30)
    a.fault("")
    await backend.restore([a.pid], timeout=30)
    await backend.restore([b.pid], timeout=30)
    assert [await a.verify(), await b.verify()] == ["verified ok"] * 2
    assert backend.pinned_free_bytes() == 2 * SHIM_BYTES


async def test_a_process_that_cannot_map_the_pool_checkpoints_into_its_own_buffer(start_job, monkeypatch):
    """A shim that refuses the pool (here it cannot map it: its address space is limited) is sent
    no ranges: its checkpoints go to host memory of its own, also after an agent restart, when it
    still maps the old pool that another job is checkpointed in (found by the review: the new
    pool's ranges were applied to the old pool, over the other job's state)."""
    monkeypatch.setenv("TIMESLICE_VMM_POOL_BYTES", str(2 * SHIM_BYTES))
    a, b = await start_job("a"), await start_job("b")
    old = VmmBackend(10)
    await old.checkpoint([b.pid], timeout=30)  # b in the old pool, a maps it too
    await old.checkpoint([a.pid], timeout=30)
    await old.restore([a.pid], timeout=30)
    assert _maps_pool(a.pid)
    monkeypatch.setenv("TIMESLICE_VMM_POOL_BYTES", str(1 << 30))
    _limit_address_space(a.pid, 256 << 20)  # no room for 1 GiB
    restarted = VmmBackend(10)
    for _ in range(2):
        [st] = await restarted.checkpoint([a.pid], timeout=30)
        assert st.state == CHECKPOINTED and restarted.pinned_free_bytes() == 0  # (nothing of the new pool taken)
        await restarted.restore([a.pid], timeout=30)
        assert await a.verify() == "verified ok"
    await old.restore([b.pid], timeout=30)
    assert await b.verify() == "verified ok"


async def test_a_checkpoints_host_room_counts_the_pool_only_where_its_processes_hold_it(start_job, short_tmp,
                                                                                         monkeypatch):
    """The node agent's host-memory check adds the pool's free bytes (taken from the host already,
    so not in MemAvailable) only for a job whose processes' shims hold the pool: one that refused
    it checkpoints into host memory of its own (found by the review of issue 26: the pool was
    counted for every checkpoint, so such a process could take host memory the host lacked)."""
    pool_bytes = 128 * MIB
    monkeypatch.setenv("TIMESLICE_VMM_POOL_BYTES", str(pool_bytes))
    a, b = await start_job("a"), await start_job("b")
    _limit_address_space(b.pid, 64 * MIB)  # b's shim cannot map the pool: it refuses it
    backend = VmmBackend(10)
    backend.seen([a.pid])
    await eventually(lambda: backend.pinned_free_bytes() == pool_bytes, 30, what="a's shim takes the pool's pages")
    node = NodeAgent(StaticProcessResolver({"a": [a.pid], "b": [b.pid]}), backends=[backend],
                     records_path=short_tmp / "records.json",
                     memory_probe=lambda: [GpuInfo("GPU-0", 0, 80 << 30, 40 << 30,
                                                   {a.pid: SHIM_BYTES, b.pid: SHIM_BYTES})],
                     host_probe=lambda: host_memory.RESERVE_BYTES + SHIM_BYTES - 1)  # one byte short without the pool
    target = f"unix://{short_tmp / 'agent.sock'}"
    server, _ = await create_server(node, target)
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = apb_grpc.NodeAgentStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Checkpoint(apb.SwitchStepRequest(job_id="b", backend="vmm"))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "no host memory for the checkpoint of job b" in err.value.details()
            assert [st.state for st in await backend.state([b.pid])] == [RUNNING]  # nothing was touched
            await stub.Checkpoint(apb.SwitchStepRequest(job_id="a", backend="vmm"))  # into the pool
            assert a.used_bytes() == 0 and backend.pinned_free_bytes() == pool_bytes - SHIM_BYTES
            await stub.Restore(apb.SwitchStepRequest(job_id="a", backend="vmm"))
    finally:
        await server.stop(0)
    assert [await a.verify(), await b.verify()] == ["verified ok"] * 2


async def test_descriptors_sent_to_the_shim_with_a_command_are_not_kept(start_job):
    """Descriptors passed with any command but the pool's are closed, however many one message
    carries (found by the review: two per message were kept, forever)."""
    job = await start_job()
    fds = f"/proc/{job.pid}/fd"
    before = len(os.listdir(fds))
    r, w = os.pipe()
    try:
        for _ in range(10):
            with socket.socket(socket.AF_UNIX) as conn:
                conn.connect(socket_path(job.pid))
                socket.send_fds(conn, [b"state\n"], [r, w, r, w])
                assert conn.makefile("rb").readline().startswith(b"ok running")
    finally:
        os.close(r)
        os.close(w)
    assert len(os.listdir(fds)) == before


async def test_failed_copy_out_leaves_the_job_on_the_gpu(start_job):
    job = await start_job()
    job.fault("dtoh error")
    with pytest.raises(BackendError, match="CUDA_ERROR_UNKNOWN"):
        await VmmBackend(10).checkpoint([job.pid], timeout=30)
    assert job.used_bytes() == SHIM_BYTES
    assert await job.verify() == "verified ok"


async def test_failed_restore_stays_checkpointed_then_restores(start_job):
    job = await start_job()
    backend = VmmBackend(10)
    await backend.checkpoint([job.pid], timeout=30)
    for fault in ("create error", "htod error"):  # no memory for it / a copy that fails: nothing left mapped
        job.fault(fault)
        with pytest.raises(BackendError):
            await backend.restore([job.pid], timeout=30)
        assert job.used_bytes() == 0
        assert [s.state for s in await backend.state([job.pid])] == [CHECKPOINTED]
    job.fault("")
    await backend.restore([job.pid], timeout=30)
    assert await job.verify() == "verified ok"


async def test_a_checkpoint_right_after_a_restore_waits_for_the_restored_buffer_to_be_freed(start_job, short_tmp,
                                                                                           monkeypatch):
    """A switch that restores first, then checkpoints the job it replaces: the restored process's
    shim frees its host buffer after it answered, and the checkpoint's host-memory check must see
    that memory freed (H200, 3 jobs of 57 GB through `timeslice serve --backend vmm`: 4 switches
    refused "no host memory", 34 ms after a 47 GB restore, and their rollbacks too). Here the
    host's memory is taken until the restored shim's last cuMemHostUnregister ends (each of its
    buffer's chunks hangs 1 s: longer than a `state` question's own 5 s in all), and a memory
    report asked meanwhile answers within its deadline. No pinned pool: every checkpoint goes to a
    buffer of the shim's own (as what a full pool does not hold does)."""
    monkeypatch.setenv("TIMESLICE_VMM_POOL_BYTES", "0")
    gb = 10**9
    chunks = -(-SHIM_BYTES // (2 * MIB))  # the host buffer's registrations (TIMESLICE_VMM_CHUNK_BYTES)
    a, b = await start_job("a"), await start_job("b")
    hit, freed = (a.faults.with_name(f"{a.faults.name}.{end}") for end in ("hit", "after"))

    def unregistered() -> int:
        return len(freed.read_text().split()) if freed.exists() else 0

    node = NodeAgent(StaticProcessResolver({"a": [a.pid], "b": [b.pid]}), backends=[VmmBackend(10)],
                     records_path=short_tmp / "records.json",
                     memory_probe=lambda: [GpuInfo("GPU-0", 0, 80 * gb, 40 * gb, {a.pid: 20 * gb, b.pid: 20 * gb})],
                     host_probe=lambda: 10 * gb if hit.exists() and unregistered() < chunks else 100 * gb)
    target = f"unix://{short_tmp / 'agent.sock'}"
    server, _ = await create_server(node, target)
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = apb_grpc.NodeAgentStub(channel)
            await stub.Checkpoint(apb.SwitchStepRequest(job_id="a", backend="vmm"))
            a.fault("unregister hang 1.0")
            await stub.Restore(apb.SwitchStepRequest(job_id="a", backend="vmm"))
            report = await stub.GetMemory(apb.GetMemoryRequest(jobs=[apb.SwitchStepRequest(job_id="b")]), timeout=5)
            assert report.host_available_bytes == 10 * gb  # (it waited 1 s, then answered what it saw)
            await stub.Checkpoint(apb.SwitchStepRequest(job_id="b", backend="vmm"))  # not refused
            assert unregistered() == chunks
            await stub.Restore(apb.SwitchStepRequest(job_id="b", backend="vmm"))
    finally:
        await server.stop(0)
    assert [await a.verify(), await b.verify()] == ["verified ok"] * 2


@pytest.mark.parametrize("step", ["checkpoint", "restore"])
async def test_a_step_that_times_out_is_undone_by_the_shim(start_job, step):
    """The agent gives up; the step the shim still runs must not land late (issue 22's kind:
    a restore that timed out ran later, onto a GPU given to others)."""
    job = await start_job()
    backend = VmmBackend(10)
    before = RUNNING
    if step == "restore":
        await backend.checkpoint([job.pid], timeout=30)
        before = CHECKPOINTED
    job.fault(f"{'dtoh' if step == 'checkpoint' else 'htod'} hang 1.5")
    with pytest.raises(StepTimeout):
        await getattr(backend, step)([job.pid], timeout=0.3)
    job.fault("")
    for _ in range(200):  # the shim answers `state` once the late step and its undo are done
        [st] = await backend.state([job.pid])
        if st.state == before and job.used_bytes() == (SHIM_BYTES if before == RUNNING else 0):
            break
        await asyncio.sleep(0.05)
    assert st.state == before
    assert job.used_bytes() == (SHIM_BYTES if before == RUNNING else 0)
    if before == CHECKPOINTED:
        await backend.restore([job.pid], timeout=30)
    assert await job.verify() == "verified ok"


async def test_a_job_whose_process_dies_mid_copy_is_reported_gone(start_job):
    job = await start_job()
    job.fault("dtoh die")
    [st] = await VmmBackend(10).checkpoint([job.pid], timeout=30)
    assert st.state == GONE


async def test_all_or_nothing_over_a_jobs_processes(start_job):
    a, b = await start_job("a"), await start_job("b")
    b.fault("dtoh error")
    with pytest.raises(BackendError, match="rolled back 1 process"):
        await VmmBackend(10).checkpoint([a.pid, b.pid], timeout=30)
    assert (a.used_bytes(), b.used_bytes()) == (SHIM_BYTES, SHIM_BYTES)
    assert [await a.verify(), await b.verify()] == ["verified ok", "verified ok"]


async def test_killed_while_checkpointed_then_restore_says_gone(start_job):
    job = await start_job()
    backend = VmmBackend(10)
    await backend.checkpoint([job.pid], timeout=30)
    job.proc.send_signal(signal.SIGKILL)
    await job.proc.wait()
    [st] = await backend.restore([job.pid], timeout=30)
    assert st.state == GONE


async def test_a_process_without_the_shim_goes_to_the_cuda_backend(start_job, caplog):
    """Here the cuda backend has no driver: a process without the shim that holds no GPU memory
    (NVML sees none here) has nothing to move; the job's shim processes move as always."""
    caplog.set_level(logging.INFO, logger="timeslice.agent")
    plain, shim = await start_job("plain", preload=False), await start_job("shim")
    backend = make_backend("vmm")
    assert not await asyncio.to_thread(os.path.exists, socket_path(plain.pid))
    states = await backend.checkpoint([plain.pid, shim.pid], timeout=30)
    assert {(s.pid, s.state) for s in states} == {(plain.pid, NO_CONTEXT), (shim.pid, CHECKPOINTED)}
    assert "moved by the cuda backend" in caplog.text
    await backend.restore([plain.pid, shim.pid], timeout=30)
    assert [await plain.verify(), await shim.verify()] == ["verified ok", "verified ok"]


async def test_only_the_processes_user_may_ask(start_job, tmp_path):
    job = await start_job()
    assert oct((tmp_path / "vmm").stat().st_mode & 0o777) == "0o700"
    if os.getuid() != 0:
        pytest.skip("needs root to ask as another user")
    ask = ("import os, socket, sys; os.setuid(65534); s = socket.socket(socket.AF_UNIX); "
           "s.connect(sys.argv[1]); s.sendall(b'checkpoint\\n'); print(s.recv(100))")
    reply = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", ask, socket_path(job.pid)],
                                    capture_output=True, text=True)
    assert "b'checkpoint" not in reply.stdout and job.used_bytes() == SHIM_BYTES  # refused: nothing moved


def test_preload_env_puts_the_shim_first():
    env = vmm_shim.preload_env({"LD_PRELOAD": "/x/libother.so"})
    assert env["LD_PRELOAD"].split() == [str(vmm_shim.library()), "/x/libother.so"]
    assert ProcessGone  # imported for the reader: `gone` is how run_step reports a ProcessGone


@contextlib.asynccontextmanager
async def _serve_vmm(fake_lib: Path, tmp_path: Path, group: str) -> AsyncIterator[dict[str, str]]:
    """`timeslice serve --config` with one group `group` (YAML flow mapping), as a user runs it:
    yields the environment its ready line gives jobs (the shim in LD_PRELOAD), over the fake
    driver; serve's log is tmp_path/serve.log."""
    (tmp_path / "groups.yaml").write_text(f"groups:\n  - {group}\n")
    sock = tmp_path / "run" / "orchestrator.sock"
    with (tmp_path / "serve.log").open("ab") as err:
        serve = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "timeslice.cli.main", "serve", "--config", str(tmp_path / "groups.yaml"),
            "--socket", str(sock), "--state-dir", str(tmp_path / "state"), stdout=subprocess.PIPE, stderr=err)
    try:
        assert serve.stdout is not None
        line = (await asyncio.wait_for(serve.stdout.readline(), 60)).decode()
        assert line.startswith(f"ready TIMESLICE_ORCHESTRATOR=unix://{sock} LD_PRELOAD={vmm_shim.library()} "
                               "groups=g(vmm)"), (tmp_path / "serve.log").read_text()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_")}
        env.update(dict(w.split("=", 1) for w in line.split()[1:3]))
        env.update({"TIMESLICE_GROUP": "g", "TIMESLICE_ACCELERATOR_PROCESS": "1",
                    "TIMESLICE_VMM_LIBCUDA": str(fake_lib), vmm_shim.DIR_ENV: str(tmp_path / "vmm"),
                    "TIMESLICE_VMM_CHUNK_BYTES": str(2 * MIB)})
        (tmp_path / "peers").mkdir()  # each keeps its first hold until both asked: at least one hand-off
        env["TIMESLICE_FAKE_VMM_PEERS"] = f"{tmp_path / 'peers'}:2"
        yield env
    finally:
        serve.send_signal(signal.SIGTERM)
        await asyncio.wait_for(serve.wait(), 30)


async def _holds(fake_lib: Path, env: dict[str, str], used: Path) -> asyncio.subprocess.Process:
    """A job of 4 holds (bench/fake_cuda/vmm/job.py): it exits 0 saying `holds ok` only when it
    found its bytes at its addresses in each (touching memory that is not back kills it)."""
    return await asyncio.create_subprocess_exec(
        sys.executable, str(FAKE / "job.py"), str(fake_lib), "--holds", "4", *map(str, SIZES),
        env={**env, "TIMESLICE_FAKE_VMM_USED": str(used)}, stdout=subprocess.PIPE, start_new_session=True)


async def test_serve_moves_unmodified_jobs_with_their_bytes_and_addresses(fake_lib, tmp_path):
    """`timeslice serve` on backend vmm, as a user runs it: its ready line names the shim, two jobs
    started with it (the client library's holds, no other change) share the group; with residency
    exclusive every hand-off checkpoints the holder through its shim and restores the other, and
    each job finds its bytes at its addresses in every hold (a job touching memory that is not
    back would die)."""
    async with _serve_vmm(fake_lib, tmp_path, "{id: g, backend: vmm, residency: exclusive}") as env:
        jobs = [await _holds(fake_lib, env, tmp_path / f"{i}.used") for i in range(2)]
        outs = await asyncio.wait_for(asyncio.gather(*(j.communicate() for j in jobs)), 120)
        text = (tmp_path / "serve.log").read_text()
        assert [(j.returncode, o[0].decode().strip()) for j, o in zip(jobs, outs)] == [(0, "holds ok")] * 2, \
            text[-3000:]
        assert text.count("vmm checkpoint pid=") >= 1 and text.count("vmm restore pid=") >= 1, text[-3000:]
        # every checkpoint copied into the node's pool (room for both jobs), which each shim maps
        checkpoints = re.findall(r"vmm checkpoint pid=\d+: (\d+) bytes .*, (\d+) of them in the node's pool", text)
        assert checkpoints and all(whole == pooled for whole, pooled in checkpoints), text[-3000:]


async def test_a_holder_whose_keep_alives_stop_is_not_moved_while_its_process_lives(fake_lib, tmp_path):
    """A holder whose keep-alives stop past its lease while its process lives (a helper's
    attack: a C call holding the GIL for 20 s, or a SIGSTOP of 30 s) may still compute, and
    nothing stops it: its memory moved under it, it died (SIGSEGV) on its next read, or its
    release raised LeaseLost. It keeps the lock while its agent reports it live; once it goes
    on, its late keep-alive renews the lease and both jobs finish with their bytes."""
    group = "{id: g, backend: vmm, residency: exclusive, lease_seconds: 2}"
    async with _serve_vmm(fake_lib, tmp_path, group) as env:
        a = await _holds(fake_lib, env, tmp_path / "a.used")
        await _line(tmp_path / "serve.log", rf"granted group=g job=\S*{a.pid}\b")
        os.kill(a.pid, signal.SIGSTOP)  # in its first hold, which waits for the second job to ask
        b = await _holds(fake_lib, env, tmp_path / "b.used")
        m = await _line(tmp_path / "serve.log", r"lease of holder past its deadline .*|lease expired .*")
        os.kill(a.pid, signal.SIGCONT)
        assert "keeps the lock" in m.group(0), m.group(0)
        outs = await asyncio.wait_for(asyncio.gather(a.communicate(), b.communicate()), 120)
        text = (tmp_path / "serve.log").read_text()
        assert [(a.returncode, outs[0][0].decode().strip()), (b.returncode, outs[1][0].decode().strip())] \
            == [(0, "holds ok")] * 2, text[-3000:]
        assert "lease expired" not in text, text[-3000:]


async def _line(path: Path, pattern: str, seconds: float = 60) -> re.Match[str]:
    """The first match of `pattern` in the file at `path`, waited for (a signal, with a deadline)."""
    def read() -> str:
        return path.read_text() if path.exists() else ""

    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        if m := re.search(pattern, await asyncio.to_thread(read)):
            return m
        assert asyncio.get_running_loop().time() < deadline, f"no {pattern!r} in {path}"
        await asyncio.sleep(0.05)


async def test_a_node_agent_killed_mid_checkpoint_loses_no_job(fake_lib, tmp_path):
    """`timeslice node-agent` + `timeslice orchestrator`, as a user runs them: the agent is
    killed (SIGKILL) while a job's shim is in the middle of its checkpoint copy. The shim
    finishes and undoes the step (its asker is gone), the restarted agent finds the job where it
    is, and both jobs finish every hold with their bytes at their addresses."""
    cli = [sys.executable, "-m", "timeslice.cli.main"]
    agent_target = f"unix://{tmp_path / 'agent.sock'}"
    group = f"{{id: g, backend: vmm, residency: exclusive, agents: ['{agent_target}']}}"
    (tmp_path / "groups.yaml").write_text(f"listen: 127.0.0.1:0\nstate_file: {tmp_path / 'state.json'}\n"
                                          f"groups:\n  - {group}\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_")}
    procs: list[asyncio.subprocess.Process] = []

    async def start(argv: list[str], log: str, env: dict[str, str]) -> asyncio.subprocess.Process:
        with (tmp_path / log).open("ab") as out:
            procs.append(await asyncio.create_subprocess_exec(*argv, env=env, stdout=out, stderr=out))
        return procs[-1]

    agent_argv = [*cli, "node-agent", "--listen", agent_target, "--state-dir", str(tmp_path / "agent")]
    faults = tmp_path / "faults"
    try:
        agent = await start(agent_argv, "agent.log", base)
        await _line(tmp_path / "agent.log", r"ready listen=")
        await start([*cli, "orchestrator", "--config", str(tmp_path / "groups.yaml")], "orchestrator.log", base)
        port = (await _line(tmp_path / "orchestrator.log", r"orchestrator serving listen=\S+ port=(\d+)")).group(1)
        faults.write_text("dtoh hang 2\n")
        env = {**vmm_shim.preload_env(base), "TIMESLICE_ORCHESTRATOR": f"127.0.0.1:{port}", "TIMESLICE_GROUP": "g",
               "TIMESLICE_ACCELERATOR_PROCESS": "1",
               "TIMESLICE_VMM_LIBCUDA": str(fake_lib), vmm_shim.DIR_ENV: str(tmp_path / "vmm"),
               "TIMESLICE_VMM_CHUNK_BYTES": str(2 * MIB), "TIMESLICE_FAKE_VMM_FAULTS": str(faults),
               "TIMESLICE_FAKE_VMM_PEERS": f"{tmp_path / 'peers'}:2"}  # (a hand-off, so a checkpoint, happens)
        (tmp_path / "peers").mkdir()
        jobs = [await asyncio.create_subprocess_exec(
            sys.executable, str(FAKE / "job.py"), str(fake_lib), "--holds", "4", *map(str, SIZES),
            env={**env, "TIMESLICE_JOB": name}, stdout=subprocess.PIPE) for name in ("a", "b")]
        await _line(Path(f"{faults}.hit"), "dtoh")  # a checkpoint copy hangs in a job's shim
        faults.write_text("")
        agent.send_signal(signal.SIGKILL)
        await agent.wait()
        await start(agent_argv, "agent.log", base)
        outs = await asyncio.wait_for(asyncio.gather(*(j.communicate() for j in jobs)), 120)
        assert [(j.returncode, o[0].decode().strip()) for j, o in zip(jobs, outs)] == [(0, "holds ok")] * 2, \
            (tmp_path / "agent.log").read_text()[-3000:]
        assert "undoing an interrupted checkpoint" in (tmp_path / "agent.log").read_text()
    finally:
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
                await asyncio.wait_for(p.wait(), 30)


async def test_a_socket_left_behind_is_not_a_shim(start_job, tmp_path):
    """A socket file at a live process's path whose process does not have the shim loaded (left
    by an earlier process of that PID): the process is moved as one without the shim (here: it
    holds no GPU memory), not failed as a shim that does not answer (review of issue 26)."""
    plain = await start_job("plain", preload=False)
    path = socket_path(plain.pid)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    left = socket.socket(socket.AF_UNIX)
    left.bind(path)
    left.close()  # the file stays, nobody listens
    [st] = await VmmBackend(10).checkpoint([plain.pid], timeout=30)
    assert st.state == NO_CONTEXT


async def test_a_silent_asker_does_not_block_the_shim(start_job):
    """A connection that sends nothing is dropped after a while; the next command is answered."""
    job = await start_job()
    silent = socket.socket(socket.AF_UNIX)
    await asyncio.to_thread(silent.connect, socket_path(job.pid))
    try:
        [st] = await VmmBackend(10).checkpoint([job.pid], timeout=30)
        assert st.state == CHECKPOINTED
    finally:
        silent.close()
    await VmmBackend(10).restore([job.pid], timeout=30)
    assert await job.verify() == "verified ok"


def test_a_runtime_loaded_locally_is_found(tmp_path):
    """A program whose CUDA runtime is loaded with RTLD_LOCAL (as Python loads an extension
    module that links it) still allocates, through the shim, and frees (review of issue 26:
    the shim looked for the runtime only in the global scope, and every cudaMalloc failed)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = FAKE / "fake_libcuda.c"
    subprocess.run([cc, "-shared", "-fPIC", "-DFAKE_DRIVER_ONLY", "-o", str(tmp_path / "libdriver.so"), str(src)],
                   check=True)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "libcudart.so.99"), str(src)], check=True)
    (tmp_path / "app.c").write_text("int cudaMalloc(void **, unsigned long); int cudaFree(void *);\n"
                                    "int app_alloc(void **p, unsigned long n) { return cudaMalloc(p, n); }\n"
                                    "int app_free(void *p) { return cudaFree(p); }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "libapp.so"), str(tmp_path / "app.c"),
                    f"-L{tmp_path}", "-l:libcudart.so.99", "-Wl,-rpath,$ORIGIN"], check=True)
    program = ("import ctypes, sys\n"
               "app = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_LOCAL)\n"
               "p = ctypes.c_void_p()\n"
               "print(app.app_alloc(ctypes.byref(p), 4 << 20), app.app_alloc(ctypes.byref(ctypes.c_void_p()), 4096),\n"
               "      app.app_free(p))\n")
    env = {**vmm_shim.preload_env(), "TIMESLICE_VMM_LIBCUDA": str(tmp_path / "libdriver.so"),
           vmm_shim.DIR_ENV: str(tmp_path / "vmm")}
    out = subprocess.run([sys.executable, "-c", program, str(tmp_path / "libapp.so")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["0", "0", "0"], out.stderr


def _gpu_with_torch() -> bool:
    import importlib.util

    if not importlib.util.find_spec("torch"):
        return False
    from timeslice.cli.demo import gpu_present

    return gpu_present()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_with_torch(), reason="needs an NVIDIA GPU and PyTorch")
def test_on_a_gpu_unmodified_jobs_keep_their_bytes_and_graphs(tmp_path):
    """bench/vmm_switch.py small: two unmodified PyTorch jobs of 2 GB with a captured CUDA graph,
    3 switches by the real driver; every replay and tensor bitwise equal (the committed H100
    runs: bench/results/vmm-switch-30gb-*-h100.json)."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "vmm_switch.py"), "--gb", "2", "--switches", "3",
                          "--out", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["verification_failures"] == 0 and len(result["switches"]) == 3
