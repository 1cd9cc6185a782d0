"""`stop_event()`: an asyncio.Event set by SIGINT, SIGTERM or SIGHUP, for every server's main loop.

Owned by the driver package; used by `timeslice orchestrator`, `kubelet-plugin` and
`controller`.
"""

from __future__ import annotations

import asyncio
import signal


def stop_event() -> asyncio.Event:
    """An event the running loop sets on SIGINT/SIGTERM, and on SIGHUP: the terminal a server
    was started from (`timeslice serve &`) closed, whose default action ended it with no
    clean-up, leaving the jobs it froze stopped (call inside the loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    return stop
