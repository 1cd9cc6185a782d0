"""One-box files other local users must not reach (issue 23, item 3): `timeslice acquire`'s
hold files and `timeslice serve`'s socket live in directories that no other user owns or can
write (`driver/private_paths.py`). Another user is a real uid: the tests chown as root."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from pathlib import Path

import pytest
from timeslice.driver.peercred import UnixFront
from timeslice.driver.private_paths import private_dir

OTHER_UID = 54321  # no user of this machine: "another local user"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's needs root")


def test_missing_directories_are_made_private_and_a_sticky_shared_parent_is_fine(short_tmp: Path) -> None:
    shared = short_tmp / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: writable by all, sticky
    made = private_dir(shared / "timeslice-1000" / "run")
    assert made.is_dir() and stat.S_IMODE(made.stat().st_mode) == 0o700
    assert stat.S_IMODE((shared / "timeslice-1000").stat().st_mode) == 0o700


@as_root
def test_a_directory_another_user_made_first_is_refused(short_tmp: Path) -> None:
    planted = short_tmp / "timeslice-0"
    planted.mkdir(mode=0o700)
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(OSError, match=f"belongs to uid {OTHER_UID}"):
        private_dir(planted)
    with pytest.raises(OSError, match=f"belongs to uid {OTHER_UID}"):
        private_dir(planted / "timeslice")  # below it: refused too, and nothing is made there
    assert not (planted / "timeslice").exists()


def test_a_planted_symbolic_link_and_a_directory_others_can_write_are_refused(short_tmp: Path) -> None:
    victim = short_tmp / "victim"
    victim.mkdir(mode=0o700)
    (short_tmp / "timeslice-0").symlink_to(victim)
    with pytest.raises(OSError, match="is a symbolic link"):
        private_dir(short_tmp / "timeslice-0")
    open_dir = short_tmp / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(OSError, match="writable by other users"):
        private_dir(open_dir)


async def test_acquire_refuses_a_planted_hold_directory_and_writes_nothing(short_tmp: Path) -> None:
    """Without $XDG_RUNTIME_DIR in its place a planted link: `acquire` refused to follow it
    (it overwrote the victim's own file through it)."""
    victim = short_tmp / "victim"
    victim.mkdir(mode=0o700)
    runtime = short_tmp / "runtime"
    runtime.mkdir(mode=0o700)
    (runtime / f"timeslice-{os.getuid()}").symlink_to(victim)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "TIMESLICE_ORCHESTRATOR": "unix:///nonexistent.sock"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "timeslice.cli.main", "acquire", "--job", "a",
                                                "--group", "g", stderr=asyncio.subprocess.PIPE, env=env)
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 2 and b"is a symbolic link" in err, err
    assert list(victim.iterdir()) == []


@as_root
async def test_serve_will_not_bind_its_socket_in_a_directory_another_user_owns(short_tmp: Path) -> None:
    planted = short_tmp / "timeslice-1000"
    planted.mkdir(mode=0o755)
    os.chown(planted, OTHER_UID, OTHER_UID)  # they could replace the socket with their own server
    with pytest.raises(OSError, match=f"belongs to uid {OTHER_UID}"):
        await UnixFront(planted / "orchestrator.sock").bind()
    assert not (planted / "orchestrator.sock").exists()
