"""End-to-end with real Flower processes: Ray simulation and a local SuperLink + SuperNodes deployment.

Each test starts the real processes through ``simulations.launch`` (the same code path the README uses), checks the
run's status as reported by ``flwr ls`` and the metrics the ServerApp wrote, and asserts nothing is left running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from simulations.launch import launch_deploy, launch_sim

pytestmark = pytest.mark.slow


def _our_processes(home) -> list[str]:
    out = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if str(home) in line and not line.startswith("Z")]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_ray_simulation_with_10_supernodes(tmp_path, monkeypatch):
    # as with `.venv/bin/python -m simulations.launch` from a shell where the venv is NOT activated: Flower's own
    # processes must still find flower-superexec / flwr-serverapp (the launcher puts the venv's scripts on PATH)
    scripts = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", os.pathsep.join(x for x in os.environ["PATH"].split(os.pathsep) if x != scripts))
    out = tmp_path / "out"
    rc = launch_sim(10, f"method='fedadam' num-server-rounds=3 fraction-train=0.5 output-dir='{out}' run-name='sim'",
                    tmp_path / "flwr", timeout=600)
    assert rc == 0
    rows = _rows(out / "sim" / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert all(r["replies-used"] == 5 for r in rows[1:])
    assert (out / "sim" / "model.pt").exists()
    assert _our_processes(tmp_path / "flwr") == []


def test_ray_simulation_failure_is_reported(tmp_path):
    rc = launch_sim(2, "method='fedadam' fedadam.beta1=3.0 num-server-rounds=1", tmp_path / "flwr", timeout=300)
    assert rc == 1
    log = (tmp_path / "flwr" / "logs" / "flwr-run.log").read_text()
    assert "fedadam.beta1 = 3.0 is out of range" in log
    assert _our_processes(tmp_path / "flwr") == []


def test_local_deployment_superlink_and_two_supernodes(tmp_path):
    out = tmp_path / "out"
    rc = launch_deploy(2, f"method='fedprox' num-server-rounds=2 output-dir='{out}' run-name='dep'", tmp_path / "flwr",
                       timeout=600)
    assert rc == 0
    rows = _rows(out / "dep" / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2] and rows[-1]["replies-used"] == 2
    assert rows[-1]["test-loss"] < rows[0]["test-loss"]
    assert _our_processes(tmp_path / "flwr") == []
