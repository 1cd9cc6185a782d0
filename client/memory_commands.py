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

Needs only `grpcio` and `protobuf`; the GPU side is the store (`timeslice.torch`).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import uuid
from typing import Protocol

import grpc
from timeslice import _rpc
from timeslice.v1 import orchestrator_pb2 as pb
from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

log = logging.getLogger("timeslice.client.memory")

# Codes after which reconnecting cannot help.
_FINAL = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
          grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED)


class StateStore(Protocol):
    """What a job registered to leave the GPU. Sizes and offsets in bytes."""

    def nbytes(self) -> int:
        """Bytes a checkpoint would move now."""
        ...

    def attach_pool(self, pool: mmap.mmap) -> None:
        """The node's pinned pool, mapped (called once, before any command that uses it)."""
        ...

    def checkpoint(self, offset: int, length: int) -> tuple[int, bool]:
        """Copy the state out and free it on the GPU: into the pool at `offset` when it fits
        in `length`, else into the store's own host memory. Returns (bytes, in the pool)."""
        ...

    def restore(self, offset: int, length: int) -> int:
        """Bring the state back (from the pool at `offset` when `length` > 0, else from the
        store's own copy); returns bytes. A store that is not checkpointed returns 0."""
        ...


class MemoryCommandLoop:
    """Serve the memory commands of `group` for `job_id` on `store` in a daemon thread."""

    def __init__(self, stub: pb_grpc.OrchestratorStub, settings: _rpc.Settings, group: str,
                 store: StateStore) -> None:
        self.group = group
        self.store = store
        self.error: str | None = None
        self.stream_id = uuid.uuid4().hex
        self._stub = stub
        self._s = settings
        self._stop = threading.Event()
        self._call: grpc.Future | None = None
        self._pool: mmap.mmap | None = None
        self._attached = threading.Event()  # the pool is usable, or will not be
        self._attached.set()
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"timeslice-memory-{group}")
        self._thread.start()

    def _run(self) -> None:
        pause = _rpc.BACKOFF_FIRST
        while not self._stop.is_set():
            request = pb.MemoryCommandsRequest(job_id=self._s.job_id, group_id=self.group, pid=os.getpid(),
                                               registered_bytes=self.store.nbytes(), stream_id=self.stream_id)
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
                    return
                log.info("memory command stream lost group=%s (reconnecting): %s", self.group, code)
            finally:
                self.connected.clear()
            self._stop.wait(pause)
            pause = min(pause * 2, _rpc.BACKOFF_MAX)

    def _handle(self, command: pb.MemoryCommand) -> None:
        if command.kind == "hello":
            if command.pool_path and self._pool is None and self._attached.is_set():
                self._attached.clear()  # registering a large pool takes seconds: not on this thread's path
                threading.Thread(target=self._attach, args=(command.pool_path, command.pool_bytes), daemon=True,
                                 name=f"timeslice-pool-{self.group}").start()
            self.connected.set()
            return
        self._attached.wait()
        t0 = time.monotonic()
        ack = pb.MemoryCommandAck(job_id=self._s.job_id, group_id=self.group, op_id=command.op_id, ok=True)
        try:
            if command.kind == "checkpoint":
                ack.bytes, ack.pinned = self.store.checkpoint(command.offset, command.length)
            elif command.kind == "restore":
                ack.bytes = self.store.restore(command.offset, command.length)
            else:
                raise ValueError(f"unknown memory command {command.kind!r}")
        except Exception as err:  # the orchestrator rolls back and reports it; this process goes on
            log.exception("memory command failed group=%s kind=%s", self.group, command.kind)
            ack.ok, ack.error = False, f"{type(err).__name__}: {err}"
        ack.seconds = time.monotonic() - t0
        ack.registered_bytes = self.store.nbytes()
        log.info("memory command group=%s kind=%s ok=%s bytes=%d pinned=%s seconds=%.3f", self.group, command.kind,
                 ack.ok, ack.bytes, ack.pinned, ack.seconds)
        try:
            self._stub.AckMemoryCommand(ack, timeout=30.0, metadata=_rpc.call_metadata())
        except grpc.RpcError as err:  # it gave up waiting (timeout): it rolls back with a restore command
            log.warning("memory command ack refused group=%s op=%s: %s", self.group, command.op_id, err)

    def _attach(self, path: str, size: int) -> None:
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                self._pool = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self.store.attach_pool(self._pool)
            log.info("pinned pool attached path=%s bytes=%d", path, size)
        except Exception as err:  # no pool: checkpoints go to the store's own memory
            self._pool = None
            log.warning("pinned pool %s unusable, using this process's own host memory: %s", path, err)
        finally:
            self._attached.set()

    def close(self) -> None:
        """Stop the thread and close the stream (the orchestrator forgets this process
        unless it is checkpointed)."""
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        self._thread.join(timeout=5.0)
