"""Compare finished runs: one figure (test accuracy and test loss per round) and one table of final metrics.

    python -m simulations.tools.compare RUN_DIR RUN_DIR … [--out DIR]

A RUN_DIR is a directory a run wrote (``metrics.jsonl`` + ``summary.json``), or one holding such directories (a
``--seeds`` group: ``seed0/``, ``seed1/``, …).  Each run's resolved configuration is read from its ``summary.json``
(``config``).  Runs whose configurations differ only in ``seed`` form one curve: the mean over the seeds with a band of
± the sample standard deviation (n − 1).  Curves are labelled by method and the settings that differ between the
compared runs (``client-lr=0.1``); the settings they share are written under the figure's title.  Keys that do not
change the results (output paths, tracking, timeouts, devices, …: :data:`IGNORED`) are not compared.

Writes ``<out>/comparison.png``, ``comparison.md`` and ``comparison.csv`` (default ``--out``: ``outputs/compare``) and
prints the markdown table.  "final" is the last round in ``metrics.jsonl``; "best" is the highest test accuracy of any
round.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Run-config keys that do not change what a run computes: never part of a label or a grouping.
IGNORED = frozenset({
    "seed", "output-dir", "run-name", "resume", "tracking", "learning-curve", "checkpoint-every", "device", "data-dir",
    "dataset-path", "grid-pull-interval", "round-timeout", "wait-for-nodes",
})

FILES = ("comparison.png", "comparison.md", "comparison.csv")
CSV_FIELDS = ("label", "method", "settings", "runs", "seeds", "status", "rounds", "final_test_accuracy_mean",
              "final_test_accuracy_std", "final_test_loss_mean", "final_test_loss_std", "best_test_accuracy_mean",
              "run_dirs")


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    status: str
    rows: list[dict[str, Any]]

    @property
    def method(self) -> str:
        return str(self.config.get("method", "?"))

    def final(self, column: str) -> float:
        values = [r[column] for r in self.rows if r.get(column) is not None]
        return float(values[-1]) if values else math.nan

    def best(self, column: str) -> float:
        values = [float(r[column]) for r in self.rows if r.get(column) is not None]
        return max(values) if values else math.nan


@dataclass
class Group:
    """Runs with the same configuration but for the seed."""

    key: tuple
    runs: list[Run] = field(default_factory=list)
    label: str = ""
    settings: str = ""

    @property
    def method(self) -> str:
        return self.runs[0].method


def find_runs(paths: Sequence[str | Path]) -> list[Path]:
    """Run directories named by ``paths``: each itself, or the run directories directly inside it (a seeds group)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").is_file():
            found.append(p)
            continue
        inner = sorted(d for d in p.glob("*/") if (d / "metrics.jsonl").is_file()) if p.is_dir() else []
        if not inner:
            raise FileNotFoundError(f"{p}: not a run directory (no metrics.jsonl in it or in its sub-directories)")
        found.extend(inner)
    return found


def load_run(path: Path) -> Run:
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary_path = path / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    config = dict(summary.get("config") or summary.get("run_config") or {})
    if not config:
        raise ValueError(f"{path}: no summary.json with a `config`: cannot tell this run's settings")
    return Run(path, config, str(summary.get("status", "unknown")), rows)


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _relevant(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The keys that can change results: not ignored, and of the run's own method if method-prefixed."""
    method = str(cfg.get("method", ""))
    return {k: v for k, v in cfg.items() if k not in IGNORED and ("." not in k or k.split(".", 1)[0] == method)}


def group_runs(runs: Sequence[Run]) -> list[Group]:
    """Group by configuration (seed aside), in the order first seen; label each by method + differing settings."""
    groups: dict[tuple, Group] = {}
    for run in runs:
        cfg = _relevant(run.config)
        key = tuple(sorted((k, json.dumps(v, sort_keys=True, default=str)) for k, v in cfg.items()))
        groups.setdefault(key, Group(key)).runs.append(run)
    configs = [dict(g.key) for g in groups.values()]
    # a key differs if two groups hold different values for it (a method-prefixed key: among that method's groups)
    keys = sorted({k for c in configs for k in c} - {"method"})
    differing = [k for k in keys if len({c.get(k, "<unset>") for c in configs if k in c or "." not in k}) > 1]
    for g, c in zip(groups.values(), configs, strict=True):
        shown = [f"{k}={_fmt(json.loads(c[k]))}" for k in differing if k in c]
        g.settings = " ".join(shown)
        g.label = g.method + (f" ({', '.join(shown)})" if shown else "")
    labels = [g.label for g in groups.values()]
    for g in groups.values():  # identical labels (cannot happen unless only ignored keys differ): number them
        if labels.count(g.label) > 1:
            g.label += f" #{list(groups.values()).index(g) + 1}"
    return list(groups.values())


def shared_settings(groups: Sequence[Group]) -> str:
    """The settings every compared run shares (for the figure's subtitle), a few at most."""
    configs = [dict(g.key) for g in groups]
    common = {k: v for k, v in configs[0].items() if all(c.get(k) == v for c in configs[1:])}
    show = [k for k in ("task", "num-server-rounds", "partitioner", "dirichlet-alpha", "client-lr", "local-epochs",
                        "local-steps", "batch-size", "fraction-train") if k in common]
    return ", ".join(f"{k}={_fmt(json.loads(common[k]))}" for k in show)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0


def curve(group: Group, column: str) -> tuple[list[int], list[float], list[float]]:
    """Rounds every run of ``group`` has ``column`` for, with the mean and sample std over its runs."""
    series = [{r["round"]: float(r[column]) for r in run.rows if r.get(column) is not None} for run in group.runs]
    rounds = sorted(set.intersection(*(set(s) for s in series))) if series else []
    stats = [mean_std([s[t] for s in series]) for t in rounds]
    return rounds, [m for m, _ in stats], [s for _, s in stats]


def table_rows(groups: Sequence[Group]) -> list[dict[str, Any]]:
    rows = []
    for g in groups:
        acc = mean_std([r.final("test-accuracy") for r in g.runs])
        loss = mean_std([r.final("test-loss") for r in g.runs])
        best = mean_std([r.best("test-accuracy") for r in g.runs])[0]
        done = sum(r.status == "completed" for r in g.runs)
        rows.append({
            "label": g.label, "method": g.method, "settings": g.settings, "runs": len(g.runs),
            "seeds": " ".join(str(r.config.get("seed", "?")) for r in g.runs),
            "status": "completed" if done == len(g.runs) else f"{done} of {len(g.runs)} completed",
            "rounds": max((r.rows[-1]["round"] for r in g.runs if r.rows), default=0),
            "final_test_accuracy_mean": acc[0], "final_test_accuracy_std": acc[1],
            "final_test_loss_mean": loss[0], "final_test_loss_std": loss[1], "best_test_accuracy_mean": best,
            "run_dirs": " ".join(str(r.path) for r in g.runs),
        })
    return rows


def _pm(mean: float, std: float, runs: int) -> str:
    if math.isnan(mean):
        return "–"
    return f"{mean:.4f} ± {std:.4f}" if runs > 1 else f"{mean:.4f}"


def markdown(rows: Sequence[Mapping[str, Any]], shared: str) -> str:
    lines = ["| run | seeds | rounds | final test accuracy | final test loss | best test accuracy | status |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        best = "–" if math.isnan(r["best_test_accuracy_mean"]) else f"{r['best_test_accuracy_mean']:.4f}"
        lines.append(f"| {r['label']} | {r['seeds']} | {r['rounds']} | "
                     f"{_pm(r['final_test_accuracy_mean'], r['final_test_accuracy_std'], r['runs'])} | "
                     f"{_pm(r['final_test_loss_mean'], r['final_test_loss_std'], r['runs'])} | {best} | "
                     f"{r['status']} |")
    note = ("Mean ± sample std over the seeds where a row has several; final = last round, best = highest test "
            "accuracy of any round.")
    return "\n".join(([f"Shared settings: {shared}.", ""] if shared else []) + lines + ["", note]) + "\n"


def plot(groups: Sequence[Group], path: Path, shared: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for i, g in enumerate(groups):
        color = plt.cm.tab10(i % 10)
        style = "-" if i < 10 else "--"  # beyond 10 curves the colours repeat: dashed then
        n = len(g.runs)
        for ax, column in zip(axes, ("test-accuracy", "test-loss"), strict=True):
            rounds, mean, std = curve(g, column)
            if not rounds:
                continue
            m, s = np.array(mean), np.array(std)
            ax.plot(rounds, m, style, color=color, lw=1.5, label=g.label + (f" · {n} seeds" if n > 1 else ""))
            if n > 1:
                ax.fill_between(rounds, m - s, m + s, color=color, alpha=0.18, lw=0)
    axes[0].set_ylabel("test accuracy (fraction correct)")
    axes[1].set_ylabel("test loss")
    for ax in axes:
        ax.set_xlabel("server round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:  # a task without accuracy (synthetic-linear): the loss panel has the curves
        handles, labels = axes[1].get_legend_handles_labels()
    bands = " (mean ± std over seeds)" if any(len(g.runs) > 1 for g in groups) else ""
    subtitle = "\n".join(textwrap.wrap(shared, 150))
    fig.suptitle(f"Comparison of {len(groups)} configuration(s){bands}" + (f"\n{subtitle}" if shared else ""),
                 fontsize=10)
    fig.legend(handles, labels, loc="lower center", ncol=min(3, max(1, len(labels))), fontsize=8)
    fig.tight_layout(rect=(0, 0.06 + 0.04 * math.ceil(len(labels) / 3), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare(paths: Sequence[str | Path], out: str | Path = "outputs/compare") -> dict[str, Path]:
    """Load the runs under ``paths``, write the figure and the table into ``out``; returns the files written."""
    runs = [load_run(p) for p in find_runs(paths)]
    groups = group_runs(runs)
    shared = shared_settings(groups)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = table_rows(groups)
    files = {"figure": out / FILES[0], "markdown": out / FILES[1], "csv": out / FILES[2]}
    plot(groups, files["figure"], shared)
    files["markdown"].write_text(markdown(rows, shared))
    with files["csv"].open("w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        wr.writeheader()
        wr.writerows(rows)
    return files


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m simulations.tools.compare",
        description="Compare finished runs: test accuracy and loss per round (mean ± std over seeds) in one figure, "
                    "final metrics in a table (markdown + csv).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  python -m simulations.tools.compare outputs/fedavg-digits-mlp-seed0 "
               "outputs/fedadam-digits-mlp-seed0\n"
               "  python -m simulations.tools.compare outputs/fedavg-digits-mlp-seeds "
               "outputs/scaffold-digits-mlp-seeds "
               "--out cmp/\n")
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR",
                    help="a run's directory (metrics.jsonl + summary.json), or one holding such directories (seeds)")
    ap.add_argument("--out", default="outputs/compare", metavar="DIR",
                    help="where comparison.png/.md/.csv go (default: outputs/compare)")
    args = ap.parse_args(argv)
    try:
        files = compare(args.runs, args.out)
    except (FileNotFoundError, ValueError) as err:
        print(f"[fedadapt] compare: {err}", file=sys.stderr)
        return 2
    print(files["markdown"].read_text(), end="")
    print(f"[fedadapt] wrote {files['figure']}, {files['markdown']}, {files['csv']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
