"""A job without a GPU whose worker is stopped while another job holds (one-box mode).

The worker stands for a job's GPU process: it is marked `TIMESLICE_ACCELERATOR_PROCESS=1`, so
that a node agent without NVML moves it (the `freeze` backend stops it while another job holds
the group, and continues it before this job's next grant). This script is the job's client: it
holds the group `ROUNDS` times around a short phase. The worker appends a timestamp to
`OUT/NAME.ticks` every 5 ms; each hold's span goes to `OUT/NAME.spans` (JSON), so that you
can see that, once its job has held, no worker ticked while the other job held (a job is
moved only after its first hold). Run two, each in its own process
group, against a `timeslice serve --config` with a `freeze` group `g` (README, "without a GPU"):

    setsid python examples/cpu_job.py a /tmp/out 3 & setsid python examples/cpu_job.py b /tmp/out 3

A fourth argument `setsid` starts the worker in a session of its own (SGLang's workers call
setsid): it is still the job's. `daemon` starts it once the job first holds, by a double fork
into a session of its own (as a daemon does: it leaves the job's process tree too); it is
the job's by the TIMESLICE_JOB the client put in the environment it inherits.
`tests/test_serve.py` runs this file.
"""

import json
import os
import signal
import subprocess
import sys
import time

from timeslice import TimeSliceOrchestratorClient

name, out, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(out, exist_ok=True)
# The worker ends with its client (argv[1]: the client's PID; 0, a daemon: after 600 s at most)
WORKER = ("import os, sys, time\nparent, end = int(sys.argv[1]), time.time() + 600\n"
          "while time.time() < end and (not parent or os.getppid() == parent):\n"
          "    print(repr(time.time()), flush=True)\n    time.sleep(0.005)\n")
mode = sys.argv[4] if len(sys.argv) > 4 else "in-group"
ticks = f"{out}/{name}.ticks"
open(ticks, "w").close()


def start_worker() -> int:
    """The worker's PID. `daemon`: `sh` starts it in the background and exits (a double fork)."""
    env = {**os.environ, "TIMESLICE_ACCELERATOR_PROCESS": "1"}
    if mode == "daemon":
        return int(subprocess.check_output(["setsid", "sh", "-c", '"$0" -c "$1" 0 >>"$2" & echo $!', sys.executable,
                                            WORKER, ticks], env=env))
    with open(ticks, "a") as f:
        children.append(subprocess.Popen([sys.executable, "-c", WORKER, str(os.getpid())], stdout=f, env=env,
                                         start_new_session=mode == "setsid"))
    return children[-1].pid


children: list[subprocess.Popen] = []
worker = None if mode == "daemon" else start_worker()
client = TimeSliceOrchestratorClient(group_id=os.environ.get("TIMESLICE_GROUP", "g"))
spans = []
try:
    for _ in range(rounds):
        with client.on_accelerators():
            t0 = time.time()
            worker = worker or start_worker()
            time.sleep(0.3)  # the phase's work (on a GPU: the worker's)
            spans.append([name, t0, time.time()])
        time.sleep(0.05)  # between phases: the other job may hold
    client.close()
finally:  # (also when the group is unknown or the orchestrator unreachable: no worker left behind)
    if worker is not None:
        os.kill(worker, signal.SIGKILL)
for child in children:
    child.wait()
with open(f"{out}/{name}.spans", "w") as f:
    json.dump(spans, f)
