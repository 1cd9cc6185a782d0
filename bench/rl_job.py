#!/usr/bin/env python3
"""One deterministic GRPO-shaped RL job: generate (GPU) -> reward (CPU) -> train (GPU), `--steps` times.

Started by bench/rl_grpo.py, alone or several per GPU. The model is a random-initialised Llama-style
`LlamaForCausalLM` (no downloads), bf16 on cuda, float32 on cpu:

    size   hidden  layers  heads/kv  intermediate  vocab   parameters
    tiny       64       2     4/4          176       512   ~0.17 M  (CPU tests)
    small     512       4     8/8         1408      8192   ~21.2 M
    1b       2048      18    16/4         5632     32000   ~0.943 B (untied embeddings)

Each step, with B = --batch, P = --prompt-len, N = --new-tokens, V = vocab:
  generate  B/4 random prompts (token ids from a generator seeded by (seed, step)), each repeated 4 times,
            [B, P] int64; N tokens sampled at temperature 1 (Gumbel-max on float32 logits, noise from a
            device generator seeded by (seed, step)) with a KV cache -> completions [B, N] int64, to CPU.
  reward    on CPU, outside any hold: a pure-Python score in [0, 1] per completion (a function of the token
            ids only), then the same scoring repeated as busy work until --reward-seconds have passed.
  train     one policy-gradient step: A = (r - group mean) / (group std + 1e-4) over groups of 4 (sample std),
            loss = -mean(A * sum of the completion's token log-probs) over the B rows; one AdamW step (lr 1e-5).

The job is written as a user's job (docs/client.md): the client comes from the environment
(`TimeSliceOrchestratorClient()`: $TIMESLICE_ORCHESTRATOR, $TIMESLICE_GROUP, $TIMESLICE_JOB when set, and
whatever else the client reads from it, such as a declared memory), and its GPU memory grows after its first
hold as a real job's does: the first hold ("init") builds the model on the GPU and the --extra-gb tensor; AdamW's
state appears at the first train step, activations and the KV cache in each phase. Every GPU phase (init,
generate, train, and the final hash) runs inside `client.on_accelerators(--group)` and ends with
`torch.cuda.synchronize()`; with --no-orchestrator the holds are no-ops. Everything that decides the math
is seeded and shapes are fixed, and `torch.use_deterministic_algorithms(True)` is on, so the final parameters
are bitwise equal between a solo and a shared run of the same --seed.

Under `torchrun --nproc-per-node R` (WORLD_SIZE > 1) the job is R data-parallel ranks of one job (one client
each, the same TIMESLICE_JOB: they share its hold): rank r uses cuda:r (gloo on the CPU), its own prompts and
sampling streams (`prompt/r`, `sample/r`), and trains through DistributedDataParallel, so every train step
all-reduces the gradients over NCCL (gloo). Each train phase also all-reduces (r + 1) and records whether the sum
came out as R(R+1)/2 (`allreduce_ok`: a communicator broken by a switch shows here). Rank 0 prints the result.

Prints one JSON line to stdout at the end (logs go to stderr). Times are wall seconds; the `phases` entries
use `time.time()` (unix seconds, comparable across processes): `acquire` (acquire called), `granted` (acquire
returned), `done` (GPU work synchronised), `released` (release returned). `param_hash` is the sha256 of the
bytes of every parameter in `named_parameters()` order (copied to the host in the final hold, hashed after it);
`extra_ok` says the --extra-gb tensor's device checksum at the end equals the one taken when it was made.
Memory (bytes, cuda only, else 0): `peak_allocated_bytes` and `peak_reserved_bytes` (PyTorch's allocator),
`process_gpu_bytes` (NVML's count for this process at the end, its CUDA context included; null when unknown).

    python bench/rl_job.py --seed 1 --size tiny --device cpu --no-orchestrator --steps 2 --reward-seconds 0.1
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import logging
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

T_START = time.time()  # stands for process start (Python's own start-up, ~tens of ms, is not counted)

GROUP = 4  # completions per prompt
LR = 1e-5
HASH_CHUNK = 1 << 28  # bytes copied to the host at a time while hashing
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 4, "vocab_size": 512},
    "small": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 8, "vocab_size": 8192},
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 18, "num_attention_heads": 16,
           "num_key_value_heads": 4, "vocab_size": 32000},
}

log = logging.getLogger("rl_job")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="job identity: seeds the model, prompts and sampling")
    p.add_argument("--size", choices=sorted(SIZES), default="1b", help="model size (see the module docstring)")
    p.add_argument("--steps", type=int, default=5, help="RL steps (generate, reward, train)")
    p.add_argument("--batch", type=int, default=16, help=f"completions per step, a multiple of {GROUP}")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per completion (exactly)")
    p.add_argument("--reward-seconds", type=float, default=3.0,
                   help="length of the CPU reward phase (scoring, then busy work up to this many seconds)")
    p.add_argument("--extra-gb", type=float, default=0.0,
                   help="extra resident device tensor of this many GB (1e9 bytes), never changed, hashed at the end")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="bf16 on cuda, float32 on cpu")
    p.add_argument("--group", help="the lock group every GPU phase holds (default: the client's, $TIMESLICE_GROUP)")
    p.add_argument("--no-orchestrator", action="store_true",
                   help="run alone without the time-slicing client (solo baseline)")
    p.add_argument("--register", choices=["none", "all"], default="all",
                   help="all: timeslice.torch.register before the first acquire (the node's pool is pinned while the "
                        "job waits), then the model, optimizer and extra tensor added inside the first hold")
    args = p.parse_args(argv)
    if args.batch <= 0 or args.batch % GROUP:
        p.error(f"--batch must be a positive multiple of {GROUP}")
    if args.steps < 0 or args.prompt_len < 1 or args.new_tokens < 1 or args.extra_gb < 0:
        p.error("--steps must be >= 0, --prompt-len and --new-tokens >= 1, --extra-gb >= 0")
    return args


def stream_seed(seed: int, step: int, stream: str) -> int:
    """A 63-bit generator seed for one (job, step, purpose): independent streams, same on every device."""
    digest = hashlib.sha256(f"{seed}/{step}/{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def usage() -> dict[str, float]:
    """This process's counters that say where a phase's time went: CPU seconds (and of them in the kernel), major
    page faults,
    involuntary context switches (getrusage(2)), and PyTorch's CUDA allocator calls and retries
    (`torch.cuda.memory_stats`: a retry freed the allocator's cache to find memory)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    out = {"cpu_s": r.ru_utime + r.ru_stime, "sys_s": r.ru_stime, "majflt": float(r.ru_majflt),
           "nivcsw": float(r.ru_nivcsw)}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        out.update(cuda_allocs=float(stats.get("num_device_alloc", 0)), alloc_retries=float(stats.get(
            "num_alloc_retries", 0)))
    return out


class Holds:
    """Runs blocks inside a hold on the GPU group (or a no-op) and records each as a phase."""

    def __init__(self, client: Any, group: str, synchronize: Callable[[], None]) -> None:
        self.client = client
        self.group = group
        self.synchronize = synchronize
        self.phases: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def phase(self, kind: str, step: int) -> Iterator[dict[str, float]]:
        """A hold around the block; the block may add its own counters to the dict it gets (kept with `usage`)."""
        scope = self.client.on_accelerators(self.group) if self.client is not None else contextlib.nullcontext()
        record: dict[str, Any] = {"kind": kind, "step": step, "acquire": time.time()}
        with scope:
            record["granted"] = time.time()
            before = usage()
            own: dict[str, float] = {}
            yield own
            self.synchronize()
            record["done"] = time.time()
            spent = {k: v - before.get(k, 0.0) for k, v in usage().items()} | own
        record["released"] = time.time()
        record["usage"] = {k: round(v, 4) for k, v in spent.items()}
        self.phases.append(record)
        log.info("%s step=%d wait=%.3fs busy=%.3fs %s", kind, step, record["granted"] - record["acquire"],
                 record["done"] - record["granted"], " ".join(f"{k}={v:.3g}" for k, v in spent.items()))

    def busy_seconds(self) -> float:
        return sum(r["done"] - r["granted"] for r in self.phases)

    def wait_seconds(self) -> float:
        return sum(r["granted"] - r["acquire"] for r in self.phases)


def score(prompt: list[int], completion: list[int]) -> float:
    """Toy verifiable reward in [0, 1] from token ids only: half the share of completion tokens congruent to the
    prompt's last token mod 8, half the longest common subsequence of the two sequences mod 8 over the prompt
    length (an O(P*N) dynamic programme: real CPU work)."""
    target = prompt[-1] % 8
    hits = sum(1 for t in completion if t % 8 == target) / len(completion)
    a = [t % 8 for t in prompt]
    row = [0] * (len(a) + 1)  # row[i]: LCS of a[:i] and the completion so far; prev_diag: the previous row[i - 1]
    for t in completion:
        b = t % 8
        prev_diag = 0
        for i, x in enumerate(a, 1):
            prev_diag, row[i] = row[i], prev_diag + 1 if x == b else max(row[i], row[i - 1])
    return 0.5 * hits + 0.5 * row[-1] / len(a)


def rewards_for(prompts: list[list[int]], completions: list[list[int]], seconds: float) -> list[float]:
    """Score every completion, then keep the CPU busy re-scoring them until `seconds` have passed."""
    t0 = time.monotonic()
    rewards = [score(p, c) for p, c in zip(prompts, completions)]
    i = 0
    while time.monotonic() - t0 < seconds:
        score(prompts[i % len(prompts)], completions[i % len(prompts)])
        i += 1
    return rewards


def process_gpu_bytes() -> int | None:
    """GPU memory NVML counts for this process (its CUDA context and PyTorch's cache, summed over GPUs), or None
    without NVML or when NVML does not list this PID (a container's own PID namespace). PyTorch's cache never
    shrinks unless emptied, so at the end of a run alone it is the process's peak as the node agent sees it."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            used = [p.usedGpuMemory for i in range(pynvml.nvmlDeviceGetCount())
                    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))
                    if p.pid == os.getpid() and p.usedGpuMemory is not None]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no pynvml, no driver: not known
        return None
    return sum(used) if used else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format=f"%(asctime)s rl_job[seed={args.seed}] %(message)s")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS
    import torch
    import torch.nn.functional as F
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(args.seed)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if args.device == "cuda" and world > 1
                          else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    on_cuda = device.type == "cuda"
    dist = None
    if world > 1:
        import torch.distributed as dist

        if on_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if on_cuda else "gloo", device_id=device if on_cuda else None)

    def stream(name: str) -> str:  # rank r's own prompts and samples; a single process keeps the plain names
        return f"{name}/{rank}" if world > 1 else name

    config = LlamaConfig(**SIZES[args.size], max_position_embeddings=max(2048, args.prompt_len + args.new_tokens),
                         tie_word_embeddings=False, attn_implementation="sdpa")
    client = None
    if not args.no_orchestrator:
        from timeslice import TimeSliceOrchestratorClient

        client = TimeSliceOrchestratorClient()
    state = None
    if client is not None and args.register == "all":  # as docs/backends.md shows: before the first hold
        import timeslice.torch

        state = timeslice.torch.register(client, group_id=args.group)
    holds = Holds(client, args.group, (lambda: torch.cuda.synchronize(device)) if on_cuda else lambda: None)

    def extra_checksum() -> list[int] | None:
        """Two wrapping int64 sums over the extra tensor, on the device, in pieces (no full-size temporary): it
        never changes, so any byte a switch got wrong shows here (cheaper than hashing tens of GB on the host)."""
        if extra is None:
            return None
        with torch.no_grad():
            words = extra[: extra.numel() // 8 * 8].view(torch.int64)
            plain = torch.zeros((), dtype=torch.int64, device=device)
            weighted = torch.zeros((), dtype=torch.int64, device=device)
            step = HASH_CHUNK // 8
            for start in range(0, words.numel(), step):
                piece = words[start:start + step]
                weights = torch.arange(start + 1, start + 1 + piece.numel(), device=device, dtype=torch.int64)
                plain += piece.sum()
                weighted += (piece * weights).sum()
            return [int(plain.item()), int(weighted.item())]

    # The first hold makes the model and the extra tensor on the device, as a user's job does (a GPU shared with
    # jobs that fill it has room for a new job's state only once the orchestrator has made it); the optimizer's
    # state appears at the first train step, in a later hold.
    with holds.phase("init", -1):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # initialise in the run dtype: no float32 copy on the device
        try:
            with device:
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(default_dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        extra = None
        if args.extra_gb > 0:
            extra = torch.empty(round(args.extra_gb * 1e9), dtype=torch.uint8, device=device)
            gen = torch.Generator(device).manual_seed(stream_seed(args.seed, -1, "extra"))
            for start in range(0, extra.numel(), HASH_CHUNK):  # in pieces: no full-size temporary
                piece = extra[start:start + HASH_CHUNK]
                piece.copy_(torch.randint(0, 256, piece.shape, dtype=torch.uint8, device=device, generator=gen))
        extra_at_start = extra_checksum()
        if state is not None:
            state.add(model, optimizer, *([] if extra is None else [extra]))
    n_params = sum(p.numel() for p in model.parameters())
    trained = model
    if dist is not None:
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(model, device_ids=[device] if on_cuda else None)
    allreduce_ok: list[bool] = []
    # transformers 5.x renames forward's `past_key_values` to `cache`; the cache object is updated in place
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    vocab = config.vocab_size
    log.info("model %s: %d parameters, %s on %s; extra %d bytes", args.size, n_params, dtype, device,
             0 if extra is None else extra.numel())

    def sample(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """[B, V] float32 logits -> [B] token ids, Gumbel-max at temperature 1."""
        u = torch.rand(logits.shape, generator=gen, device=logits.device).clamp_min_(torch.finfo(torch.float32).tiny)
        return torch.argmax(logits - torch.log(-torch.log(u)), dim=-1)

    @torch.no_grad()
    def generate(prompts: torch.Tensor, step: int, counters: dict[str, float]) -> torch.Tensor:
        """[B, P] prompts (CPU) -> [B, N] sampled completions (CPU). Adds to `counters` the host time of the
        token loop's iterations (launch-bound: a slow one is this process kept off the CPU or blocked in the
        driver): median and longest in ms, and how many took over 10 ms."""
        model.eval()
        gen = torch.Generator(device).manual_seed(stream_seed(args.seed, step, stream("sample")))
        cache = {cache_kw: DynamicCache(config=config)}
        logits = model(input_ids=prompts.to(device), use_cache=True, logits_to_keep=1, **cache).logits
        tokens = []
        iteration_ms = []
        for i in range(args.new_tokens):
            t0 = time.perf_counter()
            tokens.append(sample(logits[:, -1, :].float(), gen))
            if i + 1 < args.new_tokens:
                logits = model(input_ids=tokens[-1][:, None], use_cache=True, **cache).logits
            iteration_ms.append((time.perf_counter() - t0) * 1e3)
        iteration_ms.sort()
        counters.update(token_ms_p50=iteration_ms[len(iteration_ms) // 2], token_ms_max=iteration_ms[-1],
                        tokens_over_10ms=float(sum(ms > 10 for ms in iteration_ms)))
        return torch.stack(tokens, dim=1).cpu()

    def train(prompts: torch.Tensor, completions: torch.Tensor, advantages: torch.Tensor) -> None:
        """One policy-gradient AdamW step on [B, P] prompts, [B, N] completions, [B] advantages (all CPU)."""
        model.train()
        ids = torch.cat([prompts, completions], dim=1).to(device)
        targets = completions.to(device)
        # positions P-1 .. P+N-2 predict the N completion tokens
        logits = trained(input_ids=ids[:, :-1], use_cache=False, logits_to_keep=args.new_tokens).logits
        nll = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1), reduction="none")
        logprob_sums = -nll.view(targets.shape).sum(dim=1)
        loss = -(advantages.to(device) * logprob_sums).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if dist is not None:  # the communicator still works after whatever switch came before
            check = torch.full((1,), float(rank + 1), device=device)
            dist.all_reduce(check)
            allreduce_ok.append(check.item() == world * (world + 1) / 2)

    def params_to_host() -> list[torch.Tensor]:
        """The parameters' bytes, copied to host memory (in a hold: a short GPU phase)."""
        with torch.no_grad():
            return [p.detach().contiguous().view(-1).view(torch.uint8).cpu() for _, p in model.named_parameters()]

    def sha256(chunks: list[torch.Tensor]) -> str:
        """On the CPU, outside any hold: hashing is not GPU work."""
        h = hashlib.sha256()
        for flat in chunks:
            for start in range(0, flat.numel(), HASH_CHUNK):
                h.update(flat[start:start + HASH_CHUNK].numpy())
        return h.hexdigest()


    mean_rewards: list[float] = []
    for step in range(args.steps):
        prompt_gen = torch.Generator().manual_seed(stream_seed(args.seed, step, stream("prompt")))
        distinct = torch.randint(0, vocab, (args.batch // GROUP, args.prompt_len), generator=prompt_gen)
        prompts = distinct.repeat_interleave(GROUP, dim=0)  # [B, P]: rows 4g .. 4g+3 share a prompt

        with holds.phase("generate", step) as counters:
            completions = generate(prompts, step, counters)

        t0 = time.monotonic()
        rewards = rewards_for(prompts.tolist(), completions.tolist(), args.reward_seconds)
        r = torch.tensor(rewards, dtype=torch.float32).view(-1, GROUP)
        advantages = ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)).view(-1)
        mean_rewards.append(sum(rewards) / len(rewards))
        log.info("reward step=%d mean=%.4f cpu=%.3fs", step, mean_rewards[-1], time.monotonic() - t0)

        with holds.phase("train", step):
            train(prompts, completions, advantages)

    with holds.phase("hash", args.steps):
        host_params = params_to_host()
        extra_at_end = extra_checksum()
        if dist is not None:  # the last CUDA work of the job: a job checkpointed after its last release
            dist.destroy_process_group()  # would block in NCCL's teardown until restored, i.e. for good
    digest = sha256(host_params)
    if client is not None:
        client.close()
    if rank != 0:
        return

    result = {
        "seed": args.seed,
        "size": args.size,
        "params": n_params,
        "steps": args.steps,
        "param_hash": digest,
        "extra_ok": extra_at_start == extra_at_end,
        "gpu_busy_seconds": holds.busy_seconds(),
        "wait_seconds": holds.wait_seconds(),
        "startup_seconds": holds.phases[0]["acquire"] - T_START,
        "total_seconds": time.time() - T_START,
        "phases": holds.phases,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if on_cuda else 0,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if on_cuda else 0,
        "process_gpu_bytes": process_gpu_bytes() if on_cuda else 0,
        "ranks": world,
        "allreduce_ok": allreduce_ok,
        "rewards": mean_rewards,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
