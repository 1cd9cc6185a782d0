"""Issue 14, item 3: a rank of a two-rank job (torch.distributed over gloo, an all-reduce in
a loop) is SIGKILLed while the node agent checkpoints the job: on the CPU with `freeze`, and
on a GPU (marked `gpu`) with `cuda`, each rank holding 1 GB on the GPU.
The switch fails and rolls back for every rank: the surviving rank is running, not left
stopped, and the waiting job is told the switch failed instead of being granted beside a
job the agent could not move whole. Once the job's launcher ends it (here: the test kills
the other rank and the job's client leaves), the waiter is granted.

Real processes throughout: the ranks, a node agent process that stops at the start of the
checkpoint (tests/faults/stalling_agent.py) so that the kill lands inside the step, and the
orchestrator's server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from timeslice import AsyncTimeSliceOrchestratorClient, SwitchFailed
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.server import create_server
from timeslice.kubelet_plugin.agent.procfs import proc_state

from tests.conftest import eventually
from tests.integration_deps import need
from tests.test_gpu import _gpu

STALLING_AGENT = Path(__file__).parent / "faults" / "stalling_agent.py"

# One rank: join the gloo group and all-reduce a few times (each sum to a file), then work
# alone (on a GPU each rank keeps 1 GB there and computes on it), appending a count: with no
# collective in flight, the survivor does not see its peer die (in a collective it would end
# by itself, a connection reset: then the whole job is gone and the waiter is granted).
RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    rank, init, out, device = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    x = torch.ones(2**28 if device == "cuda" else 1024, device=device)
    with open(out, "a") as f:
        for _ in range(4):
            t = x[:4].cpu() * (rank + 1)
            dist.all_reduce(t)
            f.write(f"{t[0].item()}\\n")
            f.flush()
        n = 0
        while True:
            x.add_(1.0)
            n += 1
            f.write(f"{n}\\n")
            f.flush()
""")


def spawn(*argv: str, **kw: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], **kw)  # type: ignore[call-overload]



@pytest.mark.slow
@pytest.mark.parametrize("backend", ["freeze", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not _gpu(), reason="needs an NVIDIA GPU, PyTorch and root")])])
async def test_a_rank_killed_during_the_checkpoint_rolls_the_switch_back_for_every_rank(backend, tmp_path,
                                                                                       short_tmp) -> None:
    need("torch")
    device = "cuda" if backend == "cuda" else "cpu"
    out = [tmp_path / f"rank{r}.sums" for r in range(2)]
    init = f"file://{tmp_path / 'rendezvous'}"
    ranks = [spawn("-c", RANK, str(r), init, str(out[r]), device) for r in range(2)]
    other = spawn("-c", "import time\nwhile True: time.sleep(0.01)")
    marker, go = tmp_path / "marker", tmp_path / "go"
    target = f"unix://{short_tmp / 'agent.sock'}"
    agent = spawn(str(STALLING_AGENT), target, str(tmp_path / "records.json"), str(marker), str(go),
                  "checkpoint:before", f"a={ranks[0].pid},{ranks[1].pid}", f"b={other.pid}", stdout=subprocess.PIPE,
                  text=True, env={**os.environ, "STALL_BACKEND": backend})
    orch = Orchestrator([GroupSpec(id="g", backend=backend, agents=(target,), residency="exclusive")])
    server, port = await create_server(orch, "127.0.0.1:0")
    a = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{port}", "a", "g")
    b = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{port}", "b", "g", retry_failed_switches=False)  # failure tested
    try:
        assert agent.stdout is not None and agent.stdout.readline().strip() == "serving"
        await eventually(lambda: all(p.exists() and p.read_text().count("\n") > 3 for p in out), 120,
                         what="the all-reduces")
        assert out[0].read_text().split()[0] == "3.0"  # 1 + 2: the two ranks are joined
        await a.acquire(timeout=30)
        waiting = asyncio.ensure_future(b.acquire(timeout=60))
        await a.release()  # the switch a -> b starts; the agent stops at the start of a's checkpoint
        await eventually(marker.exists, 60, what="the agent at checkpoint:before")
        ranks[1].kill()
        ranks[1].wait()
        go.touch()
        with pytest.raises(SwitchFailed, match=r"ended during the step.*put back"):
            await waiting
        assert proc_state(ranks[0].pid) in "RS"  # the surviving rank runs: not left stopped
        count = out[0].read_text().count("\n")
        await eventually(lambda: out[0].read_text().count("\n") > count, 60, what="the surviving rank to go on")
        # the job's launcher ends the broken job; its client leaves; the waiter is then granted
        ranks[0].kill()
        ranks[0].wait()
        await a.close()
        grant = await b.acquire(timeout=30)
        assert grant.epoch >= 2
        await b.release()
    finally:
        for p in (*ranks, other, agent):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()
        if agent.stdout is not None:
            agent.stdout.close()
        await b.close()
        await a.close()
        await server.stop(0)
        await orch.close()
