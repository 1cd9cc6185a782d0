"""Unit tests: TimeSliceConfig validation and precedence, CDI specs, the plugin checkpoint."""

from __future__ import annotations

import json

import pytest
from timeslice.driver import config
from timeslice.driver.errors import InvalidArgument
from timeslice.kubelet_plugin import cdi
from timeslice.kubelet_plugin.checkpoint import Checkpoint

OURS = {"driver": "gpu.timeslice.dev"}


def entry(params: dict, requests: list[str] | None = None, source: str = "FromClaim") -> dict:
    return {"source": source, "requests": requests or [], "opaque": {**OURS, "parameters": params}}


def cfg(**kw: object) -> dict:
    return {"apiVersion": "timeslice.dev/v1alpha1", "kind": "TimeSliceConfig", **kw}


def test_later_config_replaces_earlier_as_a_whole_per_request() -> None:
    got = config.resolve([
        entry(cfg(priority=5, backend="freeze"), source="FromClass"),
        entry(cfg(leaseSeconds=30), requests=["trainer"]),
        {"source": "FromClaim", "requests": [], "opaque": {"driver": "other.example.com", "parameters": {"x": 1}}},
    ], ["trainer", "sampler"])
    assert got["trainer"].leaseSeconds == 30 and got["trainer"].priority == 0  # replaced, not merged
    assert got["sampler"].priority == 5 and got["sampler"].backend == "freeze"


def test_defaults_without_config() -> None:
    assert config.resolve([], ["gpu"])["gpu"] == config.DEFAULT


@pytest.mark.parametrize(("params", "message"), [
    (cfg(color="red"), "color: Extra inputs are not permitted"),
    (cfg(priority="high"), "priority: Input should be a valid integer"),
    (cfg(backend="magic"), "backend: Input should be 'auto', 'cuda'"),
    (cfg(leaseSeconds=-1), "leaseSeconds: Input should be greater than 0"),
    ({"kind": "TimeSliceConfig"}, "apiVersion: Field required"),
    ("not an object", "(object)"),
])
def test_bad_config_names_the_field(params: object, message: str) -> None:
    with pytest.raises(InvalidArgument, match="invalid TimeSliceConfig in config\\[0\\]") as err:
        config.resolve([{"source": "FromClaim", "opaque": {**OURS, "parameters": params}}], ["gpu"])
    assert message in str(err.value)


def test_cdi_env_keys_are_unique_per_device_and_claim(tmp_path) -> None:
    a = cdi.ClaimSpec("uid-a", "ns", "claim-a", (cdi.CdiDevice("gpu-0-seat-0", "GPU-0", ("/dev/nvidia0",)),),
                      orchestrator="10.0.0.1:50051", shared_device_nodes=("/dev/nvidiactl",))
    b = cdi.ClaimSpec("uid-b", "ns", "claim-b", (cdi.CdiDevice("gpu-1-seat-0", "GPU-1"),),
                      orchestrator="10.0.0.1:50051")
    keys: dict[str, set[str]] = {}
    for spec in (a, b):
        path = cdi.write(tmp_path, spec)
        doc = json.loads(path.read_text())
        assert doc["kind"] == "timeslice.dev/gpu" and path.name == f"timeslice.dev-gpu_{spec.claim_uid}.json"
        envs = doc["containerEdits"]["env"] + [e for d in doc["devices"] for e in d["containerEdits"]["env"]]
        for kv in envs:
            k, v = kv.split("=", 1)
            keys.setdefault(k, set()).add(v)
    assert all(len(v) == 1 for v in keys.values()), keys  # a repeated key has one value everywhere
    assert keys["TIMESLICE_DEVICE_GPU_0_SEAT_0"] == {"GPU-0"} and "TIMESLICE_CLAIM_UID_A" in keys
    assert a.cdi_id("gpu-0-seat-0") == "timeslice.dev/gpu=uid-a-gpu-0-seat-0"
    assert not any("JOB" in k for k in keys)
    cdi.remove(tmp_path, "uid-a")
    cdi.remove(tmp_path, "uid-a")  # idempotent
    assert [p.name for p in tmp_path.iterdir()] == ["timeslice.dev-gpu_uid-b.json"]


def test_checkpoint_round_trip_and_corruption(tmp_path) -> None:
    path = tmp_path / "checkpoint.json"
    cp = Checkpoint(path)
    cp.put("uid-1", {"namespace": "ns", "name": "c", "devices": []})
    assert Checkpoint(path).claims == {"uid-1": {"namespace": "ns", "name": "c", "devices": []}}
    data = json.loads(path.read_text())
    data["claims"]["uid-1"]["name"] = "tampered"
    path.write_text(json.dumps(data))
    assert Checkpoint(path).claims == {}  # checksum mismatch: not trusted
    assert (tmp_path / "checkpoint.corrupt").exists()
    cp2 = Checkpoint(path)
    cp2.put("uid-2", {})
    assert cp2.pop("uid-2") == {} and cp2.pop("uid-2") is None
