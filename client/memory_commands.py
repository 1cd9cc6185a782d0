"""The client half of the `cooperative` backend: a thread that obeys memory commands.

Owned by the client package; started by `TimeSliceOrchestratorClient.serve_memory_commands`
(which `timeslice.torch.register` calls). The thread keeps the orchestrator's
`MemoryCommands` stream open for one group, also between phases, and runs each command
on a `StateStore`: "checkpoint" copies the registered GPU state into host memory and
frees it on the GPU, "restore" brings it back into the same tensors; then it answers
with `AckMemoryCommand` (bytes, seconds, and whether the copy went to the node's pinned
pool). The orchestrator sends commands only while this job does not hold the group
(DESIGN.md, "Node agent and checkpoint backends": cooperative). The stream is reopened
with the same id after the orchestrator was unreachable; a refusal (the group is not
cooperative, unknown group) stops the thread with the error logged and kept in `error`.

A checkpoint into the pool gets a checksum (`pool_checksum`, over the bytes written),
computed right after the acknowledgement (off the switch's path: 60 GB take ~3 s of 8
threads on the H200 host) and reported with its ranges at every (re)connect, so that a
restarted orchestrator learns where this process's state is. Once the stream has broken
while the state is out (the orchestrator restarted, or was unreachable), and whenever the
client restores by itself, the bytes are checked against the checksum before anything
is restored; a mismatch (the pool was rewritten or corrupted) raises `CheckpointLost`
here and fails the job at the orchestrator: never a silent resume on other bytes.
Switches under one orchestrator, which hands a range to one process at a time, skip
the check (it would add ~3 s per 60 GB to the waiter's restore). The pool is mapped
only when it is a regular file owned by this user with no group or other access (no
symbolic link followed).

Needs only `grpcio` and `protobuf`; the GPU side is the store (`timeslice.torch`).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import grpc
import xxhash
from timeslice import _rpc
from timeslice.errors import CheckpointLost
from timeslice.v1 import orchestrator_pb2 as pb
from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

log = logging.getLogger("timeslice.client.memory")

# Codes after which reconnecting cannot help.
_FINAL = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
          grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED)


# How often a store that pins the pool ahead (`MemoryCommandLoop._pin_ahead`) looks whether its job
# stopped holding the group, seconds.
PIN_AHEAD_POLL_SECONDS = 0.05
# While a command runs, the GIL switch interval, seconds (see `_gil_at_once`).
COMMAND_SWITCH_INTERVAL = 1e-4
_interval_lock = threading.Lock()
_interval_users = 0
_interval_saved = 0.0


@contextlib.contextmanager
def _gil_at_once() -> Iterator[None]:
    """Shorten the interpreter's GIL switch interval while a command runs. The job's main
    thread may be in a CPU-bound Python phase (its reward) and hold the GIL: each of the
    copy's hundreds of torch calls then waits a whole interval (5 ms by default) to take it
    back. Measured on the H200 (bench/results/rl-grpo-b-h200.json): 45.7 GB checkpointed
    in 3.7 s from a job computing its reward, 0.87 s from a job waiting for the GPU; with
    this, every switch moving 45.7 GB out and 45.7 GB in took 1.7-2.1 s (same file, later run)."""
    global _interval_users, _interval_saved
    with _interval_lock:
        if _interval_users == 0:
            _interval_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_interval_saved, COMMAND_SWITCH_INTERVAL))
        _interval_users += 1
    try:
        yield
    finally:
        with _interval_lock:
            _interval_users -= 1
            if _interval_users == 0:
                sys.setswitchinterval(_interval_saved)


Ranges = list[tuple[int, int]]  # (offset, length) in the pool, bytes, filled in order as one buffer


def pieces(ranges: Ranges, start: int, n: int) -> list[tuple[int, int, int]]:
    """Where bytes [start, start + n) of the buffer made of `ranges` lie: [(pool offset,
    offset in the piece's source, length)], the second counted from `start`. Raises
    ValueError when the ranges hold fewer bytes."""
    out, base, done = [], 0, 0
    for off, length in ranges:
        lo, hi = max(start + done, base), min(start + n, base + length)
        if lo < hi:
            out.append((off + lo - base, lo - start, hi - lo))
            done += hi - lo
        base += length
        if done == n:
            return out
    raise ValueError(f"pool ranges hold {base} bytes, {start + n} needed")


# Bytes per piece of `pool_checksum` (pieces are checksummed in parallel threads), and the threads.
CHECKSUM_PIECE = 64 << 20
CHECKSUM_THREADS = 2


def prefix(ranges: Ranges, n: int) -> Ranges:
    """The first `n` bytes of `ranges`, as ranges."""
    out = []
    for off, length in ranges:
        if n <= 0:
            break
        out.append((off, min(length, n)))
        n -= length
    return out


def pool_checksum(pool: mmap.mmap, ranges: Ranges, nbytes: int) -> int:
    """Checksum of bytes [0, nbytes) of the buffer made of `ranges` in `pool` (see
    `pieces`): the low 32 bits of the XXH3-64 of the little-endian XXH3-64s of its
    `CHECKSUM_PIECE`-byte pieces, computed in `CHECKSUM_THREADS` threads (xxhash releases the
    GIL). It runs after each checkpoint's ack, beside the next holder's phase: CRC-32 (zlib)
    in 8 threads took 2.1-3.7 s of 8 of the H200 host's 16 CPUs per 50 GB checkpoint, and the
    holder's generate ran at 33-36 ms a token where it overlapped 3-4.6 s of them, 17-26 ms
    where it overlapped less (bench/results/rl-grpo-b-serve-cooperative-declared-*-h200.json,
    logs); XXH3 hashes ~4x the bytes per CPU second (7.5 against 1.8 GB/s on the 2-core VM).
    Raises ValueError when the ranges hold fewer than `nbytes`."""
    starts = range(0, nbytes, CHECKSUM_PIECE)
    places = [pieces(ranges, start, min(CHECKSUM_PIECE, nbytes - start)) for start in starts]

    def digest(piece: list[tuple[int, int, int]]) -> int:
        h = xxhash.xxh3_64()
        for off, _, k in piece:
            with memoryview(pool)[off:off + k] as view:
                h.update(view)
        return h.intdigest()

    if len(places) <= 1:
        digests = [digest(p) for p in places]
    else:
        with ThreadPoolExecutor(min(CHECKSUM_THREADS, len(places), os.cpu_count() or 1),
                                thread_name_prefix="timeslice-checksum") as threads:
            digests = list(threads.map(digest, places))
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *digests)) & 0xFFFFFFFF


class StateStore(Protocol):
    """What a job registered to leave the GPU. Sizes in bytes. A store may also have
    `pin_ahead() -> bool` (register the next part of the pool with CUDA; False when all of
    it is): the loop calls it while the job does not hold the group (`_pin_ahead`); and
    `unpin()` (unregister what it registered): the loop calls it on `close`."""

    def nbytes(self) -> int:
        """Bytes a checkpoint would move now."""
        ...

    def use_pool(self, pool: mmap.mmap) -> None:
        """The node's pinned pool, mapped: checkpoint into it from now on (called once, before
        the first command that uses it)."""
        ...

    def checkpoint(self, ranges: Ranges) -> tuple[int, bool]:
        """Copy the state out and free it on the GPU: into the pool `ranges` (in order, as one
        buffer: see `pieces`) when it fits, else into the store's own host memory. Returns
        (bytes used from the start of `ranges`, or copied; whether it went to the pool)."""
        ...

    def restore(self, ranges: Ranges) -> int:
        """Bring the state back (from the pool `ranges`, none: from where it was checkpointed
        to); returns bytes. A store that is not checkpointed returns 0."""
        ...


class MemoryCommandLoop:
    """Serve the memory commands of `group` for `job_id` on `store` in a daemon thread."""

    def __init__(self, stub: pb_grpc.OrchestratorStub, settings: _rpc.Settings, group: str,
                 store: StateStore, in_hold: Callable[[], bool] = lambda: False) -> None:
        self.group = group
        self.store = store
        self._in_hold = in_hold
        self.error: str | None = None
        self.stream_id = uuid.uuid4().hex
        self._stub = stub
        self._s = settings
        self._stop = threading.Event()
        self._busy = threading.Lock()  # held while a command runs and is acknowledged
        self._closing = False  # set under _busy by close(): no new command runs
        self._call: grpc.Future | None = None
        self._pool: mmap.mmap | None = None
        self._pool_offered = False  # "hello" offered a pool (mapped then, or found unusable)
        self._pin_wanted = threading.Event()  # "pin": a grant may move memory; pin the pool ahead
        # out of the GPU: (pool ranges, none: its own memory; bytes; checksum, None until computed)
        self._saved: tuple[Ranges, int, int | None] | None = None
        self._verify = False  # the stream broke while the state was out: check it before restoring
        self.lost: str | None = None  # why this process's checkpoint is lost (then nothing is restored)
        # registered bytes, measured by the job's own threads (`measure`) or around a move: a "report"
        # answers with it and never walks the job's tensors while the job may be changing them
        self.measured = store.nbytes()
        self.connected = threading.Event()
        self.ready = threading.Event()  # connected once, or refused for good (`error`)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"timeslice-memory-{group}")
        self._thread.start()

    def _run(self) -> None:
        pause = _rpc.BACKOFF_FIRST
        while not self._stop.is_set():
            self._verify = self._verify or self._saved is not None  # (re)connecting with the state out
            request = pb.MemoryCommandsRequest(job_id=self._s.job_id, group_id=self.group, pid=os.getpid(),
                                               registered_bytes=self.measured, stream_id=self.stream_id,
                                               checkpoint=self._report())
            try:
                self._call = self._stub.MemoryCommands(request, metadata=_rpc.call_metadata())
                for command in self._call:  # type: ignore[union-attr]
                    pause = _rpc.BACKOFF_FIRST
                    self._handle(command)
            except grpc.RpcError as err:
                if self._stop.is_set():
                    return
                code = _rpc.code_of(err)
                if code in _FINAL:
                    self.error = f"{code.name}: {err.details()}"  # type: ignore[union-attr]
                    log.error("memory commands refused group=%s job=%s: %s", self.group, self._s.job_id, self.error)
                    self.ready.set()
                    return
                log.info("memory command stream lost group=%s (reconnecting): %s", self.group, code)
            finally:
                self.connected.clear()
            self._stop.wait(pause)
            pause = min(pause * 2, _rpc.BACKOFF_MAX)

    def _report(self) -> pb.PoolCheckpoint | None:
        """Where this process's state is in the pool (None: it is not there)."""
        saved = self._saved
        if saved is None:
            return None
        ranges, nbytes, checksum = saved
        return pb.PoolCheckpoint(ranges=[pb.PoolRange(offset=o, length=n) for o, n in ranges], bytes=nbytes,
                                 checksum=checksum or 0)

    def _handle(self, command: pb.MemoryCommand) -> None:
        if command.kind == "hello":
            if command.pool_path and not self._pool_offered:  # once: a reconnect offers the same pool
                self._pool_offered = True
                self._attach(command.pool_path, command.pool_bytes)
            self.connected.set()
            self.ready.set()
            return
        if command.kind == "pin":
            self._pin_wanted.set()
            return
        arrived = time.monotonic()
        with self._busy:
            if not self._closing:
                self._command(command, arrived)

    def _command(self, command: pb.MemoryCommand, arrived: float) -> None:
        """Run one command and acknowledge it (under `_busy`; `arrived`: when it came, monotonic
        seconds: it may have waited for the checksum of the command before)."""
        t0 = time.monotonic()
        ack = pb.MemoryCommandAck(job_id=self._s.job_id, group_id=self.group, op_id=command.op_id, ok=True)
        if command.kind == "report":  # the job may be inside its phase (optimizer state appearing): no tensor walk
            ack.registered_bytes = self.measured
            self._ack(ack)
            return
        ranges = [(r.offset, r.length) for r in command.ranges]
        try:
            with _gil_at_once():
                self._run_command(command, ranges, ack)
        except Exception as err:  # the orchestrator rolls back and reports it; this process goes on
            log.exception("memory command failed group=%s kind=%s", self.group, command.kind)
            ack.ok, ack.error, ack.lost = False, f"{type(err).__name__}: {err}", isinstance(err, CheckpointLost)
        ack.seconds = time.monotonic() - t0
        ack.registered_bytes = self.measured = self.store.nbytes()
        phases = getattr(self.store, "last_phases", None) or {}
        log.info("memory command group=%s kind=%s ok=%s bytes=%d pinned=%s seconds=%.3f waited=%.3f%s", self.group,
                 command.kind, ack.ok, ack.bytes, ack.pinned, ack.seconds, t0 - arrived,
                 "".join(f" {k}={v:.3f}" if isinstance(v, float) else f" {k}={v}" for k, v in phases.items()))
        self._ack(ack)
        saved = self._saved
        if saved is not None and saved[0] and saved[2] is None and self._pool is not None:  # after the ack
            t1 = time.monotonic()
            self._saved = (saved[0], saved[1], pool_checksum(self._pool, saved[0], saved[1]))
            log.info("checkpoint checksum group=%s bytes=%d seconds=%.3f", self.group, saved[1],
                      time.monotonic() - t1)

    def _ack(self, ack: pb.MemoryCommandAck) -> None:
        try:
            self._stub.AckMemoryCommand(ack, timeout=30.0, metadata=_rpc.call_metadata())
        except grpc.RpcError as err:  # it gave up waiting (timeout): it rolls back with a restore command
            log.warning("memory command ack refused group=%s op=%s: %s", self.group, ack.op_id, err)

    def measure(self) -> None:
        """Measure the registered bytes now, in the caller's thread (the job's own, between
        its phases: `release()` calls it), for the next "report"."""
        self.measured = self.store.nbytes()

    def _run_command(self, command: pb.MemoryCommand, ranges: Ranges, ack: pb.MemoryCommandAck) -> None:
        if command.kind == "checkpoint":
            if self._in_hold():  # a revoked or lapsed holder may still be computing: never under it
                raise RuntimeError(f"job {self._s.job_id} is inside its GPU phase on group {self.group} (it "
                                   "holds it, or its lease lapsed mid-phase): its state stays on the GPU")
            if self.lost:
                raise CheckpointLost(self.lost)
            self._pin_wanted.set()  # a move came: the next one finds the pool pinned
            ack.bytes, ack.pinned = self.store.checkpoint(ranges if self._pool is not None else [])
            if self._saved is None:  # else it was out already (a repeated command): same bytes, same place
                self._saved = (prefix(ranges, ack.bytes) if ack.pinned and self._pool is not None else [], ack.bytes,
                               None)
        elif command.kind == "restore":
            ack.bytes = self._restore(ranges, self._verify)
        else:
            raise ValueError(f"unknown memory command {command.kind!r}")

    def _restore(self, ranges: Ranges, verify: bool) -> int:
        """`store.restore(ranges)`; with `verify`, once the pool bytes it reads (`ranges`,
        none: where it was checkpointed) match the checkpoint's checksum. Raises
        CheckpointLost (and keeps raising it: nothing of this state is restored ever after)
        when they do not."""
        if self.lost:
            raise CheckpointLost(self.lost)
        if verify and self._saved is not None and self._saved[0]:
            saved, nbytes, checksum = self._saved
            where = ranges or saved
            try:
                found = pool_checksum(self._pool, where, nbytes) if self._pool is not None else None
            except ValueError:  # ranges shorter than the state
                found = None
            if checksum is None or found != checksum:
                self.lost = (f"checkpoint lost: the {nbytes} bytes of job {self._s.job_id}'s state in the pinned pool "
                             f"({len(where)} range(s)) no longer match their checksum {checksum or 0:#010x} (found "
                             f"{'none' if found is None else f'{found:#010x}'}): the pool was rewritten or "
                             "corrupted; nothing was restored, restart the job")
                log.error("%s group=%s", self.lost, self.group)
                raise CheckpointLost(self.lost)
        moved = self.store.restore(ranges)
        self._saved, self._verify = None, False
        return moved

    def _attach(self, path: str, size: int) -> None:
        """Map the pool, let the store checkpoint into it, and start pinning it ahead of need
        (`_pin_ahead`)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                _check_private(path, os.fstat(fd), size)
                pool = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self.store.use_pool(pool)
        except Exception as err:  # no pool: checkpoints go to the store's own memory
            log.warning("pinned pool %s unusable, using this process's own host memory: %s", path, err)
            return
        self._pool = pool
        log.info("pinned pool mapped path=%s bytes=%d", path, size)
        if hasattr(self.store, "pin_ahead"):
            threading.Thread(target=self._pin_ahead, daemon=True, name=f"timeslice-pin-{self.group}").start()

    def _pin_ahead(self) -> None:
        """Once the orchestrator says a grant may move memory ("pin") or a checkpoint came, let
        the store pin (`cudaHostRegister`) the pool chunk by chunk while this job does
        not hold the group and no command runs, until all of it is pinned (the chunks that hold
        this job's checkpointed state first: its restore comes next). Jobs that fit
        together pin nothing: no move uses the pool, and each process would register all of
        it (101 GB per process on the H200 host; whether that slowed the others' phases was
        not shown: bench/results/rl-grpo-a-agent-cooperative-declared*-h200.json ran at 1.60x
        pinning and 1.66x not). A process's first
        checkpoint into a part of the pool pinned that part on the switch's path: with three
        jobs of ~50 GB rotating through a 101 GB pool on the H200, each process's first two
        checkpoints took 8-9.6 s, the later ones 1.0-1.5 s (bench/results/
        rl-grpo-b-serve-cooperative-declared-h200.json). Pinned between phases instead, it costs
        the others nothing measurable: 16 GB registered beside a GPU-busy process left its
        median iteration at 9.8 ms (bench/results/pin-probe-h200.json; the slowdown seen
        earlier, when whole pools pinned at once, came from pool pages first touched by the
        pinning, which the orchestrator now populates when it creates the pool). A chunk takes
        tens of milliseconds: a job that acquires meanwhile waits for nothing."""
        store = self.store
        self._pin_wanted.wait()
        started, chunks = time.monotonic(), 0
        while not self._stop.is_set():
            if self._in_hold() or self._busy.locked():
                self._stop.wait(PIN_AHEAD_POLL_SECONDS)
                continue
            try:
                if not store.pin_ahead():  # type: ignore[attr-defined]
                    log.info("pinned pool registered ahead group=%s chunks=%d seconds=%.1f (paused while the job "
                             "held or a command ran)", self.group, chunks, time.monotonic() - started)
                    return
                chunks += 1
            except Exception as err:  # checkpoints pin what they copy through, as before
                log.warning("pinning the pool ahead stopped group=%s: %s", self.group, err)
                return

    def restore_for_grant(self, lease_live: Callable[[], bool]) -> int | None:
        """At a grant: with no command running (none starts meanwhile), confirm the grant's
        lease (`lease_live()`: the client's keep-alive, which records the hold when it is
        live, so no checkpoint runs after either) and bring the state back if it is still out.
        Returns bytes restored (0: it was on the GPU), or None when the lease had lapsed
        (nothing restored: another job may hold the GPU now). Raises CheckpointLost when its
        bytes in the pool no longer match their checksum."""
        with self._busy:
            if not lease_live():
                return None
            return self._restore([], verify=True)

    def close(self) -> None:
        """Stop the thread and close the stream (the orchestrator forgets this process
        unless it is checkpointed), once the command it may be running is acknowledged."""
        self._stop.set()
        self._pin_wanted.set()  # (the pinning thread waits for it: it sees the stop)
        # A command in flight (a switch evicting this job as it ends) is finished and
        # acknowledged first: cancelling under it failed the other job's switch (seen on
        # two H200s, issue 14).
        with self._busy:
            self._closing = True
        if self._call is not None:
            self._call.cancel()
        self._thread.join(timeout=5.0)
        if hasattr(self.store, "unpin"):
            try:
                self.store.unpin()  # type: ignore[attr-defined]
            except Exception as err:  # the process still ends; CUDA unregisters at exit
                log.warning("unpinning the pool on close failed group=%s: %s", self.group, err)


def _check_private(path: str, st: os.stat_result, size: int) -> None:
    """Raise PermissionError unless the pool is a regular file of at least `size` bytes,
    owned by this process's user, with no group or other access: this process's state
    must not land where another user can read or write it."""
    if not stat.S_ISREG(st.st_mode) or st.st_size < size:
        raise PermissionError(f"{path} is not a regular file of {size} bytes")
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}; this "
                              f"process (uid {os.geteuid()}) writes its state only into a pool of its own user with "
                              "mode 0600")
