"""``python -m simulations.launch sim --engine inprocess [--seeds N]``: per-seed runs, seeds.json/.csv whose mean ± std
equal the per-seed metrics files' final values, and the error-band plot.  Tiny runs (3 nodes, 2 rounds, 2 local
steps), in-process: a few seconds."""

from __future__ import annotations

import csv
import json
import statistics

import pytest

from simulations.launch.__main__ import main

TINY = "num-server-rounds=2 local-steps=2 learning-curve=false train-loss-before=false"


def _last(run_dir) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return rows[-1]


def test_two_seeds_write_per_seed_runs_and_mean_std(tmp_path):
    rc = f"{TINY} output-dir='{tmp_path}' run-name='grp'"
    assert main(["sim", "--engine", "inprocess", "--seeds", "2", "--num-supernodes", "3", "--run-config", rc]) == 0
    out = tmp_path / "grp"
    data = json.loads((out / "seeds.json").read_text())
    assert data["seeds"] == [0, 1] and data["completed"] == 2
    finals = [_last(out / f"seed{s}") for s in (0, 1)]
    assert [f["round"] for f in finals] == [2, 2]
    acc = [f["test-accuracy"] for f in finals]
    loss = [f["test-loss"] for f in finals]
    assert [r["final_test_accuracy"] for r in data["per_seed"]] == acc
    assert data["final_test_accuracy"]["mean"] == pytest.approx(statistics.fmean(acc))
    assert data["final_test_accuracy"]["std"] == pytest.approx(statistics.stdev(acc))
    assert data["final_test_loss"]["mean"] == pytest.approx(statistics.fmean(loss))
    assert data["final_test_loss"]["std"] == pytest.approx(statistics.stdev(loss))
    # each seed is its own run with its own seed (different data split / init → different numbers)
    for s in (0, 1):
        assert json.loads((out / f"seed{s}" / "summary.json").read_text())["run_config"]["seed"] == s
    assert loss[0] != loss[1]
    with (out / "seeds.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["seed"] for r in rows] == ["0", "1", "mean", "std"]
    assert float(rows[2]["final_test_accuracy"]) == pytest.approx(statistics.fmean(acc))
    assert float(rows[3]["final_test_loss"]) == pytest.approx(statistics.stdev(loss))
    assert (out / "accuracy_band.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inprocess_engine_single_run(tmp_path):
    rc = f"{TINY} output-dir='{tmp_path}' run-name='one'"
    assert main(["sim", "--engine", "inprocess", "--num-supernodes", "3", "--run-config", rc]) == 0
    assert _last(tmp_path / "one")["round"] == 2


def test_seeds_needs_the_inprocess_engine():
    with pytest.raises(SystemExit):
        main(["sim", "--seeds", "2"])
