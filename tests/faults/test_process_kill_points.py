"""Fault injection (issue 10) with every component a real process: `timeslice orchestrator`
(standalone, `--state-file`), a node agent on the `freeze` backend, and two jobs, each a
client process (the library, acquire -> compute -> release) and a worker process that the
agent freezes while the other job holds. The agent stops at one point of the first switch
(before or after the checkpoint, before or after the restore: it says so in a file and
waits), the test SIGKILLs the orchestrator (then starts it again on the same state file)
or a whole job at that moment, and lets the agent go on.

Invariants, from what the clients saw at each grant and what is left at the end: every
surviving job finishes; while a job holds, its worker runs and the other job's worker, once
that job held, is stopped or gone (at most one job computes); grants' epochs only grow,
across the restart too; and no live worker is left stopped. The agent is tests/faults/stalling_agent.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from timeslice.kubelet_plugin.agent.procfs import proc_state

from bench.machine import free_port
from tests.conftest import python_child

STALLING_AGENT = Path(__file__).with_name("stalling_agent.py")


# A job's client: PHASES holds; at each grant it records its epoch and both workers' states.
# The compute is a short sleep: it is the workload, not a wait for something to happen.
CLIENT = """
    import json, sys, time
    from timeslice import TimeSliceOrchestratorClient, SwitchFailed, LeaseLost

    target, job, own, other, phases = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

    def state(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return "gone"

    c = TimeSliceOrchestratorClient(target, job, "g", unavailable_timeout=120)
    done = 0
    while done < phases:
        try:
            grant = c.acquire(timeout=120)
        except SwitchFailed as err:  # a switch rolled back: ask again
            print(json.dumps({"job": job, "switch_failed": str(err)}), flush=True)
            continue
        seen = {"job": job, "epoch": grant.epoch, "own": state(own), "other": state(other), "t0": time.time()}
        time.sleep(0.2)
        seen["t1"] = time.time()
        print(json.dumps(seen), flush=True)
        try:
            c.release()
        except LeaseLost as err:  # the hold had ended (lapsed while the orchestrator restarted)
            print(json.dumps({"job": job, "lease_lost": str(err)}), flush=True)
        done += 1
    print(json.dumps({"job": job, "finished": True}), flush=True)
"""

WORKER = """
    print("ready", flush=True)
    while True:
        pass
"""
POINTS = ["checkpoint:before", "checkpoint:after", "restore:before", "restore:after"]
PHASES = 4


def _wait(what: str, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Rig:
    """The processes of one run; `stop()` kills what is left (thawing workers first)."""

    def __init__(self, work: Path, sock: Path, point: str) -> None:
        self.work, self.point = work, point
        self.marker, self.go = work / "at", work / "go"
        self.target = f"127.0.0.1:{free_port()}"
        self.files: list = []  # open log files, closed by stop()
        self.workers = {j: python_child(WORKER) for j in ("a", "b")}
        for w in self.workers.values():
            assert w.stdout.readline() == "ready\n"
            w.stdout.close()
        agent_target = f"unix://{sock}"
        self.agent = subprocess.Popen(
            [sys.executable, str(STALLING_AGENT), agent_target, str(work / "records.json"), str(self.marker),
             str(self.go), point, *(f"{j}={w.pid}" for j, w in self.workers.items())],
            stdout=subprocess.PIPE, text=True)
        assert self.agent.stdout.readline() == "serving\n"
        self.agent.stdout.close()
        self.config = work / "orchestrator.yaml"
        self.config.write_text(yaml.safe_dump({"groups": [{
            "id": "g", "backend": "freeze", "agents": [agent_target], "lease_seconds": 3,
            "step_timeout_seconds": 20}]}))
        self.orchestrators: list[subprocess.Popen[bytes]] = []
        self.start_orchestrator()
        self.clients: dict[str, subprocess.Popen[str]] = {}
        self.out: dict[str, Path] = {}
        for job, other in (("a", "b"), ("b", "a")):
            self.out[job] = work / f"{job}.jsonl"
            self.clients[job] = subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(CLIENT), self.target, job, str(self.workers[job].pid),
                 str(self.workers[other].pid), str(PHASES)], stdout=self._open(self.out[job]), stderr=subprocess.STDOUT)

    def start_orchestrator(self) -> None:
        n = len(self.orchestrators)
        log = self.work / f"orchestrator-{n}.log"
        self.orchestrators.append(subprocess.Popen(
            [sys.executable, "-m", "timeslice.cli.main", "orchestrator", "--config", str(self.config), "--listen",
             self.target, "--state-file", str(self.work / "state.json")], stdout=self._open(log),
            stderr=subprocess.STDOUT))
        _wait("the orchestrator serving", lambda: "orchestrator serving" in log.read_text())

    def _open(self, path: Path):
        f = open(path, "w")
        self.files.append(f)
        return f

    def kill_job(self, job: str) -> None:
        for p in (self.clients[job], self.workers[job]):
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()

    def lines(self, job: str) -> list[dict]:
        return [json.loads(x) for x in self.out[job].read_text().splitlines() if x.startswith("{")]

    def stop(self) -> None:
        for p in [*self.clients.values(), *self.orchestrators, self.agent, *self.workers.values()]:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
        for f in self.files:
            f.close()

    def logs(self) -> str:
        return "\n".join(f"== {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.work.glob("*.log")))


@pytest.mark.parametrize("victim", ["orchestrator", "job"])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.slow  # > 5 s: left out of `make unit`, run by `make test`
def test_a_process_killed_at_each_point_of_a_switch_leaves_no_job_frozen_and_no_two_computing(
        point, victim, tmp_path, short_tmp) -> None:
    rig = Rig(tmp_path, short_tmp / "agent.sock", point)
    try:
        _wait(f"the agent at {point}", rig.marker.exists)
        with open(rig.work / "records.json") as f:
            records = json.load(f)["jobs"] if os.path.getsize(f.name) else {}
        moving = next(iter(records), None)  # the job being checkpointed or restored (its record)
        if victim == "orchestrator":
            rig.orchestrators[-1].kill()
            rig.orchestrators[-1].wait()
            rig.go.touch()  # the agent finishes its step with nobody waiting for the reply
            rig.start_orchestrator()
            survivors = ["a", "b"]
        else:  # the job being moved out (a checkpoint), or the one being moved in (a restore)
            first = rig.lines("a") + rig.lines("b")
            holder_first = first[0]["job"] if first else "a"
            dead = moving or (holder_first if point.startswith("checkpoint") else
                              ("b" if holder_first == "a" else "a"))
            rig.kill_job(dead)
            rig.go.touch()
            survivors = [j for j in ("a", "b") if j != dead]
        for job in survivors:
            _wait(f"job {job} to finish", lambda j=job: any(x.get("finished") for x in rig.lines(j)), timeout=180)
        grants = sorted((x for j in ("a", "b") for x in rig.lines(j) if "epoch" in x), key=lambda x: x["t0"])
        held: set[str] = set()
        for g in grants:  # at each grant: its own worker runs, and the other's, once it held, is stopped or gone
            assert g["own"] in "RS", f"{point}/{victim}: {g['job']} granted with its worker {g['own']}: {g}"
            assert g["other"] in ("T", "gone") or not held - {g["job"]}, \
                f"{point}/{victim}: {g['job']} granted while the other computes: {g}"
            held.add(g["job"])
        epochs = [g["epoch"] for g in grants]
        assert epochs == sorted(set(epochs)), f"{point}/{victim}: epochs repeated or went back: {epochs}"
        for job in survivors:  # nothing of a surviving job is left stopped once it finished
            _wait(f"job {job}'s worker not stopped", lambda j=job: proc_state(rig.workers[j].pid) in "RS", 30)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{rig.logs()}") from None
    finally:
        rig.stop()
