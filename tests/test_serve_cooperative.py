"""The cooperative path on the user's own commands (issue 21, item 3), all as real processes:
`timeslice serve` with a `backend: cooperative` group makes its pinned pool itself (a
private directory under /dev/shm, removed on stop), and two job processes that name
neither a job nor a PID move their own state through it at each hand-off (the fake store
of `test_cooperative`: "device" state in a bytearray), bit for bit. `timeslice serve`,
`timeslice node-agent` and `timeslice orchestrator` run with the `kubernetes` package
unimportable (a PYTHONPATH folder whose `kubernetes` raises ModuleNotFoundError, as an
install without the extra does)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import mmap
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from timeslice.controller.orchestrator.pinned_pool import remove_left
from timeslice.driver.host_ranges import NO_GPU_BYTES, default_size
from timeslice.v1 import orchestrator_pb2 as pb
from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

from tests.conftest import eventually
from tests.test_node_agent_cli import orchestrate_jobs_a_and_b, start, stop
from tests.test_serve import check_hand_offs, env_for

ROOT = Path(__file__).resolve().parent.parent
STATE_BYTES = 256 * 1024

# A cooperative job: registers a fake store of STATE_BYTES with the client (its own
# process group is the job), then holds the group `rounds` times; inside each hold the
# state must be what it was at the last release, then it changes it. Ends with close()
# right after its last release, while the other job may be waiting.
COOP_JOB = textwrap.dedent("""
    import hashlib, json, os, pathlib, sys, time
    import grpc
    from timeslice import TimeSliceOrchestratorClient, _rpc
    from timeslice.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc as pb_grpc
    from tests.test_cooperative import FakeStore
    name, out, rounds, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    peers = sys.argv[5].split(",") if len(sys.argv) > 5 else []  # jobs to wait for before the first hold
    class Store(FakeStore):
        pooled = 0  # checkpoints that went to the node's pool
        def checkpoint(self, ranges):
            n, in_pool = super().checkpoint(ranges)
            self.pooled += in_pool
            return n, in_pool
    client = TimeSliceOrchestratorClient(group_id="g")
    store = Store(name, size=size)
    loop = client.serve_memory_commands(store)
    assert loop.ready.wait(30) and loop.error is None, loop.error
    pathlib.Path(out, name + ".ready").touch()  # its commands are served: the peers may start (a loaded
    deadline = time.monotonic() + 60            # machine started one job's rounds after the other's ended)
    while not all(pathlib.Path(out, p + ".ready").exists() for p in peers):
        assert time.monotonic() < deadline, f"{name}: peers {peers} never started"
        time.sleep(0.01)
    status = pb_grpc.OrchestratorStub(grpc.insecure_channel(_rpc.address(os.environ["TIMESLICE_ORCHESTRATOR"])))

    def hand_on():  # hold until a peer waits (or has ended): every release hands the GPU over, however loaded
        deadline = time.monotonic() + 60
        while not any(pathlib.Path(out, p + ".json").exists() for p in peers if p != name):
            if status.GetGroupStatus(pb.GetGroupStatusRequest(group_id="g"), timeout=10,
                                     metadata=_rpc.call_metadata()).waiters or time.monotonic() > deadline:
                return
            time.sleep(0.01)

    expected, spans = bytes(store.device), []
    for i in range(rounds):
        with client.on_accelerators():
            t0 = time.time()
            assert store.device is not None and bytes(store.device) == expected, (name, i)
            store.device[:] = hashlib.sha256(expected).digest() * (size // 32)  # this phase's work
            expected = bytes(store.device)
            time.sleep(0.15)
            if peers:
                hand_on()
            spans.append([name, t0, time.time()])
        time.sleep(0.05)
    client.close()
    json.dump({"spans": spans, "commands": store.commands, "pooled": store.pooled,
               "sha": hashlib.sha256(expected).hexdigest()}, open(f"{out}/{name}.json", "w"))
""")


@pytest.fixture
def no_kubernetes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Child processes find a `kubernetes` package that is not there (ModuleNotFoundError)."""
    shim = tmp_path / "no-kubernetes" / "kubernetes"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'kubernetes'\", "
                                      "name='kubernetes')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(shim.parent), str(ROOT),
                                                                  os.environ.get("PYTHONPATH")])))


def _pool_dirs() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("timeslice-pool-*")}


# A job whose state never finishes leaving: its checkpoint says so (a file) and hangs there.
HUNG_JOB = textwrap.dedent("""
    import pathlib, signal, sys, threading
    from timeslice import TimeSliceOrchestratorClient
    from tests.test_cooperative import FakeStore
    class Hung(FakeStore):
        def checkpoint(self, ranges):
            pathlib.Path(sys.argv[1], "in-checkpoint").touch()
            threading.Event().wait()  # never answers: the test kills this process here
    client = TimeSliceOrchestratorClient(group_id="g")
    loop = client.serve_memory_commands(Hung("hung"))
    assert loop.ready.wait(30) and loop.error is None, loop.error
    client.acquire()
    print("holding", flush=True)
    sys.stdin.readline()
    client.release()
    signal.pause()  # until the test kills it
""")


@contextlib.asynccontextmanager
async def cooperative_serve(tmp_path: Path, sock: Path, *flags: str) -> AsyncIterator[tuple[Path, Path]]:
    """`timeslice serve` with one cooperative group `g` (residency exclusive: every hand-off
    moves state), logging to tmp_path/serve.log: yields (pool file, log); must stop cleanly
    (SIGTERM) and take its pool's folder with it."""
    (tmp_path / "groups.yaml").write_text("groups:\n  - {id: g, backend: cooperative, residency: exclusive}\n")
    log = tmp_path / "serve.log"
    with log.open("ab") as err:
        serve = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "timeslice.cli.main", "serve", "--config", str(tmp_path / "groups.yaml"),
            "--socket", str(sock), "--state-dir", str(tmp_path / "state"), *flags,
            stdout=asyncio.subprocess.PIPE, stderr=err)
    assert serve.stdout is not None
    try:
        line = (await asyncio.wait_for(serve.stdout.readline(), 60)).decode()
        assert line.startswith(f"ready TIMESLICE_ORCHESTRATOR=unix://{sock} groups=g(cooperative)"), log.read_text()
        pool = Path(re.findall(r"pinned_pool=(\S+)\(\d+\)", log.read_text())[-1])
        yield pool, log
    finally:
        if serve.returncode is None:
            serve.send_signal(signal.SIGTERM)
        await asyncio.wait_for(serve.wait(), 30)
    assert serve.returncode == 0, log.read_text()[-4000:]
    assert not pool.parent.exists(), "the pool's folder outlived serve"


async def group_status(sock: Path) -> pb.GroupStatus:
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        return await pb_grpc.OrchestratorStub(ch).GetGroupStatus(pb.GetGroupStatusRequest(group_id="g"))


async def waiting(sock: Path) -> bool:
    return bool((await group_status(sock)).waiters)


def coop_job(sock: Path, tmp_path: Path, name: str, rounds: int,
             *peers: str) -> Awaitable[asyncio.subprocess.Process]:
    """A COOP_JOB process; `peers`: a comma-joined list of jobs it waits for before its first hold."""
    return asyncio.create_subprocess_exec(sys.executable, "-c", COOP_JOB, name, str(tmp_path), str(rounds),
                                          str(STATE_BYTES), *peers, env=env_for(str(sock)), cwd=ROOT,
                                          start_new_session=True)


@pytest.fixture
def reserved_huge_pages(tmp_path: Path) -> Iterator[Path]:
    """A hugetlbfs mount (2 MiB pages) with 4 more huge pages reserved on the host, as an admin
    reserves them (`vm.nr_hugepages`); both undone after. Needs root (CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting hugetlbfs and reserving huge pages need root")
    mount, nr = tmp_path / "hugepages", Path("/proc/sys/vm/nr_hugepages")
    mount.mkdir()
    before = int(nr.read_text())
    subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(mount)], check=True)
    try:
        nr.write_text(str(before + 4))
        assert int(nr.read_text()) == before + 4, "the host found no memory for 4 huge pages"
        yield mount
    finally:
        nr.write_text(str(before))
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("huge", "gb", "size"), [(False, "0.0042", 4_200_000),
                                                  (True, "0.0042", 4 << 20),  # rounded down to two 2 MiB pages
                                                  (True, "0.0108", 10_800_000)])  # more than the 4 pages reserved
async def test_a_cooperative_group_on_serve_moves_each_jobs_state_through_its_private_pool(
        no_kubernetes, tmp_path, short_tmp, huge, gb, size, request) -> None:
    """On /dev/shm, or on hugetlbfs where the host reserved huge pages for the whole pool."""
    mount = request.getfixturevalue("reserved_huge_pages") if huge else None
    sock = short_tmp / "orchestrator.sock"
    before = _pool_dirs()
    async with cooperative_serve(tmp_path, sock, "--pinned-pool-gb", gb) as (pool, log):
        assert pool.parent.parent == (mount if size % (2 << 20) == 0 else Path("/dev/shm"))
        assert pool.parent.name not in before
        folder, made = os.stat(pool.parent), os.stat(pool)
        assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.geteuid()
        assert stat.S_IMODE(made.st_mode) == 0o600 and made.st_uid == os.geteuid() and made.st_size == size
        jobs = [await coop_job(sock, tmp_path, name, 4, "a,b") for name in "ab"]
        for job in jobs:
            assert await asyncio.wait_for(job.wait(), 120) == 0, log.read_text()[-4000:]
        status = await group_status(sock)
    results = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab"}
    spans = sorted((s for r in results.values() for s in r["spans"]), key=lambda s: s[1])
    assert all(cur[1] >= prev[2] for prev, cur in itertools.pairwise(spans)), spans  # one holder at a time
    hand_offs = sum(prev[0] != cur[0] for prev, cur in itertools.pairwise(spans))
    assert hand_offs >= 2, spans
    # every hand-off moved the outgoing job's state out and the incoming one's back, via the pool
    assert status.failed_switches == 0, status
    moved = [r for r in status.recent_switches if r.bytes_checkpointed]
    assert len(moved) >= hand_offs and all(r.ok and r.bytes_checkpointed == STATE_BYTES for r in moved), status
    for r in results.values():  # each job's state left and came back, always through the pool
        assert "restore" in r["commands"] and 0 < r["pooled"] == r["commands"].count("checkpoint"), results


@pytest.mark.timeout(180)
async def test_a_job_killed_while_its_state_leaves_for_a_waiter_costs_the_waiter_nothing(tmp_path, short_tmp) -> None:
    """The waiter must be granted when the job checkpointed for it leaves mid-command: here
    killed (-9) inside its checkpoint; the same path as a job whose client closes right
    after its release (its stream closes with the checkpoint unanswered). It used to fail
    the waiter's acquire with SwitchFailed ("closed its command stream")."""
    sock = short_tmp / "orchestrator.sock"
    async with cooperative_serve(tmp_path, sock, "--pinned-pool-gb", "0.004") as (_, log):
        hung = await asyncio.create_subprocess_exec(sys.executable, "-c", HUNG_JOB, str(tmp_path),
                                                    env=env_for(str(sock)), cwd=ROOT, start_new_session=True,
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert hung.stdin is not None and hung.stdout is not None
        try:
            assert await asyncio.wait_for(hung.stdout.readline(), 60) == b"holding\n", log.read_text()[-4000:]
            waiter = await coop_job(sock, tmp_path, "b", 2)
            await eventually(lambda: waiting(sock), timeout=60, interval=0.05, what="b waiting")
            hung.stdin.write(b"release\n")
            marker = tmp_path / "in-checkpoint"
            await eventually(marker.exists, timeout=60, interval=0.05, what="the holder's checkpoint")
            os.killpg(hung.pid, signal.SIGKILL)
            assert await asyncio.wait_for(waiter.wait(), 90) == 0, log.read_text()[-4000:]
        finally:
            if hung.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(hung.pid, signal.SIGKILL)
            await hung.wait()
        status = await group_status(sock)
    assert status.failed_switches == 0, status
    assert json.loads((tmp_path / "b.json").read_text())["spans"], "b never held"


async def test_node_agent_and_orchestrator_serve_jobs_without_kubernetes(no_kubernetes, tmp_path, short_tmp) -> None:
    agent_sock = f"unix://{short_tmp / 'agent.sock'}"
    agent, _ = await start("node-agent", "--listen", agent_sock, "--backends", "freeze,none", "--state-dir",
                           str(tmp_path / "agent-state"), ready=re.compile(rb"^ready listen="), stream="stdout")
    try:
        config = {"listen": "127.0.0.1:0", "groups": [{"id": "g", "backend": "freeze", "agents": [agent_sock]}]}
        orch = await orchestrate_jobs_a_and_b(config, tmp_path)
    finally:
        await stop(agent)
    assert agent.returncode == 0 and orch.returncode == 0
    check_hand_offs(tmp_path, "ab")


@pytest.mark.timeout(180)
async def test_node_agent_and_orchestrator_give_a_cooperative_group_the_default_pool(no_kubernetes, tmp_path,
                                                                                      short_tmp) -> None:
    """`timeslice orchestrator --config` with a cooperative group and no `pinned_pool` makes
    the node's pool as `timeslice serve` does (a private folder under /dev/shm, the default
    size, removed on stop): without it each job checkpointed into host memory of its own,
    and on the H200 host two jobs of 47 GB were killed with their states."""
    agent_sock = f"unix://{short_tmp / 'agent.sock'}"
    agent, _ = await start("node-agent", "--listen", agent_sock, "--backends", "none", "--state-dir",
                           str(tmp_path / "agent-state"), ready=re.compile(rb"^ready listen="), stream="stdout")
    before = _pool_dirs()
    config = {"listen": "127.0.0.1:0", "state_file": str(tmp_path / "state.json"),
              "groups": [{"id": "g", "backend": "cooperative", "agents": [agent_sock], "residency": "exclusive"}]}
    (tmp_path / "orchestrator.yaml").write_text(yaml.safe_dump(config))
    try:
        orch, m = await start("orchestrator", "--config", str(tmp_path / "orchestrator.yaml"),
                              ready=re.compile(rb"orchestrator serving listen=\S+ port=(\d+)"), stream="stderr")
        try:
            made = _pool_dirs() - before
            assert len(made) == 1, made
            pool = Path("/dev/shm") / made.pop() / "pool"
            assert f"pinned_pool={pool}(".encode() in m.string, m.string  # its log says where
            assert orch.stdout is not None  # and it says it is ready on stdout, as serve and node-agent do
            ready = await asyncio.wait_for(orch.stdout.readline(), 30)
            assert ready == b"ready listen=127.0.0.1:" + m.group(1) + b"\n", ready
            assert stat.S_IMODE(os.stat(pool.parent).st_mode) == 0o700 and os.stat(pool).st_size == default_size(0)
            env = {k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_")}
            env["TIMESLICE_ORCHESTRATOR"] = f"127.0.0.1:{m.group(1).decode()}"
            jobs = [await asyncio.create_subprocess_exec(sys.executable, "-c", COOP_JOB, name, str(tmp_path), "3",
                                                         str(STATE_BYTES), "a,b", env={**env, "TIMESLICE_JOB": name},
                                                         cwd=ROOT)
                    for name in "ab"]
            for job in jobs:
                assert await asyncio.wait_for(job.wait(), 120) == 0
        finally:
            await stop(orch)
    finally:
        await stop(agent)
    assert orch.returncode == 0 and not pool.parent.exists()
    results = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab"}
    for r in results.values():  # each job's state left and came back through the pool
        assert "restore" in r["commands"] and 0 < r["pooled"] == r["commands"].count("checkpoint"), results


def test_the_default_pool_is_the_gpus_memory_within_three_quarters_of_the_host_and_the_free_space(tmp_path) -> None:
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 3 // 4
    free = shutil.disk_usage(tmp_path).free
    assert default_size(0, tmp_path) == min(NO_GPU_BYTES, host, free)  # no GPU: 1 GB
    assert default_size(1 << 60, tmp_path) == min(host, free)
    assert default_size(4096, tmp_path) == 4096


def test_copies_through_the_pool_never_cross_a_registration_chunk() -> None:
    torch_state = pytest.importorskip("timeslice.torch")
    c = torch_state.REGISTER_CHUNK_BYTES
    assert torch_state.chunked([(c - 100, 0, 300), (5 * c, 300, 2 * c + 7), (0, 9, 10)]) == [
        (c - 100, 0, 100), (c, 100, 200), (5 * c, 300, c), (6 * c, 300 + c, c), (7 * c, 300 + 2 * c, 7), (0, 9, 10)]


def test_a_pool_sized_twice_is_refused_before_anything_is_made(tmp_path, short_tmp) -> None:
    (tmp_path / "groups.yaml").write_text(yaml.safe_dump({
        "pinned_pool": {"path": str(tmp_path / "pool"), "bytes": 4096},
        "groups": [{"id": "g", "backend": "cooperative"}]}))
    before = _pool_dirs()
    serve = [sys.executable, "-m", "timeslice.cli.main", "serve", "--config", str(tmp_path / "groups.yaml")]
    out = subprocess.run([*serve, "--socket", str(short_tmp / "o.sock"), "--state-dir", str(tmp_path / "state"),
                          "--pinned-pool-gb", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--pinned-pool-gb and the config's pinned_pool" in out.stderr, out
    assert "Traceback" not in out.stderr and not (tmp_path / "pool").exists() and _pool_dirs() == before


def _left_pool(tmp_path: Path, root: Path = Path("/dev/shm"), size: int = 4096, in_journal: bool = False) -> Path:
    """A pool folder as a killed serve leaves it under `root`, recorded in the state file of
    tmp_path/state (`in_journal`: in a journal line after the snapshot, as a serve killed
    before its journal was folded into a snapshot leaves it)."""
    folder = Path(tempfile.mkdtemp(prefix="timeslice-pool-", dir=root))
    fd = os.open(folder / "pool", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)  # (hugetlbfs has no write(2): a size, then pages as they are mapped)
    os.close(fd)
    (tmp_path / "state").mkdir(exist_ok=True)
    snapshot = tmp_path / "state" / "orchestrator-state.json"
    pool = {"path": str(folder / "pool"), "bytes": size, "checkpoints": []}
    snapshot.write_text(json.dumps({"apiVersion": "timeslice.dev/orchestrator-state/v1", "epochs": {"g": 7},
                                    "groups": {}, **({} if in_journal else {"pool": pool})}))
    if in_journal:
        snapshot.with_name(snapshot.name + ".journal").write_text(json.dumps({"seq": 1, "pool": pool}) + "\n")
    return folder / "pool"


@pytest.mark.parametrize("huge", [False, True])
def test_a_left_pool_is_removed_once_nothing_maps_it(tmp_path, huge, request) -> None:
    """A new user's trial: serve killed with SIGKILL left its pool in /dev/shm (954 MB each
    time); the next start made a new one. A pool a process still maps stays. The same on a
    hugetlbfs mount (huge pages the host reserved stay taken while the file exists)."""
    pool = _left_pool(tmp_path, request.getfixturevalue("reserved_huge_pages"), 2 << 20) if huge else \
        _left_pool(tmp_path)
    with subprocess.Popen([sys.executable, "-c", "import mmap, sys\nf = open(sys.argv[1], 'r+b')\n"
                           "m = mmap.mmap(f.fileno(), 0)\nf.close()\nprint('mapped', flush=True)\n"
                           "sys.stdin.readline()", str(pool)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as mapper:
        try:
            assert mapper.stdout is not None and mapper.stdout.readline().strip() == "mapped"
            assert not remove_left(pool) and pool.exists()
        finally:
            mapper.kill()
    assert remove_left(pool) and not pool.parent.exists()
    other = tmp_path / "timeslice-pool-x" / "pool"  # not under /dev/shm: never touched
    other.parent.mkdir()
    other.write_bytes(b"x")
    assert not remove_left(other) and other.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recorded", ["snapshot", "journal"])
async def test_serve_removes_the_pool_a_killed_serve_left_with_its_state_dir(no_kubernetes, tmp_path, short_tmp,
                                                                             recorded) -> None:
    """(`journal`: serve read the snapshot alone, and missed a pool recorded in the journal.)"""
    pool = _left_pool(tmp_path, in_journal=recorded == "journal")
    async with cooperative_serve(tmp_path, short_tmp / "orchestrator.sock", "--pinned-pool-gb", "0.004") as (
            new, log):
        assert not pool.parent.exists() and new.parent != pool.parent, log.read_text()[-2000:]
        assert "removed the pinned pool" in log.read_text()


def test_registered_cpu_tensors_are_not_gpu_state_and_a_checkpoint_of_them_moves_nothing() -> None:
    """A cooperative checkpoint in a process without CUDA crashed on the missing copy stream
    ('NoneType' object has no attribute 'wait_stream') and failed the waiter's switch: CPU
    tensors hold no GPU memory, so nothing moves and nothing changes."""
    torch = pytest.importorskip("torch")
    from timeslice.torch import TorchState

    model = torch.nn.Linear(8, 8)
    before = [p.detach().clone() for p in model.parameters()]
    state = TorchState([model])
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the model would be GPU state on it")
    assert state.checkpoint([]) == (0, False) and state.restore([]) == 0
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))


def test_the_pool_is_pinned_ahead_its_state_first_or_by_the_copy_that_needs_it_and_unpinned_on_close(
        monkeypatch) -> None:
    """A process's first checkpoints into a part of the pool pinned it on the switch's path
    (8-15 s instead of ~1 s for 50 GB on the H200). `pin_ahead` pins the pool a chunk at a
    time (the memory-command thread calls it while the job does not hold), the chunks that hold
    the job's checkpointed state first; a copy registers (`cudaHostRegister`) the chunks it lies
    in that are not pinned yet; each chunk once per process, never the whole pool in one call."""
    torch = pytest.importorskip("torch")
    import timeslice.torch as torch_state

    registered: list[tuple[int, int]] = []
    unregistered: list[int] = []

    class Runtime:
        def cudaHostRegister(self, ptr: int, n: int, flags: int) -> int:
            registered.append((ptr, n))
            return 0

        def cudaHostUnregister(self, ptr: int) -> int:
            unregistered.append(ptr)
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", Runtime)
    c = torch_state.REGISTER_CHUNK_BYTES
    pool = mmap.mmap(-1, 6 * c + 4096)  # 7 chunks, the last one short
    state = torch_state.TorchState()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (after the state made no copy stream)
    assert state.pin_ahead() is False  # no pool yet
    state.use_pool(pool)
    base = state._pool.data_ptr()
    assert registered == []  # mapped, nothing pinned
    ranges = [(3 * c + 10, 2 * c)]  # chunks 3, 4 and 5
    state._places(ranges, None, 0, 2 * c)
    state._places(ranges, None, 0, 2 * c)  # again: already pinned
    assert registered == [(base + 3 * c, c), (base + 4 * c, c), (base + 5 * c, c)]
    state._ranges = [(5 * c, c), (c + 4096, 4096)]  # checkpointed in chunks 5 and 1: chunk 1 is pinned first
    assert state.pin_ahead() is True and registered[3] == (base + c, c)
    while state.pin_ahead():
        pass
    assert registered[4:] == [(base, c), (base + 2 * c, c), (base + 6 * c, 4096)]
    state._places([(0, 7 * c)], None, 0, 6 * c)  # all pinned: nothing more
    assert len(registered) == 7
    # On close every chunk is unregistered once (an exit with them registered took longer),
    # and nothing is registered after, not even by a pin-ahead step already under way.
    state.unpin()
    assert sorted(unregistered) == sorted(ptr for ptr, _ in registered)
    assert state.pin_ahead() is False and len(registered) == 7
    state._places([(0, c)], None, 0, c)  # (a copy after close: it registers nothing)
    state.unpin()
    assert len(registered) == len(unregistered) == 7


def test_a_state_the_pool_cannot_take_goes_to_a_pageable_buffer_of_exactly_its_size() -> None:
    """PyTorch's pinned host allocator rounds a request up to a power of two (47 GB asks for
    68.7 GB), and two jobs of 47 GB that checkpointed into such buffers were killed on a
    128 GiB host. The fallback buffer is pageable and exactly the state's size, reused while
    large enough."""
    pytest.importorskip("torch")
    from timeslice.torch import TorchState

    state = TorchState()
    buf = state._own_buffer(3 * 2**20 + 5)
    assert buf.numel() == buf.untyped_storage().nbytes() == 3 * 2**20 + 5 and not buf.is_pinned()
    assert state._own_buffer(2**20) is buf and state._own_buffer(4 * 2**20).numel() == 4 * 2**20


def test_a_state_the_host_cannot_hold_fails_its_checkpoint_before_anything_is_copied() -> None:
    """H100 host, 3 x 57 GB on `serve`: a 47 GB state the pool could not take went to its own
    buffer with ~30 GB available, and the kernel killed the job as the copy filled it (the
    allocation itself succeeds: memory is overcommitted). Now the checkpoint raises MemoryError
    first (the switch rolls back; the job keeps computing)."""
    pytest.importorskip("torch")
    from timeslice import host_memory
    from timeslice.torch import TorchState

    state = TorchState()
    too_big = host_memory.available_bytes() + 8 * 2**30  # well past it, however the host's memory moves meanwhile
    with pytest.raises(MemoryError, match=r"bytes available \(MemAvailable\) and keeps 2147483648"):
        state._own_buffer(too_big)
    assert state._own is None
