"""driver/liveness.py: the heartbeat file a livenessProbe checks (issue 12, item 1)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

from timeslice.driver.liveness import Heartbeat, main, tasks_alive


async def test_the_file_is_touched_while_every_check_passes_and_not_once_a_task_ended(tmp_path, caplog) -> None:
    path = tmp_path / "live"
    worker = asyncio.create_task(asyncio.Event().wait(), name="worker")
    beat = Heartbeat(path, {"tasks": tasks_alive(lambda: [worker, None])}, interval=3600)
    beat.start()
    try:
        os.utime(path, (1, 1))
        assert beat.beat() and path.stat().st_mtime > 1

        async def boom() -> None:
            raise RuntimeError("reflector died")

        worker = asyncio.create_task(boom(), name="reflector-pods")
        await asyncio.wait({worker})
        os.utime(path, (1, 1))
        assert not beat.beat() and path.stat().st_mtime == 1
        assert beat.failing == ["tasks: task reflector-pods ended: RuntimeError('reflector died')"]
        assert "not live" in caplog.text and "reflector died" in caplog.text
    finally:
        await beat.stop()
    assert not path.exists()


async def test_a_check_that_raises_counts_as_failing(tmp_path) -> None:
    beat = Heartbeat(tmp_path / "live", {"sockets": lambda: 1 / 0})
    beat.start()
    try:
        assert not beat.beat() and beat.failing == ["sockets: check failed: ZeroDivisionError('division by zero')"]
    finally:
        await beat.stop()


def test_the_probe_command_fails_on_an_old_or_missing_file(tmp_path, capsys) -> None:
    path = tmp_path / "live"
    assert main([str(path), "30"]) == 1 and "no heartbeat" in capsys.readouterr().err
    path.touch()
    assert main([str(path), "30"]) == 0
    os.utime(path, (time.time() - 60, time.time() - 60))
    assert main([str(path), "30"]) == 1 and "60 s old" in capsys.readouterr().err
    # as the probe runs it: a fresh interpreter, the module alone
    r = subprocess.run([sys.executable, "-m", "timeslice.driver.liveness", str(path), "30"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "heartbeat" in r.stderr
