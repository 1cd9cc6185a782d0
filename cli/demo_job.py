"""Demo RL job: alternates a GPU phase (generate/train) with a reward phase.

Started by the demo runner as its own process; uses only the client library, as a
real workload would. The GPU phase runs inside `client.on_accelerators()` and asks
the job's accelerator worker (inherited socket) to compute; the reward phase runs
outside the lock. Prints one JSON line per round (times from `time.monotonic()`,
which is system-wide on Linux, so the runner can line jobs up).
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import time

from timeslice import TimeSliceOrchestratorClient


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to `timeslice demo`, which stops us
    p = argparse.ArgumentParser(description="timeslice demo job (started by `timeslice demo`)")
    p.add_argument("--worker-fd", type=int, required=True)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--gen-seconds", type=float, default=0.3)
    p.add_argument("--reward-seconds", type=float, default=0.3)
    a = p.parse_args()
    worker = socket.socket(fileno=a.worker_fd).makefile("rw", buffering=1)
    client = TimeSliceOrchestratorClient()  # $TIMESLICE_ORCHESTRATOR, $TIMESLICE_JOB, $TIMESLICE_GROUP

    for rnd in range(a.rounds):
        t_acquire = time.monotonic()
        with client.on_accelerators():
            grant = client.holding()
            t_granted = time.monotonic()
            worker.write(json.dumps({"op": "phase", "seconds": a.gen_seconds}) + "\n")
            worker.flush()
            result = json.loads(worker.readline())
            if rnd == a.rounds - 1:  # tear the device state down while holding, as a real job ends
                worker.write(json.dumps({"op": "exit"}) + "\n")
                worker.flush()
                worker.readline()  # EOF: the worker has exited
            t_release = time.monotonic()
        t_released = time.monotonic()
        print(json.dumps({
            "job": client.job_id, "round": rnd, "acquire": t_acquire, "granted": t_granted,
            "gen_start": result["start"], "gen_end": result["end"], "release": t_release,
            "released": t_released, "check_ok": result["check_ok"], "device_free_bytes": result["device_free_bytes"],
            "restored": grant.restored if grant else False,
            "switch_seconds": grant.switch_seconds if grant else 0.0, "epoch": grant.epoch if grant else 0,
        }), flush=True)
        time.sleep(a.reward_seconds)  # reward phase: off the accelerator
    client.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
