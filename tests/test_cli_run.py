"""`timeslice run -- CMD`, `timeslice acquire` and `timeslice release` (issue 13, item 4)
against a real orchestrator server: commands of two jobs never run at once, CMD's status is
the exit status, a hold outlives `acquire` until `release`, and the documented codes for a
grant that does not come in time and for a command that cannot start."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import signal
import sys
from collections.abc import Iterator

import grpc
import pytest
from timeslice import AsyncTimeSliceOrchestratorClient
from timeslice.v1 import orchestrator_pb2 as pb
from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

from tests.conftest import eventually

# CMD: append (job, start, end) to a file around a short piece of work.
WORK = ("import json, sys, time; t0 = time.time(); time.sleep(0.3); "
        "open(sys.argv[1], 'a').write(json.dumps([sys.argv[2], t0, time.time()]) + '\\n')")


@pytest.fixture(autouse=True)
def no_holder_left(tmp_path) -> Iterator[None]:
    """A test that fails midway must not leave a holder process running."""
    yield
    with contextlib.suppress(OSError, ValueError, KeyError):
        os.kill(json.loads((tmp_path / "hold.json").read_text())["pid"], signal.SIGKILL)


async def timeslice_run(target: str, job: str, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "timeslice.cli.main", "run", "--target", target, "--job", job, "--group", "g", *args,
        stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, err.decode()


async def test_commands_of_different_jobs_never_run_at_once(target, tmp_path) -> None:
    """(Two runs of one job share its hold, as a job's processes do.)"""
    log = tmp_path / "spans"
    runs = [timeslice_run(target, job, "--", sys.executable, "-c", WORK, str(log), job) for job in "abcd"]
    assert [rc for rc, _ in await asyncio.gather(*runs)] == [0, 0, 0, 0]
    spans = sorted((json.loads(line) for line in log.read_text().splitlines()), key=lambda s: s[1])
    assert len(spans) == 4
    for (_, _, end), (_, start, _) in itertools.pairwise(spans):
        assert start >= end, spans


# CMD that leaves a worker running and exits at once: the worker marks a file when it starts, then
# appends ("a", start, end) around a short piece of work.
LEAVES_A_WORKER = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                   "'import json, sys, time; t0 = time.time(); open(sys.argv[2], \"w\").close(); time.sleep(0.6); "
                   "open(sys.argv[1], \"a\").write(json.dumps([\"a\", t0, time.time()]) + chr(10))', *sys.argv[1:]])")


async def test_processes_a_command_leaves_running_keep_its_hold_until_they_end(target, tmp_path) -> None:
    """A helper's attack: `timeslice run --job a -- sh -c 'worker &'` released when the shell
    exited, so the worker computed through the next job's hold (and its job, left, was never
    stopped again). Like flock(1), the hold lasts until what CMD left running has ended."""
    log, started = tmp_path / "spans", tmp_path / "worker-started"
    a = asyncio.create_task(timeslice_run(target, "a", "--", sys.executable, "-c", LEAVES_A_WORKER, str(log),
                                          str(started)))
    await eventually(started.exists, timeout=60, what="a's worker started")
    rc_b, _ = await timeslice_run(target, "b", "--", sys.executable, "-c", WORK, str(log), "b")
    rc_a, err_a = await a
    assert (rc_a, rc_b) == (0, 0), err_a
    (_, _, a_end), (_, b_start, _) = sorted((json.loads(line) for line in log.read_text().splitlines()),
                                            key=lambda s: s[1])
    assert b_start >= a_end, log.read_text()  # b never ran while a's worker did
    assert "left processes" in err_a, err_a


async def test_the_commands_status_is_the_exit_status(target) -> None:
    assert (await timeslice_run(target, "a", "--", "sh", "-c", "exit 3"))[0] == 3
    assert (await timeslice_run(target, "a", "--", "sh", "-c", "kill -TERM $$"))[0] == 128 + 15
    async with grpc.aio.insecure_channel(target) as ch:
        before = (await pb_grpc.OrchestratorStub(ch).GetGroupStatus(pb.GetGroupStatusRequest(group_id="g"))).grants
        rc, err = await timeslice_run(target, "a", "--", "/nonexistent/cmd")
        assert rc == 127 and "cannot start /nonexistent/cmd" in err
        after = (await pb_grpc.OrchestratorStub(ch).GetGroupStatus(pb.GetGroupStatusRequest(group_id="g"))).grants
    assert after == before  # a command that cannot start takes no grant (a new-user try found one taken)


async def test_the_command_of_run_job_is_that_jobs_as_its_environment_says(target, tmp_path) -> None:
    """A helper's attack on a standalone node: `timeslice run --job a -- CMD` started CMD with no
    TIMESLICE_JOB, so the node agent found none of job a's processes to stop, and CMD computed
    beside the next holder once a's lease lapsed. CMD carries the job it runs for; `acquire
    --job`, whose script's next commands it cannot name, says so."""
    out = tmp_path / "job"
    env = {k: v for k, v in os.environ.items() if k != "TIMESLICE_JOB"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "timeslice.cli.main", "run", "--target", target, "--job", "a", "--group", "g", "--",
        "sh", "-c", f'echo "$TIMESLICE_JOB" > {out}', env=env)
    assert await asyncio.wait_for(proc.wait(), 120) == 0
    assert out.read_text() == "a\n"
    hold = ["--job", "a", "--group", "g", "--hold-file", str(tmp_path / "hold.json")]
    rc, err = await timeslice("acquire", "--target", target, *hold, env=env)
    assert rc == 0 and "export TIMESLICE_JOB=a" in err, err
    assert (await timeslice("release", *hold, env=env))[0] == 0
    rc, err = await timeslice("acquire", "--target", target, *hold, env={**env, "TIMESLICE_JOB": "a"})
    assert rc == 0 and "warning" not in err, err
    assert (await timeslice("release", *hold))[0] == 0


async def test_no_grant_within_the_timeout_exits_75(target) -> None:
    holder = AsyncTimeSliceOrchestratorClient(target, "other", "g")
    await holder.acquire()
    try:
        rc, err = await timeslice_run(target, "a", "--timeout", "0.5", "--", "true")
        assert rc == 75 and "acquire g" in err, err
    finally:
        await holder.close()
    assert (await timeslice_run(target, "a", "--", "true"))[0] == 0  # the group was left as it was


async def timeslice(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "timeslice.cli.main", *args,
                                                stderr=asyncio.subprocess.PIPE, env=env)
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, err.decode()


async def _status(target: str) -> pb.GroupStatus:
    async with grpc.aio.insecure_channel(target) as ch:
        return await pb_grpc.OrchestratorStub(ch).GetGroupStatus(pb.GetGroupStatusRequest(group_id="g"))


async def _waiting(target: str, job: str) -> bool:
    return job in [w.job_id for w in (await _status(target)).waiters]


async def test_an_infinite_timeout_waits_without_bound(target) -> None:
    """A helper's trial: `acquire(timeout=math.inf)` raised OverflowError (a deadline past the
    clock's range) and `timeslice run --timeout inf` printed a traceback. Infinity is no bound,
    as None is; NaN is refused, saying why."""
    holder = AsyncTimeSliceOrchestratorClient(target, "other", "g")
    await holder.acquire()
    try:
        running = asyncio.ensure_future(timeslice_run(target, "a", "--timeout", "inf", "--", "true"))
        await eventually(lambda: _waiting(target, "a"), timeout=30, what="a waiting")
        await holder.release()
        assert await running == (0, "")
        client = AsyncTimeSliceOrchestratorClient(target, "b", "g")
        try:
            with pytest.raises(ValueError, match="NaN"):
                await client.acquire(timeout=math.nan)
            assert (await client.acquire(timeout=math.inf)).epoch == 3
            await client.release()
        finally:
            await client.close()
    finally:
        await holder.close()


async def test_acquire_holds_until_release_across_commands(target, tmp_path) -> None:
    """`timeslice acquire` returns once granted and the hold outlives it (a holder process keeps
    the lease); another job waits until `timeslice release`; a second acquire of the same hold
    is refused; release without a hold says so."""
    hold = str(tmp_path / "hold.json")
    args = ["--job", "a", "--group", "g", "--hold-file", hold]
    assert (await timeslice("acquire", "--target", target, *args))[0] == 0
    state = json.loads((tmp_path / "hold.json").read_text())
    assert state["state"] == "held" and state["group"] == "g" and state["epoch"] == 1
    rc, err = await timeslice("acquire", "--target", target, *args)
    assert rc == 2 and "already holds" in err
    other = AsyncTimeSliceOrchestratorClient(target, "b", "g")
    waiter = asyncio.ensure_future(other.acquire(timeout=60))
    try:
        await eventually(lambda: _waiting(target, "b"), timeout=30, what="b waiting")
        status = await _status(target)
        assert status.holder.job_id == "a" and not waiter.done()  # a holds, across commands; b waits
        assert (await timeslice("release", *args))[0] == 0
        assert not (tmp_path / "hold.json").exists()
        assert (await waiter).epoch == 2
        await other.release()
    finally:
        waiter.cancel()
        await other.close()
    rc, err = await timeslice("release", *args)
    assert rc == 2 and "no hold file" in err


async def test_acquire_that_gets_no_grant_in_time_exits_75_and_leaves_no_hold(target, tmp_path) -> None:
    holder = AsyncTimeSliceOrchestratorClient(target, "other", "g")
    await holder.acquire()
    try:
        rc, err = await timeslice("acquire", "--target", target, "--job", "a", "--group", "g", "--timeout", "0.5",
                                  "--hold-file", str(tmp_path / "hold.json"))
        assert rc == 75 and "acquire g" in err, err
        assert not (tmp_path / "hold.json").exists()
    finally:
        await holder.close()


async def test_acquire_under_timeout_fails_loudly_and_holds_nothing(target, tmp_path) -> None:
    """`timeout 60 timeslice acquire` exited 0 holding nothing: the hold ends with the process
    that ran acquire, here `timeout`, which ends when acquire returns (and in one-box mode
    `timeout`'s own process group would have been the job). It is refused, saying why."""
    proc = await asyncio.create_subprocess_exec(
        "timeout", "60", sys.executable, "-m", "timeslice.cli.main", "acquire", "--target", target, "--job", "a",
        "--group", "g", "--hold-file", str(tmp_path / "hold.json"), stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 2 and b"runs under `timeout`" in err, err
    assert not (tmp_path / "hold.json").exists() and (await _status(target)).holder.job_id == ""


async def test_acquire_in_a_subshell_holds_until_the_scripts_release(target, tmp_path) -> None:
    """A helper's attack on `timeslice serve`: in `(timeslice acquire; echo acquired)` acquire
    returned 0, but the hold ended with the subshell that ran it (the process it watched), at
    its `)`: the script computed on while the next job was granted (4 of 4 runs). The hold is
    the script's: it lasts until the script releases."""
    cli = f"{sys.executable} -m timeslice.cli.main"
    hold = f"--job a --group g --hold-file {tmp_path / 'hold.json'}"
    script = (f"(cd {tmp_path} && {cli} acquire --target {target} {hold}; echo $? > {tmp_path / 'acquired'})\n"
              f"while [ ! -e {tmp_path / 'go'} ]; do sleep 0.01; done\n"
              f"{cli} release {hold}; echo $? > {tmp_path / 'released'}\n")
    proc = await asyncio.create_subprocess_exec("bash", "-c", script)
    other = AsyncTimeSliceOrchestratorClient(target, "b", "g")
    waiter: asyncio.Future | None = None
    try:
        await eventually(lambda: (tmp_path / "acquired").exists() and (tmp_path / "acquired").read_text(), 60,
                         what="the subshell's acquire")
        assert (tmp_path / "acquired").read_text().strip() == "0"
        waiter = asyncio.ensure_future(other.acquire(timeout=60))
        await eventually(lambda: _waiting(target, "b"), timeout=30, what="b waiting")
        assert (await _status(target)).holder.job_id == "a" and not waiter.done()  # the script still holds
        (tmp_path / "go").touch()
        assert (await waiter).epoch == 2
        await asyncio.wait_for(proc.wait(), 60)
        assert (tmp_path / "released").read_text().strip() == "0"
        await other.release()
    finally:
        if waiter is not None:
            waiter.cancel()
        (tmp_path / "go").touch()
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        await other.close()


async def test_two_acquires_of_one_hold_at_once_start_one_holder_and_release_frees_the_group(target,
                                                                                             tmp_path) -> None:
    """Two `acquire`s of one hold from one script at once both went on: each started a
    holder, and `release` ended only the one whose hold file was written last, so the group
    stayed held. The hold file is claimed exclusively: one goes on, the other is refused."""
    args = ["acquire", "--target", target, "--job", "a", "--group", "g", "--hold-file", str(tmp_path / "hold.json")]
    results = await asyncio.gather(timeslice(*args), timeslice(*args))
    assert sorted(rc for rc, _ in results) == [0, 2], results
    assert "already holds" in next(err for rc, err in results if rc == 2)
    assert (await _status(target)).holder.job_id == "a"
    assert (await timeslice("release", *args[3:]))[0] == 0
    await eventually(lambda: _free(target), timeout=30, what="the group free after release")


async def test_a_hold_file_left_by_a_process_that_ended_is_replaced(target, tmp_path) -> None:
    gone = await asyncio.create_subprocess_exec("true")
    await gone.wait()  # its pid names no process now
    (tmp_path / "hold.json").write_text(json.dumps({"pid": gone.pid, "state": "held"}))
    hold = ["--job", "a", "--group", "g", "--hold-file", str(tmp_path / "hold.json")]
    assert (await timeslice("acquire", "--target", target, *hold))[0] == 0
    assert json.loads((tmp_path / "hold.json").read_text())["pid"] != gone.pid
    assert (await timeslice("release", *hold))[0] == 0


async def _free(target: str) -> bool:
    return (await _status(target)).holder.job_id == ""


async def test_acquire_without_a_group_says_so_as_run_does(target, tmp_path, monkeypatch) -> None:
    """A new user's trial: with no group, `acquire` said only "the holder ended without a
    grant" (exit 69; the reason went to a log it then deleted); `run` says what is missing."""
    monkeypatch.delenv("TIMESLICE_GROUP", raising=False)
    rc, err = await timeslice("acquire", "--target", target, "--job", "a", "--hold-file", str(tmp_path / "hold.json"))
    assert rc == 2 and "no group id" in err, err
    assert not (tmp_path / "hold.json").exists()


async def test_a_killed_holder_is_reported_and_an_interrupted_acquire_leaves_no_hold(target, tmp_path) -> None:
    """Found by a new-user try: `release` after the holder was SIGKILLed answered 0, and a
    Ctrl-C on a waiting `acquire` left a hold file of a hold that never was."""
    hold = tmp_path / "hold.json"
    args = ["--job", "a", "--group", "g", "--hold-file", str(hold)]
    assert (await timeslice("acquire", "--target", target, *args))[0] == 0
    os.kill(json.loads(hold.read_text())["pid"], signal.SIGKILL)
    rc, err = await timeslice("release", *args)
    assert rc == 70 and "ended without releasing" in err, err
    assert not hold.exists() and not hold.with_suffix(".log").exists()

    holder = AsyncTimeSliceOrchestratorClient(target, "other", "g")
    await holder.acquire(timeout=30)  # a's lease may still run: wait for it to lapse
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "timeslice.cli.main", "acquire", "--target",
                                                target, *args, stderr=asyncio.subprocess.PIPE)
    try:
        for _ in range(600):  # until a's acquire waits in the queue (a signal, not a fixed time)
            async with grpc.aio.insecure_channel(target) as ch:
                group = await pb_grpc.OrchestratorStub(ch).GetGroupStatus(pb.GetGroupStatusRequest(group_id="g"))
            if any(w.job_id == "a" for w in group.waiters):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the acquire never waited in the queue")
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 60)
        assert proc.returncode == 130 and not hold.exists()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await holder.release()
        await holder.close()
    assert (await timeslice("run", "--target", target, "--job", "b", "--group", "g", "--timeout", "30", "--",
                            "true"))[0] == 0  # nobody holds g
