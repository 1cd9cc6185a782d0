"""Async RL: sample on the job's own GPU, train on a GPU shared with other jobs.

One worker process per claim set, marked with its pod-level claim name, so the node agent
moves only the trainer's state when the shared trainer GPU switches jobs. One JSON line
per phase: {"kind": "sample"|"train", "start", "end", "check_ok"} (CLOCK_MONOTONIC).
"""

import json
import os
import socket
import subprocess
import sys

from timeslice import TimeSliceOrchestratorClient

STEPS = int(os.environ.get("STEPS", "4"))
SAMPLE_SECONDS = float(os.environ.get("SAMPLE_SECONDS", "2"))
TRAIN_SECONDS = float(os.environ.get("TRAIN_SECONDS", "1"))


def start_worker(claim: str):
    mine, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "timeslice.cli.demo_worker", "--fd", str(theirs.fileno())],
                            pass_fds=[theirs.fileno()], env={**os.environ, "TIMESLICE_ACCELERATOR_PROCESS": claim})
    theirs.close()
    return proc, mine.makefile("rw", buffering=1)


def phase(link, seconds: float) -> dict:
    link.write(json.dumps({"op": "phase", "seconds": seconds}) + "\n")
    link.flush()
    return json.loads(link.readline())


def stop(proc, link) -> None:
    link.write(json.dumps({"op": "exit"}) + "\n")
    link.flush()
    proc.wait()


client = TimeSliceOrchestratorClient()  # $TIMESLICE_ORCHESTRATOR (CDI), $TIMESLICE_JOB
workers = {claim: start_worker(claim) for claim in ("sampler", "trainer")}
for step in range(STEPS):
    for kind, claim, seconds in (("sample", "sampler", SAMPLE_SECONDS), ("train", "trainer", TRAIN_SECONDS)):
        with client.on_accelerators(claim):
            r = phase(workers[claim][1], seconds)
            if step == STEPS - 1:  # free the device state while still holding the lock
                stop(*workers[claim])
        print(json.dumps({"kind": kind, "step": step, "start": r["start"], "end": r["end"],
                          "check_ok": r["check_ok"]}), flush=True)
client.close()
