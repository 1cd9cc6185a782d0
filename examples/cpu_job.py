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
setsid): it is still the job's. `tests/test_serve.py` runs this file.
"""

import json
import os
import subprocess
import sys
import time

from timeslice import TimeSliceOrchestratorClient

name, out, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(out, exist_ok=True)
WORKER = "import sys, time\nwhile True:\n    print(repr(time.time()), flush=True)\n    time.sleep(0.005)\n"
with open(f"{out}/{name}.ticks", "w") as ticks:
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=ticks,
                              env={**os.environ, "TIMESLICE_ACCELERATOR_PROCESS": "1"},
                              start_new_session=sys.argv[4:] == ["setsid"])
client = TimeSliceOrchestratorClient(group_id=os.environ.get("TIMESLICE_GROUP", "g"))
spans = []
for _ in range(rounds):
    with client.on_accelerators():
        t0 = time.time()
        time.sleep(0.3)  # the phase's work (on a GPU: the worker's)
        spans.append([name, t0, time.time()])
    time.sleep(0.05)  # between phases: the other job may hold
client.close()
worker.kill()
with open(f"{out}/{name}.spans", "w") as f:
    json.dump(spans, f)
