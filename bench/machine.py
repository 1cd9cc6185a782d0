"""What every benchmark shares: the machine it ran on, and how its JSON result is written."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import socket
import subprocess
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now, for a server a benchmark or test starts later: below the
    kernel's ephemeral range (`net.ipv4.ip_local_port_range`), which a port bound to 0 comes from
    and so do the local ports of every outgoing connection meanwhile (randomized schedules, seed
    170029: a job's engine found the port it was given taken). Raises OSError when none is found."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = random.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port of 127.0.0.1 below {low}")


def host_memory() -> dict[str, int]:
    """/proc/meminfo in bytes (Linux; {} elsewhere)."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, _, v = line.partition(":")
            parts = v.split()
            if parts and parts[0].isdigit():
                out[k] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


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
    except OSError:
        pass
    if "MemTotal" in (mem := host_memory()):
        info["mem_total_kib"] = mem["MemTotal"] // 1024
    if mem.get("HugePages_Total"):  # reserved huge pages: where `timeslice serve` puts its pinned pool
        info["huge_pages"] = {"reserved": mem["HugePages_Total"], "page_bytes": mem.get("Hugepagesize", 0)}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0:
            info["gpus"] = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def emit(result: dict[str, Any], out: str | None) -> None:
    """Add the machine and the time, print the result as JSON, and write it to `out`."""
    result = {**result, "machine": describe(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
