"""A job's own use of the client, as a tester tried it through `timeslice serve` (backend
`none`, the lock alone, so that only the client and the lease rules stand between two jobs):
a waiter stopped through its grant, two threads or tasks of one job entering
`on_accelerators()` at once, a child forked inside a hold. Each case computed beside another
job or left a lease nobody released. serve and the jobs are real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from pathlib import Path

import grpc
from timeslice.v1 import orchestrator_pb2 as pb
from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

from tests.conftest import eventually
from tests.test_serve import env_for, serve_process
from tests.test_serve_faults import line

# Job A: holds and releases as its stdin says ("release", "acquire"), printing each step.
JOB_A = textwrap.dedent("""
    import sys
    from timeslice import TimeSliceOrchestratorClient
    c = TimeSliceOrchestratorClient(group_id="g")
    c.acquire(timeout=60)
    print("granted", flush=True)
    for cmd in sys.stdin:
        if cmd.strip() == "release":
            c.release()
        else:
            c.acquire(timeout=60)
        print(cmd.strip() + "d", flush=True)
""")
# Job B: once it holds, it writes the file named in argv[1] (its compute), releases, ends.
JOB_B = textwrap.dedent("""
    import sys
    from pathlib import Path
    from timeslice import TimeSliceOrchestratorClient
    c = TimeSliceOrchestratorClient(group_id="g")
    with c.on_accelerators(timeout=60):
        Path(sys.argv[1]).write_text("held")
    c.close()
    print("done", flush=True)
""")


async def start(sock: str, code: str, *args: str, stderr: Path | None = None) -> asyncio.subprocess.Process:
    with (stderr or Path(os.devnull)).open("ab") as err:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=err, env=env_for(sock), start_new_session=True)


async def tell(proc: asyncio.subprocess.Process, command: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(command.encode() + b"\n")
    await proc.stdin.drain()
    await line(proc, command + "d")


async def waiting(sock: str, job: str) -> bool:
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        status = await pb_grpc.OrchestratorStub(ch).GetGroupStatus(pb.GetGroupStatusRequest(group_id="g"),
                                                                   timeout=10)
    return any(w.job_id == job for w in status.waiters)


async def end(*procs: asyncio.subprocess.Process | None) -> None:
    for p in procs:
        if p is not None and p.returncode is None:
            os.killpg(p.pid, signal.SIGKILL)
            await p.wait()


async def test_a_waiter_stopped_through_its_grant_never_computes_under_it_once_its_lease_lapsed(tmp_path) -> None:
    """A tester's case: job B, waiting, was stopped (Ctrl-Z) while A released; B was granted
    while stopped, its lease lapsed, A held again, and B, continued, returned the lapsed grant
    and computed inside A's hold (on serve's default `cuda` too: B had no CUDA context yet, so
    its checkpoint stopped nothing). Now a grant whose answer waited unread for over a quarter of
    its lease is confirmed first; refused, B asks again and holds only after A releases."""
    async with serve_process(tmp_path, lease_seconds=2, backend="none") as (sock, _, _):
        computed = tmp_path / "b-computed"
        a = await start(sock, JOB_A)
        b = None
        try:
            await line(a, "granted")
            b = await start(sock, JOB_B, str(computed), stderr=tmp_path / "b.err")
            job_b = f"pgid-{b.pid}"
            await eventually(lambda: waiting(sock, job_b), 60, what="job B queued")
            os.killpg(b.pid, signal.SIGSTOP)
            await tell(a, "release")
            log = tmp_path / "serve.log"
            await eventually(lambda: f"lease expired group=g job={job_b} " in log.read_text(), 60,
                             what="B's grant lapsing while B is stopped")
            await tell(a, "acquire")
            os.killpg(b.pid, signal.SIGCONT)
            await eventually(lambda: computed.exists() or "lapsed before this process saw it" in
                             (tmp_path / "b.err").read_text(), 60, what="B asking again or computing")
            assert not computed.exists(), "B computed under its lapsed grant while A held"
            await eventually(lambda: waiting(sock, job_b), 60, what="job B queued again")
            await tell(a, "release")
            await line(b, "done")
            assert await asyncio.wait_for(b.wait(), 60) == 0
        finally:
            await end(a, b)


# Job T: two threads (or, with argv[1] == "tasks", two asyncio tasks of the asyncio client) enter
# one group's scope at once, both inside before either leaves; then another job must get it.
JOB_T = textwrap.dedent("""
    import asyncio, sys, threading
    from timeslice import AsyncTimeSliceOrchestratorClient, TimeSliceOrchestratorClient
    if sys.argv[1] == "threads":
        c = TimeSliceOrchestratorClient(group_id="g")
        both = threading.Barrier(2, timeout=60)
        errors = []
        def step():
            try:
                with c.on_accelerators(timeout=60):
                    both.wait()
            except Exception as err:
                errors.append(repr(err))
        threads = [threading.Thread(target=step) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print("ok" if not errors else errors, flush=True)
    else:
        async def main():
            async with AsyncTimeSliceOrchestratorClient(group_id="g") as c:
                both = asyncio.Barrier(2)
                @c.on_accelerators(timeout=60)
                async def step():
                    await asyncio.wait_for(both.wait(), 60)
                results = await asyncio.gather(step(), step(), return_exceptions=True)
                errors = [repr(r) for r in results if r is not None]
                print("ok" if not errors else errors, flush=True)
                sys.stdin.readline()
        asyncio.run(main())
    sys.stdin.readline()  # lives on holding nothing
""")


async def test_two_threads_or_tasks_of_one_job_entering_its_scope_at_once_share_one_hold(tmp_path) -> None:
    """A tester's case: two threads (or two `asyncio.gather`ed tasks) of one job inside
    `on_accelerators()` at once: each got a grant of its own, the second overwrote the first in
    the client, one scope raised NotHolding, and the first hold's keep-alives ran on for as long as
    the process lived: the next job's acquire timed out. Now the later one waits for the first
    one's grant and shares its hold (as nested scopes do)."""
    async with serve_process(tmp_path, lease_seconds=2, backend="none") as (sock, _, _):
        for kind in ("threads", "tasks"):
            computed = tmp_path / f"b-computed-{kind}"
            t = await start(sock, JOB_T, kind, stderr=tmp_path / "t.err")
            b = None
            try:
                await line(t, "ok")
                b = await start(sock, JOB_B, str(computed))
                await line(b, "done")  # the group was free: nothing of T's holds went on
                assert computed.exists()
            finally:
                await end(t, b)


# Job F: holds, forks a child that tries the client (its acquire and its close), then releases.
JOB_F = textwrap.dedent("""
    import os
    from timeslice import TimeSliceError, TimeSliceOrchestratorClient
    c = TimeSliceOrchestratorClient(group_id="g")
    with c.on_accelerators(timeout=60):
        pid = os.fork()
        if pid == 0:
            try:
                with c.on_accelerators(timeout=5):
                    os._exit(0)  # it would compute here, whoever holds
            except TimeSliceError as err:
                print("child refused:", err, flush=True)
                c.close()  # the parent's holds and groups: untouched
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
    print("released", flush=True)
""")


async def test_a_child_forked_inside_a_hold_cannot_use_its_parents_client(tmp_path) -> None:
    """A tester's case: a `multiprocessing` fork pool made inside `on_accelerators()`: its
    workers inherited the parent's hold, their scopes returned at once, and they computed inside
    the next job's holds. Now a forked child that uses the parent's client is refused, says
    how to do it, and its close() leaves the parent's hold alone."""
    async with serve_process(tmp_path, lease_seconds=2, backend="none") as (sock, _, _):
        f = await start(sock, JOB_F)
        try:
            out = (await asyncio.wait_for(f.communicate(), 60))[0].decode().splitlines()
            assert out[0].startswith("child refused: ") and "make a client in the child" in out[0], out
            assert out[1:] == ["child exit 3", "released"] and f.returncode == 0, out
        finally:
            await end(f)
