"""StateWriter: the thread that performs the orchestrator's state-file writes, off the event loop.

Owned by `StateFile` (state_file.py), which hands it one write at a time (a journal line
or a whole snapshot: `Journal.append`, `Journal.compact`) and learns of its end on the
event loop that handed it, with no loop turn of a future's own in between.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable

Write = Callable[[bytes], None]


class StateWriter:
    """`report(None | OSError)` is called on the loop that handed each write, once it ended
    (any exception a write raises is reported as an OSError). Call `put` and `stop` on the
    event loop."""

    def __init__(self, report: Callable[[OSError | None], None]) -> None:
        self._report = report
        self._queue: queue.SimpleQueue[tuple[Write, bytes] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop the thread reports to

    def put(self, write: Write, data: bytes) -> None:
        """Perform `write(data)` in the thread (started for the running loop; one of another
        loop, which reports to nobody, is stopped first)."""
        loop = asyncio.get_running_loop()
        if self._thread is not None and self.loop is not loop:
            self.stop()
        if self._thread is None:
            self.loop = loop
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

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        while (step := self._queue.get()) is not None:
            write, data = step
            err = None
            try:
                write(data)
            except Exception as exc:  # (a bug too must fail the waiting grants, never leave them waiting)
                err = exc if isinstance(exc, OSError) else OSError(f"{type(exc).__name__}: {exc}")
            try:
                loop.call_soon_threadsafe(self._report, err)
            except RuntimeError:  # the loop is closed: nobody waits any more
                return
