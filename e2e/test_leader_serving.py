"""A leader that cannot serve gives the Lease up (issue 12, item 1): its serving task failed
(here: its port is taken) while the leader-election library went on renewing the Lease, so
the standby never led. Two controller replicas as host processes, as in test_timeslicing."""

from __future__ import annotations

import socket
import time

import pytest

from e2e.plugin_fixtures import apply_base, token_kubeconfig, wait
from e2e.test_timeslicing import Controller

LEASE_SECONDS = 4  # the replicas' --lease-duration


@pytest.mark.timeout(180)
def test_a_leader_that_cannot_serve_steps_down_and_the_standby_leads(kube, tmp_path) -> None:
    apply_base(kube, "namespace.yaml", "rbac-controller.yaml")
    kubeconfig = str(token_kubeconfig(kube, "timeslice-controller", tmp_path / "ctl.kubeconfig"))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    blocked = Controller(tmp_path, "blocked", kubeconfig, listen=f"127.0.0.1:{taken.getsockname()[1]}")
    standby = None
    try:
        wait(lambda: "cannot serve yet" in blocked.text(), 60, "the first replica leads, and cannot serve")
        standby = Controller(tmp_path, "standby", kubeconfig, listen="127.0.0.1:0")
        exit_code = wait(lambda: blocked.proc.poll(), 60, "the replica that cannot serve exits")
        exited = time.monotonic()
        assert exit_code != 0 and "giving up the Lease and exiting" in blocked.text(), blocked.text()[-3000:]
        wait(lambda: "successfully acquired lease" in standby.text(), LEASE_SECONDS + 5, "the standby takes the Lease")
        assert time.monotonic() - exited <= LEASE_SECONDS + 5  # the target: lease duration + 5 s
        wait(lambda: "controller serving" in standby.text(), 60, "the standby serves")
    finally:
        taken.close()
        for c in (blocked, standby):
            if c is not None:
                c.stop()
