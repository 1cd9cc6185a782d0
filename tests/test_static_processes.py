"""StaticProcessResolver with `descendants`: a launcher's job is also the processes it starts
(torchrun's ranks, issue 14), found on /proc at each call."""

from __future__ import annotations

import os
import signal

import pytest
from timeslice.driver.errors import NotFound
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver

from tests.conftest import python_child

# A launcher that starts a rank, which starts a helper; each prints its pid once started.
LAUNCHER = """
    import subprocess, sys, time
    helper = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"
    rank = ("import os, subprocess, sys; print(os.getpid(), flush=True); "
            f"p = subprocess.Popen([sys.executable, '-c', {helper!r}]); p.wait()")
    p = subprocess.Popen([sys.executable, "-c", rank])
    p.wait()
"""


async def test_a_launchers_job_is_it_and_every_live_descendant(children) -> None:
    launcher = python_child(LAUNCHER, start_new_session=True)
    children.append(launcher)
    try:
        rank, helper = int(launcher.stdout.readline()), int(launcher.stdout.readline())  # both started
        resolver = StaticProcessResolver({"job": [launcher.pid]}, descendants=True)
        assert await resolver.pids("job") == [launcher.pid, rank, helper]
        assert await StaticProcessResolver({"job": [launcher.pid]}).pids("job") == [launcher.pid]
        with pytest.raises(NotFound):
            await resolver.pids("other")
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
