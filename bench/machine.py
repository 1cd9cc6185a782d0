"""Describe the machine a benchmark ran on (recorded in every result JSON)."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any


def describe() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname_kind": os.environ.get("TIMESLICE_MACHINE", ""),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(next(ln.split()[1] for ln in f if ln.startswith("MemTotal")))
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0:
            info["gpus"] = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info
