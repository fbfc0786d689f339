"""Outputs of a reproduction: per-entry aggregates over seeds, claim verdicts, results files, tables and plots."""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .catalogue import Claim, Paper, papers, settings
from .runner import _num, read_metrics, summarize

COLUMNS = [
    "paper", "setting", "label", "method", "seed", "status", "client_lr", "server_lr", "rounds", "final_test_accuracy",
    "mean_test_accuracy_last", "final_test_loss", "best_test_accuracy", "final_train_loss", "mean_train_loss_last",
    "early_train_loss", "target",
    "rounds_to_target", "bytes_up_per_round", "bytes_down_per_round", "bytes_per_round", "seconds", "run_dir", "error",
]


def aggregate(results: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per label: mean/std over seeds of the numeric columns; rounds to target over the seeds that reached it."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        if r["status"] != "ok":
            out.setdefault(r["label"], {"method": r["method"], "status": r["status"], "n": 0})
            continue
        a = out.setdefault(r["label"], {"method": r["method"], "status": "ok", "n": 0, "_rows": []})
        a["_rows"].append(r)
    for a in out.values():
        rows = a.pop("_rows", [])
        a["n"] = len(rows)
        if not rows:
            continue
        for col in ("final_test_accuracy", "mean_test_accuracy_last", "best_test_accuracy", "final_train_loss",
                    "mean_train_loss_last",
                    "early_train_loss", "bytes_per_round", "bytes_up_per_round", "bytes_down_per_round"):
            vals = [float(r[col]) for r in rows]
            a[col] = statistics.fmean(vals)
            a[col + "_std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
        reached = [r["rounds_to_target"] for r in rows if r["rounds_to_target"] is not None]
        a["reached"] = len(reached)
        # A seed that never reaches the target counts as ∞, so the mean is only finite when all seeds reach it.
        a["rounds_to_target"] = statistics.fmean(reached) if len(reached) == len(rows) else math.inf
        a["rounds_to_target_std"] = statistics.stdev(reached) if len(reached) == len(rows) > 1 else 0.0
        a["client_lr"] = rows[0]["client_lr"]
        a["server_lr"] = rows[0].get("server_lr")
    return out


def judge(claim: Claim, agg: Mapping[str, Mapping[str, Any]]) -> tuple[str, str]:
    """``(verdict, numbers)`` for one claim.

    ``reproduced`` = the paper's direction by more than the seed noise (the larger of the two std over seeds);
    ``same direction, within seed noise``; ``NOT reproduced`` = the opposite direction by more than the noise;
    ``opposite, within seed noise``; ``no difference`` (identical means); ``n/a`` when a side is missing or neither
    side reached the target.
    """
    b, w = agg.get(claim.better, {}), agg.get(claim.worse, {})
    if b.get("status") != "ok" or w.get("status") != "ok" or claim.metric not in b or claim.metric not in w:
        return "n/a", "a method of the comparison was skipped or failed"
    vb, vw = float(b[claim.metric]), float(w[claim.metric])
    if math.isinf(vb) and math.isinf(vw):
        return "n/a", "neither reached the target"
    sb, sw = float(b.get(claim.metric + "_std", 0.0)), float(w.get(claim.metric + "_std", 0.0))
    noise = max(sb if math.isfinite(sb) else 0.0, sw if math.isfinite(sw) else 0.0)
    higher_better = "accuracy" in claim.metric
    diff = (vb - vw) if higher_better else (vw - vb)  # > 0: the paper's direction
    if diff == 0:
        verdict = "no difference"
    elif math.isinf(diff) or abs(diff) > noise:
        verdict = "reproduced" if diff > 0 else "NOT reproduced"
    else:
        verdict = "same direction, within seed noise" if diff > 0 else "opposite, within seed noise"
    return verdict, (f"{claim.better} {fmt(vb)} ± {fmt(sb)} vs {claim.worse} {fmt(vw)} ± {fmt(sw)} ({claim.metric})")


SMOKE_HEADING = "SMOKE RUN (--quick): not a reproduction"
NO_TARGET = "n/a — no method reached the target"


def nobody_reached(agg: Mapping[str, Mapping[str, Any]]) -> bool:
    """True when no seed of any entry that ran reached the target test accuracy."""
    return not any(a.get("reached", 0) for a in agg.values() if a.get("status") == "ok")


def verdicts(claims: Sequence[Claim], agg: Mapping[str, Mapping[str, Any]],
             quick: bool = False) -> list[tuple[Claim, str, str]]:
    """``(claim, verdict, numbers)`` per claim.  A smoke run (``--quick``: a few rounds) in which no method reached
    the target gives no verdict at all: :data:`NO_TARGET`, whatever the claim's metric."""
    out = []
    for c in claims:
        verdict, numbers = judge(c, agg)
        if quick and nobody_reached(agg):
            verdict = NO_TARGET
        out.append((c, verdict, numbers))
    return out


def fmt(v: Any) -> str:
    if v is None:
        return "–"
    v = float(v)
    if math.isinf(v):
        return "∞"
    return f"{v:.4g}"


def markdown_table(paper: Paper, setting: str, results: Sequence[Mapping[str, Any]], command: str,
                   quick: bool = False) -> str:
    agg = aggregate(results)
    seeds = sorted({r["seed"] for r in results if r["status"] == "ok"})
    rounds = next((r["rounds"] for r in results if r["status"] == "ok"), 0)
    target = paper.target_for(setting)
    clients = settings()[setting].clients or f"{paper.num_nodes} clients"
    lines = [
        f"### Paper {paper.key} — {paper.title} — setting `{setting}`",
        "",
        *([f"**{SMOKE_HEADING}** — a CI-sized check that the suite runs ({rounds} rounds, first data setting "
           "only); its verdicts say nothing about the papers' claims.", ""] if quick else []),
        f"`{command}` · {len(seeds)} seed(s) {seeds} · {rounds} rounds · {clients} · "
        f"target test accuracy {target:g}",
        "",
        "| entry | method | client lr | server lr | final test acc (mean ± std) | "
        "test acc, last quarter (mean ± std) | rounds to target | "
        "train loss (last rounds) | bytes/round (up+down) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in paper.entries_for(setting):
        a = agg.get(entry.label, {})
        if a.get("status") != "ok":
            why = next((r.get("error") for r in results if r["label"] == entry.label and r.get("error")), "")
            lines.append(f"| {entry.label} | `{entry.method}` | – | – | {a.get('status', 'skipped')} | – | – | – | "
                         f"{why or '–'} |")
            continue
        rt = a["rounds_to_target"]
        rts = "∞" if math.isinf(rt) else f"{rt:.1f}"
        rts += f" ({a['reached']}/{a['n']} reached)"
        lines.append(
            f"| {entry.label} | `{entry.method}` | {a['client_lr']:g} | {fmt(a.get('server_lr'))} | "
            f"{a['final_test_accuracy']:.4f} ± "
            f"{a['final_test_accuracy_std']:.4f} | {a['mean_test_accuracy_last']:.4f} ± "
            f"{a['mean_test_accuracy_last_std']:.4f} | {rts} | "
            f"{a['mean_train_loss_last']:.4f} | {a['bytes_per_round'] / 1e3:.1f} kB |"
        )
    if paper.claims_for(setting):
        lines += ["", "| paper's claim | on our data | numbers (mean over seeds) |", "|---|---|---|"]
        for c, verdict, numbers in verdicts(paper.claims_for(setting), agg, quick):
            lines.append(f"| {c.text} | **{verdict}** | {numbers} |")
    return "\n".join(lines) + "\n"


def write_outputs(paper: Paper, setting: str, results: list[dict[str, Any]], out: Path, command: str,
                  plots: bool = True, quick: bool = False) -> dict[str, Path]:
    """results.csv/json, table.md and the plots of one paper × setting; ``quick`` labels them a smoke run."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"csv": out / "results.csv", "json": out / "results.json", "table": out / "table.md"}
    with files["csv"].open("w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        wr.writeheader()
        for r in results:
            wr.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in COLUMNS})
    agg = aggregate(results)
    files["json"].write_text(json.dumps(
        {"paper": paper.key, "title": paper.title, "setting": setting, "command": command,
         "target": paper.target_for(setting), "quick": quick, "results": results, "aggregate": agg,
         "claims": [{"claim": c.text, "verdict": v, "numbers": n}
                    for c, v, n in verdicts(paper.claims_for(setting), agg, quick)]},
        indent=2, default=_json_default))
    files["table"].write_text(markdown_table(paper, setting, results, command, quick))
    if plots and any(r["status"] == "ok" for r in results):
        files.update(plot_curves(paper, setting, results, out, quick=quick))
    return files


def write_summary(out: Path) -> Path:
    """``<out>/summary.md``: every claim verdict found in ``<out>/<paper>/<setting>/results.json``, one table."""
    lines = ["| paper | setting | paper's claim | on our data | numbers (mean over seeds) |", "|---|---|---|---|---|"]
    counts: dict[str, int] = {}
    smoke = False
    for path in sorted(out.glob("*/*/results.json")):
        data = json.loads(path.read_text())
        smoke = smoke or bool(data.get("quick"))
        for c in data.get("claims", []):
            lines.append(f"| {data['paper']} | `{data['setting']}` | {c['claim']} | **{c['verdict']}** "
                         f"| {c['numbers']} |")
            counts[c["verdict"]] = counts.get(c["verdict"], 0) + 1
    tally = ", ".join(f"{v}: {n}" for v, n in sorted(counts.items()))
    path = out / "summary.md"
    head = f"# Claims checked under `{out}`\n\n"
    if smoke:
        head += (f"**{SMOKE_HEADING}** — some results come from `--quick` runs (a few rounds, first data setting "
                 "only); their verdicts say nothing about the papers' claims.\n\n")
    path.write_text(f"{head}{tally or 'no results'}\n\n" + "\n".join(lines) + "\n")
    return path


def _json_default(v: Any) -> Any:
    return str(v)


def curves(results: Sequence[Mapping[str, Any]], column: str) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """Per label: rounds, mean and std over seeds of ``column`` read back from the runs' metrics files."""
    import numpy as np

    by_label: dict[str, list[list[float]]] = {}
    rounds_of: dict[str, list[int]] = {}
    for r in results:
        if r["status"] != "ok":
            continue
        rows = read_metrics(Path(r["run_dir"]) / "metrics.jsonl")
        by_label.setdefault(r["label"], []).append([_num(x.get(column)) for x in rows])
        rounds_of[r["label"]] = [x["round"] for x in rows]
    out = {}
    for label, series in by_label.items():
        arr = np.array(series, dtype=float)
        keep = ~np.all(np.isnan(arr), axis=0)  # rounds without the metric (round 0 has no training loss)
        arr = arr[:, keep]
        rounds = [t for t, k in zip(rounds_of[label], keep, strict=True) if k]
        out[label] = (rounds, list(np.nanmean(arr, 0)), list(np.nanstd(arr, 0)))
    return out


def smoke_label(fig: Any) -> None:
    """Mark a figure of a ``--quick`` run on the image itself: a plot copied out of its folder still says so."""
    fig.text(0.5, 0.5, "SMOKE RUN", fontsize=54, color="tab:red", alpha=0.22, rotation=25, ha="center",
             va="center", weight="bold", zorder=10)
    fig.text(0.5, 0.01, SMOKE_HEADING, fontsize=9, color="tab:red", ha="center", va="bottom")


def plot_curves(paper: Paper, setting: str, results: Sequence[Mapping[str, Any]], out: Path,
                quick: bool = False) -> dict[str, Path]:
    """accuracy/loss/train_loss.png: mean ± std over seeds per entry; ``quick``: labelled SMOKE RUN on the image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    files = {}
    n_seeds = len({r["seed"] for r in results if r["status"] == "ok"})
    for name, column, ylabel in (("accuracy", "test-accuracy", "test accuracy (fraction correct)"),
                                 ("loss", "test-loss", "test loss (cross-entropy, nats)"),
                                 ("train_loss", "train-loss-before",
                                  "training loss at the broadcast model (clients' mean, nats)")):
        fig, ax = plt.subplots(figsize=(8, 5))
        for i, (label, (rounds, mean, std)) in enumerate(curves(results, column).items()):
            m, s = np.array(mean), np.array(std)
            # 10 distinct colours; entries beyond the 10th repeat them dashed so no two lines look alike
            line, = ax.plot(rounds, m, label=label, lw=1.5, color=plt.cm.tab10(i % 10), ls="-" if i < 10 else "--")
            ax.fill_between(rounds, m - s, m + s, color=line.get_color(), alpha=0.18, lw=0)
        if column == "test-accuracy":
            target = paper.target_for(setting)
            ax.axhline(target, color="grey", ls=":", lw=1, label=f"target {target:g}")
        else:
            ax.set_yscale("log")
        ax.set_xlabel("server round")
        ax.set_ylabel(ylabel)
        ax.set_title(f"Paper {paper.key} on {settings()[setting].title()}: mean ± std over {n_seeds} seed(s)",
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout(rect=(0, 0.04 if quick else 0, 1, 1))  # room for the smoke run's footer
        if quick:
            smoke_label(fig)
        files[name] = out / f"{name}.png"
        fig.savefig(files[name], dpi=110)
        plt.close(fig)
    return files


def rewrite(out: Path) -> list[Path]:
    """Rewrite tables, plots and ``summary.md`` from the ``results.json`` files under ``out`` (no runs); the result
    columns are recomputed from each run's own metrics file (columns added since it ran)."""
    table = papers()
    done = []
    for path in sorted(out.glob("*/*/results.json")):
        data = json.loads(path.read_text())
        p = table[data["paper"]]
        for row in data["results"]:
            metrics_file = Path(row.get("run_dir") or "-") / "metrics.jsonl"
            if row["status"] == "ok" and metrics_file.exists():
                row.update(summarize(read_metrics(metrics_file), p.target_for(data["setting"])))
        write_outputs(p, data["setting"], data["results"], path.parent, data["command"], quick=bool(data.get("quick")))
        done.append(path.parent)
    return done
