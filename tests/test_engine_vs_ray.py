"""A real Ray simulation (``simulations.launch sim``, 10 SuperNodes) — and the in-process engine used for sweeps gives
the same global model as that Ray simulation for the same seed.

This one Ray run covers what used to be two (``test_runtime.py::test_ray_simulation_with_10_supernodes`` ran the same
method, rounds and sampling without the engine comparison): the launcher works from a shell whose venv is not
activated, 10 SuperNodes with half of them sampled per round (served by one ClientApp actor: ``ray_cpus=1``),
the ServerApp's metrics and model file, nothing left running — and every round's model and test loss equal the
engine's (float64: deterministic math, 1e-9).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from simulations.engine.inprocess import run_inprocess
from simulations.launch import launch_sim
from simulations.launch.flwr_cli import format_run_config
from tests.helpers import our_processes

pytestmark = pytest.mark.slow

NODES = 10
CONFIG = {"method": "fedadam", "num-server-rounds": 3, "local-steps": 3, "batch-size": 16, "precision": "float64",
          "fraction-train": 0.5, "seed": 4, "fedadam.server-lr": 0.05}


def test_ray_simulation_with_10_supernodes_matches_the_inprocess_engine(tmp_path, monkeypatch):
    # as with `.venv/bin/python -m simulations.launch` from a shell where the venv is NOT activated: Flower's own
    # processes must still find flower-superexec / flwr-serverapp (the launcher puts the venv's scripts on PATH)
    scripts = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", os.pathsep.join(x for x in os.environ["PATH"].split(os.pathsep) if x != scripts))
    out = tmp_path / "out"
    cfg = {**CONFIG, "output-dir": str(out)}
    rc = launch_sim(NODES, format_run_config({**cfg, "run-name": "ray"}),
                    tmp_path / "flwr", timeout=600, ray_cpus=1)
    assert rc == 0
    assert our_processes(tmp_path / "flwr") == []
    run_inprocess({**cfg, "run-name": "engine"}, NODES)
    ray_model = torch.load(out / "ray" / "model.pt")
    eng_model = torch.load(out / "engine" / "model.pt")
    assert ray_model.keys() == eng_model.keys()
    for k in ray_model:
        np.testing.assert_allclose(ray_model[k].numpy(), eng_model[k].numpy(), rtol=0, atol=1e-9, err_msg=k)
    rows = [[json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("ray", "engine")]
    assert [r["round"] for r in rows[0]] == [r["round"] for r in rows[1]] == [0, 1, 2, 3]
    assert all(r["replies-used"] == NODES // 2 for r in rows[0][1:])  # fraction-train 0.5 of 10 SuperNodes
    for a, b in zip(*rows, strict=True):
        assert a["test-loss"] == pytest.approx(b["test-loss"], abs=1e-9)
        assert a.get("replies-used") == b.get("replies-used")
    assert rows[1][-1]["test-loss"] < rows[1][0]["test-loss"]
