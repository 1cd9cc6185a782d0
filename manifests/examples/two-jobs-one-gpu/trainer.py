"""An RL job's loop: a GPU phase inside the lock, a reward phase outside it."""

import os
import time

from timeslice import TimeSliceOrchestratorClient

client = TimeSliceOrchestratorClient()  # $TIMESLICE_ORCHESTRATOR from the claim's CDI env


@client.on_accelerators(group_id="gpu")
def train_step(step: int) -> None:
    print(f"{os.environ.get('HOSTNAME', '')} step {step}: training on the GPU", flush=True)
    time.sleep(float(os.environ.get("GPU_SECONDS", "2")))


for step in range(int(os.environ.get("STEPS", "5"))):
    train_step(step)
    time.sleep(float(os.environ.get("REWARD_SECONDS", "2")))  # reward scoring, off the GPU
client.close()
