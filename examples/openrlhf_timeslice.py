"""OpenRLHF (github.com/OpenRLHF/OpenRLHF) with timeslice: where acquire and release go. Not run here.

Read in OpenRLHF/OpenRLHF at 3c3be623 (2026-08-13): `openrlhf/cli/train_ppo_ray.py` (`train`),
`openrlhf/trainer/ppo_trainer.py` (`PPOTrainer.fit`, `BasePPOTrainer.train_step`, `ppo_train`,
`broadcast_to_vllm`), `openrlhf/trainer/ppo_utils/samples_generator.py` (`generate_samples`).

OpenRLHF's `PPOTrainer` is a single controller and a Ray actor: its `fit()` loop calls, per
step, `samples_generator.generate_samples()` (wakes the vLLM engines when `vllm.enable_sleep`,
generates, scores through the agent or remote reward, puts the engines back to sleep) and
`train_step()` (experience: reference, critic and reward-model forward passes; `ppo_train`: the
critic and actor `fit` on their Ray actor groups; `broadcast_to_vllm`). Those two calls are the
job's GPU phases, so the hold goes around each of them, in the controller: a job's holds are
shared by all of its processes (the orchestrator checkpoints and restores the job's processes,
or in a cluster its pods), so the vLLM engines and the DeepSpeed actors need no client of their
own. Checkpoints (`save_logs_and_checkpoints` every `ckpt.save_steps`, `save_best_checkpoint`)
and evaluation (`evaluate`) also run on the GPUs and get their own holds; between these calls
(prompt loading, logging) the group is free for another job.

`ts_ray.on_accelerators` makes the controller's client in the actor's process on first use (a
client cannot be pickled into a Ray actor); `ts_ray.client_of(self)` is that client.

Wiring, in a copy of `openrlhf/cli/train_ppo_ray.py` (`train(args)`): create the controller
with `TimeSlicedPPOTrainer.remote(...)` (same arguments) instead of `PPOTrainer.remote(...)`, with
`TIMESLICE_ORCHESTRATOR` and `TIMESLICE_JOB` in its Ray runtime env (in a cluster pod the token
names the job). Model loading (`async_init_model_from_pretrained`, called by `train` before
`fit`) runs outside a hold unless `train` wraps it in `client.on_accelerators("openrlhf")`.
"""

from __future__ import annotations

import ray
import timeslice.integrations.ray as ts_ray
from openrlhf.trainer.ppo_trainer import PPOTrainer

GROUP = "openrlhf"  # the claim set of the job's GPUs (the pod-level claim name)
TIMEOUT = 3600.0  # seconds one step may wait for the GPUs


class _TimeSlicedPPOTrainer(PPOTrainer.__ray_actor_class__):  # PPOTrainer is `@ray.remote`: subclass its class
    """`PPOTrainer` whose generation, training step, checkpoint and evaluation each hold the group."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        generate = self.samples_generator.generate_samples  # called by `fit` once per step

        def generate_samples(**generate_kwargs):
            with ts_ray.client_of(self).on_accelerators(GROUP, timeout=TIMEOUT):
                return generate(**generate_kwargs)

        self.samples_generator.generate_samples = generate_samples

    @ts_ray.on_accelerators(GROUP, timeout=TIMEOUT)
    def train_step(self, rollout_samples, global_step):
        return super().train_step(rollout_samples, global_step)

    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        if global_step % self.args.ckpt.save_steps:  # logging only: no GPU work, no hold
            return super().save_logs_and_checkpoints(global_step, logs_dict, client_states)
        with ts_ray.client_of(self).on_accelerators(GROUP, timeout=TIMEOUT):
            return super().save_logs_and_checkpoints(global_step, logs_dict, client_states)

    @ts_ray.on_accelerators(GROUP, timeout=TIMEOUT)
    def broadcast_to_vllm(self):  # inside train_step (the holds nest) and, when resuming, at the start of fit
        return super().broadcast_to_vllm()

    @ts_ray.on_accelerators(GROUP, timeout=TIMEOUT)
    def save_best_checkpoint(self, eval_metrics, global_step, client_states=None):
        return super().save_best_checkpoint(eval_metrics, global_step, client_states)

    @ts_ray.on_accelerators(GROUP, timeout=TIMEOUT)
    def evaluate(self, global_step, **generate_kwargs):
        return super().evaluate(global_step, **generate_kwargs)

    def fit(self, global_step=0):
        try:
            return super().fit(global_step)
        finally:
            ts_ray.close(self)  # Leave: a job moved off the GPUs after its last release is brought back


TimeSlicedPPOTrainer = ray.remote(_TimeSlicedPPOTrainer)
