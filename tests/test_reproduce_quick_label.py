"""``python -m simulations.reproduce … --quick`` output is a smoke run: labelled so, and without verdicts when no method
reached the target.  Checked on hand-made result rows (no runs), so this is fast."""

from __future__ import annotations

import json
from pathlib import Path

from simulations import reproduce as R


def _rows(acc_a: float, acc_b: float, reached: bool) -> list[dict]:
    rows = []
    for label, method, acc in (("a", "fedavg", acc_a), ("b", "fedadam", acc_b)):
        for seed, jitter in ((0, 0.0), (1, 0.001)):
            v = acc + jitter
            rows.append({
                "paper": "zzz", "setting": "iid", "label": label, "method": method, "seed": seed, "status": "ok",
                "client_lr": 0.1, "server_lr": 1.0, "rounds": 8, "final_test_accuracy": v,
                "mean_test_accuracy_last": v, "final_test_loss": 1.0, "best_test_accuracy": v, "final_train_loss": 1.0,
                "mean_train_loss_last": 1.0, "early_train_loss": 2.0, "target": 0.8,
                "rounds_to_target": (5 if label == "a" else 7) if reached else None, "bytes_up_per_round": 10.0,
                "bytes_down_per_round": 10.0, "bytes_per_round": 20.0, "seconds": 0.1, "run_dir": "", "error": None,
            })
    return rows


PAPER = R.Paper("zzz", "test", ("iid",), (R.Entry("a", {"method": "fedavg"}), R.Entry("b", {"method": "fedadam"})),
                claims=(R.Claim("a", "b", "final_test_accuracy", "a beats b"),
                        R.Claim("b", "a", "rounds_to_target", "b is faster")),
                target=0.8)


def test_quick_run_without_any_method_at_target_is_a_smoke_run_without_verdicts(tmp_path):
    out = tmp_path / "zzz" / "iid"
    files = R.write_outputs(PAPER, "iid", _rows(0.5, 0.3, reached=False), out, "cmd --quick", plots=False, quick=True)
    table = files["table"].read_text()
    assert R.SMOKE_HEADING in table
    data = json.loads(files["json"].read_text())
    assert data["quick"] is True
    assert [c["verdict"] for c in data["claims"]] == [R.NO_TARGET, R.NO_TARGET]
    assert "NOT reproduced" not in table and "**reproduced**" not in table
    assert table.count(f"**{R.NO_TARGET}**") == 2
    summary = R.write_summary(tmp_path).read_text()
    assert R.SMOKE_HEADING in summary and f"{R.NO_TARGET}: 2" in summary and "NOT reproduced" not in summary


def test_quick_run_with_a_method_at_target_keeps_verdicts_but_the_smoke_label(tmp_path):
    out = tmp_path / "zzz" / "iid"
    files = R.write_outputs(PAPER, "iid", _rows(0.9, 0.85, reached=True), out, "cmd --quick", plots=False, quick=True)
    data = json.loads(files["json"].read_text())
    assert [c["verdict"] for c in data["claims"]] == ["reproduced", "NOT reproduced"]
    assert R.SMOKE_HEADING in files["table"].read_text()


def test_full_run_is_not_labelled_and_keeps_its_verdicts(tmp_path):
    out = tmp_path / "zzz" / "iid"
    files = R.write_outputs(PAPER, "iid", _rows(0.5, 0.3, reached=False), out, "cmd", plots=False)
    table = files["table"].read_text()
    assert R.SMOKE_HEADING not in table
    data = json.loads(files["json"].read_text())
    assert data["quick"] is False
    # accuracy ordering is judged; rounds to target is n/a (neither side reached it)
    assert [c["verdict"] for c in data["claims"]] == ["reproduced", "n/a"]
    assert R.SMOKE_HEADING not in R.write_summary(tmp_path).read_text()



def _figure_texts(monkeypatch, tmp_path, quick: bool) -> dict[str, list[str]]:
    """Every text artist of each figure write_outputs saves (captured at savefig), by file name."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    rows = _rows(0.5, 0.3, reached=False)
    for r in rows:  # each run's metrics file, as the plots read them back
        run = tmp_path / "runs" / f"{r['label']}-{r['seed']}"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"round": t, "test-accuracy": 0.1 * t, "test-loss": 2.0 - 0.1 * t,
                        **({"train-loss-before": 2.0 - 0.1 * t} if t else {})}) + "\n" for t in range(4)))
        r["run_dir"] = str(run)
    seen: dict[str, list[str]] = {}
    save = Figure.savefig

    def spy(fig, path, *args, **kwargs):
        seen[Path(path).name] = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    R.write_outputs(PAPER, "iid", rows, tmp_path / "out", "cmd", plots=True, quick=quick)
    return seen


def test_quick_plots_say_smoke_run_on_the_image(monkeypatch, tmp_path):
    texts = _figure_texts(monkeypatch, tmp_path, quick=True)
    assert set(texts) == {"accuracy.png", "loss.png", "train_loss.png"}
    for name, found in texts.items():
        assert "SMOKE RUN" in found and R.SMOKE_HEADING in found, name
        assert (tmp_path / "out" / name).stat().st_size > 0


def test_full_run_plots_carry_no_smoke_label(monkeypatch, tmp_path):
    texts = _figure_texts(monkeypatch, tmp_path, quick=False)
    assert texts and not any("SMOKE" in t for found in texts.values() for t in found)
