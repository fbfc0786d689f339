"""``python -m simulations.tools.compare``: a figure and a table of final metrics from real run directories.

Three tiny real runs (the in-process engine, digits-mlp, 2 nodes, 2 rounds of 2 local steps): FedAvg with seeds 0 and 1
and FedAdam with seed 0 at another client learning rate.  The two FedAvg runs differ only in the seed, so they are one
row / one curve with a band; the labels name the method and the setting that differs (client-lr).
"""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path

import matplotlib
import pytest

from simulations.tools import compare

BASE = {"task": "digits-mlp", "num-server-rounds": 2, "min-available-nodes": 2, "min-train-nodes": 2, "local-steps": 2,
        "tracking": "none"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from simulations.engine.inprocess import run_inprocess

    out = tmp_path_factory.mktemp("runs")
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    flwr_logger.setLevel(logging.WARNING)
    made = {}
    try:
        for name, extra in (("avg0", {"method": "fedavg", "seed": 0}), ("avg1", {"method": "fedavg", "seed": 1}),
                            ("adam0", {"method": "fedadam", "seed": 0, "client-lr": 0.1})):
            run_inprocess({**BASE, **extra, "output-dir": str(out), "run-name": name}, 2)
            made[name] = out / name
    finally:
        flwr_logger.setLevel(level)
    return made


def test_compare_writes_a_figure_and_a_table_from_run_directories(runs, tmp_path, monkeypatch, capsys) -> None:
    from matplotlib.figure import Figure

    seen: dict[str, Figure] = {}
    save = Figure.savefig

    def spy(fig, path, *args, **kwargs):
        seen["fig"] = fig
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    out = tmp_path / "cmp"
    assert compare.main([str(runs["avg0"]), str(runs["avg1"]), str(runs["adam0"]), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(compare.FILES)
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    rows = list(csv.DictReader((out / "comparison.csv").open()))
    assert [(r["label"], r["runs"], r["seeds"]) for r in rows] == [
        ("fedavg (client-lr=0.5)", "2", "0 1"), ("fedadam (client-lr=0.1)", "1", "0")]
    # the numbers are the runs' own final rows: mean and sample std over the two FedAvg seeds
    finals = [json.loads((runs[n] / "metrics.jsonl").read_text().splitlines()[-1]) for n in ("avg0", "avg1")]
    accs = [f["test-accuracy"] for f in finals]
    assert float(rows[0]["final_test_accuracy_mean"]) == pytest.approx(sum(accs) / 2, rel=1e-12)
    assert float(rows[0]["final_test_accuracy_std"]) == pytest.approx(abs(accs[0] - accs[1]) / math.sqrt(2), rel=1e-9)
    adam = json.loads((runs["adam0"] / "metrics.jsonl").read_text().splitlines()[-1])
    assert float(rows[1]["final_test_loss_mean"]) == pytest.approx(adam["test-loss"], rel=1e-12)
    assert {r["rounds"] for r in rows} == {"2"} and {r["status"] for r in rows} == {"completed"}

    md = (out / "comparison.md").read_text()
    assert "| fedavg (client-lr=0.5) | 0 1 | 2 | " in md and " ± " in md and "task=digits-mlp" in md
    assert md in capsys.readouterr().out

    # the figure: accuracy and loss panels, one curve per configuration, a band (fill) only for the seeded one
    fig = seen["fig"]
    acc_ax, loss_ax = fig.axes
    assert "accuracy" in acc_ax.get_ylabel() and "loss" in loss_ax.get_ylabel()
    for ax in (acc_ax, loss_ax):
        assert [line.get_label() for line in ax.get_lines()] == ["fedavg (client-lr=0.5) · 2 seeds",
                                                                 "fedadam (client-lr=0.1)"]
        assert len(ax.collections) == 1  # fill_between of the two-seed curve
        assert list(ax.get_lines()[0].get_xdata()) == [0, 1, 2]
    texts = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
    assert any("mean ± std over seeds" in t for t in texts)


def test_a_seeds_group_directory_expands_to_its_runs(runs, tmp_path) -> None:
    group = tmp_path / "group"
    group.mkdir()
    for name in ("avg0", "avg1"):
        (group / name).symlink_to(runs[name], target_is_directory=True)
    files = compare.compare([group], tmp_path / "out")
    rows = list(csv.DictReader(files["csv"].open()))
    assert [(r["label"], r["runs"]) for r in rows] == [("fedavg", "2")]  # nothing differs but the seed


def test_not_a_run_directory_is_a_clear_error(tmp_path, capsys) -> None:
    assert compare.main([str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_labels_name_only_the_settings_that_differ() -> None:
    def run(**cfg) -> compare.Run:
        return compare.Run(Path("x"), {"seed": 0, "output-dir": "o", "task": "digits-mlp", **cfg}, "completed", [])

    groups = compare.group_runs([
        run(method="fedadam", **{"fedadam.server-lr": 0.1, "batch-size": 16}),
        run(method="fedadam", **{"fedadam.server-lr": 0.01, "batch-size": 16}, seed=3),
        run(method="fedavg", **{"fedavg.server-lr": 1.0, "batch-size": 32}, **{"output-dir": "elsewhere"}),
    ])
    assert [g.label for g in groups] == ["fedadam (batch-size=16, fedadam.server-lr=0.1)",
                                         "fedadam (batch-size=16, fedadam.server-lr=0.01)",
                                         "fedavg (batch-size=32)"]
