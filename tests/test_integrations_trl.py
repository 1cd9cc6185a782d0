"""`TimeSliceCallback` in TRL's `GRPOTrainer` (issue 13, item 3): a random 2-layer Llama of width
32 with a word-level tokenizer built here (no download), 2 GRPO steps on the CPU, against a real
orchestrator server. TRL generates and scores the completions inside the optimizer step
(`GRPOTrainer._prepare_inputs` -> `_generate_and_score_completions`), so a reward function
runs while the job holds the group, and one wrapped in `released()` runs while another job
holds it. Marked slow: about 10 s with TRL's import."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from timeslice import TimeSliceOrchestratorClient

from tests.integration_deps import need

torch = need("torch")
transformers = need("transformers")
trl = need("trl")
datasets = need("datasets")
tokenizers = need("tokenizers")
from timeslice.integrations.transformers import TimeSliceCallback  # noqa: E402  (imports transformers)

# TRL 1.16 / transformers 5.24 call transformers' own deprecated `gradient_checkpointing*` names
# (FutureWarning, in their code, not ours).
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")]


async def test_grpo_scores_inside_the_hold_and_released_rewards_give_it_back(target, tmp_path) -> None:
    await asyncio.to_thread(grpo, target, tmp_path)


def grpo(target: str, tmp_path: Path) -> None:
    client = TimeSliceOrchestratorClient(target, "a", "g")
    other = TimeSliceOrchestratorClient(target, "b", "g")
    hold = TimeSliceCallback(client, "g", timeout=60)
    seen: dict[str, list[object]] = {"held": [], "given": []}

    def length(completions: list[str], **kwargs: object) -> list[float]:
        seen["held"].append(client.holding("g") is not None)
        return [float(len(c)) for c in completions]

    @hold.released()
    def verifier(completions: list[str], **kwargs: object) -> list[float]:  # a CPU reward: no GPU state
        seen["given"].append((client.holding("g") is None, other.acquire(timeout=30).epoch))
        other.release()
        return [float("w1" in c) for c in completions]

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(62)}}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1))
    prompts = datasets.Dataset.from_dict({"prompt": [" ".join(f"w{(i + j) % 60}" for j in range(4))
                                                     for i in range(16)]})
    args = trl.GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, use_cpu=True, report_to=[], disable_tqdm=True,
                          save_strategy="no", logging_strategy="no")
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[length, verifier], args=args, train_dataset=prompts,
                              processing_class=tokenizer, callbacks=[hold])
    try:
        with hold:
            trainer.train()
        assert trainer.state.global_step == 2
        assert client.holding("g") is None
    finally:
        client.close()
        other.close()
    assert seen["held"] == [True, True]  # scoring runs inside the step's hold
    assert seen["given"] == [(True, 2), (True, 5)], seen  # a 1, b 2, a 3 (back), a 4 (step 2), b 5
