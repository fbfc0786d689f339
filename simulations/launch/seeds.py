"""``python -m simulations.launch sim --engine inprocess [--seeds N]``: the in-process engine from the command line.

Without ``--seeds`` it is one ordinary run (:func:`simulations.engine.inprocess.run_inprocess`: the real ServerApp logic
driving the real ClientApp in this process, no Ray, no SuperLink), writing the usual files under
``<output-dir>/<run-name>/``.

With ``--seeds N`` it runs the same configuration with seeds ``s0 … s0+N-1`` (``s0`` = the run-config's ``seed``,
default 0) and writes, under ``<output-dir>/<run-name or <method>-<task>-seeds>/``::

    seed<s>/metrics.jsonl, metrics.csv, summary.json, model.pt   each seed's own run (the engine's files)
    seeds.json                                                    per seed: final test accuracy/loss; mean ± std
    seeds.csv                                                     one row per seed, then a ``mean`` and a ``std`` row
    accuracy_band.png                                             test accuracy per round, mean ± std over the seeds

``std`` is the sample standard deviation (n − 1; 0 for one seed), as in the reproduction suite's tables.  The
per-seed numbers are read back from each run's ``metrics.jsonl`` (the same helpers as :mod:`simulations.reproduce`).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .flwr_cli import parse_run_config_arg

FIELDS = ("seed", "status", "rounds", "final_test_accuracy", "final_test_loss", "best_test_accuracy", "run_dir")


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def group_dir(cfg: Mapping[str, Any]) -> Path:
    """Where a multi-seed run writes: ``<output-dir>/<run-name>``, or ``<output-dir>/<method>-<task>-seeds``."""
    from app_common.config import parse as app_config

    fed = app_config(dict(cfg))
    return Path(fed.output_dir).expanduser().resolve() / (fed.run_name or f"{fed.method}-{fed.task}-seeds")


def run_seeds(run_config: Mapping[str, Any], seeds: int, num_nodes: int, engine: str = "inprocess",
              **grid_kwargs: Any) -> dict[str, Any]:
    """Run ``run_config`` once per seed in-process; write per-seed runs, ``seeds.json``/``.csv`` and the band plot.

    Returns the ``seeds.json`` content (plus ``"dir"``).  A seed whose run fails or raises is recorded with its
    status and left out of the mean and std.
    """
    from simulations.reproduce.runner import run_one, summarize

    if seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {seeds}")
    base = dict(run_config)
    out = group_dir(base)
    first = int(base.get("seed", 0))
    rows: list[dict[str, Any]] = []
    for s in range(first, first + seeds):
        cfg = {**base, "seed": s, "output-dir": str(out), "run-name": f"seed{s}"}
        print(f"[fedadapt] seed {s} ({s - first + 1}/{seeds}) …", flush=True)
        try:
            summary, metrics = run_one(cfg, num_nodes, engine, **grid_kwargs)
        except Exception as err:  # a failing seed must not hide the others; the row says why
            rows.append({"seed": s, "status": f"error: {type(err).__name__}: {err}"[:300],
                         "run_dir": str(out / f"seed{s}")})
            print(f"[fedadapt] seed {s}: {rows[-1]['status']}", flush=True)
            continue
        row = {"seed": s, "status": summary.get("status", "completed"), "run_dir": str(out / f"seed{s}")}
        if metrics:
            row.update({k: v for k, v in summarize(metrics, 1.0).items()
                        if k in ("rounds", "final_test_accuracy", "final_test_loss", "best_test_accuracy")})
        rows.append(row)
        print(f"[fedadapt] seed {s}: {row['status']}, test accuracy {row.get('final_test_accuracy', math.nan):.4f}, "
              f"test loss {row.get('final_test_loss', math.nan):.4f}", flush=True)
    ok = [r for r in rows if r["status"] == "completed"]
    stats = {}
    for col in ("final_test_accuracy", "final_test_loss"):
        m, sd = _mean_std([float(r[col]) for r in ok])
        stats[col] = {"mean": m, "std": sd}
    result = {"run_config": base, "num_nodes": num_nodes, "seeds": [r["seed"] for r in rows],
              "completed": len(ok), "per_seed": rows, **stats}
    out.mkdir(parents=True, exist_ok=True)
    (out / "seeds.json").write_text(json.dumps(result, indent=2, default=str))
    with (out / "seeds.csv").open("w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
        wr.writeheader()
        for r in rows:
            wr.writerow(r)
        for stat in ("mean", "std"):
            wr.writerow({"seed": stat, "status": f"{len(ok)} completed",
                         **{col: stats[col][stat] for col in ("final_test_accuracy", "final_test_loss")}})
    if ok:
        plot_band(ok, out / "accuracy_band.png", title=_title(base, len(ok)))
    acc, loss = stats["final_test_accuracy"], stats["final_test_loss"]
    print(f"[fedadapt] {len(ok)}/{seeds} seeds completed: final test accuracy {acc['mean']:.4f} ± {acc['std']:.4f}, "
          f"test loss {loss['mean']:.4f} ± {loss['std']:.4f} → {out}/seeds.json", flush=True)
    return {**result, "dir": str(out)}


def band(runs: Sequence[Mapping[str, Any]],
         column: str = "test-accuracy") -> tuple[list[int], list[float], list[float]]:
    """Rounds, mean and sample std over ``runs`` (rows with ``run_dir``) of ``column`` from their metrics files."""
    from simulations.reproduce.runner import _num, read_metrics

    series = [{r["round"]: _num(r.get(column)) for r in read_metrics(Path(run["run_dir"]) / "metrics.jsonl")}
              for run in runs]
    rounds = sorted(set.intersection(*(set(s) for s in series)))
    means, stds = [], []
    for t in rounds:
        m, sd = _mean_std([s[t] for s in series])
        means.append(m)
        stds.append(sd)
    return rounds, means, stds


def _title(cfg: Mapping[str, Any], n: int) -> str:
    keys = " ".join(f"{k}={v}" for k, v in sorted(cfg.items()) if k not in ("seed", "output-dir", "run-name"))
    return f"{keys or 'default job'}: mean ± std over {n} seed(s)"


def plot_band(runs: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rounds, mean, std = band(runs)
    m, s = np.array(mean), np.array(std)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    line, = ax.plot(rounds, m, lw=1.5, label="mean")
    ax.fill_between(rounds, m - s, m + s, color=line.get_color(), alpha=0.2, lw=0, label="± std")
    ax.set_xlabel("server round")
    ax.set_ylabel("test accuracy (fraction correct)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def launch_inprocess(num_nodes: int, run_config: str | None, seeds: int | None = None,
                     engine: str = "inprocess", **grid_kwargs: Any) -> int:
    """The ``--engine inprocess|vectorized`` entry point: one run (``seeds`` None) or :func:`run_seeds`; exit status 0
    when every run completed.  ``grid_kwargs``: the engine's grid's (``actors``, ``address``: the vectorized engine
    on Ray)."""
    cfg = parse_run_config_arg(run_config)
    if seeds is not None:
        res = run_seeds(cfg, seeds, num_nodes, engine, **grid_kwargs)
        return 0 if res["completed"] == len(res["per_seed"]) else 1
    from simulations.engine.inprocess import run_inprocess

    summary = run_inprocess(cfg, num_nodes, engine=engine, **grid_kwargs)
    print(f"[fedadapt] {engine} run {summary.get('status')}: {json.dumps(summary.get('final'), default=str)}",
          flush=True)
    return 0 if summary.get("status") == "completed" else 1
