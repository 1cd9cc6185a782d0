"""`timeslice.torch`: PyTorch state that may leave the GPU between phases (cooperative backend).

Owned by the client package (extra `torch`). Usage::

    from timeslice import TimeSliceOrchestratorClient
    import timeslice.torch

    client = TimeSliceOrchestratorClient()
    timeslice.torch.register(client, model, optimizer, group_id="trainer")
    with client.on_accelerators("trainer"):
        train_step()

When the orchestrator needs this job's GPU memory for another job (and only while this
job does not hold the group), `TorchState` copies every registered CUDA storage (module
parameters, gradients and buffers; optimizer state; plain tensors) into host memory,
frees the storages (`UntypedStorage.resize_(0)`, then `torch.cuda.empty_cache()` so that
NVML shows the memory free), and on the next grant, before `acquire()` returns, brings
them back into the same tensor objects (`resize_` then copy). Addresses are not kept:
fine for eager training and sampling, not for captured CUDA graphs (measured choice:
see docs/backends.md). Tensors that share a storage (tied weights, views)
move once.

Host memory: the node's pinned pool when the orchestrator offers one (a shared file
mapped here, registered with `cudaHostRegister`, CUDA Runtime API, once per process, in
chunks of `REGISTER_CHUNK_BYTES`, each copy within one chunk, so that the job's own threads
run while tens of GB pin: ahead of need while the job does not hold the GPU (`pin_ahead`),
and by a command for the chunks it copies through that are not pinned yet), else a
pageable buffer of this process of the state's size, allocated on the first checkpoint and
reused (`_own_buffer`). Copies run on a side stream made at registration, through the pool
at the link's pinned-memory speed (H200: 45.7 GB out in 0.88 s, 41.9 GB in in 0.88 s,
bench/results/rl-grpo-b-h200-failed.log).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from timeslice import host_memory
from timeslice.memory_commands import MemoryCommandLoop, Ranges, pieces, prefix

log = logging.getLogger("timeslice.torch")
ALIGN = 4096  # bytes: each storage starts on a page in host memory (DMA-friendly)
CONNECT_TIMEOUT_SECONDS = 30.0
# The pool is registered with CUDA this many bytes per call. Pinning takes the process's
# memory-map lock for the whole call: on the H200 host one call for a 60 GB pool held it
# for seconds, and every thread that mapped memory meanwhile (the lease keep-alive among
# them) stopped until the lease lapsed (issue 21). A copy never spans two chunks: CUDA
# pins per registration, and a copy across two would not run at the pinned speed.
REGISTER_CHUNK_BYTES = 256 << 20
# A restore refills the allocator's cache (`TorchState._warm`) only when it is short of this many bytes.
WARM_MIN_BYTES = 64 << 20


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def chunked(places: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """`places` ((pool offset, source offset, length), from `pieces`) cut where they cross a
    `REGISTER_CHUNK_BYTES` boundary of the pool, so that each copy lies in one registration."""
    out = []
    for off, src, k in places:
        while k > 0:
            n = min(k, REGISTER_CHUNK_BYTES - off % REGISTER_CHUNK_BYTES)
            out.append((off, src, n))
            off, src, k = off + n, src + n, k - n
    return out


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all bytes of `storage` (on its device)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


class TorchState:
    """The CUDA storages reachable from `objects` (modules, optimizers, tensors), found
    anew at each checkpoint (optimizer state appears after the first step). Thread-safe:
    commands run on the memory-command thread."""

    def __init__(self, objects: Iterable[Any] = ()) -> None:
        self._objects: list[Any] = list(objects)
        self._lock = threading.Lock()
        self._pool: torch.Tensor | None = None
        self._own: torch.Tensor | None = None
        self._moved: list[tuple[torch.UntypedStorage, int, int]] = []  # (storage, host offset, bytes)
        self._in_pool = False
        self._ranges: Ranges = []  # the pool ranges the state is in
        self._pinned: set[int] = set()  # the pool's chunks registered with CUDA (`REGISTER_CHUNK_BYTES` each)
        self._pin_lock = threading.Lock()  # guards `_pinned` and each registration (a command and `pin_ahead`)
        self._unpinned = False  # `unpin` ran: the process is ending; nothing is registered again
        self._reserved: dict[torch.device, int] = {}  # bytes PyTorch's allocator reserved per device at the checkpoint
        # seconds of the last command's parts (and chunks it had to register), for its log line
        self.last_phases: dict[str, float | int] = {}
        # The copy stream is made now: making one later, on a full GPU, fails (CUDA needs device memory for it).
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def add(self, *objects: Any) -> None:
        """Register more state (modules, optimizers, tensors)."""
        with self._lock:
            self._objects.extend(objects)

    def _tensors(self) -> Iterable[torch.Tensor]:
        for obj in self._objects:
            if isinstance(obj, torch.nn.Module):
                for p in obj.parameters():
                    yield p
                    if p.grad is not None:
                        yield p.grad
                yield from obj.buffers()
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    yield from (v for v in state.values() if isinstance(v, torch.Tensor))
            elif isinstance(obj, torch.Tensor):
                yield obj
            else:
                raise TypeError(f"timeslice.torch cannot move {type(obj).__name__}: register modules, optimizers "
                                "or tensors")

    def _storages(self) -> list[torch.UntypedStorage]:
        seen: dict[int, torch.UntypedStorage] = {}
        for t in self._tensors():
            if t.is_cuda:
                s = t.untyped_storage()
                if s.nbytes() > 0:
                    seen.setdefault(s.data_ptr(), s)
        return list(seen.values())

    def nbytes(self) -> int:
        with self._lock:
            if self._moved:
                return sum(n for _, _, n in self._moved)
            return sum(s.nbytes() for s in self._storages())

    def use_pool(self, pool: mmap.mmap) -> None:
        """Checkpoint into `pool` from now on (`_places`: what a command does with the parts
        `pin_ahead` has not pinned yet)."""
        with self._lock:
            self._pool = torch.frombuffer(pool, dtype=torch.uint8)

    def pin_ahead(self) -> bool:
        """Register one chunk of the pool not registered yet: first those that hold this job's
        checkpointed state (its restore comes next), then the first in the pool; False when none
        is left (or there is no pool or no CUDA, or `unpin` ran). Called by the memory-command
        thread while this job does not hold the GPU, chunk after chunk, so that commands find
        the pool pinned: a process's first checkpoints into a part of the pool pinned it on the
        switch's path (8-10 s instead of 1-1.5 s for 50 GB on the H200: bench/results/
        rl-grpo-b-serve-cooperative-declared-h200.json), and registering 16 GB beside a
        GPU-busy process did not slow it (median iteration 9.8 ms alone and meanwhile;
        bench/results/pin-probe-h200.json). Raises RuntimeError when CUDA refuses."""
        pool = self._pool
        if pool is None or self._unpinned or not torch.cuda.is_available():
            return False
        chunks = -(-pool.numel() // REGISTER_CHUNK_BYTES)
        with self._pin_lock:
            own = [i for off, n in self._ranges
                   for i in range(off // REGISTER_CHUNK_BYTES, -(-(off + n) // REGISTER_CHUNK_BYTES))]
            index = next((i for i in (*own, *range(chunks)) if i not in self._pinned), None)
        if index is None:
            return False
        self._pin(index)
        return True

    def unpin(self) -> None:
        """Unregister every chunk this process registered (`cudaHostUnregister`); no chunk is
        registered after it. The memory-command loop calls it on close, with no command left to
        run: a process that ended with the pool registered spent longer in its exit than one that
        unregistered it first (H200 host, 3 processes, 90 GB each registered and 40 GB of GPU
        memory: 8.7 s to exit, against 3.6 s to unregister and 1.4-1.7 s more to exit;
        bench/results/exit-probe-h200.json; in shape b's jobs other costs of the exit remained:
        7.5-9.6 s). A state checkpointed into the pool stays there (the file keeps its bytes)."""
        with self._pin_lock:
            self._unpinned = True
            base = None if self._pool is None else self._pool.data_ptr()
            for index in sorted(self._pinned):
                err = torch.cuda.cudart().cudaHostUnregister(base + index * REGISTER_CHUNK_BYTES)
                if int(err) != 0:
                    log.warning("cudaHostUnregister of pool chunk %d failed: error %d", index, int(err))
            self._pinned.clear()

    def _pin(self, index: int) -> None:
        """Register chunk `index` of the pool unless it is (or `unpin` ran)."""
        with self._pin_lock:
            if index in self._pinned or self._pool is None or self._unpinned:
                return
            start = index * REGISTER_CHUNK_BYTES
            n = min(REGISTER_CHUNK_BYTES, self._pool.numel() - start)
            err = torch.cuda.cudart().cudaHostRegister(self._pool.data_ptr() + start, n, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of the pinned pool failed at byte {start}: error {int(err)}")
            self._pinned.add(index)

    def checkpoint(self, ranges: Ranges) -> tuple[int, bool]:
        """Returns (host bytes used: storages packed at 4 KiB boundaries; in the pool)."""
        with self._lock:
            if self._moved:  # already out (a repeated command)
                return self._host_bytes(), self._in_pool
            layout, total = [], 0
            for s in self._storages():
                layout.append((s, total, s.nbytes()))
                total += _align(s.nbytes())
            in_pool = self._pool is not None and total <= sum(n for _, n in ranges)
            self.last_phases = {"pin_s": 0.0, "pinned_chunks": 0}
            t0 = time.monotonic()
            host = None if in_pool or not total else self._own_buffer(total)  # (nothing on a GPU: nothing to copy)
            with self._copy_stream():
                for s, off, n in layout:
                    dev = _bytes_view(s)
                    for dst, src, k in self._places(ranges, host, off, n):
                        dst.copy_(dev[src:src + k], non_blocking=True)
            t1 = time.monotonic()
            self._reserved = {d: torch.cuda.memory_reserved(d) for d in {s.device for s, _, _ in layout}
                              if d.type == "cuda"}
            for s, _, _ in layout:
                s.resize_(0)
            torch.cuda.empty_cache()
            self.last_phases.update(copy_s=t1 - t0 - self.last_phases["pin_s"], free_s=time.monotonic() - t1)
            self._moved, self._in_pool = layout, in_pool
            self._ranges = prefix(ranges, total) if in_pool else []
            return total, in_pool

    @contextlib.contextmanager
    def _copy_stream(self) -> Iterator[None]:
        """Copies run on the side stream, after the work queued so far, and are waited for;
        without CUDA (CPU tensors) they are plain synchronous copies."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            yield
        self._stream.synchronize()

    def restore(self, ranges: Ranges) -> int:
        with self._lock:
            if not self._moved:
                return 0
            ranges = ranges or self._ranges
            if self._in_pool and (self._pool is None or sum(n for _, n in ranges) < self._host_bytes()):
                raise RuntimeError(f"restore: the pool ranges given hold {sum(n for _, n in ranges)} bytes, this "
                                   f"state was checkpointed into {self._host_bytes()}")
            host = None if self._in_pool else self._own
            self.last_phases = {"pin_s": 0.0, "pinned_chunks": 0}
            t0 = time.monotonic()
            for s, _, n in self._moved:  # allocated on the current stream, where the tensors are used
                s.resize_(n)
            t1 = time.monotonic()
            with self._copy_stream():
                for s, off, n in self._moved:
                    dev = _bytes_view(s)
                    for src, dst, k in self._places(ranges, host, off, n):
                        dev[dst:dst + k].copy_(src, non_blocking=True)
            t2 = time.monotonic()
            moved = sum(n for _, _, n in self._moved)
            self._moved = []
            self._warm()
            self.last_phases.update(alloc_s=t1 - t0, copy_s=t2 - t1 - self.last_phases["pin_s"],
                                    warm_s=time.monotonic() - t2)
            return moved

    def _warm(self) -> None:
        """Give PyTorch's caching allocator back, as one cached block per device, what it had
        reserved at the checkpoint beyond what the restore brought back (activations, KV
        cache: memory the job's phases allocate and free again), so that the job's next phase
        allocates from its cache as it did before it was moved, not with `cudaMalloc` call
        after call beside other processes' copies, pinning and frees (the checkpoint emptied that
        cache: NVML must show the memory free). On the H200, shape b's generate phases ran
        4.3-9.9 s shared against 3.3 s alone (bench/results/
        rl-grpo-b-serve-cooperative-declared-66b7230-h200.json); how much of that these calls
        were is not measured yet. Within the job's reservation: it held this much when it was
        seen last. A device that has not that much free keeps what it has (logged)."""
        for device, reserved in self._reserved.items():
            short = reserved - torch.cuda.memory_reserved(device)
            if short < WARM_MIN_BYTES:
                continue
            try:
                block = torch.empty(short, dtype=torch.uint8, device=device)  # on the job's stream: reusable there
                del block
            except torch.cuda.OutOfMemoryError as err:
                log.info("allocator cache not refilled on %s (%d bytes): %s", device, short, err)
        self._reserved = {}

    def _host_bytes(self) -> int:
        _, off, n = self._moved[-1]
        return off + _align(n)

    def _places(self, ranges: Ranges, own: torch.Tensor | None, start: int,
                n: int) -> list[tuple[torch.Tensor, int, int]]:
        """Host slices for bytes [start, start + n) of the packed state: [(host slice, offset
        in the storage, length)], in the pool `ranges` or in the store's own buffer `own`. The
        pool's chunks among them that are not pinned yet are registered first: copying into
        its pages unregistered ran at ~3 GB/s on the H200, slower than registering them
        (~8 GB/s) then copying (bench/results/rl-grpo-b-serve-cooperative-declared-27d8e96-h200.json);
        registering 4 at once did not make a first checkpoint shorter (bench/results/
        rl-grpo-b-serve-cooperative-declared-c7df758-h200.json)."""
        if own is not None:
            return [(own[start:start + n], 0, n)]
        places = chunked(pieces(ranges, start, n))
        t0, before = time.monotonic(), len(self._pinned)
        try:
            for off, _, _ in places:
                self._pin(off // REGISTER_CHUNK_BYTES)
        except RuntimeError as err:  # the copies still run, at pageable speed
            log.warning("%s: copying at pageable speed", err)
        if self.last_phases:  # (a checkpoint or restore command set them to 0; none outside one)
            self.last_phases["pin_s"] += time.monotonic() - t0
            self.last_phases["pinned_chunks"] += len(self._pinned) - before
        return [(self._pool[off:off + k], src, k) for off, src, k in places]  # type: ignore[index]

    def _own_buffer(self, total: int) -> torch.Tensor:
        """This process's host buffer (reused), when the node has no pool or it is full:
        pageable, of exactly `total` bytes (copies at ~12 GB/s out, ~6 GB/s in on the H200:
        reference/checkpoint-h200.md). Not PyTorch's pinned memory: its host allocator rounds
        a request up to a power of two (47 GB asks 2**36 B, 68.7 GB), and on the H200 host (128 GiB)
        two jobs of 47 GB that checkpointed into such buffers were killed with their states
        (bench/results/rl-grpo-b-agent-cooperative-nopool-h200.json). Raises MemoryError when
        the host has not that much (`host_memory`: the allocation itself succeeds and the kernel
        kills the process as the copy fills it), before anything is copied: the checkpoint
        fails, the orchestrator rolls its switch back, and the job keeps computing."""
        if self._own is not None and self._own.numel() >= total:
            return self._own
        self._own = None
        available = host_memory.available_bytes()
        if total > available - host_memory.RESERVE_BYTES:
            raise MemoryError(f"no host memory for a {total}-byte checkpoint of this process's GPU state: the host has "
                              f"{available} bytes available (MemAvailable) and keeps {host_memory.RESERVE_BYTES}; "
                              "the node's pinned pool could not take it")
        try:
            self._own = torch.empty(total, dtype=torch.uint8)
        except RuntimeError as err:
            raise MemoryError(f"no host memory for a {total}-byte checkpoint of this process's GPU state: "
                              f"{err}") from err
        return self._own


def register(client: Any, *objects: Any, group_id: str | None = None,
             memory: str | int | None = None) -> TorchState:
    """Let `objects` (modules, optimizers, CUDA tensors) leave the GPU while this job does
    not hold `group_id` (a group whose backend is `cooperative`). `client` is a
    `TimeSliceOrchestratorClient`; returns the `TorchState` (`.add(...)` registers more)
    once the orchestrator's command stream is open (at most 30 s; a warning after that).
    `memory`: the most GPU memory this job holds while it computes, per GPU (bytes or a
    quantity such as "57Gi"): declared with its acquires from now on (`client.memory`).
    Raises TypeError for an object it cannot move, ValueError for a malformed memory."""
    if memory is not None:
        client.memory = memory
    state = TorchState(objects)
    state.nbytes()  # raises TypeError now rather than at the first checkpoint
    loop: MemoryCommandLoop = client.serve_memory_commands(state, group_id)
    state.loop = loop  # type: ignore[attr-defined]
    if not loop.ready.wait(CONNECT_TIMEOUT_SECONDS):  # until then the orchestrator cannot move this state
        log.warning("memory commands not connected after %g s; registered state stays on the GPU until then",
                    CONNECT_TIMEOUT_SECONDS)
    elif loop.error:
        log.warning("registered state stays on the GPU: %s", loop.error)
    return state
