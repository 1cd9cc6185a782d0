"""The model GPUs that tests put in place of the orchestrator's switcher accept every call the
orchestrator makes of `SwitchCoordinator.memory` (a drift once went unseen: a double without
`for_plan` failed only the rare schedule that took the new call, in CI)."""

from __future__ import annotations

import inspect

import pytest
from timeslice.controller.orchestrator.switch import SwitchCoordinator

from tests.faults.test_group_memory_schedules import GrowingGpu
from tests.faults.test_group_schedules import ModelGpu
from tests.test_residency import FakeGpu, HostGpu, SampledGpu, WatchedGpu


@pytest.mark.parametrize("double", [ModelGpu, GrowingGpu, FakeGpu, HostGpu, WatchedGpu, SampledGpu])
def test_a_model_gpu_takes_every_argument_of_the_switchers_memory(double: type) -> None:
    real = inspect.signature(SwitchCoordinator.memory)
    names = [p for p in real.parameters if p not in ("self", "spec", "jobs")]
    assert names == ["watch", "low_free", "for_plan"], "the switcher's memory() changed: update the doubles"
    inspect.signature(double.memory).bind(object(), object(), [], watch=1.0, low_free=0, for_plan=False)
