"""GPU discovery: fake profiles everywhere; NVML where a GPU driver is (marked `gpu`)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
from timeslice.driver.errors import FailedPrecondition, GpuDiscoveryError
from timeslice.kubelet_plugin.devices import (
    CONTROL_DEVICE_NODES,
    FAKE_PROFILES,
    GpuInfo,
    discover_gpus,
    fake_uuid,
    parse_fake_profile,
)


def test_fake_h200_profile() -> None:
    gpus = discover_gpus("4xH200", node="node-a")
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert [g.uuid for g in gpus] == [f"GPU-fake-node-a-{i}" for i in range(4)]
    for g in gpus:
        assert g.fake
        assert (g.product_name, g.architecture, g.cuda_compute_capability) == ("NVIDIA H200", "Hopper", "9.0")
        assert g.memory_bytes == 143771 * 2**20  # what NVML reports on the H200 host
        assert g.driver_version == "580.159.04"
    assert gpus[2].device_node == "/dev/nvidia2"
    assert gpus[2].device_nodes == ()  # fake: nothing to pass through
    real = dataclasses.replace(gpus[2], fake=False)
    assert real.device_nodes == ("/dev/nvidia2", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
    assert CONTROL_DEVICE_NODES == real.device_nodes[1:]


def test_fake_h100_profile_and_case() -> None:
    gpus = discover_gpus("2xh100", node="n")
    assert len(gpus) == 2
    assert gpus[0].product_name == "NVIDIA H100 80GB HBM3"
    assert gpus[0].memory_bytes == 81559 * 2**20
    assert gpus[0].architecture == "Hopper" and gpus[0].cuda_compute_capability == "9.0"


def test_fake_gpus_are_deterministic_per_node() -> None:
    assert discover_gpus("2xH200", node="a") == discover_gpus("2xH200", node="a")
    assert {g.uuid for g in discover_gpus("2xH200", node="a")}.isdisjoint(
        g.uuid for g in discover_gpus("2xH200", node="b"))


def test_gpu_info_is_frozen() -> None:
    g = discover_gpus("1xH200", node="n")[0]
    assert isinstance(g, GpuInfo)
    with pytest.raises(AttributeError):
        g.index = 3  # type: ignore[misc]


@pytest.mark.parametrize("spec", ["4xA100", "2xB200", "1xH300"])
def test_unknown_model_names_the_known_ones(spec: str) -> None:
    with pytest.raises(ValueError, match="unknown model") as err:
        parse_fake_profile(spec)
    for known in FAKE_PROFILES:
        assert known in str(err.value)


@pytest.mark.parametrize("spec", ["H200", "4x", "x4", "0xH200", "4*H200", "", "-1xH200"])
def test_malformed_profiles(spec: str) -> None:
    with pytest.raises(ValueError, match="fake GPU profile"):
        parse_fake_profile(spec)


def test_long_node_names_keep_uuids_within_64_characters() -> None:
    node = "node-" + "x" * 240
    uuids = [fake_uuid(node, i) for i in range(12)]
    assert all(len(u) <= 64 and u.startswith("GPU-fake-node-x") for u in uuids)
    assert len(set(uuids)) == 12
    assert fake_uuid(node, 3) == fake_uuid(node, 3)
    assert fake_uuid(node, 3) != fake_uuid(node + "y", 3)


def _nvml_works() -> bool:
    if importlib.util.find_spec("pynvml") is None:
        return False
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is None, reason="nvidia-ml-py not installed")
def test_nvml_without_a_driver_is_a_clear_error() -> None:
    if _nvml_works():
        pytest.skip("NVML works here: this host has a GPU driver")
    with pytest.raises(GpuDiscoveryError, match=r"NVML did not start.*--fake-gpus") as err:
        discover_gpus(None)
    assert isinstance(err.value, FailedPrecondition) and not err.value.retryable


@pytest.mark.gpu
@pytest.mark.skipif(not _nvml_works(), reason="needs NVML and an NVIDIA GPU driver")
def test_nvml_discovery_on_a_gpu_host() -> None:
    import os

    gpus = discover_gpus(None)
    assert gpus, "NVML works but lists no GPU"
    assert [g.index for g in gpus] == list(range(len(gpus)))
    assert len({g.uuid for g in gpus}) == len(gpus)
    for g in gpus:
        print(g)
        assert not g.fake
        assert g.uuid.startswith("GPU-") and g.product_name.startswith("NVIDIA")
        assert g.architecture != "Unknown"
        major, minor = g.cuda_compute_capability.split(".")
        assert major.isdigit() and minor.isdigit()
        assert g.driver_version.split(".")[0].isdigit()
        assert g.memory_bytes > 1 << 30
        assert os.path.exists(g.device_node), g.device_node
