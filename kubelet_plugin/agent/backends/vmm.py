"""Backend `vmm`: an unmodified job's device memory moved by the timeslice-vmm shim in its processes.

The shim (`shim/timeslice_vmm.c`, loaded with `LD_PRELOAD`: `timeslice.driver.vmm_shim`) serves the
process's cudaMalloc with CUDA virtual memory and listens on a unix socket
`$TIMESLICE_VMM_DIR/<pid>.sock`. A step sends it one line (`checkpoint`, `restore`, `state`) and
reads one line back: `ok <running|checkpointed> <bytes> <seconds> <seconds a checkpoint's copies
waited for host memory to be faulted in and registered> <bytes of the checkpoint in the pool>` or
`error <reason>`. The shim copies every allocation to pinned host memory and releases the physical
memory with the addresses kept reserved (checkpoint), or maps new memory at the same addresses and
copies back (restore); each step is all-or-nothing in the process, and one whose asker hung up
before the answer (this step timed out) is undone by the shim, so it never lands late. Over a
job's processes the step is all-or-nothing too (`run_step`).

The node's pinned pool (`VmmPool`, a memfd) is handed to each shim once (`pool`, its descriptor
passed over the socket) as soon as the agent sees the process: in a memory report (`seen`) or at
its first step; only to processes of the agent's own user. The shim registers it in the
background, and a checkpoint names the pool's ranges it copies into (`checkpoint pool=<the
memfd's inode> <offset>+<length>,...`); what they do not hold goes to a private buffer of the
shim's, and so does all of it when the shim holds another pool. The ranges stay the job's while
it is checkpointed and come back to the pool on its restore's answer, or, for a checkpoint that
timed out (which the shim undoes), once the shim says it runs; those of a process that ended come
back at the next checkpoint.

The socket is reached through the process's own view of the file system (`/proc/<pid>/root`,
its PID as its namespace numbers it): a pod's `/tmp` needs no host mount. A process without the
shim loaded and listening (started without it, or no allocation yet) is moved by the `cuda`
backend, with a log line; where there is none (no driver or cuda-bindings), such a process that NVML
shows holding no GPU memory has nothing to move (`no-context`), and one that holds some fails the step.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Sequence

from timeslice.driver import host_ranges, vmm_shim
from timeslice.driver.errors import BackendError, ProcessGone, StepTimeout
from timeslice.driver.peercred import start_time
from timeslice.driver.rollback import undo
from timeslice.kubelet_plugin.agent import gpu_memory
from timeslice.kubelet_plugin.agent.backends.base import (
    CHECKPOINTED,
    NO_CONTEXT,
    RUNNING,
    Backend,
    ProcState,
    log,
    run_step,
)
from timeslice.kubelet_plugin.agent.backends.vmm_pool import SIZE_ENV, VmmPool
from timeslice.kubelet_plugin.agent.gpu_memory import GpuInfo
from timeslice.kubelet_plugin.agent.procfs import exit_state, gone_or_failed

REPLY_LIMIT = 256  # bytes: one line of the shim's answer
MAX_RANGES = 128  # pool ranges one checkpoint names (the shim's TSV_MAX_SEGS - 1; its command line holds 4095 bytes)
STATE_SECONDS = 5.0  # a `state` question answers at once (it waits only for a step in progress)
FREE_SECONDS = 120.0  # a shim frees a checkpoint's host buffer (tens of GB unpinned and unmapped) within this


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def socket_path(pid: int) -> str:
    """Where the shim in `pid` listens, as this process can reach it: its DIR_ENV (else its
    user's default folder) and its PID as its own namespace numbers it, through its root when
    its mount namespace is not ours. Raises OSError when /proc has no such process."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    status = _status(pid)
    uid = int(status.get("Uid", "0").split()[0])
    directory = env[vmm_shim.DIR_ENV.encode()].decode() if vmm_shim.DIR_ENV.encode() in env \
        else vmm_shim.default_dir(uid)
    ns_pid = int(status.get("NSpid", str(pid)).split()[-1])
    try:
        same = os.readlink("/proc/self/ns/mnt") == os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        same = False
    return f"{directory if same else f'/proc/{pid}/root{directory}'}/{ns_pid}.sock"


def _gone_or_failed(pid: int, message: str) -> ProcessGone | BackendError:
    """ProcessGone for a process that is gone or ending (exiting: its /proc files already answer
    ESRCH, its shim no more), else BackendError (`procfs.gone_or_failed` waits for a zombie)."""
    return ProcessGone(message) if exit_state(pid) != "live" else gone_or_failed(pid, message)


def has_shim(pid: int) -> bool:
    """Whether `pid` has the shim loaded and its socket exists (a socket file alone may be left
    by an earlier process of that PID). Raises OSError when /proc has no such process."""
    with open(f"/proc/{pid}/maps") as f:
        loaded = any("timeslice_vmm" in line for line in f)
    return loaded and os.path.exists(socket_path(pid))


class VmmBackend(Backend):
    """`pool_bytes`: the size of the node's pinned pool (0: none; None: $TIMESLICE_VMM_POOL_BYTES,
    else `host_ranges.default_size` of the GPUs' total memory, which `memory_probe` (NVML) reads)."""

    name = "vmm"

    def __init__(self, lock_timeout: float, memory_probe: Callable[[], list[GpuInfo]] = gpu_memory.gpus,
                 pool_bytes: int | None = None) -> None:
        self.lock_timeout = lock_timeout
        self._memory_probe = memory_probe
        self._pool_bytes = pool_bytes
        self._cuda: Backend | None = None
        self._frees: dict[int, asyncio.Task[None]] = {}  # pid -> waiting for its shim to free a host buffer
        self._pool: VmmPool | None = None
        self._pool_made: asyncio.Future[None] | None = None  # once: a pool that could not be made is not tried again
        # pid -> (its start time, the task handing it the pool)
        self._handed: dict[int, tuple[int | None, asyncio.Future[bool | None]]] = {}
        self._ranges: dict[int, tuple[int | None, list[tuple[int, int]]]] = {}  # pid -> (start time, its ranges)
        self._release_later: dict[int, list[tuple[int, int]]] = {}  # pid -> ranges back once its shim answers

    async def host_memory_settled(self, timeout: float) -> bool:
        """Once the shims that answered a restore have freed its host buffer (`_free_after`),
        or `timeout` seconds. Without it a checkpoint asked right after a restore (a switch
        that restores first) finds the host memory still taken and is refused (seen on the
        H200: 47 GB, 34 ms after the restore's answer). A wait that times out leaves the
        frees to be waited for by the next caller."""
        if not self._frees:
            return True
        _, pending = await asyncio.wait(list(self._frees.values()), timeout=timeout)  # (wait cancels none of them)
        return not pending

    def _free_after(self, pid: int) -> None:
        """`pid`'s shim frees a host buffer after its answer (a restore's, or a timed-out
        checkpoint's, which it undoes): a `state` question, which it answers once that is done
        (it serves one command at a time), tells when (`host_memory_settled`)."""
        if pid not in self._frees:
            self._frees[pid] = asyncio.ensure_future(self._freed(pid))

    async def _freed(self, pid: int) -> None:
        """Wait for `pid`'s shim to answer a `state` question (it serves one command at a time,
        so it has ended the step and what follows it). Then the pool ranges of a checkpoint that
        timed out (`_release_later`) go back to the pool if the shim undid it (it runs), and stay
        the job's if not (checkpointed: its answer came too late, or its undo failed). Until the
        shim answers or its process is gone they stay taken: asked again while it is busy or its
        socket refuses (its backlog full)."""
        warned = False
        try:
            while exit_state(pid) == "live":  # (an exiting process frees its memory as it ends)
                try:
                    now = await self._ask(pid, "state", FREE_SECONDS)
                except ProcessGone:
                    break
                except (StepTimeout, BackendError) as err:
                    if not warned:
                        log.warning("vmm: pid %d has not answered after its step (%s): asking again", pid, err)
                        warned = True
                    await asyncio.sleep(1.0)
                    continue
                born = start_time(pid)
                if now.state == CHECKPOINTED and pid in self._release_later and born is not None:
                    self._ranges[pid] = (born, self._ranges.get(pid, (born, []))[1] + self._release_later.pop(pid))
                break
        finally:
            self._frees.pop(pid, None)
            if self._pool is not None:
                self._pool.release(self._release_later.pop(pid, []))

    def pinned_free_bytes(self) -> int:
        return self._pool.populated_free() if self._pool is not None else 0

    async def pinned_free_for(self, pids: Sequence[int]) -> int:
        """The pool's free bytes only where the shim of each live process of `pids` holds the pool
        (handed now if it had not been, as their checkpoint would): one that refused it (another
        user's process, or one that cannot map it) or has no shim (the `cuda` backend moves it)
        checkpoints into host memory of its own, which the pool's pages, taken already, do not
        give (the check counted them and let such a checkpoint take host memory the host lacked)."""
        if await self._pool_now() is None:
            return 0
        live = [pid for pid in pids if exit_state(pid) == "live"]
        held = await asyncio.gather(*(self._hand_pool(pid) for pid in live))
        return self.pinned_free_bytes() if all(h is True for h in held) else 0

    def seen(self, pids: Sequence[int]) -> None:
        for pid in pids:
            self._hand_pool(pid)

    async def _pool_now(self) -> VmmPool | None:
        """The node's pool, made at the first need (None: none, as configured, or because it
        could not be made: logged once, not tried again)."""
        if self._pool_made is None:
            self._pool_made = asyncio.ensure_future(self._make_pool())
        await asyncio.shield(self._pool_made)
        return self._pool

    async def _make_pool(self) -> None:
        try:
            size = self._pool_bytes if self._pool_bytes is not None else os.environ.get(SIZE_ENV)
            gpus = [] if size is not None else await asyncio.to_thread(self._memory_probe)
            want = int(size) if size is not None else host_ranges.default_size(sum(g.total for g in gpus), None)
            self._pool = VmmPool.create(want) if want > 0 else None
        except (OSError, ValueError) as err:
            log.warning("vmm: no pinned pool (%s): each checkpoint registers host memory of its own, slower", err)

    def _hand_pool(self, pid: int) -> asyncio.Future[bool | None]:
        """Hand the pool to `pid`'s shim, once per process (one task, shared by every asker):
        True once its shim holds it; None when it will not (refused, logged; a process of another
        user than the agent's: the pool holds every job's state, and only one user's processes
        may map it); False when there is no pool or no shim answering yet (asked again next time)."""
        born = start_time(pid)
        held = self._handed.get(pid)
        if held is not None and held[0] == born and (not held[1].done() or held[1].result() is not False):
            return held[1]
        task = asyncio.ensure_future(self._give_pool(pid))
        self._handed[pid] = (born, task)
        return task

    async def _give_pool(self, pid: int) -> bool | None:
        pool = await self._pool_now()
        if pool is None:
            return False
        try:
            if not await asyncio.to_thread(has_shim, pid):
                return False
            uid = int((await asyncio.to_thread(_status, pid)).get("Uid", "-1").split()[0])
            if uid != os.geteuid():
                log.info("vmm: pid %d is uid %d's, the pinned pool this agent's (uid %d): its checkpoints go to host "
                         "memory of its own", pid, uid, os.geteuid())
                return None
            line = await asyncio.wait_for(self._exchange(pid, "pool", [pool.fd]), STATE_SECONDS)
        except (OSError, ValueError) as err:  # (no shim listening, no answer in time, a line too long)
            log.info("vmm: pid %d not handed the pinned pool (%s)", pid, err)
            return False
        answer = line.decode(errors="replace").strip()
        if not answer.startswith("ok"):
            log.warning("vmm: pid %d refused the pinned pool (%s): its checkpoints go to host memory of its own",
                        pid, answer)
            return None
        return True

    async def checkpoint(self, pids: Sequence[int], timeout: float) -> list[ProcState]:
        return await self._step("checkpoint", "restore", pids, timeout)

    async def restore(self, pids: Sequence[int], timeout: float) -> list[ProcState]:
        return await self._step("restore", "checkpoint", pids, timeout)

    async def state(self, pids: Sequence[int]) -> list[ProcState]:
        shim, other = await self._split(pids)
        states = [await self._ask(pid, "state", STATE_SECONDS) for pid in shim]
        if not other:
            return states
        cuda = await self._fallback(other)
        return states + (await cuda.state(other) if cuda else [ProcState(pid, NO_CONTEXT) for pid in other])

    async def _step(self, command: str, inverse: str, pids: Sequence[int], timeout: float) -> list[ProcState]:
        """`command` on every shim process, the `cuda` backend's on the rest; all or nothing."""
        one = {"checkpoint": self._checkpoint_one, "restore": self._restore_one}
        shim, other = await self._split(pids)
        done = await run_step(f"vmm {command}", shim, lambda p: one[command](p, timeout),
                              lambda p: one[inverse](p, timeout))
        if not other:
            return done
        try:
            cuda = await self._fallback(other)
            if cuda is None:
                return done + [ProcState(pid, NO_CONTEXT) for pid in other]
            return done + await (cuda.checkpoint(other, timeout) if command == "checkpoint"
                                 else cuda.restore(other, timeout))
        except BaseException as err:
            failure = f"vmm {command} of the processes without the shim failed ({err})"
            await undo(done, lambda st: one[inverse](st.pid, timeout), lambda st: f"pid {st.pid}", failure)
            raise

    async def _checkpoint_one(self, pid: int, timeout: float) -> ProcState:
        """Checkpoint `pid` into as much of the pool as is free (its shim holds the pool: handed
        now if the agent had not yet), the rest into a private buffer of its shim's."""
        ranges: list[tuple[int, int]] = []
        pool = await self._pool_now()
        if pool is not None and await self._hand_pool(pid) is True:
            self._give_back_ended()
            now = await self._ask(pid, "state", STATE_SECONDS)
            if now.state == RUNNING:
                pool.release(self._ranges.pop(pid, (None, []))[1])  # a restore that failed to undo left it so
                ranges = pool.take(min(now.gpu_bytes, pool.free_bytes))
                ranges = pool.keep(ranges, sum(n for _, n in ranges[:MAX_RANGES]))
        named = f"pool={pool.inode} " + ",".join(f"{off}+{n}" for off, n in ranges) if pool and ranges else ""
        try:
            words = await self._answer(pid, "checkpoint", timeout, named)
        except BackendError:  # answered with an error (the shim kept nothing), or gone
            if pool is not None:
                pool.release(ranges)
            raise
        except BaseException:  # timed out or cancelled: the shim undoes it, copying back from these ranges
            self._release_later.setdefault(pid, []).extend(ranges)
            self._free_after(pid)
            raise
        if pool is not None and ranges:  # what the shim put in the pool: the first bytes of its ranges
            in_pool = int(words[5]) if len(words) > 5 and words[5].isdigit() else sum(n for _, n in ranges)
            kept, born = pool.keep(ranges, in_pool), start_time(pid)
            if born is None:  # ended since its answer: nothing of it to restore
                pool.release(kept)
            else:
                self._ranges[pid] = (born, kept)
        return ProcState(pid, words[1], int(words[2]))

    async def _restore_one(self, pid: int, timeout: float) -> ProcState:
        """Restore `pid`; its pool ranges are free again once its shim says it runs (a restore
        that fails or times out is undone by the shim, into the same ranges)."""
        try:
            done = await self._ask(pid, "restore", timeout)
        except ProcessGone:
            self._give_back(pid)
            raise
        self._give_back(pid)
        return done

    def _give_back(self, pid: int) -> None:
        held = self._ranges.pop(pid, None)
        if held is not None and self._pool is not None:
            self._pool.release(held[1])

    def _give_back_ended(self) -> None:
        """The ranges of processes that ended while checkpointed (killed, or exited) back to the pool;
        the processes that ended forgotten."""
        for pid, (born, _) in list(self._ranges.items()):
            if start_time(pid) != born:
                self._give_back(pid)
        for pid, (born, _) in list(self._handed.items()):
            if start_time(pid) != born:
                del self._handed[pid]

    async def _split(self, pids: Sequence[int]) -> tuple[list[int], list[int]]:
        """The PIDs whose shim listens, and the others (logged: the `cuda` backend moves them)."""
        shim: list[int] = []
        other: list[int] = []
        for pid in pids:
            try:
                listens = await asyncio.to_thread(has_shim, pid)
            except OSError:
                listens = True  # gone from /proc: asking its shim reports it gone (`run_step`)
            (shim if listens else other).append(pid)
        if other:
            log.info("vmm: no timeslice-vmm shim socket in pid(s) %s (not started with LD_PRELOAD=%s, or no "
                     "allocation yet): moved by the cuda backend", other, vmm_shim.LIBRARY_NAME)
        return shim, other

    async def _fallback(self, pids: Sequence[int]) -> Backend | None:
        """The `cuda` backend for `pids` (processes without the shim); None where there is none
        (no driver or cuda-bindings) and NVML shows none of them holding GPU memory: nothing of
        them to move. Raises BackendError when one holds some and there is no cuda backend."""
        if self._cuda is None:
            from timeslice.kubelet_plugin.agent.backends.cuda import CudaBackend
            try:
                self._cuda = CudaBackend(self.lock_timeout)
            except BackendError as err:
                held = await asyncio.to_thread(gpu_memory.process_gpu_bytes)
                if any(held.get(pid) for pid in pids):
                    raise BackendError(f"pid(s) {[p for p in pids if held.get(p)]} hold GPU memory without the "
                                       f"timeslice-vmm shim, and the cuda backend is unavailable: {err}") from err
                log.info("vmm: pid(s) %s hold no GPU memory (NVML) and have no shim: nothing to move", list(pids))
                return None
        return self._cuda

    async def _ask(self, pid: int, command: str, timeout: float) -> ProcState:
        """`_answer`, as the process's state and its bytes on the GPU (or checkpointed)."""
        words = await self._answer(pid, command, timeout)
        return ProcState(pid, words[1], int(words[2]))

    async def _answer(self, pid: int, command: str, timeout: float, args: str = "") -> list[str]:
        """One command to the shim in `pid` (`args` after it, if any); its answer's words ("ok",
        state, bytes, seconds, seconds waiting for host memory, bytes in the pool). Raises
        ProcessGone (the process ended), StepTimeout (no answer within `timeout` seconds: the
        connection is closed, and the shim undoes the step when it ends, or does not begin it),
        BackendError (the shim's error, an answer that is not the state asked for, or no shim
        answering)."""
        try:
            line = await asyncio.wait_for(self._exchange(pid, f"{command} {args}" if args else command), timeout)
        except asyncio.TimeoutError:
            if command == "checkpoint":  # (undone by the shim, which then frees its buffer)
                self._free_after(pid)
            raise StepTimeout(f"vmm {command} pid {pid}: no answer in {timeout:.1f} s (the shim undoes it)") from None
        except (OSError, ValueError) as err:
            raise _gone_or_failed(pid, f"vmm {command} pid {pid}: no answer from its shim ({err})") from err
        words = line.decode(errors="replace").split()
        want = {"checkpoint": CHECKPOINTED, "restore": RUNNING}.get(command)
        if len(words) >= 3 and words[0] == "ok" and words[1] in (RUNNING, CHECKPOINTED) and words[2].isdigit() \
                and words[1] == (want or words[1]):
            if command != "state":
                seconds = words[3] if len(words) > 3 else "?"
                waited = f" ({words[4]} s of it waiting for host memory)" if command == "checkpoint" and len(
                    words) > 4 else ""
                pooled = f", {words[5]} of them in the node's pool" if command == "checkpoint" and len(
                    words) > 5 else ""
                log.info("vmm %s pid=%d: %s bytes in %s s%s%s", command, pid, words[2], seconds, waited, pooled)
            if command == "restore":  # (its buffer is freed after this answer)
                self._free_after(pid)
            return words
        if not words:  # the shim answers every command it reads: its process is ending
            raise _gone_or_failed(pid, f"vmm {command} pid {pid}: the shim closed the connection unanswered")
        raise BackendError(f"vmm {command} pid {pid}: {' '.join(words[1:]) if words[0] == 'error' else line!r}")

    @staticmethod
    async def _exchange(pid: int, command: str, fds: Sequence[int] = ()) -> bytes:
        """Send `command` to the shim in `pid`, with the descriptors `fds` (SCM_RIGHTS, unix(7)),
        and return its one-line answer (b"": none). Raises OSError (no shim listening), ValueError
        (an answer over REPLY_LIMIT bytes)."""
        path = await asyncio.to_thread(socket_path, pid)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.setblocking(False)
            await asyncio.get_running_loop().sock_connect(conn, path)
            line = f"{command}\n".encode()  # (a few bytes into a new connection's empty buffer: never blocks)
            if fds:
                socket.send_fds(conn, [line], list(fds))
            else:
                conn.send(line)
            reader, writer = await asyncio.open_unix_connection(sock=conn, limit=REPLY_LIMIT)
        except BaseException:
            conn.close()
            raise
        try:
            return await reader.readline()
        finally:
            writer.close()
