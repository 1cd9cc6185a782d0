"""`stop_event()`: an asyncio.Event set by SIGINT or SIGTERM, for every server's main loop.

Owned by the driver package; used by `timeslice orchestrator`, `kubelet-plugin` and
`controller`.
"""

from __future__ import annotations

import asyncio
import signal


def stop_event() -> asyncio.Event:
    """An event the running loop sets on SIGINT/SIGTERM (call inside the loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
