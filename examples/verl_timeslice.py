"""veRL (github.com/volcengine/verl) with timeslice: where acquire and release go. Not run here.

Read in volcengine/verl at b178a3cd (2026-01-29): `verl/trainer/main_ppo.py` (`run_ppo`,
`TaskRunner.run`), `verl/trainer/ppo/ray_trainer.py` (`RayPPOTrainer.init_workers`, `fit`,
`_compute_or_extract_reward`), `verl/workers/fsdp_workers.py` (the Ray workers).

veRL is single-controller: `RayPPOTrainer.fit()` runs in one process (the `TaskRunner` Ray actor)
and drives every GPU worker (rollout replicas, actor, reference, critic) through worker-group
calls. So the hold is taken there, not in the workers: a job's holds are shared by all of its
processes (the orchestrator checkpoints and restores the job's processes, or in a cluster its
pods, whichever process asked), and one hold covers the whole step. Per step on the GPUs:
`update_weights` (wake the rollout replicas with the new weights), `generate_sequences`,
`sleep_replicas`, old/reference log-probs, values, the critic and actor updates. The one phase
where the GPUs wait for the CPU is the reward function (`reward_fn`: rule-based scores,
verifiers, sandboxes), which `fit` calls in this process through `_compute_or_extract_reward`;
that is where the group is given back.

Wiring: veRL recipes keep their own `TaskRunner` (a subclass passed as `run_ppo(config,
task_runner_class=...)`); in its `run`, where veRL builds `RayPPOTrainer(...)` and calls
`trainer.init_workers(); trainer.fit()`, build the subclass below and call `train`:

    client = TimeSliceOrchestratorClient()       # $TIMESLICE_ORCHESTRATOR, $TIMESLICE_JOB (a pod: its token)
    trainer = TimeSlicedPPOTrainer(config=config, ..., timeslice=client)   # RayPPOTrainer's arguments
    try:
        train(trainer)
    finally:
        client.close()      # Leave: a job moved off the GPUs after its last release is brought back
"""

from __future__ import annotations

from timeslice import TimeSliceOrchestratorClient
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

GROUP = "verl"  # the claim set of the job's GPUs (the pod-level claim name)


class TimeSlicedPPOTrainer(RayPPOTrainer):
    """`RayPPOTrainer` that gives the GPUs back while the reward function runs on the CPU.

    `fit()` must run inside a hold (see `train`); this releases it around the reward and waits
    for the grant again before the log-prob passes (`acquire()` returns once this job's GPU
    state is back). With `reward_model.launch_reward_fn_async` veRL runs the reward as a Ray
    task beside the log-prob passes and does not call this method in the training step; with
    the reward loop (`use_reward_loop`) the scores come with the rollout and this method only
    extracts them: the release and acquire then move nothing unless another job waits."""

    def __init__(self, *args, timeslice: TimeSliceOrchestratorClient, **kwargs):
        super().__init__(*args, **kwargs)
        self.timeslice = timeslice

    def _compute_or_extract_reward(self, batch, reward_fn=None, reward_for_val=False, sum_reward=False):
        self.timeslice.release(GROUP)
        try:
            return super()._compute_or_extract_reward(batch, reward_fn=reward_fn, reward_for_val=reward_for_val,
                                                      sum_reward=sum_reward)
        finally:
            self.timeslice.acquire(GROUP, timeout=3600)


def train(trainer: TimeSlicedPPOTrainer) -> None:
    """What `TaskRunner.run` does last (`trainer.init_workers(); trainer.fit()`), inside a hold:
    loading the models onto the GPUs is GPU work too."""
    with trainer.timeslice.on_accelerators(GROUP, timeout=3600):
        trainer.init_workers()
        trainer.fit()
