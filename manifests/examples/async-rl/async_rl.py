"""Async RL: sample on the job's own GPU, train on a GPU shared with other jobs.

One worker process per claim set, marked with its pod-level claim name, so the node agent
moves only the trainer's state when the shared trainer GPU switches jobs. One JSON line
per phase: {"kind": "sample"|"train", "start", "end", "check_ok", "waited", "queued"}
(CLOCK_MONOTONIC; `waited`: seconds from asking to the grant, the call included; `queued`:
the orchestrator's count, seconds in its queue). `PHASES` lists what this pod runs, as
kind:claim pairs (default "sample:sampler,train:trainer": both, alternating, in one pod;
"train:gpu" is a trainer pod whose claim is called `gpu`, as in the peers' layout; "rest:"
waits `REST_SECONDS` holding nothing).
"""

import json
import os
import socket
import subprocess
import sys
import time

from timeslice import TimeSliceOrchestratorClient

STEPS = int(os.environ.get("STEPS", "4"))
SAMPLE_SECONDS = float(os.environ.get("SAMPLE_SECONDS", "2"))
TRAIN_SECONDS = float(os.environ.get("TRAIN_SECONDS", "1"))
REST_SECONDS = float(os.environ.get("REST_SECONDS", "1"))
SECONDS = {"sample": SAMPLE_SECONDS, "train": TRAIN_SECONDS}
PHASES = [tuple(p.split(":", 1)) for p in os.environ.get("PHASES", "sample:sampler,train:trainer").split(",")]


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


client = TimeSliceOrchestratorClient()  # $TIMESLICE_ORCHESTRATOR (CDI); the job: from this pod's token
workers = {claim: start_worker(claim) for _, claim in PHASES if claim}
for step in range(STEPS):
    for kind, claim in PHASES:
        if not claim:  # a phase off the GPU
            time.sleep(REST_SECONDS)
            continue
        asked = time.monotonic()
        with client.on_accelerators(claim):
            waited = time.monotonic() - asked
            queued = client.holding(claim).waited_seconds
            r = phase(workers[claim][1], SECONDS[kind])
            if step == STEPS - 1:  # free the device state while still holding the lock
                stop(*workers[claim])
        print(json.dumps({"kind": kind, "step": step, "start": r["start"], "end": r["end"],
                          "check_ok": r["check_ok"], "waited": waited, "queued": queued}), flush=True)
client.close()
