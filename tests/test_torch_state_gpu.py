"""`timeslice.torch` on a real GPU (marked `gpu`; skipped without PyTorch and CUDA).

A cooperative checkpoint empties PyTorch's caching allocator (NVML must show the memory
free); the restore gives the cache back what it held, so that the job's next phase
allocates as it did before it was moved, with no `cudaMalloc` (on the H200, shape b's
generate phases ran 3.3 s alone and 4.3-9.9 s shared while other processes copied, pinned
and freed: bench/results/rl-grpo-b-serve-cooperative-declared-*-h200.json).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs PyTorch with CUDA")]


def phase(model: torch.nn.Module) -> torch.Tensor:
    """A phase that allocates and frees more than the model: 300 MB and 200 MB of scratch."""
    a = torch.ones(300 << 20, dtype=torch.uint8, device="cuda")
    b = torch.ones(200 << 20, dtype=torch.uint8, device="cuda")
    out = model(torch.ones(8, 1024, device="cuda")).sum() + a[0] + b[0]
    del a, b
    return out


def test_a_restore_refills_the_allocator_cache_so_the_next_phase_calls_no_cudamalloc() -> None:
    from timeslice.torch import WARM_MIN_BYTES, TorchState

    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)).cuda()
    params = [p.detach().clone() for p in model.parameters()]
    first = phase(model)
    torch.cuda.synchronize()
    state = TorchState([model])
    reserved = torch.cuda.memory_reserved()
    assert state.checkpoint([])[0] > 0
    assert torch.cuda.memory_reserved() < reserved - (400 << 20)  # the cache went with the state
    assert state.restore([]) > 0
    assert torch.cuda.memory_reserved() >= reserved - WARM_MIN_BYTES
    allocs = torch.cuda.memory_stats()["num_device_alloc"]
    again = phase(model)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["num_device_alloc"] == allocs  # served from the refilled cache
    assert torch.equal(first, again)
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
