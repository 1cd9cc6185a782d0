"""The orchestrator's state file as a snapshot plus a journal (issue 24: persistence per
group, off the event loop, one write per loop turn): what a crash, a full disk or a
removed file leaves, in real processes where the fault is real (SIGKILL, RLIMIT_FSIZE)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from timeslice.controller.orchestrator import state_format
from timeslice.controller.orchestrator.state_file import StateFile

REPO = Path(__file__).resolve().parent.parent

# Records one change after another in 20 groups, each waited for, and prints its number once
# `durable()` said it is on disk. A small COMPACT_MIN makes it compact the journal many times.
WRITER = """
import asyncio, sys
from pathlib import Path
from timeslice.controller.orchestrator import state_journal
from timeslice.controller.orchestrator.state_file import StateFile
state_journal.COMPACT_MIN = 4096

async def main():
    state = StateFile(Path(sys.argv[1]))
    i = 0
    while True:
        i += 1
        state.reserve(f"g{i % 20}", i)
        state.record(f"g{i % 20}", f"job-{i}", [], [f"job-{i}"])
        await state.durable()
        print(i, flush=True)

asyncio.run(main())
"""


def test_every_change_reported_written_survives_a_sigkill_at_any_point_of_writes_and_compactions(tmp_path) -> None:
    """SIGKILL of the writing process at 12 points (mid-append, mid-compaction, between):
    every change `durable()` reported written is in what the next start loads, and the state
    loads (a torn last line is dropped, never refused)."""
    path = tmp_path / "state.json"
    for kill_after in (1, 7, 40, 90, 150, 260, 400, 555, 700, 820, 1000, 1300):
        acked = 0
        with subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO) as child:
            assert child.stdout is not None
            for line in child.stdout:
                acked = int(line)
                if acked >= kill_after:
                    break
            child.send_signal(signal.SIGKILL)
        assert acked >= kill_after, f"the writer ended early (rc {child.returncode})"
        # the last acknowledged change of each group, from this run (each run starts again at 1)
        last = {f"g{i % 20}": i for i in range(1, acked + 1)}
        state = StateFile(path)
        for group, i in last.items():
            holder = state.placement(group).holder
            assert holder is not None and int(holder.removeprefix("job-")) >= i, (kill_after, group, holder, i)
            assert state.start(group) > i  # the epoch block reserved before it is never lost
        state.close()
        path.unlink()
        state_format.journal_path(path).unlink()


FULL_DISK = """
import asyncio, os, resource, signal, sys
from pathlib import Path
from timeslice.controller.orchestrator import state_format
from timeslice.controller.orchestrator.state_file import StateFile

async def main():
    path = Path(sys.argv[1])
    state = StateFile(path)
    state.record("g", "a", [], ["a"])
    await state.durable()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, or is cut short
    size = state_format.journal_path(path).stat().st_size
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, resource.RLIM_INFINITY))
    state.record("g", "b-" + "x" * 200, [], ["b"])
    try:
        await state.durable()
        print("written", flush=True)
    except OSError as err:
        print("failed", err.errno, flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    state.record("g", "c", [], ["c"])
    await state.durable()
    print("then written", flush=True)

asyncio.run(main())
"""


def test_a_write_the_disk_cut_short_is_cut_off_and_written_again_whole(tmp_path) -> None:
    """A journal line cut short by a full disk (RLIMIT_FSIZE, a real short write) fails its
    callers, and the next write first cuts it off: the journal holds whole lines only, and
    the state after the disk is back is the latest."""
    path = tmp_path / "state.json"
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(path)], capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["failed 27", "then written"]  # EFBIG
    lines = state_format.journal_path(path).read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(json.loads(line) for line in lines[:-1])
    assert StateFile(path).placement("g").holder == "c"


def test_a_torn_last_line_is_dropped_and_a_bad_line_before_others_is_refused(tmp_path, caplog) -> None:
    path = tmp_path / "state.json"
    state = StateFile(path)
    state.close()
    journal = state_format.journal_path(path)
    journal.write_text('{"seq": 1, "epochs": {"g": 1000}, "groups": {"g": {"holder": "a"}}}\n'
                       '{"seq": 2, "epochs": {}, "groups": {"g": {"hol')
    assert StateFile(path).placement("g").holder == "a"
    assert "its last line is torn" in caplog.text
    journal.write_text('{"seq": 1, "epochs": {"g": 1000}, "groups": {"g": {"holder": "a"}}}\n'
                       '{"seq": 2, "epochs": {}, "groups": {"g": {"hol\n'
                       '{"seq": 3, "epochs": {}, "groups": {"g": {"holder": "c"}}}\n')
    with pytest.raises(ValueError, match=r"state.json.journal is unreadable \(line 2: .*move it away"):
        StateFile(path)
    journal.write_text('{"seq": 2, "groups": {"g": {"holder": "b"}}}\n{"seq": 2, "groups": {"g": {"holder": "c"}}}\n')
    with pytest.raises(ValueError, match=r"line 2: change 2 after 2"):
        StateFile(path)


def test_journal_lines_a_compaction_already_has_are_not_applied_again(tmp_path) -> None:
    """A crash after a compaction wrote its snapshot but before it emptied the journal: the
    old lines (seq up to the snapshot's) would set older values; they are skipped."""
    path = tmp_path / "state.json"
    path.write_text('{"apiVersion": "timeslice.dev/orchestrator-state/v1", "seq": 5, "epochs": {"g": 3000}, '
                    '"groups": {"g": {"holder": "new"}}}')
    state_format.journal_path(path).write_text(
        '{"seq": 4, "epochs": {"g": 2000}, "groups": {"g": {"holder": "old"}}}\n'
        '{"seq": 5, "epochs": {}, "groups": {"g": {"holder": "new"}}}\n'
        '{"seq": 6, "epochs": {"h": 1000}, "groups": {}}\n')
    state = StateFile(path)
    assert (state.placement("g").holder, state.start("g"), state.start("h")) == ("new", 3000, 1000)


@pytest.mark.parametrize("how", ["journal removed", "journal renamed", "journal linked elsewhere, then removed",
                                 "snapshot removed", "snapshot renamed"])
async def test_state_files_removed_or_moved_under_a_running_orchestrator_are_written_again_whole(
        tmp_path, caplog, how) -> None:
    """Someone removes or moves the state files while the orchestrator runs (review of issue
    24: what it appended went to a file the next start does not read, and a missing snapshot
    made the start empty the journal): the next write notices, logs it, and writes the whole
    state again; the next start has every change reported written."""
    path = tmp_path / "state.json"
    journal = state_format.journal_path(path)
    state = StateFile(path)
    state.reserve("g", 1)
    state.record("g", "a", [], ["a"])
    await state.durable()
    if how == "journal removed":
        journal.unlink()
    elif how == "journal renamed":
        journal.rename(tmp_path / "inspected")
    elif how == "journal linked elsewhere, then removed":
        os.link(journal, tmp_path / "backup")
        journal.unlink()
    elif how == "snapshot removed":
        path.unlink()
    else:
        path.rename(tmp_path / "inspected")
    state.reserve("g", 2000)
    state.record("h", "b", [], ["b"])
    await state.durable()
    assert "was removed or replaced: the whole state is written again" in caplog.text
    again = StateFile(path)
    assert (again.placement("g").holder, again.placement("h").holder, again.start("g")) == ("a", "b", 3000)
    again.close()
    state.close()


async def test_a_file_removed_while_a_write_runs_holds_its_callers_until_the_whole_state_is_written(
        tmp_path, monkeypatch) -> None:
    """The journal removed while a line is being written to it: the line lands in a file the
    next start does not read, so its callers are told only once the whole state is written
    again (review of issue 24: an idle orchestrator killed then lost that change)."""
    path = tmp_path / "state.json"
    state = StateFile(path)
    real = os.pwrite

    def removed_meanwhile(fd: int, data: bytes, offset: int) -> int:
        written = real(fd, data, offset)
        state_format.journal_path(path).unlink()
        return written

    monkeypatch.setattr(os, "pwrite", removed_meanwhile)
    state.reserve("g", 1)
    await state.durable()
    monkeypatch.setattr(os, "pwrite", real)
    again = StateFile(path)
    assert again.start("g") == 1001
    again.close()
    state.close()


def test_a_journal_without_its_snapshot_is_refused_not_emptied(tmp_path) -> None:
    path = tmp_path / "state.json"
    state = StateFile(path)
    state.close()
    state_format.journal_path(path).write_text('{"seq": 1, "epochs": {"g": 1000}}\n')
    path.unlink()
    with pytest.raises(ValueError, match=r"is missing, but its journal .* is not empty: put the snapshot back"):
        StateFile(path)
    assert state_format.journal_path(path).stat().st_size  # kept


HOLDER = """
import sys
from pathlib import Path
from timeslice.controller.orchestrator.state_file import StateFile
state = StateFile(Path(sys.argv[1]))
print("ready", flush=True)
sys.stdin.readline()  # holds the file until the test closes its stdin
"""


def test_a_second_orchestrator_on_the_same_state_file_is_refused(tmp_path) -> None:
    """Two orchestrator processes on one state file would write over each other's lines and
    repeat fencing epochs (review of issue 24): the second refuses to start, naming why."""
    path = tmp_path / "state.json"
    with subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, cwd=REPO) as first:
        assert first.stdout is not None and first.stdout.readline().strip() == "ready"
        code = "import sys; from pathlib import Path; from timeslice.controller.orchestrator.state_file import " \
               "StateFile; StateFile(Path(sys.argv[1]))"
        second = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=REPO,
                                timeout=60)
        assert first.stdin is not None
        first.stdin.close()
        assert first.wait(60) == 0
    assert second.returncode != 0 and "is in use by another orchestrator" in second.stderr
    StateFile(path).close()  # free again once the first is gone


def test_a_dropped_last_line_is_kept_beside_the_journal(tmp_path) -> None:
    """A last line that does not parse is dropped as torn, but it may be someone's edit: the
    journal is kept as <journal>.torn-<time> before the start empties it."""
    path = tmp_path / "state.json"
    StateFile(path).close()
    state_format.journal_path(path).write_text('{"seq": 1, "epochs": {"g": 1000}}\n{"seq": 2, "epochs": {"g": 2x}}\n')
    state = StateFile(path)
    assert state.start("g") == 1000
    kept = list(tmp_path.glob("state.json.journal.torn-*"))
    assert len(kept) == 1 and b"2x" in kept[0].read_bytes()
    state.close()


def test_one_state_file_serves_a_second_event_loop(tmp_path) -> None:
    """A StateFile used from a new event loop (an in-process restart): its writer thread of
    the old loop reported to nobody and every later grant waited for ever (review of issue
    24). It starts a writer for the new loop."""
    path = tmp_path / "state.json"
    state = StateFile(path)

    async def change(group: str) -> None:
        state.record(group, "a", [], ["a"])
        await asyncio.wait_for(state.durable(), 10)

    asyncio.run(change("g1"))
    asyncio.run(change("g2"))
    state.close()
    again = StateFile(path)
    assert (again.placement("g1").holder, again.placement("g2").holder) == ("a", "a")
    again.close()


async def test_the_changes_of_one_loop_turn_share_one_line_of_only_the_groups_that_changed(tmp_path) -> None:
    """Per group: 1000 groups, 3 of them change in one loop turn: one journal line with those
    3 (not the whole state)."""
    path = tmp_path / "state.json"
    threads = set(threading.enumerate())
    state = StateFile(path)
    for i in range(1000):
        state.record(f"g{i}", "a", [], [])
    await state.durable()
    before = state_format.journal_path(path).read_bytes().count(b"\n")
    for i in (5, 500, 999):
        state.record(f"g{i}", "b", [], ["b"])
    await asyncio.gather(state.durable(), state.durable())
    lines = state_format.journal_path(path).read_bytes().split(b"\n")[:-1]
    assert len(lines) == before + 1
    assert set(json.loads(lines[-1])["groups"]) == {"g5", "g500", "g999"}
    state.close()
    assert not set(threading.enumerate()) - threads  # its writer thread ended


async def test_a_failed_write_fails_those_waiting_for_the_next_and_their_changes_are_written_again(
        tmp_path, monkeypatch) -> None:
    """A write fails while changes wait for the next: their callers fail with it, unwritten
    (nothing is written after a change that is not), and the next write has all the changes."""
    from timeslice.controller.orchestrator.state_journal import Journal

    path = tmp_path / "state.json"
    state = StateFile(path)
    entered, gate = threading.Event(), threading.Event()
    real = Journal.append

    def first_fails(journal: Journal, line: bytes) -> None:  # the disk fills during the first write
        entered.set()
        assert gate.wait(30)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Journal, "append", first_fails)
    state.record("g1", "a", [], ["a"])
    first = state.durable()
    assert await asyncio.to_thread(entered.wait, 30)
    state.record("g2", "b", [], ["b"])
    second = state.durable()  # made while the first is in flight
    monkeypatch.setattr(Journal, "append", real)
    gate.set()
    for fut in (first, second):
        with pytest.raises(OSError, match="No space left"):
            await fut
    assert b"g2" not in state_format.journal_path(path).read_bytes()
    await state.durable()
    again = StateFile(path)
    assert (again.placement("g1").holder, again.placement("g2").holder) == ("a", "b")
    again.close()
    state.close()
