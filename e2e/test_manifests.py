"""manifests/ against the real API server: server-side dry run of the real-cluster
install, then the local-cluster overlay (hack/local-overlay) applied for real."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_manifests_pass_server_side_dry_run(kube) -> None:
    # A server-side dry run creates nothing, so objects in a new namespace would fail with
    # "namespace not found": create the two namespaces first (kubectl's documented limit).
    created = [ns for ns in ("timeslice-system", "timeslice-examples")
               if kube.run("create", "namespace", ns, check=False).returncode == 0]
    try:
        r = kube.run("apply", "--dry-run=server", "-k", str(ROOT / "manifests"))
    finally:
        for ns in created:
            kube.run("delete", "namespace", ns, "--wait=true", "--timeout=120s", check=False, timeout=180)
    for obj in ("deviceclass.resource.k8s.io/gpu.timeslice.dev", "daemonset.apps/timeslice-kubelet-plugin",
                "deployment.apps/timeslice-controller", "resourceclaimtemplate.resource.k8s.io/timesliced-gpu",
                "job.batch/rl-job-a", "clusterrole.rbac.authorization.k8s.io/timeslice-controller"):
        assert obj in r.stdout, r.stdout


def test_local_overlay_applies_for_real(kube) -> None:
    overlay = str(ROOT / "hack" / "local-overlay")
    try:
        kube.run("apply", "-k", overlay, timeout=120)
        ds = kube.run("get", "-n", "timeslice-system", "daemonset/timeslice-kubelet-plugin", "-o",
                      "jsonpath={.spec.template.spec.hostNetwork} {.spec.template.spec.containers[0].image}")
        assert ds.stdout == "true registry.local/timeslice/python:1"
        assert kube.run("get", "deviceclass", "gpu.timeslice.dev", "-o", "name").stdout.strip() == \
            "deviceclass.resource.k8s.io/gpu.timeslice.dev"
        tmpl = kube.run("get", "-n", "timeslice-examples", "resourceclaimtemplate/timesliced-gpu", "-o",
                        "jsonpath={.spec.spec.devices.requests[0].exactly.deviceClassName}")
        assert tmpl.stdout == "gpu.timeslice.dev"
        # least privilege: the plugin may publish slices but not write claim status
        can = kube.run("auth", "can-i", "create", "resourceslices.resource.k8s.io",
                       "--as=system:serviceaccount:timeslice-system:timeslice-kubelet-plugin", check=False)
        assert can.stdout.strip() == "yes"
        cannot = kube.run("auth", "can-i", "update", "resourceclaims/status",
                          "--as=system:serviceaccount:timeslice-system:timeslice-kubelet-plugin", check=False)
        assert cannot.stdout.strip() == "no"
    finally:
        kube.run("delete", "-k", overlay, "--ignore-not-found", "--wait=true", "--timeout=120s", check=False,
                 timeout=180)
