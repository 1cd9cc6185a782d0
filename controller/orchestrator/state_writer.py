"""StateWriter: the thread that writes the orchestrator's state file, off the event loop.

Owned by `StateFile` (state_file.py), which hands it numbered steps (a journal line, or a
whole snapshot) as soon as a caller waits for them, without waiting for the steps before
to end. The thread performs them in order and writes the journal lines that are queued
together with one `pwrite` (`Journal.append`), then reports each step's end to the loop in
one call. After a step failed, it refuses (`Refused`) every step handed to it before the
loop's `reset()`: those were built before the loop knew, and nothing is written after a
change that is not (the loop fails them with the failed one and writes their changes again).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from timeslice.controller.orchestrator.state_journal import Journal


@dataclass(frozen=True)
class Step:
    """`number`: the step's place in the order handed; `snapshot`: `data` is a whole
    snapshot (else one journal line, ending with a newline)."""

    number: int
    snapshot: bool
    data: bytes


class Refused(OSError):
    """A step not performed: one handed before it failed."""


_RESET = object()
Report = Callable[[list[tuple[int, OSError | None]]], None]


class StateWriter:
    """`report([(step number, None | OSError)])` is called on the event loop, in order.
    Call `put`, `reset` and `close` on the event loop."""

    def __init__(self, journal: Journal, report: Report) -> None:
        self._journal = journal
        self._report = report
        self._queue: queue.SimpleQueue[Step | object | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def put(self, step: Step) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(asyncio.get_running_loop(),),
                                            name="orchestrator-state-file", daemon=True)
            self._thread.start()
        self._queue.put(step)

    def reset(self) -> None:
        """The loop has taken in a failure: perform the steps handed from now on."""
        self._queue.put(_RESET)

    def close(self) -> None:
        """Stop the thread once the steps handed before are done (waits up to 5 s)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(5)
            self._thread = None

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        failed: OSError | None = None  # a step failed: refuse every step until the loop's reset
        while True:
            items = [self._queue.get()]
            while True:  # and those queued meanwhile: their lines share one write
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            results: list[tuple[int, OSError | None]] = []
            lines: list[Step] = []
            for item in items:
                if item is None or item is _RESET or not isinstance(item, Step) or item.snapshot:
                    failed = self._write_lines(lines, results, failed)
                if item is None:
                    break
                if item is _RESET:
                    failed = None
                elif isinstance(item, Step) and failed is not None:
                    results.append((item.number, Refused(f"not written: an earlier write failed ({failed})")))
                elif isinstance(item, Step) and item.snapshot:
                    failed = self._perform(self._journal.compact, item.data)
                    results.append((item.number, failed))
                elif isinstance(item, Step):
                    lines.append(item)
            failed = self._write_lines(lines, results, failed)
            if results:
                try:
                    loop.call_soon_threadsafe(self._report, results)
                except RuntimeError:  # the loop is closed: nobody waits any more
                    return
            if None in items:
                return

    def _write_lines(self, lines: list[Step], results: list[tuple[int, OSError | None]],
                     failed: OSError | None) -> OSError | None:
        """Append `lines` (then empty it) in one write; their results go to `results`."""
        if not lines:
            return failed
        failed = self._perform(self._journal.append, b"".join(s.data for s in lines))
        results += [(s.number, failed) for s in lines]
        lines.clear()
        return failed

    @staticmethod
    def _perform(write: Callable[[bytes], None], data: bytes) -> OSError | None:
        try:
            write(data)
        except Exception as exc:  # (a bug too must fail the waiting grants, never leave them waiting)
            return exc if isinstance(exc, OSError) else OSError(f"{type(exc).__name__}: {exc}")
        return None
