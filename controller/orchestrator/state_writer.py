"""StateWriter: performs the orchestrator's state-file writes, on the event loop while the
disk is fast, else in a thread of its own.

Owned by `StateFile` (state_file.py), which hands it one write at a time (a journal line
or a whole snapshot: `Journal.append`, `Journal.compact`) and learns of its end on the
event loop that handed it, with no loop turn of a future's own in between. A journal line
is appended on the loop (one `pwrite` of a few hundred bytes: ~0.2 ms on a local disk,
where a thread's hand-off costs a grant GIL waits and loop turns: `bench/handoff.py
--state-file`); one that took longer than `inline_seconds` sends the next ones to the
thread for `INLINE_RETRY_SECONDS`, so a slow disk does not stall the loop at every grant.
A snapshot is always written in the thread (a whole file, renamed and fsync'd).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger("timeslice.orchestrator")
Write = Callable[[bytes], None]
INLINE_SECONDS = 0.002  # an append on the loop that took longer sends the next ones to the thread ...
INLINE_RETRY_SECONDS = 10.0  # ... for this long


class StateWriter:
    """`report(None | OSError)` is called on the loop that handed each write, once it ended
    (any exception a write raises is reported as an OSError): at once, from `put`, for an
    append done on the loop; a loop turn later for one that failed there (never inside the
    caller's own step). `inline_seconds`: 0 hands every write to the thread. Call `put` and
    `stop` on the event loop."""

    def __init__(self, report: Callable[[OSError | None], None], inline_seconds: float = INLINE_SECONDS) -> None:
        self._report = report
        self._inline_seconds = inline_seconds
        self._inline_after = 0.0  # (monotonic seconds) appends run on the loop again from then
        self._queue: queue.SimpleQueue[tuple[Write, bytes] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None  # the loop the thread reports to
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop the last write handed reports to

    def put(self, write: Write, data: bytes, append: bool = False) -> None:
        """Perform `write(data)`: on the loop when `append` (a journal line) and the disk has
        been fast, else in the thread (started for the running loop; one of another loop,
        which reports to nobody, is stopped first)."""
        loop = self.loop = asyncio.get_running_loop()
        if append and self._inline_seconds and time.monotonic() >= self._inline_after:
            self._write_here(loop, write, data)
            return
        if self._thread is not None and self._thread_loop is not loop:
            self.stop()
        if self._thread is None:
            self._thread_loop = loop
            self._thread = threading.Thread(target=self._run, args=(loop,), name="orchestrator-state-file",
                                            daemon=True)
            self._thread.start()
        self._queue.put((write, data))

    def stop(self) -> None:
        """Stop the thread once the write handed before is done (waits up to 5 s)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(5)
            self._thread = None

    def _write_here(self, loop: asyncio.AbstractEventLoop, write: Write, data: bytes) -> None:
        start = time.monotonic()
        try:
            write(data)
        except Exception as exc:
            loop.call_soon(self._report, _os_error(exc))
            return
        finally:
            if (took := time.monotonic() - start) > self._inline_seconds:
                self._inline_after = start + INLINE_RETRY_SECONDS
                log.warning("orchestrator state journal: an append took %.4f s on the event loop; the next ones for "
                            "%.0f s go to the writer thread", took, INLINE_RETRY_SECONDS)
        self._report(None)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        while (step := self._queue.get()) is not None:
            write, data = step
            err = None
            try:
                write(data)
            except Exception as exc:  # (a bug too must fail the waiting grants, never leave them waiting)
                err = _os_error(exc)
            try:
                loop.call_soon_threadsafe(self._report, err)
            except RuntimeError:  # the loop is closed: nobody waits any more
                return


def _os_error(exc: Exception) -> OSError:
    return exc if isinstance(exc, OSError) else OSError(f"{type(exc).__name__}: {exc}")
