"""An RL job's loop: a GPU phase inside the lock, a reward phase outside it.

The accelerator work runs in a worker process marked TIMESLICE_ACCELERATOR_PROCESS=1
(`timeslice.cli.demo_worker`: tensors on the GPU, or a buffer hashed on the CPU): that
is the process the node agent checkpoints, or freezes on GPU-less nodes. This process
keeps running through the reward phase and asks for the lock again. One JSON line per
step (times from CLOCK_MONOTONIC, shared by every container on the node).
"""

import json
import os
import socket
import subprocess
import sys
import time

from timeslice import TimeSliceOrchestratorClient

STEPS = int(os.environ.get("STEPS", "5"))
GPU_SECONDS = float(os.environ.get("GPU_SECONDS", "2"))
REWARD_SECONDS = float(os.environ.get("REWARD_SECONDS", "2"))

mine, theirs = socket.socketpair()
worker = subprocess.Popen(
    [sys.executable, "-m", "timeslice.cli.demo_worker", "--fd", str(theirs.fileno()),
     "--mode", os.environ.get("WORKER_MODE", "cpu")],
    pass_fds=[theirs.fileno()], env={**os.environ, "TIMESLICE_ACCELERATOR_PROCESS": "1"})
theirs.close()
link = mine.makefile("rw", buffering=1)


def send(message: dict) -> None:
    link.write(json.dumps(message) + "\n")
    link.flush()  # a text-mode socket file holds writes until a read, or a flush

client = TimeSliceOrchestratorClient()  # $TIMESLICE_ORCHESTRATOR (from CDI), $TIMESLICE_GROUP; the job: from the token

for step in range(STEPS):
    with client.on_accelerators():
        grant = client.holding()
        send({"op": "phase", "seconds": GPU_SECONDS})
        result = json.loads(link.readline())
        if step == STEPS - 1:  # free the device state while still holding the lock
            send({"op": "exit"})
            worker.wait()
    print(json.dumps({"step": step, "start": result["start"], "end": result["end"], "check_ok": result["check_ok"],
                      "epoch": grant.epoch if grant else 0, "restored": grant.restored if grant else False}),
          flush=True)
    time.sleep(REWARD_SECONDS)
client.close()
