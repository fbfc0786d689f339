"""Reproduction suite (``simulations/reproduce.py``): files, columns, and numbers that match the runs' metrics files."""

from __future__ import annotations

import csv
import json
import math
import statistics

import numpy as np
import pytest

from simulations import reproduce as R

ROUNDS = 3


def metrics(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("rep")
    assert R.main(["004", "--quick", "--seeds", "2", "--rounds", str(ROUNDS), "--out", str(out)]) == 0
    return out / "004" / "class1"


def test_quick_writes_files_with_the_right_columns(quick):
    for name in ("results.csv", "results.json", "table.md", "accuracy.png", "loss.png"):
        assert (quick / name).stat().st_size > 0, name
    for png in ("accuracy.png", "loss.png"):
        assert (quick / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with (quick / "results.csv").open() as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
    assert reader.fieldnames == R.COLUMNS
    paper = R.papers()["004"]
    methods = R.load_methods()
    expected = {(e.label, str(s)) for e in paper.entries if e.method in methods for s in (0, 1)}
    assert {(r["label"], r["seed"]) for r in rows if r["status"] == "ok"} == expected
    assert all(r["status"] in ("ok", "skipped") for r in rows)


def test_numbers_match_the_metrics_files(quick):
    rows = json.loads((quick / "results.json").read_text())["results"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok
    for r in ok:
        m = metrics(quick / "runs" / f"{R.safe(r['label'])}-seed{r['seed']}")
        assert [x["round"] for x in m] == list(range(ROUNDS + 1))
        assert r["final_test_accuracy"] == m[-1]["test-accuracy"]
        assert r["final_test_loss"] == m[-1]["test-loss"]
        assert r["best_test_accuracy"] == max(x["test-accuracy"] for x in m)
        hit = [x["round"] for x in m[1:] if x["test-accuracy"] >= r["target"]]
        assert r["rounds_to_target"] == (hit[0] if hit else None)
        assert r["bytes_per_round"] == pytest.approx(np.mean([x["bytes-up"] + x["bytes-down"] for x in m[1:]]))
        assert r["bytes_up_per_round"] == pytest.approx(np.mean([x["bytes-up"] for x in m[1:]]))
        assert r["mean_train_loss_last"] == pytest.approx(np.mean([x["train-loss-before"] for x in m[-R.last_window(ROUNDS):]]))
        cfg = json.loads((quick / "runs" / f"{R.safe(r['label'])}-seed{r['seed']}" / "summary.json").read_text())["run_config"]
        assert cfg["seed"] == r["seed"] and cfg["method"] == r["method"] and cfg["partitioner"] == "classes"
        assert cfg["classes-per-client"] == 1 and cfg["num-server-rounds"] == ROUNDS
    # the markdown table states mean ± std over the seeds of exactly these numbers
    table = (quick / "table.md").read_text()
    for label in {r["label"] for r in ok}:
        accs = [r["final_test_accuracy"] for r in ok if r["label"] == label]
        assert f"{statistics.fmean(accs):.4f} ± {statistics.stdev(accs):.4f}" in table
    # seeds differ (partition + init), the run is not a copy of another seed
    by = {(r["label"], r["seed"]): r for r in ok}
    assert any(by[(lab, 0)]["final_test_loss"] != by[(lab, 1)]["final_test_loss"] for lab, _ in by)


def test_deterministic_rerun_gives_identical_row(quick, tmp_path):
    paper = R.papers()["004"]
    entry = paper.entries[0]
    row = R.run_grid(paper, "class1", [1], ROUNDS, tmp_path)[0]
    old = next(r for r in json.loads((quick / "results.json").read_text())["results"]
               if r["label"] == entry.label and r["seed"] == 1)
    for col in ("final_test_accuracy", "final_test_loss", "mean_train_loss_last", "bytes_per_round"):
        assert row[col] == old[col], col


def test_report_rewrites_tables_from_results_json(quick):
    table = (quick / "table.md").read_text()
    (quick / "table.md").unlink()
    assert R.main(["report", "--out", str(quick.parent.parent)]) == 0
    assert (quick / "table.md").read_text() == table


def test_unregistered_methods_are_reported_as_skipped(tmp_path):
    paper = R.Paper("zzz", "test", ("iid",), (R.Entry("ghost", {"method": "no-such-method"}),
                                              R.Entry("avg", {"method": "fedavg", "client-lr": 0.1})),
                    claims=(R.Claim("avg", "ghost", "final_test_accuracy", "x"),))
    rows = R.run_grid(paper, "iid", [0], 2, tmp_path)
    assert [r["status"] for r in rows] == ["skipped", "ok"]
    files = R.write_outputs(paper, "iid", rows, tmp_path, "cmd", plots=False)
    table = files["table"].read_text()
    assert "| ghost | `no-such-method` | – | skipped |" in table and "**n/a**" in table


def test_summarize_and_judge_on_hand_made_rows():
    rows = [{"round": 0, "test-accuracy": 0.1, "test-loss": 2.0}] + [
        {"round": t, "test-accuracy": a, "test-loss": 1.0 / t, "train-loss-before": 4.0 - t, "bytes-up": 10, "bytes-down": 30}
        for t, a in zip(range(1, 9), (0.2, 0.5, 0.79, 0.81, 0.7, 0.85, 0.9, 0.88))
    ]
    s = R.summarize(rows, 0.8)
    assert s["rounds_to_target"] == 4 and s["final_test_accuracy"] == 0.88 and s["best_test_accuracy"] == 0.9
    assert s["mean_train_loss_last"] == pytest.approx(np.mean([4 - 7, 4 - 8]))  # last quarter of 8 rounds
    assert s["early_train_loss"] == pytest.approx(3.0) and s["bytes_per_round"] == 40
    assert R.summarize(rows, 0.95)["rounds_to_target"] is None
    agg = {"a": {"status": "ok", "final_test_accuracy": 0.9, "rounds_to_target": 5.0},
           "b": {"status": "ok", "final_test_accuracy": 0.8, "rounds_to_target": math.inf}}
    assert R.judge(R.Claim("a", "b", "final_test_accuracy", ""), agg)[0] == "reproduced"
    assert R.judge(R.Claim("b", "a", "final_test_accuracy", ""), agg)[0] == "NOT reproduced"
    assert R.judge(R.Claim("a", "b", "rounds_to_target", ""), agg)[0] == "reproduced"
    noisy = {"a": {**agg["a"], "final_test_accuracy_std": 0.05}, "b": {**agg["b"], "final_test_accuracy_std": 0.2}}
    assert R.judge(R.Claim("a", "b", "final_test_accuracy", ""), noisy)[0] == "same direction, within seed noise"
    assert R.judge(R.Claim("b", "a", "final_test_accuracy", ""), noisy)[0] == "opposite, within seed noise"


def test_sweep_picks_lowest_mean_training_loss(tmp_path):
    paper = R.Paper("zzz", "test", ("iid",), (R.Entry("avg", {"method": "fedavg", "client-lr": 0.1}),))
    res = R.sweep(paper, "iid", [0], 4, tmp_path, grid=[0.001, 0.3])
    chosen = res["chosen"]["avg"]
    scores = {}
    for lr in ("0.001", "0.3"):
        m = metrics(tmp_path / "runs" / f"lr{lr}" / "avg-seed0")
        scores[lr] = np.mean([x["train-loss-before"] for x in m[-R.last_window(4):]])
        assert chosen["scores"][lr] == pytest.approx(scores[lr])
    assert chosen["client_lr"] == float(min(scores, key=scores.get))
    assert json.loads((tmp_path / "sweep.json").read_text())["chosen"]["avg"]["client_lr"] == chosen["client_lr"]
