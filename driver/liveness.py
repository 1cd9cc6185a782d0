"""Liveness for a kubelet `exec` probe: a heartbeat file touched while the process works.

Owned by the server process (`timeslice controller`, `timeslice kubelet-plugin` with
`--liveness-file`). `Heartbeat` runs on the server's event loop and sets the file's
modification time every `interval` seconds while every check passes; the pod's
livenessProbe (manifests/base) runs `python3 -m timeslice.driver.liveness FILE MAX_AGE`,
which exits 1 when the file is older than MAX_AGE seconds. So a blocked event loop, a
stopped process, or a background task that died (a check fails) makes the kubelet restart
the container. A file, not a port: a standby controller serves no port, and two replicas
on one host network (the local cluster) could not share one.

A check is a callable that returns None when healthy, else why not (one line); it runs on
the loop, so it must not block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from timeslice.driver.tasks import cancel_and_wait

log = logging.getLogger("timeslice.liveness")

Check = Callable[[], "str | None"]


def tasks_alive(tasks: Callable[[], Iterable[asyncio.Task[Any] | None]]) -> Check:
    """A check that fails once any task `tasks()` returns has ended (None: not started)."""
    def check() -> str | None:
        for t in tasks():
            if t is not None and t.done():
                err = None if t.cancelled() else t.exception()
                return f"task {t.get_name()} ended" + (f": {err!r}" if err else "")
        return None
    return check


class Heartbeat:
    """Touch `path` every `interval` seconds while all `checks` pass (seconds; the probe's
    MAX_AGE should be a few intervals). Failing checks are logged once each time the set
    of failures changes. The file is created at `start()`; OSError if it cannot be."""

    def __init__(self, path: Path, checks: Mapping[str, Check], interval: float = 5.0) -> None:
        self.path = path
        self._checks = checks
        self._interval = interval
        self._task: asyncio.Task[None] | None = None
        self.failing: list[str] = []

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="liveness")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        with contextlib.suppress(OSError):
            self.path.unlink()

    def beat(self) -> bool:
        """Run the checks; touch the file when all pass. Returns whether it did."""
        failing = []
        for name, check in self._checks.items():
            try:
                why = check()
            except Exception as err:  # a check that cannot tell counts as failing
                why = f"check failed: {err!r}"
            if why:
                failing.append(f"{name}: {why}")
        if failing != self.failing:
            if failing:
                log.error("not live (the liveness probe will restart this container): %s", "; ".join(failing))
            else:
                log.info("live again")
            self.failing = failing
        if failing:
            return False
        try:
            os.utime(self.path)
        except OSError as err:
            log.error("liveness file %s not touched: %s", self.path, err)
            return False
        return True

    async def _run(self) -> None:
        while True:
            self.beat()
            await asyncio.sleep(self._interval)


def main(argv: list[str]) -> int:
    """`python3 -m timeslice.driver.liveness FILE MAX_AGE`: 0 when FILE was touched within
    MAX_AGE seconds, else 1 with the reason on stderr (the kubelet shows it in an Event)."""
    path, max_age = Path(argv[0]), float(argv[1])
    try:
        age = time.time() - path.stat().st_mtime
    except OSError as err:
        print(f"no heartbeat: {err}", file=sys.stderr)
        return 1
    if age > max_age:
        print(f"heartbeat {path} is {age:.0f} s old (more than {max_age:.0f} s): the process is stuck or a part "
              "of it stopped (see its log)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
