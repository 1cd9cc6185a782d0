"""`timeslice.integrations.transformers.TimeSliceCallback` (issue 13, item 3) on real
`transformers.Trainer`s (a 2-layer GPT-2 of width 32, random weights, random tokens, on the
CPU) against a real orchestrator server: two trainers of two jobs sharing a group never
compute at once (training micro-batches, evaluation, checkpoints) and both finish;
`released()` gives the group to another job inside a step; a step that raises leaves no hold."""

from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from timeslice import TimeSliceOrchestratorClient

from tests.integration_deps import need

torch = need("torch")
transformers = need("transformers")
from timeslice.integrations.transformers import TimeSliceCallback  # noqa: E402  (imports transformers)


@dataclass(frozen=True)
class Span:
    """GPU work of one job: `kind` is "loss" (a training or evaluation batch) or "save"."""

    job: str
    kind: str
    start: float
    end: float
    held: bool  # the job's client held the group when the work began


def tiny_trainer(out: Path, client: TimeSliceOrchestratorClient, hold: TimeSliceCallback, spans: list[Span],
                 step: Any = None, **args: Any) -> Any:
    """A Trainer of a random 2-layer GPT-2 that records each batch's loss and each checkpoint
    as a Span; `step(trainer)` runs inside each training batch's loss."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 16))]
    job = client.job_id

    class Recording(transformers.Trainer):  # type: ignore[misc]
        def compute_loss(self, *a: Any, **kw: Any) -> Any:
            start, held = time.monotonic(), client.holding("g") is not None
            if step is not None and self.model.training:
                step(self)
            loss = super().compute_loss(*a, **kw)
            spans.append(Span(job, "loss", start, time.monotonic(), held))
            return loss

        def save_model(self, *a: Any, **kw: Any) -> None:
            start, held = time.monotonic(), client.holding("g") is not None
            super().save_model(*a, **kw)
            spans.append(Span(job, "save", start, time.monotonic(), held))

    settings = {"output_dir": str(out / job), "max_steps": 4, "per_device_train_batch_size": 2, "use_cpu": True,
                "report_to": [], "disable_tqdm": True, "save_strategy": "no", "logging_strategy": "no",
                "dataloader_num_workers": 0, **args}
    return Recording(model=transformers.GPT2LMHeadModel(config), args=transformers.TrainingArguments(**settings),
                     train_dataset=data, eval_dataset=data[:4], callbacks=[hold])


def train(trainer: Any, hold: TimeSliceCallback) -> None:
    with hold:
        trainer.train()


# The tests run their sync scenario in a worker thread: the orchestrator serves on the test's event loop.

async def test_two_trainers_sharing_a_group_never_compute_at_once(target, tmp_path) -> None:
    """Gradient accumulation (2 micro-batches a step), logging every step, evaluation and a
    checkpoint every 2 steps: all of it runs while the job holds the group, and never while
    the other job does."""
    await asyncio.to_thread(two_trainers, target, tmp_path)


def two_trainers(target: str, tmp_path: Path) -> None:
    spans: list[Span] = []
    clients = [TimeSliceOrchestratorClient(target, job, "g") for job in ("a", "b")]
    holds = [TimeSliceCallback(c, "g", timeout=60) for c in clients]
    trainers = [tiny_trainer(tmp_path, c, h, spans, gradient_accumulation_steps=2, logging_strategy="steps",
                             logging_steps=1, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                             save_steps=2, per_device_eval_batch_size=2)
                for c, h in zip(clients, holds)]
    try:
        with ThreadPoolExecutor(2) as pool:  # .result() raises what a trainer raised
            for done in [pool.submit(train, t, h) for t, h in zip(trainers, holds)]:
                done.result(timeout=120)
        assert [t.state.global_step for t in trainers] == [4, 4]
        assert [c.holding("g") for c in clients] == [None, None]
    finally:
        for c in clients:
            c.close()
    for job in "ab":
        kinds = [s.kind for s in spans if s.job == job]
        assert kinds.count("save") == 2 and kinds.count("loss") == 4 * 2 + 2 * 2, kinds  # + 2 evaluations x 2 batches
    assert all(s.held for s in spans), [s for s in spans if not s.held]
    a, b = ([s for s in spans if s.job == job] for job in "ab")
    overlaps = [(x, y) for x, y in itertools.product(a, b) if x.start < y.end and y.start < x.end]
    assert not overlaps, overlaps


async def test_released_gives_the_group_to_another_job_inside_a_step(target, tmp_path) -> None:
    """A reward-like function wrapped in `released()` runs without the hold: another job is
    granted meanwhile; the step has the hold again after it."""
    await asyncio.to_thread(released_in_a_step, target, tmp_path)


def released_in_a_step(target: str, tmp_path: Path) -> None:
    spans: list[Span] = []
    client = TimeSliceOrchestratorClient(target, "a", "g")
    other = TimeSliceOrchestratorClient(target, "b", "g")
    hold = TimeSliceCallback(client, "g", timeout=60)
    given: list[tuple[bool, int]] = []

    @hold.released()
    def reward() -> None:
        epoch = other.acquire(timeout=30).epoch  # only possible while a gave the group back
        given.append((client.holding("g") is None, epoch))
        other.release()

    trainer = tiny_trainer(tmp_path, client, hold, spans, step=lambda _: reward(), max_steps=2)
    try:
        train(trainer, hold)
        assert client.holding("g") is None
    finally:
        client.close()
        other.close()
    assert given == [(True, 2), (True, 5)]  # epochs: a 1, b 2, a 3 (back), a 4 (step 2), b 5
    assert [s.held for s in spans] == [True, True], spans  # the loss ran with the hold back


async def test_concurrent_async_released_scopes_give_back_once(target) -> None:
    """TRL gathers `async` reward functions: scopes open at once share one give-back, and the
    last to end takes the hold again."""
    await asyncio.to_thread(concurrent_released, target)


def concurrent_released(target: str) -> None:
    client = TimeSliceOrchestratorClient(target, "a", "g")
    other = TimeSliceOrchestratorClient(target, "b", "g")
    hold = TimeSliceCallback(client, "g", timeout=60)

    async def rewards() -> list[bool]:
        second_in, first_done = asyncio.Event(), asyncio.Event()

        @hold.released()
        async def first() -> bool:
            await second_in.wait()
            await asyncio.to_thread(other.acquire, timeout=30)
            await asyncio.to_thread(other.release)
            return client.holding("g") is None

        @hold.released()
        async def second() -> bool:
            second_in.set()
            await first_done.wait()
            return client.holding("g") is None  # first's scope ended, this one is still open

        async def first_then_signal() -> bool:
            given_back = await first()
            first_done.set()
            return given_back

        return list(await asyncio.gather(first_then_signal(), second()))

    try:
        hold.on_step_begin(None, None, None)
        assert asyncio.run(rewards()) == [True, True]
        assert client.holding("g") is not None
        hold.on_step_end(None, None, transformers.TrainerControl())
        assert client.holding("g") is None
    finally:
        client.close()
        other.close()


async def test_a_step_that_raises_leaves_no_hold(target, tmp_path) -> None:
    await asyncio.to_thread(raising_step, target, tmp_path)


def raising_step(target: str, tmp_path: Path) -> None:
    spans: list[Span] = []
    client = TimeSliceOrchestratorClient(target, "a", "g")
    other = TimeSliceOrchestratorClient(target, "b", "g")
    hold = TimeSliceCallback(client, "g", timeout=60)

    def fail_in_second_step(trainer: Any) -> None:
        if trainer.state.global_step == 1:
            raise RuntimeError("reward model crashed")

    trainer = tiny_trainer(tmp_path, client, hold, spans, step=fail_in_second_step)
    try:
        with pytest.raises(RuntimeError, match="reward model crashed"):
            train(trainer, hold)
        assert client.holding("g") is None
        # granted at once, well within the 10 s a lapsed lease would take: a's hold was released
        assert other.acquire(timeout=5).epoch == 3  # a 1, a 2, b 3
        other.release()
    finally:
        client.close()
        other.close()


def test_with_no_orchestrator_configured_the_callback_holds_nothing_and_says_so(monkeypatch, caplog) -> None:
    """An integration with no orchestrator configured raised (building the client) where it
    should do nothing: `TimeSliceCallback()` from an environment without
    `$TIMESLICE_ORCHESTRATOR` lets the trainer run as without it, with one warning (issue 25)."""
    import logging

    monkeypatch.delenv("TIMESLICE_ORCHESTRATOR", raising=False)
    caplog.set_level(logging.WARNING, "timeslice")
    hold = TimeSliceCallback(group_id="g")
    args, state, control = None, transformers.TrainerState(), transformers.TrainerControl()
    with hold:
        for _ in range(2):
            hold.on_step_begin(args, state, control)
            with hold.released():
                pass
            hold.on_step_end(args, state, control)
        hold.on_train_end(args, state, control)
    assert [r.getMessage() for r in caplog.records if "no orchestrator configured" in r.getMessage()]
