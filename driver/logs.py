"""Logging setup for the servers: `key=value` lines on stderr.

Owned by the driver package; called once by each entry point (`timeslice ...`).
"""

from __future__ import annotations

import logging
import sys


def setup(level: str = "INFO") -> None:
    """Configure the root logger: `time level logger message` lines, message carrying key=value."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("grpc").setLevel(logging.WARNING)
