"""Process facts from /proc: used by the node agent and its `freeze` backend."""

from __future__ import annotations

from timeslice.driver.errors import ProcessGone


def proc_state(pid: int) -> str:
    """The one-letter state of `pid` from /proc (R, S, D, T, t, Z, ...); raises ProcessGone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessGone(f"process {pid} does not exist") from None
    # comm (field 2) may hold spaces and parentheses: the state follows the last ')'.
    return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3].decode()
