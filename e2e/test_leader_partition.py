"""Leader election across 20 partitions from the real API server (issue 24, item 1).

Two `timeslice controller --leader-election` replicas run as host processes (as in
test_leader_serving), each reaching the local cluster's API server through a TCP proxy of its
own (tests/test_leader_election.Proxy; TLS passes through it). Twenty times, the serving
replica's proxy is made a black hole (it accepts and reads, forwards nothing, closes nothing:
a partition its connections do not notice). The cut-off leader must log that it stops
serving before the standby logs that it serves (never two replicas serving), and exit; a
fresh replica then stands by for the next round."""

from __future__ import annotations

import asyncio
import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.plugin_fixtures import apply_base, token_kubeconfig
from e2e.test_timeslicing import Controller
from tests.test_leader_election import Proxy

PARTITIONS = 20
DEADLINE = 60.0  # seconds one step may take on a loaded machine


def _at(c: Controller, text: str) -> datetime.datetime | None:
    """When `c` first logged a line containing `text` (the line's timestamp), or None."""
    line = next((x for x in c.text().splitlines() if text in x), None)
    return None if line is None else datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


async def _until(check: Any, what: str, *shown: Controller) -> None:
    deadline = asyncio.get_running_loop().time() + DEADLINE
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not within {DEADLINE} s; " + "; ".join(
                f"{Path(c.log_path).stem}: {c.text().splitlines()[-8:]}" for c in shown))
        await asyncio.sleep(0.1)


@pytest.mark.timeout(900)
async def test_a_partitioned_leader_stops_serving_before_the_standby_serves_twenty_times(kube, tmp_path) -> None:
    apply_base(kube, "namespace.yaml", "rbac-controller.yaml")
    base = yaml.safe_load(token_kubeconfig(kube, "timeslice-controller", tmp_path / "ctl.kubeconfig").read_text())
    server = base["clusters"][0]["cluster"]["server"]  # https://127.0.0.1:6443
    host, port = server.removeprefix("https://").rsplit(":", 1)
    assert host == "127.0.0.1", server
    made: list[tuple[Controller, Proxy]] = []

    async def replica(name: str) -> tuple[Controller, Proxy]:
        proxy = Proxy(int(port))
        await proxy.start()
        config = yaml.safe_load(yaml.safe_dump(base))
        config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.url.rsplit(':', 1)[1]}"
        path = tmp_path / f"{name}.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        c = Controller(tmp_path, name, str(path), listen=f"unix://{tmp_path / (name + '.sock')}")
        made.append((c, proxy))
        return c, proxy

    try:
        leader, leader_proxy = await replica("r0")
        await _until(lambda: _at(leader, "controller serving"), "r0 leading and serving", leader)
        standby, standby_proxy = await replica("r1")
        await _until(lambda: _at(standby, "waiting for leadership"), "r1 standing by", standby)
        for i in range(PARTITIONS):
            leader_proxy.hang()
            await _until(lambda s=standby: _at(s, "controller serving"), f"partition {i}: the standby serving",
                         leader, standby)
            stopped, serving = _at(leader, "controller stops serving"), _at(standby, "controller serving")
            assert stopped is not None and serving is not None and stopped < serving, (
                f"partition {i}: two replicas served at once", stopped, serving, leader.text().splitlines()[-6:])
            await _until(lambda c=leader: c.proc.poll() is not None, f"partition {i}: the cut-off leader exits",
                         leader)
            leader, leader_proxy = standby, standby_proxy
            standby, standby_proxy = await replica(f"r{i + 2}")
            await _until(lambda s=standby: _at(s, "waiting for leadership"), f"r{i + 2} standing by", standby)
    finally:
        for c, proxy in made:
            c.stop()
            await proxy.stop()
