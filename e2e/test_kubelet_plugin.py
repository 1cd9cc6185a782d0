"""The DRA kubelet plugin with the real kubelet: registration, ResourceSlices, prepare
with CDI, unprepare, placement over GPUs, bad input, and restarts.

The plugin runs as a host process (fake GPUs: 2xH200, 4 seats each) with the
ServiceAccount token of manifests/base (so RBAC is the real, least one)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from e2e.plugin_fixtures import (
    CDI_DIR,
    PluginProcess,
    apply_base,
    checkpoint_claims,
    claim_pod,
    claim_template,
    devices_of,
    our_slices,
    pod_claims,
    pod_env,
    token_kubeconfig,
    unique,
    wait,
)


@pytest.fixture(scope="module")
def plugin(kube, node_name, tmp_path_factory):
    apply_base(kube, "namespace.yaml", "deviceclass.yaml", "admission-policy.yaml", "rbac-kubelet-plugin.yaml")
    work = tmp_path_factory.mktemp("plugin")
    p = PluginProcess(work, token_kubeconfig(kube, "timeslice-kubelet-plugin", work / "kubeconfig"), node_name)
    p.start()
    try:
        wait(lambda: len([d for s in our_slices(kube) for d in s["spec"]["devices"]]) == 8, 60,
             "8 published seats")
        wait(lambda: "registered with kubelet" in p.text(), 60, "registration")
        yield p
    finally:
        p.stop()
        print(p.text()[-4000:])


def test_slices_are_published_seat_major_and_republished(kube, plugin, node_name) -> None:
    slices = our_slices(kube)
    names = [d["name"] for s in slices for d in s["spec"]["devices"]]
    assert names[:4] == ["gpu-0-seat-0", "gpu-1-seat-0", "gpu-0-seat-1", "gpu-1-seat-1"]
    s = slices[0]["spec"]
    assert s["nodeName"] == node_name and s["pool"]["name"] == node_name and s["pool"]["resourceSliceCount"] == 1
    attrs = slices[0]["spec"]["devices"][0]["attributes"]
    assert attrs["fake"] == {"bool": True} and attrs["seat"] == {"int": 0} and "physicalGpu" in attrs
    generation = s["pool"]["generation"]
    kube.run("delete", "resourceslice", slices[0]["metadata"]["name"])
    wait(lambda: our_slices(kube) and our_slices(kube)[0]["spec"]["pool"]["generation"] > generation, 30,
         "slices re-published with a higher generation")


def test_pod_gets_cdi_env_and_unprepare_runs_when_it_ends(kube, namespace, plugin) -> None:
    claim_template(kube, namespace, "kp-one-seat")
    pod = unique("cdi")
    claim_pod(kube, namespace, pod, {"gpu": "kp-one-seat"})
    kube.wait_pod_phase(namespace, pod, {"Running"}, timeout=120)
    claim = pod_claims(kube, namespace, pod)["gpu"]
    uid, device = claim["metadata"]["uid"], devices_of(claim)[0]
    env = pod_env(kube, namespace, pod)
    key = "TIMESLICE_DEVICE_" + device.upper().replace("-", "_")
    assert env[key].startswith("GPU-fake-"), env
    assert env["TIMESLICE_ORCHESTRATOR"] == "127.0.0.1:50051"
    assert env["TIMESLICE_CLAIM_" + uid.upper().replace("-", "_")].endswith(claim["metadata"]["name"])
    assert not any("JOB" in k for k in env)  # no job identity through CDI
    spec = CDI_DIR / f"timeslice.dev-gpu_{uid}.json"
    assert spec.exists() and uid in checkpoint_claims(plugin.workdir)
    kube.run("delete", "pod", "-n", namespace, pod, "--wait=true", "--timeout=60s")
    wait(lambda: not spec.exists() and uid not in checkpoint_claims(plugin.workdir), 60, "unprepare")


def test_two_pods_land_on_different_gpus_while_idle_gpus_remain(kube, namespace, plugin) -> None:
    claim_template(kube, namespace, "kp-spread")
    pods = [unique("kp-spread"), unique("kp-spread")]
    for p in pods:
        claim_pod(kube, namespace, p, {"gpu": "kp-spread"})
    for p in pods:
        kube.wait_pod_phase(namespace, p, {"Running"}, timeout=120)
    gpus = {devices_of(pod_claims(kube, namespace, p)["gpu"])[0].split("-seat-")[0] for p in pods}
    assert gpus == {"gpu-0", "gpu-1"}
    kube.run("delete", "pod", "-n", namespace, *pods, "--wait=true", "--timeout=60s")


def test_container_with_two_claims_sees_both_intact(kube, namespace, plugin) -> None:
    claim_template(kube, namespace, "kp-first")
    claim_template(kube, namespace, "kp-second")
    pod = unique("two")
    claim_pod(kube, namespace, pod, {"trainer": "kp-first", "sampler": "kp-second"})
    kube.wait_pod_phase(namespace, pod, {"Running"}, timeout=120)
    env = pod_env(kube, namespace, pod)
    for claim in pod_claims(kube, namespace, pod).values():
        uid = claim["metadata"]["uid"]
        assert env["TIMESLICE_CLAIM_" + uid.upper().replace("-", "_")].endswith(claim["metadata"]["name"])
        assert "TIMESLICE_DEVICE_" + devices_of(claim)[0].upper().replace("-", "_") in env
    kube.run("delete", "pod", "-n", namespace, pod, "--wait=true", "--timeout=60s")


def test_count_two_with_the_seat_constraint_gets_two_physical_gpus(kube, namespace, plugin) -> None:
    claim_template(kube, namespace, "kp-pair", count=2, constraints=[{"matchAttribute": "gpu.timeslice.dev/seat"}])
    pod = unique("kp-pair")
    claim_pod(kube, namespace, pod, {"gpu": "kp-pair"})
    kube.wait_pod_phase(namespace, pod, {"Running"}, timeout=120)
    devices = devices_of(pod_claims(kube, namespace, pod)["gpu"])
    assert {d.split("-seat-")[0] for d in devices} == {"gpu-0", "gpu-1"}
    assert len({d.split("-seat-")[1] for d in devices}) == 1
    kube.run("delete", "pod", "-n", namespace, pod, "--wait=true", "--timeout=60s")
    bad = kube.run("apply", "-f", "-", check=False, input=(
        '{"apiVersion":"resource.k8s.io/v1","kind":"ResourceClaim","metadata":{"name":"nope","namespace":"'
        + namespace + '"},"spec":{"devices":{"requests":[{"name":"gpu","exactly":{"deviceClassName":'
        '"gpu.timeslice.dev","count":2}}]}}}'))
    assert bad.returncode != 0 and "matchAttribute: gpu.timeslice.dev/seat" in bad.stderr


def test_allocation_mode_all_gets_every_seat_of_a_gpu(kube, namespace, plugin) -> None:
    """Issue 11, item 6: a job that must not share takes a whole GPU (every seat of GPU 1, one
    claim): the admission policy lets it in and the plugin prepares the four seats."""
    claim_template(kube, namespace, "kp-whole", every_seat_of="device.attributes['gpu.timeslice.dev'].index == 1")
    pod = unique("kp-whole")
    claim_pod(kube, namespace, pod, {"gpu": "kp-whole"})
    kube.wait_pod_phase(namespace, pod, {"Running"}, timeout=120)
    assert sorted(devices_of(pod_claims(kube, namespace, pod)["gpu"])) == [f"gpu-1-seat-{k}" for k in range(4)]
    kube.run("delete", "pod", "-n", namespace, pod, "--wait=true", "--timeout=60s")


def test_malformed_config_fails_only_its_claim_with_an_event(kube, namespace, plugin) -> None:
    claim_template(kube, namespace, "kp-bad-config", config={"apiVersion": "timeslice.dev/v1alpha1",
                                                          "kind": "TimeSliceConfig", "backend": "magic"})
    claim_template(kube, namespace, "kp-good")
    bad, good = unique("bad"), unique("kp-good")
    claim_pod(kube, namespace, bad, {"gpu": "kp-bad-config"})
    claim_pod(kube, namespace, good, {"gpu": "kp-good"})
    kube.wait_pod_phase(namespace, good, {"Running"}, timeout=120)
    claim = wait(lambda: pod_claims(kube, namespace, bad).get("gpu"), 60, "bad pod's claim")

    def event() -> str:
        return kube.run("get", "events", "-n", namespace, "--field-selector",
                        f"involvedObject.name={claim['metadata']['name']},reason=PrepareFailed", "-o",
                        "jsonpath={.items[*].message}", check=False).stdout
    assert "backend: Input should be 'auto'" in wait(event, 60, "PrepareFailed event")
    assert kube.json("get", "pod", "-n", namespace, bad)["status"]["phase"] == "Pending"
    kube.run("delete", "pod", "-n", namespace, bad, good, "--wait=true", "--timeout=60s")


def test_plugin_and_kubelet_restarts_keep_the_pod_and_clean_up_later(kube, namespace, plugin) -> None:
    claim_template(kube, namespace, "kp-restart")
    pod = unique("kp-restart")
    claim_pod(kube, namespace, pod, {"gpu": "kp-restart"})
    kube.wait_pod_phase(namespace, pod, {"Running"}, timeout=120)
    uid = pod_claims(kube, namespace, pod)["gpu"]["metadata"]["uid"]
    spec = CDI_DIR / f"timeslice.dev-gpu_{uid}.json"
    spec.unlink()  # as after a reboot: /var/run/cdi is tmpfs
    plugin.stop()
    plugin.start()
    wait(lambda: spec.exists(), 60, "CDI spec recreated from the checkpoint")
    wait(lambda: plugin.text().count("registered with kubelet") >= 2, 60, "re-registration")
    hack = Path(__file__).resolve().parent.parent / "hack" / "local-cluster.sh"
    import subprocess
    subprocess.run([str(hack), "restart-kubelet"], check=True, capture_output=True, timeout=300)
    time.sleep(2)
    assert kube.json("get", "pod", "-n", namespace, pod)["status"]["phase"] == "Running"
    wait(lambda: len([d for s in our_slices(kube) for d in s["spec"]["devices"]]) == 8, 60,
         "slices back after the kubelet wiped them")
    kube.run("delete", "pod", "-n", namespace, pod, "--wait=true", "--timeout=90s")
    wait(lambda: not spec.exists() and uid not in checkpoint_claims(plugin.workdir), 90, "unprepare after restarts")
