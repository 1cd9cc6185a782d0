"""The Helm chart manifests/helm/timeslice-dra (issue 13, item 5) renders, with default values,
exactly the objects of manifests/base, so the two installs never drift; its values change what
they say and bad values fail with helm's message. helm is built by hack/helm.sh on first use.
e2e/test_helm.py compares the local values with hack/local-driver and installs the chart."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from timeslice.cli.main import parser
from timeslice.driver import names

from tests.helm_chart import (
    BASE,
    CHART,
    LOCAL_VALUES,
    RenderError,
    by_key,
    differences,
    helm,
    kustomization_resources,
    render,
)

# the first test may build helm (hack/helm.sh)
pytestmark = pytest.mark.timeout(1800)


def objects(objs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def container(objs: list[dict], kind: str, name: str) -> dict:
    return objects(objs)[(kind, name)]["spec"]["template"]["spec"]["containers"][0]


def test_default_values_render_exactly_manifests_base() -> None:
    diff = differences(render(), kustomization_resources(BASE))
    assert not diff, ("the chart's defaults and manifests/base differ; change both (or the values):\n"
                      + "\n\n".join(diff))


def test_a_change_to_only_one_side_is_caught(tmp_path: Path) -> None:
    """The comparison above is not vacuous: a flag changed in a copy of manifests/base, or in a
    copy of the chart, makes it report that object and the change."""
    base = shutil.copytree(BASE, tmp_path / "base")
    plugin = base / "kubelet-plugin.yaml"
    plugin.write_text(plugin.read_text().replace('"--agent-tls", ', ""))
    diff = differences(render(), kustomization_resources(base))
    assert len(diff) == 1 and "timeslice-kubelet-plugin" in diff[0] and "+        - --agent-tls" in diff[0], diff

    chart = shutil.copytree(CHART, tmp_path / "chart")
    policy = chart / "templates" / "admission-policy.yaml"
    policy.write_text(policy.read_text().replace("failurePolicy: Ignore", "failurePolicy: Fail"))
    diff = differences(render(chart), kustomization_resources(BASE))
    assert len(diff) == 1 and "gpu.timeslice.dev-extended-resource" in diff[0] and "+  failurePolicy: Fail" in diff[0]

    (base / "controller.yaml").write_text((BASE / "controller.yaml").read_text() + "---\n" + yaml.safe_dump(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "extra", "namespace": "timeslice-system"}}))
    diff = differences(render(), kustomization_resources(base))
    assert "only in kustomize: ('v1', 'ConfigMap', 'timeslice-system', 'extra')" in diff, diff


def test_a_kustomization_doing_more_than_listing_files_is_not_read_as_one(tmp_path: Path) -> None:
    base = shutil.copytree(BASE, tmp_path / "base")
    kust = base / "kustomization.yaml"
    kust.write_text(kust.read_text() + "commonLabels: {team: gpu}\n")
    with pytest.raises(AssertionError, match=r"uses \['commonLabels'\]"):
        kustomization_resources(base)


def test_device_mode_fake_gpus_backends_and_image() -> None:
    objs = render(sets=["devices.sharing=consumable", "devices.fakeGPUs=2xH200", "devices.seats=8",
                        "backends={freeze,none}", "defaultBackend=freeze", "image.tag=0.2.0",
                        "image.pullPolicy=Always", "kubeletPlugin.logLevel=DEBUG"])
    plugin = container(objs, "DaemonSet", "timeslice-kubelet-plugin")
    assert plugin["command"][:8] == ["timeslice", "kubelet-plugin", "--fake-gpus", "2xH200", "--sharing",
                                     "consumable", "--seats", "8"]
    cmd = plugin["command"]
    assert cmd[cmd.index("--backends") + 1] == "freeze,none" and cmd[cmd.index("--log-level") + 1] == "DEBUG"
    controller = container(objs, "Deployment", "timeslice-controller")
    assert controller["command"][controller["command"].index("--default-backend") + 1] == "freeze"
    for c in (plugin, controller):
        assert (c["image"], c["imagePullPolicy"]) == ("ghcr.io/timeslice-dra/timeslice:0.2.0", "Always")
    # the plugin's parser takes the command it renders
    args = parser().parse_args(cmd[1:])
    assert (args.sharing, args.seats, args.fake_gpus) == ("consumable", 8, "2xH200")


def test_another_namespace_moves_every_object_and_the_names_that_carry_it() -> None:
    objs = render(sets=["namespace.name=gpu-sharing"])
    namespaced = [o for o in objs if o["kind"] not in ("Namespace", "DeviceClass", "ClusterRole",
                                                       "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                                                       "ValidatingAdmissionPolicyBinding")]
    assert namespaced and {o["metadata"]["namespace"] for o in namespaced} == {"gpu-sharing"}
    assert objects(objs)[("Namespace", "gpu-sharing")]
    subjects = [s for o in objs if o["kind"] in ("ClusterRoleBinding", "RoleBinding") for s in o["subjects"]]
    assert {s["namespace"] for s in subjects} == {"gpu-sharing"}
    cmd = container(objs, "DaemonSet", "timeslice-kubelet-plugin")["command"]
    # the agent's default allowed caller is timeslice-system's controller: name this one's
    assert cmd[cmd.index("--agent-allowed-users") + 1] == "system:serviceaccount:gpu-sharing:timeslice-controller"
    assert cmd[cmd.index("--orchestrator") + 1] == "timeslice-orchestrator.gpu-sharing.svc:50051"
    own_pod = objects(objs)[("ValidatingAdmissionPolicy", "timeslice-kubelet-plugin-own-pod")]
    assert "system:serviceaccount:gpu-sharing:timeslice-kubelet-plugin" in \
        own_pod["spec"]["matchConditions"][0]["expression"]
    assert ("Namespace", "gpu-sharing") not in objects(render(sets=["namespace.name=gpu-sharing",
                                                                   "namespace.create=false"]))


def test_agent_tls_off_is_refused_the_token_never_goes_in_clear() -> None:
    """The agents always take the controller's token (--agent-auth tokenreview); without TLS
    pinning their certificates it would go in clear to whoever listens on the agent port."""
    with pytest.raises(RenderError, match=r"agentTLS\.enabled=false is refused"):
        render(sets=["agentTLS.enabled=false"])
    default = objects(render())
    plugin = default[("DaemonSet", "timeslice-kubelet-plugin")]["spec"]["template"]["spec"]["containers"][0]
    controller = default[("Deployment", "timeslice-controller")]["spec"]["template"]["spec"]["containers"][0]
    assert "--agent-tls" in plugin["command"] and "--require-agent-tls" in controller["command"]


def test_scheduling_resources_replicas_probes(tmp_path: Path) -> None:
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "kubeletPlugin": {"nodeSelector": {"nvidia.com/gpu.present": "true"}, "tolerations": [toleration],
                          "livenessProbe": {"enabled": False}},
        "controller": {"nodeSelector": {"kubernetes.io/os": "linux"}, "replicas": 3,
                       "resources": {"limits": {"memory": "1Gi"}}, "leaderElection": {"leaseDuration": 30},
                       "metrics": {"port": 9090}}}))
    objs = render(values=[values])
    ds = objects(objs)[("DaemonSet", "timeslice-kubelet-plugin")]["spec"]["template"]["spec"]
    assert ds["nodeSelector"] == {"nvidia.com/gpu.present": "true"} and ds["tolerations"] == [toleration]
    assert "livenessProbe" not in ds["containers"][0] and "--liveness-file" not in ds["containers"][0]["command"]
    deploy = objects(objs)[("Deployment", "timeslice-controller")]["spec"]
    assert deploy["replicas"] == 3 and deploy["template"]["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}
    c = deploy["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"] == {"memory": "1Gi"} and "livenessProbe" in c
    assert c["command"][c["command"].index("--lease-duration") + 1] == "30"
    assert c["command"][c["command"].index("--metrics-listen") + 1] == "0.0.0.0:9090"
    assert {"name": "metrics", "containerPort": 9090} in c["ports"]
    assert deploy["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9090"


def test_host_network_controller_declares_no_ports_and_the_service_targets_the_number() -> None:
    objs = objects(render(values=[LOCAL_VALUES]))
    pod = objs[("Deployment", "timeslice-controller")]["spec"]["template"]
    assert pod["spec"]["hostNetwork"] is True and "ports" not in pod["spec"]["containers"][0]
    assert "annotations" not in pod["metadata"]  # metrics off
    assert objs[("Service", "timeslice-orchestrator")]["spec"]["ports"][0]["targetPort"] == 50051


@pytest.mark.parametrize("sets, message", [
    (["controller.leaderElection.enabled=false"], "controller.replicas > 1 needs controller.leaderElection.enabled"),
    (["devices.sharing=shared"], "devices.sharing"),
    (["backends={freeze,cooperative}"], "backends"),
    (["devices.fakeGPUs=H200"], "devices.fakeGPUs"),
    (["auth.clients=password"], "auth.clients"),
    (["controller.typo=1"], "typo"),
    (["kubeletPlugin.nodeSelector.gpu=true"], "want string"),  # --set makes a boolean of it
])
def test_bad_values_fail_with_a_message_naming_them(sets: list[str], message: str) -> None:
    with pytest.raises(RenderError, match=message.replace(".", r"\.")):
        render(sets=sets)
    render(sets=["controller.leaderElection.enabled=false", "controller.replicas=1"])  # one replica needs no Lease


def test_the_schema_offers_what_the_commands_take() -> None:
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())["properties"]
    assert tuple(schema["backends"]["items"]["enum"]) == names.BACKENDS
    sub = next(a for a in parser()._actions if a.dest == "command").choices  # argparse's subparsers
    choices = {(cmd, a.dest): list(a.choices) for cmd in ("kubelet-plugin", "controller")
               for a in sub[cmd]._actions if a.choices}
    assert schema["defaultBackend"]["enum"] == ["", *choices[("controller", "default_backend")]]
    assert schema["devices"]["properties"]["sharing"]["enum"] == ["", *choices[("kubelet-plugin", "sharing")]]
    assert schema["auth"]["properties"]["clients"]["enum"] == choices[("controller", "auth")]


def test_helm_lint_passes_strict() -> None:
    for values in ([], ["--values", str(LOCAL_VALUES)]):
        p = helm("lint", "--strict", str(CHART), *values)
        assert p.returncode == 0, p.stdout + p.stderr


def test_objects_are_unique() -> None:
    by_key(render(values=[LOCAL_VALUES]), "chart")


def test_gpu_node_values_mount_the_driver_select_gpu_nodes_and_pull_with_secrets(tmp_path: Path) -> None:
    """values-gpu-nodes.yaml (issue 24, item 2): the plugin on labelled GPU nodes only, tolerating
    the GPU taint, the host's driver root mounted read-only and named to the plugin; pull
    secrets on both pods."""
    gpu_values = CHART / "values-gpu-nodes.yaml"
    secrets = tmp_path / "secrets.yaml"
    secrets.write_text(yaml.safe_dump({"imagePullSecrets": [{"name": "regcred"}]}))
    objs = objects(render(values=[gpu_values, secrets]))
    pod = objs[("DaemonSet", "timeslice-kubelet-plugin")]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    command = pod["containers"][0]["command"]
    assert command[command.index("--driver-root"):][:4] == ["--driver-root", "/driver-root", "--driver-root-host", "/"]
    # the host's root: no propagation (it needs "/" shared or slave; the local cluster's runtime
    # refused the container: "path / is mounted on / but it is not a shared or slave mount")
    mount = {"name": "driver-root", "mountPath": "/driver-root", "readOnly": True}
    assert mount in pod["containers"][0]["volumeMounts"]
    assert {"name": "driver-root", "hostPath": {"path": "/", "type": "Directory"}} in pod["volumes"]
    operator = objects(render(values=[gpu_values], sets=["driver.root=/run/nvidia/driver"]))
    mounts = operator[("DaemonSet", "timeslice-kubelet-plugin")]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "driver-root", "mountPath": "/driver-root", "readOnly": True,
            "mountPropagation": "HostToContainer"} in mounts["volumeMounts"]  # a driver container's, mounted later
    controller = objs[("Deployment", "timeslice-controller")]["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == controller["imagePullSecrets"] == [{"name": "regcred"}]
    p = helm("lint", "--strict", str(CHART), "--values", str(gpu_values))
    assert p.returncode == 0, p.stdout + p.stderr
    with pytest.raises(RenderError, match="driver"):
        render(sets=["driver.root=relative/path"])
