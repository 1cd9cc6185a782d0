"""`timeslice.integrations.transformers`: hold the GPUs for each optimizer step of a Hugging Face `Trainer`.

Owned by the client package; imported only by jobs that train with `transformers` (this module
imports it). Usage, also for TRL's `GRPOTrainer`, `RLOOTrainer`, `SFTTrainer`, ... (subclasses of
`transformers.Trainer`)::

    from timeslice import TimeSliceOrchestratorClient
    from timeslice.integrations.transformers import TimeSliceCallback

    client = TimeSliceOrchestratorClient()
    hold = TimeSliceCallback(client, "trainer")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[hold])
    with hold:                  # a step that raises leaves no hold behind
        trainer.train()

Where the hold begins and ends (read in transformers 5.24 `Trainer._run_epoch`,
`_maybe_log_save_evaluate`, `_finalize_training`, and `TrainerCallback` in `trainer_callback.py`):

- `on_step_begin` acquires: it fires before the first micro-batch of an optimizer step, so the
  forward/backward of every gradient-accumulation micro-batch, the optimizer step and, in TRL's
  GRPO, the generation and scoring of completions (`GRPOTrainer._prepare_inputs` calls
  `_generate_and_score_completions` from inside `training_step`) run while the job holds the group.
- `on_step_end` releases, unless the step's logging, evaluation or checkpoint is due (they run
  after `on_step_end` and use the GPU: the loss is read with `.item()`, evaluation runs the model,
  a checkpoint copies its weights): then the release waits for the last of `on_log`,
  `on_evaluate`, `on_save` that is due. The last step holds until `on_train_end` (the final log,
  `load_best_model_at_end`). Epoch-end logging/evaluation/saving acquires in `on_epoch_end`.
- The flags are read from `TrainerControl` after `DefaultFlowCallback` set them (the `Trainer`
  puts its default callbacks first); a callback listed after this one that sets them is not seen.
- `TrainerCallback` has no hook for an exception: a step that raises leaves the hold to the
  `with hold:` block around `train()` (or `release_hold()`, or the client's `close()`); a
  process that dies stops its lease's keep-alives and the orchestrator ends it after the
  group's `lease_seconds`.

Giving the GPUs back inside a step: `released()` (a context manager and a decorator for plain and
`async def` functions) releases the hold and takes it again at the end. Use it around work of
this process that runs inside a step but touches no GPU state of the job: TRL reward functions
that run on the CPU (`reward_funcs=[...]`: regexes, verifiers, sandboxed code; TRL calls them
from `_calculate_rewards`, inside the step), `tools=` that call out, a `rollout_func` that
generates on a vLLM server elsewhere (`vllm_mode="server"`). Not around generation on this
GPU (TRL's default, `vllm_mode="colocate"`), nor around TRL's weight sync to vLLM. This is a
scope the user places rather than an option that wraps TRL's private methods: a callback is
not given the trainer, TRL has no callback around generation or reward, and the private
methods' names change between TRL versions (read in huggingface/trl `trl/trainer/grpo_trainer.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from timeslice._rpc import ENV_TARGET
from timeslice.client import TimeSliceOrchestratorClient
from timeslice.errors import LeaseLost
from timeslice.scope import decorate
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

log = logging.getLogger("timeslice.integrations.transformers")
F = TypeVar("F", bound=Callable[..., Any])
# The event after which the hold of a step ends, latest first in the order the Trainer runs them.
Until = Literal["train_end", "save", "evaluate", "log"]


def _last_due(control: TrainerControl) -> Until | None:
    """The last GPU-using event that `control` says is due after this point, None: none."""
    if control.should_training_stop:
        return "train_end"
    if control.should_save:
        return "save"
    if control.should_evaluate:
        return "evaluate"
    if control.should_log:
        return "log"
    return None


class TimeSliceCallback(TrainerCallback):  # type: ignore[misc]
    """Hold `group_id` from `on_step_begin` to the end of the step's GPU work (module docstring).

    Args:
        client: the job's `TimeSliceOrchestratorClient` (one per process; each rank of a
            distributed run passes its own, with the same job id: a job's holds are shared).
            None: one from the environment (`$TIMESLICE_ORCHESTRATOR`, ...); when no
            orchestrator is configured there, the callback holds nothing and says so once
            (a warning), so that one training script runs with and without time-slicing.
        group_id: the claim set to hold; None: the client's default (`$TIMESLICE_GROUP`).
        timeout: seconds one acquire may wait for the grant (None: no bound); past it the
            step raises `AcquireTimeout` out of `trainer.train()`.
        priority: queue priority of the acquires (None: the client's).

    Raises from the training loop what `acquire()`/`release()` raise: `AcquireTimeout`,
    `SwitchFailed`, `OrchestratorUnavailable`, `GroupNotFound`, `LeaseLost` (the lease lapsed
    during the step: its work may have overlapped another job's).
    Thread-safe: `released()` may be entered from reward threads or tasks.
    """

    def __init__(self, client: TimeSliceOrchestratorClient | None = None, group_id: str | None = None, *,
                 timeout: float | None = None, priority: int | None = None) -> None:
        if client is None and os.environ.get(ENV_TARGET):
            client = TimeSliceOrchestratorClient()
        elif client is None:
            log.warning("no orchestrator configured (%s is unset): TimeSliceCallback holds nothing, the trainer "
                        "runs as without it", ENV_TARGET)
        self._client = client
        self._group = group_id
        self._timeout = timeout
        self._priority = priority
        self._lock = threading.Lock()
        self._holding = False  # the step's hold is on (given back or not)
        self._until: Until | None = None  # the event that ends it (None: on_step_end)
        self._given_back = 0  # released() scopes open now; > 0: the client holds nothing for us

    # -- the hold ------------------------------------------------------------
    def _hold(self, until: Until | None = None) -> None:
        if self._client is None:  # no orchestrator configured: never holding, nothing to release
            return
        with self._lock:
            if not self._holding:
                self._client.acquire(self._group, timeout=self._timeout, priority=self._priority)
                self._holding = True
            self._until = until

    def release_hold(self) -> None:
        """End the hold this callback took, if any (idempotent): for a `finally` around
        `trainer.train()`; `with callback:` does the same. Raises `LeaseLost` when the lease
        had lapsed during the hold."""
        with self._lock:
            if not self._holding:
                return
            self._holding = False
            self._until = None
            if self._given_back:  # inside released(): the client holds nothing of ours
                return
            self._client.release(self._group)

    def _release_after(self, event: Until) -> None:
        if self._until == event:
            self.release_hold()

    def __enter__(self) -> TimeSliceCallback:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.release_hold()
        except LeaseLost:
            if exc is None:
                raise
            log.info("lease already lost when training failed: %s", exc)

    # -- TrainerCallback events (transformers `trainer_callback.py`) ----------
    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self._hold()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        until = _last_due(control)
        if until is None:
            self.release_hold()
        else:
            with self._lock:
                self._until = until

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        until = _last_due(control)
        if until is not None:
            self._hold(until)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._release_after("log")

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._release_after("evaluate")

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._release_after("save")

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.release_hold()

    # -- giving the GPUs back inside a step ----------------------------------
    def _give_back(self) -> None:
        with self._lock:
            if self._given_back == 0 and self._holding:
                self._client.release(self._group)
            self._given_back += 1

    def _take_back(self) -> None:
        with self._lock:  # a scope entered while this waits for the grant finds the hold back and gives it again
            self._given_back -= 1
            if self._given_back == 0 and self._holding:
                self._client.acquire(self._group, timeout=self._timeout, priority=self._priority)

    def released(self) -> _Released:
        """A context manager and decorator (plain and `async def` functions) that gives the
        group back for its duration when this callback holds it, and waits for the grant
        again at its end (also when the body raises). Outside a hold it does nothing.
        Concurrent scopes (TRL gathers `async` reward functions) share one give-back: the last
        to end takes the hold again. Raises at its end what `acquire()` raises."""
        return _Released(self)


class _Released:
    """`TimeSliceCallback.released()`: one object that is a context manager and a decorator."""

    def __init__(self, owner: TimeSliceCallback) -> None:
        self._owner = owner

    def __enter__(self) -> None:
        self._owner._give_back()

    def __exit__(self, *exc: object) -> None:
        self._owner._take_back()

    async def __aenter__(self) -> None:
        await asyncio.to_thread(self._owner._give_back)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self._owner._take_back)

    def __call__(self, fn: F) -> F:
        return decorate(self, fn)
