"""ResourceSlice building: seat-major order, splitting, API name and value rules, modes.

What the API server itself accepts is checked in e2e/test_resourceslices.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from timeslice.driver.names import DRIVER_NAME
from timeslice.kubelet_plugin.devices import discover_gpus
from timeslice.kubelet_plugin.resourceslices import (
    CONSUMABLE,
    MAX_DEVICES_PER_SLICE,
    SEATS,
    build_devices,
    build_slices,
    check_device,
    consumable_devices,
    is_qualified_name,
    seat_devices,
    semver,
    slice_name,
)

NODE, UID = "127.0.0.1", "6a1b0c9e-0000-4000-8000-000000000001"
C_IDENT_32 = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,31}$")


def gpus(n: int, model: str = "H200", node: str = NODE):
    return discover_gpus(f"{n}x{model}", node=node)


def names(devices) -> list[str]:
    return [d["name"] for d in devices]


def test_seats_are_published_seat_major() -> None:
    devices = seat_devices(gpus(3), seats_per_gpu=2)
    assert names(devices) == ["gpu-0-seat-0", "gpu-1-seat-0", "gpu-2-seat-0",
                              "gpu-0-seat-1", "gpu-1-seat-1", "gpu-2-seat-1"]
    assert [(d["attributes"]["index"]["int"], d["attributes"]["seat"]["int"]) for d in devices] == [
        (0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_seat_order_does_not_depend_on_discovery_order() -> None:
    g = gpus(4)
    assert seat_devices(list(reversed(g))) == seat_devices(g)


def test_default_is_four_seats_per_gpu() -> None:
    devices = build_devices(gpus(4))
    assert len(devices) == 16
    assert names(devices)[:5] == ["gpu-0-seat-0", "gpu-1-seat-0", "gpu-2-seat-0", "gpu-3-seat-0", "gpu-0-seat-1"]


def test_each_seat_carries_its_gpu() -> None:
    g = gpus(2)[1]
    d = next(d for d in build_devices(gpus(2)) if d["name"] == "gpu-1-seat-3")
    assert d["attributes"] == {
        "uuid": {"string": g.uuid},
        "physicalGpu": {"string": g.uuid},
        "index": {"int": 1},
        "productName": {"string": "NVIDIA H200"},
        "architecture": {"string": "Hopper"},
        "cudaComputeCapability": {"version": "9.0.0"},
        "driverVersion": {"version": "580.159.4"},
        "fake": {"bool": True},
        "seat": {"int": 3},
    }
    assert d["capacity"] == {"memory": {"value": str(143771 * 2**20)}}
    assert "allowMultipleAllocations" not in d


def test_real_gpus_are_not_marked_fake() -> None:
    real = [dataclasses.replace(g, fake=False, uuid=f"GPU-{i}") for i, g in enumerate(gpus(2))]
    for d in build_devices(real):
        assert d["attributes"]["fake"] == {"bool": False}


def test_fake_gpus_are_marked_fake_in_every_mode() -> None:
    for mode in (SEATS, CONSUMABLE):
        devices = build_devices(gpus(2), mode)
        assert all(d["attributes"]["fake"] == {"bool": True} for d in devices)
        assert all(d["attributes"]["uuid"]["string"].startswith("GPU-fake-") for d in devices)


def test_consumable_mode_one_shareable_device_per_gpu() -> None:
    devices = build_devices(gpus(2, "H100"), CONSUMABLE)
    assert names(devices) == ["gpu-0", "gpu-1"]
    d = devices[0]
    assert d["allowMultipleAllocations"] is True
    assert d["attributes"]["seat"] == {"int": 0}  # its only seat: seats-mode constraints hold (issue 12, item 10)
    mem = 81559 * 2**20
    assert d["capacity"] == {"memory": {
        "value": str(mem),
        "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": str(mem), "step": str(2**20)}}}}


def test_consumable_max_is_a_multiple_of_the_step() -> None:
    odd = dataclasses.replace(gpus(1)[0], memory_bytes=80 * 2**30 + 12345)
    policy = consumable_devices([odd])[0]["capacity"]["memory"]["requestPolicy"]
    assert int(policy["validRange"]["max"]) == 80 * 2**30
    assert int(policy["validRange"]["max"]) % int(policy["validRange"]["step"]) == 0


def test_unknown_mode_and_bad_seat_count() -> None:
    with pytest.raises(ValueError, match="seats, consumable"):
        build_devices(gpus(1), "exclusive")
    with pytest.raises(ValueError, match="at least 1"):
        seat_devices(gpus(1), 0)


@pytest.mark.parametrize("mode", [SEATS, CONSUMABLE])
def test_attribute_names_are_qualified_names(mode: str) -> None:
    for d in build_devices(gpus(2), mode):
        assert len(d["attributes"]) + len(d["capacity"]) <= 32
        for key in [*d["attributes"], *d["capacity"]]:
            assert C_IDENT_32.match(key), key
            assert is_qualified_name(key) and is_qualified_name(f"{DRIVER_NAME}/{key}")
        check_device(d)


def test_qualified_name_rules() -> None:
    assert is_qualified_name("a" * 32) and not is_qualified_name("a" * 33)
    assert not is_qualified_name("physical-gpu") and not is_qualified_name("1gpu")
    assert is_qualified_name("resource.kubernetes.io/pcieRoot")
    assert not is_qualified_name("Bad_Domain/x") and not is_qualified_name("/x")


@pytest.mark.parametrize(("given", "want"), [("9.0", "9.0.0"), ("580.159.04", "580.159.4"), ("12", "12.0.0"),
                                             ("535.104.05", "535.104.5"), ("10.0.0", "10.0.0")])
def test_semver(given: str, want: str) -> None:
    assert semver(given) == want


@pytest.mark.parametrize("bad", ["", "9.0.0.1", "r580", "9.x", "9..0"])
def test_semver_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        semver(bad)


@pytest.mark.parametrize(("device", "message"), [
    ({"name": "GPU-0"}, "DNS label"),
    ({"name": "gpu-0", "attributes": {"physical-gpu": {"string": "x"}}}, "qualified name"),
    ({"name": "gpu-0", "attributes": {"a" * 33: {"int": 1}}}, "qualified name"),
    ({"name": "gpu-0", "attributes": {"x": {"int": 1, "string": "1"}}}, "exactly one"),
    ({"name": "gpu-0", "attributes": {"x": {"int": True}}}, "wrong type"),
    ({"name": "gpu-0", "attributes": {"x": {"string": "y" * 65}}}, "longer than 64"),
    ({"name": "gpu-0", "attributes": {"x": {"version": "9.0"}}}, "semver"),
    ({"name": "gpu-0", "attributes": {f"a{i}": {"int": i} for i in range(33)}}, "more than 32"),
])
def test_check_device_names_the_rule(device: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_device(device)


def test_one_slice_for_a_small_pool() -> None:
    (s,) = build_slices(NODE, UID, build_devices(gpus(4)), generation=7)
    assert s["apiVersion"] == "resource.k8s.io/v1" and s["kind"] == "ResourceSlice"
    assert s["metadata"] == {"name": f"{NODE}-{DRIVER_NAME}-000", "ownerReferences": [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": UID, "controller": True}]}
    assert s["spec"]["driver"] == DRIVER_NAME and s["spec"]["nodeName"] == NODE
    assert s["spec"]["pool"] == {"name": NODE, "generation": 7, "resourceSliceCount": 1}
    assert names(s["spec"]["devices"]) == names(build_devices(gpus(4)))


def test_split_at_128_devices_with_one_generation_and_count() -> None:
    devices = build_devices(gpus(40), seats_per_gpu=8)  # 320 devices
    slices = build_slices(NODE, UID, devices, generation=3)
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 128, 64]
    assert {json.dumps(s["spec"]["pool"], sort_keys=True) for s in slices} == {
        json.dumps({"generation": 3, "name": NODE, "resourceSliceCount": 3}, sort_keys=True)}
    assert [d["name"] for s in slices for d in s["spec"]["devices"]] == names(devices)  # order kept across slices
    assert [s["metadata"]["name"] for s in slices] == [f"{NODE}-{DRIVER_NAME}-{i:03d}" for i in range(3)]
    assert sorted(s["metadata"]["name"] for s in slices) == [s["metadata"]["name"] for s in slices]
    assert slices[0]["spec"]["devices"][:2] == devices[:2]
    assert names(slices[0]["spec"]["devices"])[39:41] == ["gpu-39-seat-0", "gpu-0-seat-1"]


def test_exactly_128_devices_fit_one_slice() -> None:
    assert len(build_slices(NODE, UID, build_devices(gpus(32)), 1)) == 1
    assert len(build_slices(NODE, UID, build_devices(gpus(33)), 1)) == 2


def test_empty_pool_is_one_empty_slice() -> None:
    (s,) = build_slices(NODE, UID, [], 1)
    assert s["spec"]["devices"] == [] and s["spec"]["pool"]["resourceSliceCount"] == 1


def test_build_is_deterministic_and_pure() -> None:
    devices = build_devices(gpus(8))
    before = copy.deepcopy(devices)
    a = build_slices(NODE, UID, devices, 2)
    b = build_slices(NODE, UID, build_devices(gpus(8)), 2)
    assert json.dumps(a, sort_keys=False) == json.dumps(b, sort_keys=False)
    a[0]["spec"]["devices"][0]["name"] = "changed"
    assert devices == before  # the slices own copies


def test_build_rejects_bad_input() -> None:
    devices = build_devices(gpus(1))
    with pytest.raises(ValueError, match="twice"):
        build_slices(NODE, UID, devices + devices[:1], 1)
    with pytest.raises(ValueError, match="generation"):
        build_slices(NODE, UID, devices, 0)
    with pytest.raises(ValueError, match="uid"):
        build_slices(NODE, "", devices, 1)
    with pytest.raises(ValueError, match="max devices"):
        build_slices(NODE, UID, devices, 1, max_devices=129)


def test_slice_names_fit_object_name_rules() -> None:
    long_node = ("a" * 60 + ".") * 4 + "b" * 10  # 254 characters
    name = slice_name(long_node, 2)
    assert len(name) <= 253 and name.endswith(f"-{DRIVER_NAME}-002")
    assert slice_name(long_node, 2) == name and slice_name(long_node + "c", 2) != name
    assert re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", name)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 80), seats=st.integers(1, 9), per_slice=st.integers(1, MAX_DEVICES_PER_SLICE),
       generation=st.integers(1, 2**40))
def test_slices_properties(n: int, seats: int, per_slice: int, generation: int) -> None:
    devices = seat_devices(gpus(n, node="n"), seats)
    slices = build_slices("n", UID, devices, generation, max_devices=per_slice)
    flat = [d for s in slices for d in s["spec"]["devices"]]
    assert flat == devices and len(flat) == n * seats
    assert all(0 < len(s["spec"]["devices"]) <= per_slice for s in slices)
    assert {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices} == {
        (generation, len(slices))}
    # seat-major: the k-th seat of every GPU comes before any (k+1)-th seat
    order = [(d["attributes"]["seat"]["int"], d["attributes"]["index"]["int"]) for d in flat]
    assert order == sorted(order)
    assert len({d["name"] for d in flat}) == len(flat)
