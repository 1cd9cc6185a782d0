"""The cooperative pinned pool across an orchestrator restart, with real processes.

A real `timeslice orchestrator --config` process (cooperative group, pinned pool, state
file), a real node agent, and two real job processes whose registered state is CPU
tensors checkpointed into the pool. The orchestrator is killed (SIGKILL, SIGTERM) while
a job is checkpointed and started again with the same configuration: the pool file is
reopened, not rewritten, and the job comes back bit for bit; a pool range corrupted in
between fails the job with "checkpoint lost" (never a silent resume); a planted symbolic
link or a pool file open to other users stops the orchestrator with a clear message. An
orchestrator killed after a job's restore ran but before its answer came back (the state file
still says checkpointed) counts that job as on the GPU after its restart: it is moved out
before another job is restored beside it; one killed while a job's checkpoint command is out
waits for that job's process to say where its state is before it takes it as moved out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import os
import queue
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc.aio
import pytest
from timeslice.controller.orchestrator import state_format
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.pinned_pool import PinnedPool, PoolRefused
from timeslice.controller.orchestrator.server import create_server as create_orchestrator_server
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.server import create_server as create_agent_server
from timeslice.memory_commands import _check_private, pieces, pool_checksum

from bench.machine import free_port
from tests.conftest import eventually
from tests.test_cooperative import FakeStore, connected, job

POOL_BYTES = 4 << 20
DEADLINE = 60.0  # seconds any one step may take on a loaded machine

# A job: CPU tensors registered with a store that checkpoints them into the pool ranges it
# is offered (and "frees" them: zeroed, as the GPU copy would be), driven by lines on stdin.
JOB = r'''
import hashlib, queue, sys, threading
import torch
from timeslice import TimeSliceOrchestratorClient
from timeslice.memory_commands import pieces

job, target = sys.argv[1], sys.argv[2]
# options: "hold-checkpoint": a checkpoint waits for the line "go" before it starts; "hold-restore": a
# restore, once done, waits for "go" before it returns (and is acknowledged); "hold-grant": below; "no-resend":
# an acquire cut off by an orchestrator outage fails at once (it is not resent to the next orchestrator)
options = set(sys.argv[3:])
go = threading.Event()
torch.manual_seed(sum(map(ord, job)))
tensors = [torch.randn(1000, 250), torch.randn(777, dtype=torch.float64), torch.randint(0, 1 << 30, (333,))]

def say(*words):
    print(*words, flush=True)

def digest():
    return hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)).hexdigest()

class CpuStore:
    def __init__(self):
        self.pool, self.ranges, self.n = None, None, 0
    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in tensors)
    def use_pool(self, pool):
        self.pool = torch.frombuffer(pool, dtype=torch.uint8)
    def checkpoint(self, ranges):
        if "hold-checkpoint" in options:
            say("checkpointing")
            go.wait()
        if self.ranges is not None:
            return self.n, True
        n = self.nbytes()
        if self.pool is None or sum(k for _, k in ranges) < n:
            raise RuntimeError("the test's pool is too small")
        flat = torch.cat([t.view(-1).view(torch.uint8) for t in tensors])
        for off, src, k in pieces(ranges, 0, n):
            self.pool[off:off + k].copy_(flat[src:src + k])
        for t in tensors:
            t.zero_()  # "freed"
        self.ranges, self.n = ranges, n
        say("checkpointed")
        return n, True
    def restore(self, ranges):
        if self.ranges is None:
            return 0
        ranges, start = ranges or self.ranges, 0
        for t in tensors:
            k = t.numel() * t.element_size()
            dst = t.view(-1).view(torch.uint8)
            for off, src, m in pieces(ranges, start, k):
                dst[src:src + m].copy_(self.pool[off:off + m])
            start += k
        self.ranges = None
        say("restored")
        if "hold-restore" in options:
            go.wait()
        return start

client = TimeSliceOrchestratorClient(target, job, "g", **({"unavailable_timeout": 0} if "no-resend" in options else {}))
loop = client.serve_memory_commands(CpuStore())
loop.connected.wait(60)
say("ready", digest())
if "hold-grant" in options:  # the first acquire's reply, once received, waits for "go" (a process paused there)
    acquire, held = client._stub.Acquire, []
    def held_reply(*args, **kw):
        reply = acquire(*args, **kw)
        if not held:
            held.append(reply)
            say("grant-received")
            go.wait()
        return reply
    client._stub.Acquire = held_reply
lines = queue.Queue()
def read():  # "go" is seen even while the main thread waits for it
    for line in sys.stdin:
        (go.set if line.strip() == "go" else lambda: lines.put(line))()
    lines.put(None)
threading.Thread(target=read, daemon=True).start()
for line in iter(lines.get, None):
    try:
        if line.strip() == "acquire":
            client.acquire(timeout=60)
            say("granted", digest())
        elif line.strip() == "release":
            client.release()
            say("released")
    except Exception as err:
        say("error", type(err).__name__, str(err).replace("\n", " "))
'''


class Child:
    """A child process whose stdout lines are read by a thread; `expect` waits for one."""

    def __init__(self, argv: list[str], **kw: object) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, **kw)  # type: ignore[call-overload]
        self.lines: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.err.append), daemon=True).start()

    @staticmethod
    def _read(stream: object, put: Callable[[str], object]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            put(line.rstrip("\n"))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    async def expect(self, *first: str, timeout: float = DEADLINE) -> list[str]:
        """The words of the next line that starts with `first` (other lines are skipped)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                line = await asyncio.to_thread(self.lines.get, True, max(0.0, deadline - loop.time()))
            except queue.Empty:
                raise AssertionError(f"no line {' '.join(first)!r} within {timeout} s; stderr tail: "
                                     f"{self.err[-15:]}") from None
            words = line.split()
            if words[:len(first)] == list(first):
                return words

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                stream.close()  # type: ignore[union-attr]


@dataclass
class Box:
    """The orchestrator's configuration, its agent, and the processes started."""

    dir: Path
    config: Path
    pool: Path
    state: Path
    target: str
    children: list[Child]

    def orchestrator(self) -> Child:
        child = Child([sys.executable, "-c", "from timeslice.cli.main import main; raise SystemExit(main())",
                       "orchestrator", "--config", str(self.config)])
        self.children.append(child)
        return child

    def job(self, name: str, *options: str) -> Child:
        child = Child([sys.executable, "-c", JOB, name, self.target, *options])
        self.children.append(child)
        return child

    def checkpoints(self) -> dict[str, dict]:
        """The state file's pool checkpoints by job."""
        doc = state_format.load(self.state)
        return {c.job: c.model_dump() for c in (doc.pool.checkpoints if doc and doc.pool else [])}


@pytest.fixture
async def box(short_tmp: Path) -> AsyncIterator[Box]:
    agent_target = f"unix://{short_tmp / 'agent.sock'}"
    agent_server, _ = await create_agent_server(NodeAgent(StaticProcessResolver()), agent_target)
    port = free_port()
    config = short_tmp / "orchestrator.yaml"
    pool, state = short_tmp / "pool", short_tmp / "state.json"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "listen": f"127.0.0.1:{port}", "state_file": str(state),
        "pinned_pool": {"path": str(pool), "bytes": POOL_BYTES},
        "groups": [{"id": "g", "backend": "cooperative", "agents": [agent_target], "lease_seconds": 3}]}))
    b = Box(short_tmp, config, pool, state, f"127.0.0.1:{port}", [])
    try:
        yield b
    finally:
        for child in reversed(b.children):
            child.stop()
        await agent_server.stop(0)


async def _serving(orch: Child) -> None:
    await eventually(lambda: any("orchestrator serving" in line for line in orch.err) or orch.proc.poll() is not None,
                     timeout=DEADLINE, interval=0.05, what="the orchestrator serving")
    assert orch.proc.poll() is None, f"orchestrator exited: {orch.err[-10:]}"


async def _checkpointed_a(box: Box, *a_options: str) -> tuple[Child, Child, str]:
    """Jobs a and b running; a checkpointed into the pool for b. Returns (a, b, a's digest)."""
    await _serving(box.orchestrator())
    a, b = box.job("a", *a_options), box.job("b")
    _, before = await a.expect("ready")
    await b.expect("ready")
    a.send("acquire")
    assert (await a.expect("granted"))[1] == before
    a.send("release")
    await a.expect("released")
    b.send("acquire")
    await a.expect("checkpointed")
    await b.expect("granted")
    b.send("release")
    await b.expect("released")
    assert box.checkpoints()["a"]["bytes"]  # recorded before the orchestrator goes down
    return a, b, before


def _flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        byte = f.read(offset + 1)[-1]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def _kill(orch: Child, how: signal.Signals) -> None:
    orch.proc.send_signal(how)
    assert orch.proc.wait(DEADLINE) in (-signal.SIGKILL, 0), orch.err[-10:]


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
async def test_a_checkpointed_job_comes_back_bit_for_bit_after_the_orchestrator_restarts(box, how) -> None:
    a, b, before = await _checkpointed_a(box)
    inode, pool_bytes = os.stat(box.pool).st_ino, box.pool.read_bytes()
    _kill(box.children[0], how)
    assert os.stat(box.pool).st_ino == inode and box.pool.read_bytes() == pool_bytes  # kept, as it was
    orch = box.orchestrator()
    await _serving(orch)
    assert os.stat(box.pool).st_ino == inode and box.pool.read_bytes() == pool_bytes  # reopened, not rewritten
    assert any("pinned pool reopened" in line for line in orch.err)
    a.send("acquire")
    await a.expect("restored")
    assert (await a.expect("granted"))[1] == before  # bitwise equal to before the checkpoint
    assert not any("restored by the client" in line for line in a.err)  # by the orchestrator, with room checked
    await eventually(lambda: "a" not in box.checkpoints(), what="a's ranges freed in the state file")
    a.send("release")
    await a.expect("released")
    b.send("acquire")  # the group serves on: a leaves through the pool again
    await a.expect("checkpointed")
    await b.expect("granted")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
async def test_a_pool_range_corrupted_while_the_orchestrator_is_down_fails_the_job_as_lost(box, how) -> None:
    a, b, _ = await _checkpointed_a(box)
    _kill(box.children[0], how)
    offset, length = box.checkpoints()["a"]["ranges"][0]
    _flip(box.pool, offset + length // 2)  # one byte of a's state
    await _serving(box.orchestrator())
    a.send("acquire")
    words = await a.expect("error")
    assert "checkpoint lost" in " ".join(words), words
    assert "restored" not in list(a.lines.queue)  # nothing was restored
    await eventually(lambda: "a" not in box.checkpoints(), what="a's ranges freed in the state file")
    a.send("acquire")  # it stays failed: never resumed on other bytes
    words = await a.expect("error")
    assert "checkpoint lost" in " ".join(words), words
    b.send("acquire")  # the others go on
    await b.expect("granted")


@pytest.mark.parametrize("reconnect", ["before b asks", "while b's switch waits for it"])
async def test_a_restore_done_but_not_recorded_when_the_orchestrator_dies_counts_the_job_on_the_gpu(
        box, reconnect) -> None:
    """a's restore (for a's grant, b moved out) ran in a's process; the orchestrator is killed
    before a's answer reaches it, so the state file still records a checkpointed (seed 1247 of
    bench/schedules.py: the restarted orchestrator took a for checkpointed, restored the other
    job beside it, which ran out of memory). Restarted, it counts a on the GPU until a's process
    says where its state is, and b's grant moves a out first: a's process reconnects (its state
    on the GPU) before b asks, or while b's switch waits to checkpoint it."""
    a, b, before = await _checkpointed_a(box, "hold-restore", "no-resend")
    a.send("acquire")
    await b.expect("checkpointed")
    await a.expect("restored")  # done in a's process; its answer waits for "go"
    _kill(box.children[0], signal.SIGKILL)
    assert box.checkpoints()["a"]["bytes"] and box.checkpoints()["b"]["bytes"]  # both recorded checkpointed
    await a.expect("error")  # its acquire died with the orchestrator: nobody asks for a now
    if reconnect == "before b asks":
        a.send("go")  # its answer finds no orchestrator; its stream reconnects with its state on the GPU
    orch = box.orchestrator()
    await _serving(orch)
    if reconnect == "before b asks":
        await eventually(lambda: any("state on the GPU, recorded as checkpointed" in line and "job=a " in line
                                     for line in orch.err), timeout=DEADLINE, what="a's process reconnected")
    await eventually(lambda: any("checkpoint confirmed" in line and "job=b " in line for line in orch.err),
                     timeout=DEADLINE, what="b's process reconnected")
    b.send("acquire")
    if reconnect != "before b asks":
        await eventually(lambda: any("switch start" in line and "evict=['a']" in line for line in orch.err),
                         timeout=DEADLINE, what="b's switch moving a out")
        a.send("go")
    await a.expect("checkpointed")  # moved out before b is restored beside it
    await b.expect("restored")
    await b.expect("granted")
    b.send("release")
    await b.expect("released")
    a.send("acquire")  # and back, bit for bit
    await b.expect("checkpointed")
    await a.expect("restored")
    assert (await a.expect("granted"))[1] == before


async def test_a_job_whose_checkpoint_was_out_when_the_orchestrator_died_is_waited_for_before_it_counts_as_moved(
        box) -> None:
    """The other window: the orchestrator dies while a's checkpoint command is out (the state
    file has the ranges offered, no answer). Restarted, b's grant must move a out: a's process
    has not reconnected, and its state may still be on the GPU, so the checkpoint waits for it
    (it was taken for a job with no process, nothing to move, and b was granted beside a)."""
    await _serving(box.orchestrator())
    a, b = box.job("a", "hold-checkpoint"), box.job("b", "no-resend")
    _, before = await a.expect("ready")
    await b.expect("ready")
    a.send("acquire")
    await a.expect("granted")
    a.send("release")
    await a.expect("released")
    b.send("acquire")
    await a.expect("checkpointing")  # the command reached a's process, which waits for "go"
    _kill(box.children[0], signal.SIGKILL)
    assert box.checkpoints()["a"]["bytes"] is None  # offered, not answered
    await b.expect("error")  # its acquire died with the orchestrator
    orch = box.orchestrator()
    await _serving(orch)
    await eventually(lambda: any("process connected" in line and "job=b " in line for line in orch.err),
                     timeout=DEADLINE, what="b's process reconnected")
    b.send("acquire")
    await eventually(lambda: any("switch start" in line and "evict=['a']" in line for line in orch.err),
                     timeout=DEADLINE, what="b's switch moving a out")
    a.send("go")  # the checkpoint runs now; a's process reconnects and says so
    await a.expect("checkpointed")
    await b.expect("granted")
    lines = [line for line in orch.err if ("job=a " in line and "checkpoint confirmed" in line)
             or ("switch done" in line and "evict=['a']" in line)]
    assert "checkpoint confirmed" in lines[0], lines  # the switch went on only once a's process had said
    b.send("release")
    await b.expect("released")
    a.send("acquire")  # and back, bit for bit
    await a.expect("restored")
    assert (await a.expect("granted"))[1] == before


async def test_a_planted_symlink_or_a_pool_open_to_others_stops_the_orchestrator_clearly(box) -> None:
    elsewhere = box.dir / "elsewhere"
    elsewhere.write_bytes(b"secret")
    box.pool.symlink_to(elsewhere)
    orch = box.orchestrator()
    assert orch.proc.wait(DEADLINE) == 2
    err = "\n".join(orch.err)
    assert "symbolic link" in err and str(box.pool) in err and "Traceback" not in err, err
    assert elsewhere.read_bytes() == b"secret"  # not followed, not written
    box.pool.unlink()
    box.pool.write_bytes(bytes(POOL_BYTES))
    box.pool.chmod(0o644)
    orch = box.orchestrator()
    assert orch.proc.wait(DEADLINE) == 2
    err = "\n".join(orch.err)
    assert "mode 0644" in err and "0600" in err and "Traceback" not in err, err
    box.pool.chmod(0o600)  # private and of the configured size: reopened as it is
    await _serving(box.orchestrator())
    assert box.pool.stat().st_size == POOL_BYTES


# -- in one process: what the orchestrator learns without a state file, and the pool file ---------------------------

async def test_without_a_state_file_a_restart_learns_each_checkpoint_from_its_process(short_tmp: Path) -> None:
    """The job a process reports checkpointed is restored by the orchestrator before it
    computes, bit for bit, from the reopened pool; its range is held meanwhile."""
    agent_target, target = f"unix://{short_tmp / 'agent.sock'}", f"unix://{short_tmp / 'orch.sock'}"
    agent_server, _ = await create_agent_server(NodeAgent(StaticProcessResolver()), agent_target)
    spec = GroupSpec(id="g", backend="cooperative", agents=(agent_target,), lease_seconds=3)

    async def start() -> tuple[Orchestrator, grpc.aio.Server]:
        orch = Orchestrator([spec], pinned_pool=PinnedPool(short_tmp / "pool", 1 << 20))
        await orch.adopt_agents()
        server, _ = await create_orchestrator_server(orch, target)
        return orch, server

    orch, server = await start()
    sa, sb = FakeStore("a"), FakeStore("b")
    a, b = job(target, "a", sa), job(target, "b", sb)
    try:
        await connected(a)
        await connected(b)
        for client in (a, b):  # a leaves through the pool for b
            await asyncio.to_thread(client.acquire)
            await asyncio.to_thread(client.release)
        assert sa.device is None and sa.own is None and sa.ranges
        orch.cooperative.keep_pool_if_in_use()
        await server.stop(0)
        await orch.close()
        assert (short_tmp / "pool").exists()  # kept: a is checkpointed in it
        orch, server = await start()
        assert orch.cooperative.pool is not None and orch.cooperative.pool.reopened
        await eventually(lambda: orch.cooperative.checkpointed("g", "a"), timeout=30, what="a's report")
        assert "a" in orch.group("g").residency.checkpointed and orch.cooperative.pool.used_bytes == len(sa.original)
        await asyncio.to_thread(a.acquire)
        assert sa.device == bytearray(sa.original) and sa.commands[-1] == "restore"
        assert orch.cooperative.pool.used_bytes == 0
    finally:
        await asyncio.to_thread(a.close)
        await asyncio.to_thread(b.close)
        await server.stop(0)
        await orch.close()
        await agent_server.stop(0)


async def test_a_grant_whose_lease_lapsed_before_its_process_saw_it_is_never_used(box) -> None:
    """Issue 22, case 4. a's grant reached its process, which stalled before acquire() returned
    (no keep-alive yet); the orchestrator was killed and started again; a's command stream
    came back, the adopted hold's lease lapsed, and b was granted with a checkpointed for it.
    When a's process goes on, it must not restore its own state and compute beside b: it
    confirms the grant's lease before it uses it, finds it lapsed, asks again, and is granted
    with its state restored by the orchestrator once b releases. Before: the client restored
    at any grant it received, and the restarted orchestrator queued a again on that
    keep-alive (an unknown lease of a checkpointed job), as for a process stopped by a node
    agent, though a cooperative process is never stopped."""
    await _serving(box.orchestrator())
    a, b = box.job("a", "hold-grant"), box.job("b")
    _, before = await a.expect("ready")
    await b.expect("ready")
    a.send("acquire")
    await a.expect("grant-received")
    _kill(box.children[0], signal.SIGKILL)
    await _serving(box.orchestrator())
    b.send("acquire")
    await a.expect("checkpointed")  # over a's stream, reconnected: a's lease lapsed, a is moved out for b
    await b.expect("granted")
    a.send("go")
    await eventually(lambda: any("lapsed before this process saw it" in line for line in a.err), timeout=DEADLINE,
                     what="a finding its grant lapsed")
    assert list(a.lines.queue) == []  # neither restored nor granted while b holds
    b.send("release")
    await b.expect("released")
    await a.expect("restored")  # by the orchestrator, for a's new grant, after b released
    assert (await a.expect("granted"))[1] == before
    assert not any("restored by the client" in line for line in a.err)


def test_the_pool_is_created_private_and_reopened_only_as_it_was(short_tmp: Path) -> None:
    old = os.umask(0)
    try:
        pool = PinnedPool(short_tmp / "pool", 8192)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(pool.path).st_mode) == 0o600 and not pool.reopened
    pool.path.write_bytes(b"x" * 8192)  # "a checkpoint"
    again = PinnedPool(pool.path, 8192, populate=True)
    assert again.reopened and pool.path.read_bytes() == b"x" * 8192  # not truncated, not zeroed
    with pytest.raises(PoolRefused, match="holds 8192 bytes, the configuration says 4096"):
        PinnedPool(pool.path, 4096)
    assert pool.path.read_bytes() == b"x" * 8192


def test_reserve_takes_exactly_free_ranges_or_nothing(short_tmp: Path) -> None:
    pool = PinnedPool(short_tmp / "pool", 100)
    pool.reserve([(10, 20), (50, 10)])
    assert pool.used_bytes == 30 and pool.take_all() == [(60, 40), (30, 20), (0, 10)]
    pool.release([(0, 10)])
    with pytest.raises(ValueError, match=r"\[5, 15\) is not free"):
        pool.reserve([(0, 5), (5, 10)])  # the second overlaps a range held
    assert pool.used_bytes == 90  # nothing reserved
    with pytest.raises(ValueError, match="not free"):
        pool.reserve([(95, 10)])  # beyond the pool


def test_the_client_maps_only_a_pool_of_its_own_user_with_mode_0600(short_tmp: Path) -> None:
    path = short_tmp / "pool"
    path.write_bytes(bytes(4096))
    path.chmod(0o640)
    with pytest.raises(PermissionError, match="mode 0640"):
        _check_private(str(path), os.stat(path), 4096)
    path.chmod(0o600)
    _check_private(str(path), os.stat(path), 4096)
    link = short_tmp / "link"
    link.symlink_to(path)
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        os.open(link, os.O_RDWR | os.O_NOFOLLOW)  # as the client opens it


def test_the_checksum_sees_one_flipped_byte_whatever_the_ranges(short_tmp: Path) -> None:
    data = os.urandom(3 * 4096 + 7)
    ranges = [(20000, 5000), (0, 8000)]
    buf = mmap.mmap(-1, 32768)
    for off, src, k in pieces(ranges, 0, len(data)):
        buf[off:off + k] = data[src:src + k]
    crc = pool_checksum(buf, ranges, len(data))
    assert crc == pool_checksum(buf, ranges, len(data))
    buf[3] ^= 1
    assert pool_checksum(buf, ranges, len(data)) != crc
