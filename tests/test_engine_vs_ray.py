"""The in-process engine used for sweeps gives the same global model as the Ray simulation for the same seed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from simulations.engine import run_inprocess
from simulations.launch import launch_sim

pytestmark = pytest.mark.slow

CONFIG = {"method": "fedadam", "num-server-rounds": 3, "local-steps": 3, "batch-size": 16, "precision": "float64",
          "fraction-train": 0.5, "seed": 4, "fedadam.server-lr": 0.05}


def _toml(v):
    return f"'{v}'" if isinstance(v, str) else repr(v)


def test_inprocess_engine_matches_ray_simulation(tmp_path):
    out = tmp_path / "out"
    cfg = {**CONFIG, "output-dir": str(out)}
    rc = launch_sim(6, " ".join(f"{k}={_toml(v)}" for k, v in {**cfg, "run-name": "ray"}.items()), tmp_path / "flwr",
                    timeout=600)
    assert rc == 0
    run_inprocess({**cfg, "run-name": "engine"}, 6)
    ray_model = torch.load(out / "ray" / "model.pt")
    eng_model = torch.load(out / "engine" / "model.pt")
    for k in ray_model:
        np.testing.assert_allclose(ray_model[k].numpy(), eng_model[k].numpy(), rtol=0, atol=1e-9, err_msg=k)
    rows = [[json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()] for name in ("ray", "engine")]
    assert [r["round"] for r in rows[0]] == [r["round"] for r in rows[1]] == [0, 1, 2, 3]
    for a, b in zip(*rows):
        assert a["test-loss"] == pytest.approx(b["test-loss"], abs=1e-9)
        assert a.get("replies-used") == b.get("replies-used")
    assert rows[1][-1]["test-loss"] < rows[1][0]["test-loss"]
