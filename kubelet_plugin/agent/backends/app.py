"""Backend `app`: the job's inference engine frees and re-takes its own GPU memory.

Owned by the node agent (`NodeAgent.backend("app").bind(engine)` per step). vLLM and
SGLang can drop their weights and KV cache and load them again much faster than a process
checkpoint; a checkpoint here is the engine's sleep (vLLM `POST /sleep?level=N`, SGLang
`POST /release_memory_occupation`), a restore its wake (`POST /wake_up`,
`POST /resume_memory_occupation`). The calls, their bodies and answers are those of
`driver/app_engine.py` (upstream files named there).

A checkpoint is verified: NVML's per-process memory of the job's processes must drop by
at least `MIN_FREED_FRACTION` of what they held before the sleep beyond what a sleep keeps
(`KEPT_BYTES` per process: an engine that holds no more has nothing to free, and one with a
small model frees little of its total), else the engine is woken again and the step fails
(BackendError). Without NVML (GPU-less nodes, the demo, tests
without a probe) the check is skipped and a log line says so; the step then reports 0
bytes (unknown). An engine's own word that it sleeps (vLLM `GET /is_sleeping`) never
stands in for that check: it is taken, with nothing sent, only when NVML shows the job's
processes freed as much since this agent last saw them awake (before a sleep it sent and
checked); otherwise the sleep is sent (vLLM ignores a
sleep while it sleeps: `vllm/v1/executor/abstract.py` `sleep`) and checked as any other.
A sleep sent to an engine that said it slept, and that frees nothing, fails the step and
leaves the engine as it was found (no wake).

The engine's answers are not trusted either: no redirect is followed (a 3xx fails the call,
naming its status), at most `MAX_REPLY_BYTES` of a reply body are read, and at most
`MAX_ERROR_TEXT` printable characters of any text the engine sent (a body, a `Location`,
an HTTP error that quotes its bytes) go into a step's error, which the group status shows.

Each call is bounded by the engine's `timeoutSeconds` and the step's timeout
(StepTimeout); a sleep that fails or times out is undone by a wake before the error is
raised (the engines serialize these requests, so a wake sent after a sleep that is still
running runs after it), except for an engine that said it slept before it was sent.

Retries: only calls whose repetition cannot change the outcome are repeated, a bounded
number of times within the call's bound: a connection that was refused (the request never
reached the engine) and `GET /is_sleeping`. A sleep or wake the engine may have received is
never sent again (SGLang's tag bookkeeping fails on a second resume); with vLLM its outcome
is read from `/is_sleeping` instead.

The engine is called on the URL from the agent's own network namespace: the job's
processes must share it (hostNetwork pods, one-box mode), else the step fails with
FailedPrecondition before anything is sent (another engine may listen on the node's
loopback at that port).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
from timeslice.driver.app_engine import ENGINE_VLLM, AppEngine
from timeslice.driver.errors import BackendError, FailedPrecondition, InvalidArgument, StepTimeout
from timeslice.kubelet_plugin.agent.backends.base import CHECKPOINTED, RUNNING, UNKNOWN, Backend, ProcState
from timeslice.kubelet_plugin.agent.gpu_memory import GpuInfo, gpus

log = logging.getLogger("timeslice.agent")

# A sleep must free at least this share of the GPU memory the job's processes held beyond
# what a sleep keeps of each: the CUDA context and the allocator's own reserve, ~0.5 GB per
# process (bytes). Measured against the whole, an engine holding little more than that could
# never sleep, and the group retried its sleep for good (a helper's attack: 12 failed
# switches in 40 s, the waiter timed out with the GPU 98% free).
MIN_FREED_FRACTION = 0.5
KEPT_BYTES = 512 << 20
# Connection attempts of one call when the engine refuses the connection (it never saw the
# request), and the first wait between them, doubled after each, seconds.
CONNECT_ATTEMPTS = 3
CONNECT_BACKOFF_SECONDS = 0.05
MAX_REPLY_BYTES = 64 << 10
"""Bytes of one engine reply's body the agent reads, at most; the rest is left unread and
the connection closed. vLLM and SGLang answer these calls in a few dozen bytes (empty,
`null`, `{"is_sleeping": true}`, `{"error": {"message": ...}}`), so this bounds the agent's
memory per call whatever an engine sends (a 400 MB body took the agent to 938 MB). A
`GET /is_sleeping` answer over it is an error; a sleep's or wake's 200 needs no body."""
MAX_ERROR_TEXT = 200
"""Characters of text an engine sent (a reply body, a redirect's `Location`, an HTTP
library error that quotes the engine's bytes) quoted in a step's error, at most: the error
reaches the orchestrator's group status and logs. `_excerpt` keeps printable ASCII only."""
_SPACES = re.compile(r"\s+")


def _excerpt(text: str | bytes | BaseException) -> str:
    """A short, printable rendering of text an engine controls: whitespace runs become one
    space, other characters outside printable ASCII `?`, at most `MAX_ERROR_TEXT` characters
    (`...` marks a cut)."""
    raw = str(text) if isinstance(text, BaseException) else text
    head = raw[:4 * MAX_ERROR_TEXT]  # whitespace runs shrink: enough to fill the excerpt
    flat = _SPACES.sub(" ", head.decode("utf-8", "replace") if isinstance(head, bytes) else head).strip()
    clean = "".join(c if " " <= c <= "~" else "?" for c in flat)
    return clean[:MAX_ERROR_TEXT] + "..." if len(clean) > MAX_ERROR_TEXT or len(raw) > len(head) else clean


async def _read_bounded(resp: aiohttp.ClientResponse) -> tuple[bytes, bool]:
    """`resp`'s body up to `MAX_REPLY_BYTES`, and whether it had more (left unread: the
    connection is closed)."""
    data = bytearray()
    while len(data) <= MAX_REPLY_BYTES:
        chunk = await resp.content.read(MAX_REPLY_BYTES + 1 - len(data))
        if not chunk:
            return bytes(data), False
        data += chunk
    resp.close()
    return bytes(data[:MAX_REPLY_BYTES]), True


def engine_session() -> aiohttp.ClientSession:
    """An HTTP session for engine calls: bodies as sent (no decompression: a small
    compressed body cannot grow past `MAX_REPLY_BYTES` unread), no proxy from the
    environment, aiohttp's bounds on header lines and count."""
    return aiohttp.ClientSession(auto_decompress=False, trust_env=False, headers={"Accept-Encoding": "identity"})


def _freed_enough(held: dict[int, int], now: dict[int, int]) -> bool:
    """Whether the processes that held `held` and now hold `now` (bytes per process) freed what a
    sleep must: `MIN_FREED_FRACTION` of all but `KEPT_BYTES` of each."""
    freeable = sum(max(0, n - KEPT_BYTES) for n in held.values())
    return sum(held.values()) - sum(now.values()) >= MIN_FREED_FRACTION * freeable


class _Unsent(Exception):
    """The engine refused the connection: the request never reached it."""


class OutcomeLost(BackendError):
    """A sleep or wake was sent and its answer lost (connection cut): it may have run."""


class NoSuchApi(BackendError):
    """The engine answered HTTP 404: it has no such endpoint (sleep mode off, or not the
    engine named), so nothing was run."""


class EngineClient:
    """The sleep/wake API of one engine (`AppEngine`) over HTTP (aiohttp). Methods take
    their bound in seconds and raise StepTimeout or BackendError."""

    def __init__(self, engine: AppEngine) -> None:
        self.engine = engine

    async def sleep(self, session: aiohttp.ClientSession, timeout: float) -> None:
        e = self.engine
        if e.engine == ENGINE_VLLM:
            await self._post(session, "/sleep", timeout, params={"level": str(e.level)})
        else:
            await self._post(session, "/release_memory_occupation", timeout, body={})

    async def wake(self, session: aiohttp.ClientSession, timeout: float) -> None:
        if self.engine.engine == ENGINE_VLLM:
            await self._post(session, "/wake_up", timeout)
        else:
            await self._post(session, "/resume_memory_occupation", timeout, body={})

    async def sleeping(self, session: aiohttp.ClientSession, timeout: float) -> bool | None:
        """vLLM's `GET /is_sleeping`; None for SGLang (no such endpoint)."""
        if self.engine.engine != ENGINE_VLLM:
            return None
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        backoff = CONNECT_BACKOFF_SECONDS
        for attempt in range(1, CONNECT_ATTEMPTS + 1):
            try:  # a GET: repeated on any transport error
                answer = await self._request(session, "GET", "/is_sleeping", max(0.001, until - loop.time()))
                return bool(answer.get("is_sleeping")) if isinstance(answer, dict) else None
            except (_Unsent, aiohttp.ClientError) as err:
                if attempt == CONNECT_ATTEMPTS or loop.time() + backoff >= until:
                    raise BackendError(f"{self.engine.describe()}: GET /is_sleeping failed: {_excerpt(err)}") \
                        from err
            await asyncio.sleep(backoff)
            backoff *= 2
        return None  # not reached

    async def _post(self, session: aiohttp.ClientSession, path: str, timeout: float,
                    params: dict[str, str] | None = None, body: dict[str, Any] | None = None) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        backoff = CONNECT_BACKOFF_SECONDS
        for attempt in range(1, CONNECT_ATTEMPTS + 1):
            try:
                await self._request(session, "POST", path, max(0.001, until - loop.time()), params, body)
                return
            except _Unsent as err:  # never reached the engine: safe to send again
                if attempt == CONNECT_ATTEMPTS or loop.time() + backoff >= until:
                    raise BackendError(f"{self.engine.describe()}: POST {path}: cannot connect after {attempt} "
                                       f"attempt(s): {err}") from err
                log.info("engine %s refused POST %s (%s): retry %d in %.2f s", self.engine.url, path, err, attempt,
                         backoff)
            except aiohttp.ClientError as err:  # it may have received it: not sent again
                raise OutcomeLost(f"{self.engine.describe()}: POST {path} failed, outcome unknown: "
                                   f"{type(err).__name__}: {_excerpt(err)}") from err
            await asyncio.sleep(backoff)
            backoff *= 2

    async def _request(self, session: aiohttp.ClientSession, method: str, path: str, timeout: float,
                       params: dict[str, str] | None = None, body: dict[str, Any] | None = None) -> Any:
        """The JSON answer (None when empty, or not JSON); raises _Unsent, aiohttp.ClientError,
        StepTimeout, or BackendError for a status other than 200 (a redirect is not followed)
        and for a GET's answer over `MAX_REPLY_BYTES` (at most that much is read)."""
        url = self.engine.url + path
        try:
            async with asyncio.timeout(timeout):
                async with session.request(method, url, params=params, json=body, allow_redirects=False) as resp:
                    data, cut = await _read_bounded(resp)
        except TimeoutError:
            raise StepTimeout(f"{self.engine.describe()}: {method} {path} got no answer within {timeout:.3g} s") \
                from None
        except aiohttp.ClientConnectorError as err:
            raise _Unsent(_excerpt(err)) from err
        what = f"{self.engine.describe()}: {method} {path} answered HTTP {resp.status}"
        if 300 <= resp.status < 400:
            raise BackendError(f"{what}, a redirect (Location: {_excerpt(resp.headers.get('Location', ''))!r}): "
                               "not followed, the agent calls the engine only at its own URL")
        if resp.status != 200:
            hint = ""
            if resp.status == 404:
                hint = (" (serve vLLM with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode)" if
                        self.engine.engine == ENGINE_VLLM else " (serve SGLang with --enable-memory-saver)")
            more = f" (a body over {MAX_REPLY_BYTES} bytes, read no further)" if cut else ""
            raise (NoSuchApi if resp.status == 404 else BackendError)(f"{what}: {_excerpt(data)}{more}{hint}")
        if cut:
            if method == "GET":
                raise BackendError(f"{what} with a body over {MAX_REPLY_BYTES} bytes (read no further): not an "
                                   f"answer of its API: {_excerpt(data)}")
            return None  # a sleep's or wake's 200: its body is not used
        try:
            return json.loads(data) if data.strip() else None
        except ValueError:
            return None


def _check_network_namespace(pids: Sequence[int], engine: AppEngine) -> None:
    """Raise FailedPrecondition when a process of the job runs in another network namespace
    than this agent (its loopback is not ours), or when that cannot be read."""
    mine = os.stat("/proc/self/ns/net")
    for pid in pids:
        try:
            theirs = os.stat(f"/proc/{pid}/ns/net")
        except FileNotFoundError:
            continue  # gone: nothing of it to move
        except PermissionError as err:
            raise FailedPrecondition(f"cannot read the network namespace of process {pid} ({err}): the agent "
                                     f"cannot tell whether {engine.url} is the job's engine") from err
        if (theirs.st_dev, theirs.st_ino) != (mine.st_dev, mine.st_ino):
            raise FailedPrecondition(
                f"process {pid} of the job runs in another network namespace than the node agent, so the agent "
                f"cannot reach its engine at {engine.url} (its loopback is the pod's); run the engine's pod with "
                "hostNetwork: true, or the agent in the job's network namespace (one-box mode)")


_Key = tuple[str, tuple[int, ...]]  # an engine: its URL and its processes


class AppBackend(Backend):
    """`engine` None: the node's backend `app`, to `bind` per step; `memory_probe`: NVML
    (`gpu_memory.gpus`; [] without NVML skips the memory check)."""

    name = "app"

    def __init__(self, engine: AppEngine | None = None, memory_probe: Callable[[], list[GpuInfo]] = gpus,
                 asleep: set[_Key] | None = None, awake: dict[_Key, dict[int, int]] | None = None) -> None:
        self.engine = engine
        self._probe = memory_probe
        # (URL, PIDs) of the engines this agent put to sleep and has not woken (shared by the
        # bound copies): a repeated checkpoint of one (a rollback's) sends nothing; a restarted
        # engine has other PIDs
        self._asleep: set[_Key] = set() if asleep is None else asleep
        # GPU bytes per PID each engine held awake, as NVML showed them before the last sleep
        # this agent sent and checked: what an engine that says it sleeps is measured against
        self._awake: dict[_Key, dict[int, int]] = {} if awake is None else awake

    def bind(self, app: AppEngine | None) -> Backend:
        if app is None:
            raise InvalidArgument("backend app needs the job's engine (the step's `app`: TimeSliceConfig app "
                                  "with engine and url)")
        return AppBackend(app, self._probe, self._asleep, self._awake)

    def _client(self) -> EngineClient:
        if self.engine is None:
            raise InvalidArgument("backend app needs the job's engine (bind it first)")
        return EngineClient(self.engine)

    def _bound(self, timeout: float) -> float:
        assert self.engine is not None
        return min(timeout, self.engine.timeoutSeconds) if timeout > 0 else self.engine.timeoutSeconds

    async def _bytes(self, pids: Sequence[int]) -> dict[int, int] | None:
        """GPU bytes per PID now; None without NVML."""
        found = await asyncio.to_thread(self._probe)
        if not found:
            return None
        wanted = set(pids)
        out = dict.fromkeys(pids, 0)
        for g in found:
            for pid, n in g.processes.items():
                if pid in wanted:
                    out[pid] += n
        return out

    async def checkpoint(self, pids: Sequence[int], timeout: float) -> list[ProcState]:
        client = self._client()
        engine = client.engine
        _check_network_namespace(pids, engine)
        bound = self._bound(timeout)
        t0 = time.monotonic()
        key = (engine.url, tuple(sorted(pids)))
        if key in self._asleep:
            log.info("app sleep engine=%s pids=%s: asleep already (this agent's sleep), nothing sent", engine.url,
                     list(pids))
            return [ProcState(p, CHECKPOINTED) for p in pids]
        async with engine_session() as session:
            said_asleep = await client.sleeping(session, bound)  # vLLM's word: checked below, never taken alone
            before = await self._bytes(pids)
            freed = self._freed_since_awake(key, before) if said_asleep else None
            if freed is not None:
                self._asleep.add(key)
                log.info("app sleep engine=%s pids=%s: asleep already by its word, and NVML shows %d bytes freed "
                         "since this agent saw it awake; nothing sent", engine.url, list(pids), sum(freed.values()))
                return [ProcState(p, CHECKPOINTED, freed.get(p, 0)) for p in pids]
            try:  # (to an engine that said it sleeps too: vLLM ignores a sleep while it sleeps)
                await client.sleep(session, bound)
            except (StepTimeout, BackendError) as err:
                raise await self._undo(session, client, bound, f"sleep of {engine.describe()} failed", err,
                                       said_asleep) from err
            after = await self._bytes(pids)
            if before is None or after is None:
                self._asleep.add(key)
                log.info("app sleep engine=%s pids=%s seconds=%.3f: GPU memory not verified (NVML unavailable), "
                         "bytes reported 0 (unknown)", engine.url, list(pids), time.monotonic() - t0)
                return [ProcState(p, CHECKPOINTED) for p in pids]
            held, left = sum(before.values()), sum(after.values())
            if held == 0:
                self._asleep.add(key)
                log.info("app sleep engine=%s pids=%s: GPU memory not verified (NVML shows none held by these "
                         "processes before the sleep)", engine.url, list(pids))
                return [ProcState(p, CHECKPOINTED) for p in pids]
            if not _freed_enough(before, after):
                word = ("; it had answered is_sleeping: true before this sleep was sent, and that is taken only "
                        "with its memory freed" if said_asleep else "")
                kept = BackendError(f"{engine.describe()} answered the sleep, but the GPU memory of the job's "
                                    f"processes {list(pids)} did not drop: {held} bytes before, {left} after (NVML; "
                                    f"at least {MIN_FREED_FRACTION:.0%} of what they held beyond {KEPT_BYTES} bytes "
                                    f"each must be freed){word}")
                raise await self._undo(session, client, bound, "checkpoint failed", kept, said_asleep)
        self._asleep.add(key)
        self._awake[key] = before
        log.info("app sleep engine=%s pids=%s freed=%d of %d bytes seconds=%.3f", engine.url, list(pids),
                 held - left, held, time.monotonic() - t0)
        return [ProcState(p, CHECKPOINTED, max(0, before[p] - after.get(p, 0))) for p in pids]

    def _freed_since_awake(self, key: _Key, now: dict[int, int] | None) -> dict[int, int] | None:
        """Bytes per PID freed since NVML last showed the engine awake to this agent (before a
        sleep it sent and checked), when that is enough for a sleep (`_freed_enough`); None when
        it is not, or cannot be told (no NVML, never seen awake)."""
        awake = self._awake.get(key)
        if now is None or not awake:
            return None
        if not any(awake.values()) or not _freed_enough(awake, now):
            return None
        return {p: max(0, awake.get(p, 0) - n) for p, n in now.items()}

    async def _undo(self, session: aiohttp.ClientSession, client: EngineClient, bound: float, what: str,
                    err: BackendError | StepTimeout, said_asleep: bool | None) -> BackendError | StepTimeout:
        """Wake the engine after a failed sleep (a vLLM engine that reports it is awake is
        left alone, and so is one that said it slept before the sleep was sent: as it was
        found); returns the error to raise, of `err`'s class, naming the undo's outcome."""
        if said_asleep:
            return type(err)(f"{what}: {err}; left as it was found (it said it slept before the sleep was sent: no "
                             "wake sent)")
        if isinstance(err, NoSuchApi):  # (a wake would be answered 404 too: "UNDO FAILED" for an engine never slept)
            return type(err)(f"{what}: {err}; nothing to undo (no such endpoint: the engine did not sleep)")
        try:
            if await client.sleeping(session, bound) is False:
                return type(err)(f"{what}: {err}; the engine reports it is awake")
            await client.wake(session, bound)
        except (StepTimeout, BackendError) as undo:
            log.error("app undo failed engine=%s: %s", client.engine.url, undo)
            return type(err)(f"{what}: {err}; UNDO FAILED, the engine may stay asleep: {undo}")
        return type(err)(f"{what}: {err}; woke it again")

    async def restore(self, pids: Sequence[int], timeout: float) -> list[ProcState]:
        client = self._client()
        _check_network_namespace(pids, client.engine)
        t0 = time.monotonic()
        async with engine_session() as session:
            try:
                await client.wake(session, self._bound(timeout))
            except OutcomeLost:  # with vLLM, ask whether the wake whose answer was lost happened
                if await client.sleeping(session, self._bound(timeout)) is not False:
                    raise
            self._asleep.discard((client.engine.url, tuple(sorted(pids))))
        log.info("app wake engine=%s pids=%s seconds=%.3f", client.engine.url, list(pids), time.monotonic() - t0)
        return [ProcState(p, RUNNING) for p in pids]

    async def state(self, pids: Sequence[int]) -> list[ProcState]:
        """vLLM: every PID `checkpointed` while the engine sleeps, else `running`; SGLang (no
        such query) and an unbound backend: `unknown`."""
        if self.engine is None:
            return [ProcState(p, UNKNOWN) for p in pids]
        async with engine_session() as session:
            asleep = await EngineClient(self.engine).sleeping(session, self.engine.timeoutSeconds)
        st = UNKNOWN if asleep is None else (CHECKPOINTED if asleep else RUNNING)
        return [ProcState(p, st) for p in pids]
