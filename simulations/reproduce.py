"""Reproduction suite: each paper's own comparison set on offline data, over seeds, with tables and plots.

    python -m simulations.reproduce 002 --quick --seeds 2            # one paper, CI-sized (< 60 s)
    python -m simulations.reproduce all [--seeds 3] [--rounds 50]    # every paper, every data setting
    python -m simulations.reproduce sweep 002 [--lrs 0.01,0.1,1]     # pick client lrs by the papers' rule
    python -m simulations.reproduce theory                            # paper 000 Fig. 1 + paper 003 surrogate plots
    python -m simulations.reproduce report --out DIR                  # rewrite tables/plots from DIR's results.json

Every run is the real ServerApp logic driving the real ClientApp in this process
(:func:`simulations.engine.run_inprocess`), so a row of ``results.csv`` is exactly what ``flwr run`` with the same
run-config computes (the engine is deterministic for a seed).  For each paper and data setting the suite writes, under
``--out`` (default ``outputs/reproduce``)::

    <paper>/<setting>/runs/<label>-seed<s>/metrics.{jsonl,csv}, summary.json   (the engine's own files)
    <paper>/<setting>/results.csv, results.json     one row per method × seed (+ one row per skipped method)
    <paper>/<setting>/table.md                      mean ± std over seeds, rounds to target, bytes/round, claims
    <paper>/<setting>/accuracy.png, loss.png        test accuracy / loss vs round, mean ± std band per method

Grids list registry names; a method that is not registered (yet) in this installation is reported as ``skipped``.
Learning rates: each grid entry carries a default client lr (documented in ``docs/reproduce.md``); ``sweep`` re-picks the
client lr of every entry from a small grid by the papers' rule — lowest mean training loss of the global model
(``train-loss-before``: the clients' loss at the broadcast model) over the last rounds — and writes ``sweep.json``, which
``--lrs-from`` feeds back into a reproduction run.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import io
import json
import logging
import math
import statistics
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRESETS_DIR = Path(__file__).parent / "presets"
DEFAULT_OUT = Path("outputs") / "reproduce"
# Method modules that register methods on import; optional so the suite runs on any subset of them.
OPTIONAL_MODULES = ("fedlocal", "localupdate", "fedda", "mimelite", "fedlada", "fedcm", "scaffold", "fedlamb")

# ------------------------------------------------------------------------------------------ data settings
# Digits presets (scikit-learn's bundled 8×8 digits, 10 clients): label skew from Dirichlet(α) or one class per client.
SETTINGS: dict[str, dict[str, Any]] = {
    "dir0.1": {"task": "digits-mlp", "partitioner": "dirichlet", "dirichlet-alpha": 0.1},
    "dir0.3": {"task": "digits-mlp", "partitioner": "dirichlet", "dirichlet-alpha": 0.3},
    "dir0.6": {"task": "digits-mlp", "partitioner": "dirichlet", "dirichlet-alpha": 0.6},
    "class1": {"task": "digits-mlp", "partitioner": "classes", "classes-per-client": 1},
    "iid": {"task": "digits-mlp", "partitioner": "iid"},
}
COMMON = {"batch-size": 32, "local-epochs": 1, "local-steps": 0}


@dataclass(frozen=True)
class Entry:
    """One line of a paper's comparison: a label and run-config overrides (must include ``method``)."""

    label: str
    overrides: Mapping[str, Any]

    @property
    def method(self) -> str:
        return str(self.overrides["method"])


@dataclass(frozen=True)
class Claim:
    """The paper's direction of effect: ``better`` beats ``worse`` on ``metric`` (mean over seeds)."""

    better: str
    worse: str
    metric: str  # a results column; higher is better for accuracies, lower for losses / rounds
    text: str


@dataclass(frozen=True)
class Paper:
    key: str
    title: str
    settings: tuple[str, ...]  # first = the quick / main setting
    entries: tuple[Entry, ...]
    claims: tuple[Claim, ...] = ()
    target: float = 0.8  # test accuracy for "rounds to target"
    num_nodes: int = 10
    extra: Mapping[str, Any] = field(default_factory=dict)  # run-config keys for every entry of the paper


def _fedlocal_entries() -> tuple[Entry, ...]:
    """Paper 000: the presets of ``simulations/presets/fedlocal.toml`` (tuned there on digits Dirichlet 0.3)."""
    table = tomllib.loads((PRESETS_DIR / "fedlocal.toml").read_text())
    return tuple(Entry(name, dict(keys)) for name, keys in table.items())


def _e(label: str, method: str, lr: float, **keys: Any) -> Entry:
    return Entry(label, {"method": method, "client-lr": lr, **keys})


def papers() -> dict[str, Paper]:
    sgd_lr, ada_lr = 0.1, 0.01
    return {
        "000": Paper(
            "000", "Wang et al. 2021, Local Adaptivity in FL (FedLocal)", ("dir0.3", "dir0.1"), _fedlocal_entries(),
            claims=(
                Claim("c-adagrad-s-adagrad", "c-sgd-s-sgd", "final_test_accuracy",
                      "client+server AdaGrad beats FedAvg (Table 1)"),
                Claim("c-adagrad-s-adagrad", "c-sgd-s-adagrad", "final_test_accuracy",
                      "adding client AdaGrad to server AdaGrad helps (Table 1)"),
                Claim("c-adagrad-s-adagrad-joint", "c-adagrad-s-adagrad", "final_test_accuracy",
                      "joint correction ≥ no correction (Table 2)"),
                Claim("c-adagrad-s-adagrad", "sync-c-adagrad-s-adagrad", "final_test_accuracy",
                      "restarting client states beats synchronising them (§6)"),
            ),
        ),
        "001": Paper(
            "001", "Jin et al. 2022, FedDA (decoupled adaptive optimization)", ("dir0.3",),
            (
                _e("fedavg", "fedavg", sgd_lr),
                _e("fedopt-sgdm", "fedavgm", sgd_lr),
                _e("fedopt-adam", "fedadam", sgd_lr, **{"fedadam.server-lr": 0.03}),
                _e("fedopt-adagrad", "fedadagrad", sgd_lr, **{"fedadagrad.server-lr": 0.03}),
                _e("fedda-sgdm", "fedda-sgdm", sgd_lr),
                _e("fedda-adam", "fedda-adam", sgd_lr, **{"fedda-adam.server-lr": 0.03}),
                _e("fedda-adagrad", "fedda-adagrad", sgd_lr, **{"fedda-adagrad.server-lr": 0.03}),
                _e("mimelite-sgdm", "mimelite", sgd_lr),
                _e("fedlocal-adagrad", "fedlocal", 0.1, **{"fedlocal.server-opt": "sgd", "fedlocal.server-lr": 1.0}),
                _e("scaffold", "scaffold", sgd_lr),
            ),
            claims=(
                Claim("fedda-sgdm", "fedopt-sgdm", "final_test_accuracy", "FedDA-SGDM beats FedOpt-SGDM (Table 2)"),
                Claim("fedda-adam", "fedopt-adam", "final_test_accuracy", "FedDA-Adam beats FedOpt-Adam (Table 2)"),
                Claim("fedda-adagrad", "fedopt-adagrad", "final_test_accuracy", "FedDA-AdaGrad beats FedOpt-AdaGrad (Table 2)"),
                Claim("fedda-sgdm", "fedavg", "final_test_accuracy", "FedDA-SGDM beats FedAvg (Table 2)"),
            ),
        ),
        "002": Paper(
            "002", "Sun et al., FedLADA (local amended AMSGrad)", ("dir0.6", "dir0.1"),
            (
                _e("fedavg", "fedavg", sgd_lr, weighting="uniform"),
                _e("fedprox", "fedprox", sgd_lr, **{"fedprox.mu": 0.01}),
                _e("scaffold", "scaffold", sgd_lr),
                _e("fedcm", "fedcm", sgd_lr),
                _e("fedadam", "fedadam", sgd_lr, **{"fedadam.server-lr": 0.03}),
                _e("localadam", "localadam", ada_lr),
                _e("fedlada", "fedlada", ada_lr),
            ),
            claims=(
                Claim("fedlada", "fedavg", "rounds_to_target", "FedLADA reaches the target in fewer rounds than FedAvg (Table 7)"),
                Claim("fedlada", "localadam", "final_test_accuracy", "the amended direction beats plain local Adam (Table 3)"),
                Claim("fedcm", "fedavg", "final_test_accuracy", "client momentum (FedCM) beats FedAvg (Table 6)"),
                Claim("fedlada", "fedadam", "final_test_accuracy", "FedLADA beats server-adaptive FedAdam (Table 6)"),
            ),
            extra={"fraction-train": 0.5},
        ),
        "003": Paper(
            "003", "Charles & Konečný 2020, Outsized importance of learning rates (LocalUpdate)", ("dir0.3",),
            (
                _e("gamma=0.01", "localupdate", 0.01, **{"localupdate.server-lr": 0.3, "localupdate.theta-steps": 10}),
                _e("gamma=0.1", "localupdate", 0.1, **{"localupdate.server-lr": 0.3, "localupdate.theta-steps": 10}),
                _e("gamma=1", "localupdate", 1.0, **{"localupdate.server-lr": 0.3, "localupdate.theta-steps": 10}),
                _e("fomaml-gamma=0.1", "localupdate", 0.1,
                   **{"localupdate.theta": "fomaml", "localupdate.server-lr": 0.3, "localupdate.theta-steps": 10}),
                _e("minibatch-sgd", "localupdate", 0.1, **{"localupdate.theta": "sgd", "localupdate.server-lr": 0.3}),
                _e("decay-from-gamma=1", "localupdatedecay", 1.0,
                   **{"localupdatedecay.server-lr": 0.3, "localupdatedecay.theta-steps": 10, "localupdatedecay.window": 5,
                      "localupdatedecay.patience": 5, "localupdatedecay.cooldown": 5, "localupdatedecay.min-delta": 0.01}),
            ),
            claims=(
                Claim("gamma=0.1", "gamma=0.01", "early_train_loss", "a larger γ lowers the training loss early (Fig. 2)"),
                Claim("gamma=0.1", "gamma=1", "final_train_loss", "very large γ plateaus higher (Fig. 2)"),
                Claim("decay-from-gamma=1", "gamma=1", "final_train_loss",
                      "LocalUpdateDecay recovers from an untuned large γ (Fig. 5)"),
            ),
            extra={"batch-size": 20},
        ),
        "004": Paper(
            "004", "Karimi et al., Fed-LAMB (layer-wise locally adaptive)", ("class1", "iid"),
            (
                _e("fed-sgd", "fedavg", sgd_lr, weighting="uniform"),
                _e("fed-ams", "fedams", ada_lr),
                _e("adp-fed", "adpfed", sgd_lr),
                _e("fed-lamb", "fedlamb", ada_lr),
            ),
            claims=(
                Claim("fed-lamb", "fed-ams", "final_test_accuracy", "Fed-LAMB beats Fed-AMS (Table 1, Fig. 2)"),
                Claim("fed-lamb", "fed-sgd", "final_test_accuracy", "Fed-LAMB beats Fed-SGD (Table 1)"),
                Claim("fed-lamb", "fed-ams", "rounds_to_target", "Fed-LAMB needs fewer rounds than Fed-AMS (Fig. 2)"),
            ),
            extra={"fraction-train": 0.5},
        ),
    }


# ------------------------------------------------------------------------------------------ running
def load_methods() -> dict[str, Any]:
    """Import the registry plus every optional method module that is present; return ``METHODS``."""
    import flower_strategies  # noqa: F401
    from flower_strategies.registry import METHODS

    for mod in OPTIONAL_MODULES:
        try:
            importlib.import_module(f"flower_strategies.{mod}")
        except ImportError:
            pass
    return METHODS


def run_config_for(paper: Paper, setting: str, entry: Entry, seed: int, rounds: int, out_dir: Path,
                   lr_override: float | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {**COMMON, **SETTINGS[setting], **paper.extra, **entry.overrides}
    if lr_override is not None:
        cfg["client-lr"] = lr_override
    cfg.update({"seed": seed, "num-server-rounds": rounds, "output-dir": str(out_dir),
                "run-name": f"{safe(entry.label)}-seed{seed}"})
    return cfg


def safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in label)


def run_one(cfg: Mapping[str, Any], num_nodes: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run one configuration quietly; return the engine's summary and the per-round rows it wrote."""
    from server_app.app import run_dir
    from simulations.engine import run_inprocess
    from flower_strategies.hparams import FederationConfig

    import torch

    flwr_logger = logging.getLogger("flwr")
    level, threads = flwr_logger.level, torch.get_num_threads()
    flwr_logger.setLevel(logging.WARNING)
    torch.set_num_threads(1)  # tiny models: intra-op threads only add contention (≈20× slower on 2 busy cores)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            summary = run_inprocess(dict(cfg), num_nodes)
    finally:
        flwr_logger.setLevel(level)
        torch.set_num_threads(threads)
    fed = FederationConfig.from_run_config({k: v for k, v in cfg.items() if k in FederationConfig.keys(None)}, None)
    rows = read_metrics(run_dir(fed) / "metrics.jsonl")
    return summary, rows


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _num(v: Any) -> float:
    return float(v) if v is not None else math.nan


def last_window(num_rounds: int) -> int:
    """Rounds averaged by the selection rule: the last quarter (at least 1, at most 100 as in the papers)."""
    return max(1, min(100, num_rounds // 4))


def summarize(rows: Sequence[Mapping[str, Any]], target: float) -> dict[str, Any]:
    """The results columns of one run, computed from its metrics rows (round 0 = the initial model)."""
    trained = [r for r in rows if r["round"] > 0]
    final = rows[-1]
    w = last_window(len(trained))
    tl = [_num(r.get("train-loss-before")) for r in trained]
    reach = next((r["round"] for r in trained if _num(r.get("test-accuracy")) >= target), None)
    up = [_num(r.get("bytes-up")) for r in trained]
    down = [_num(r.get("bytes-down")) for r in trained]
    early = max(1, len(trained) // 5)
    return {
        "rounds": len(trained),
        "final_test_accuracy": _num(final.get("test-accuracy")),
        "final_test_loss": _num(final.get("test-loss")),
        "best_test_accuracy": max((_num(r.get("test-accuracy")) for r in rows), default=math.nan),
        "final_train_loss": _num(trained[-1].get("train-loss-before")) if trained else math.nan,
        "mean_train_loss_last": statistics.fmean(tl[-w:]) if tl else math.nan,
        "early_train_loss": statistics.fmean(tl[:early]) if tl else math.nan,
        "target": target,
        "rounds_to_target": reach,
        "bytes_up_per_round": statistics.fmean(up) if up else math.nan,
        "bytes_down_per_round": statistics.fmean(down) if down else math.nan,
        "bytes_per_round": statistics.fmean([a + b for a, b in zip(up, down)]) if up else math.nan,
    }


COLUMNS = [
    "paper", "setting", "label", "method", "seed", "status", "client_lr", "rounds", "final_test_accuracy",
    "final_test_loss", "best_test_accuracy", "final_train_loss", "mean_train_loss_last", "early_train_loss", "target",
    "rounds_to_target", "bytes_up_per_round", "bytes_down_per_round", "bytes_per_round", "seconds", "run_dir", "error",
]


class Progress:
    """``[reproduce] run 3/22 (002/dir0.6 fedlada seed 1) … elapsed 12s, ~30s left``."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.monotonic()

    def start(self, what: str) -> None:
        el = time.monotonic() - self.t0
        eta = f", ~{el / self.done * (self.total - self.done):.0f}s left" if self.done else ""
        print(f"[reproduce] run {self.done + 1}/{self.total} ({what}) | elapsed {el:.0f}s{eta}", flush=True)

    def finish(self) -> None:
        self.done += 1


def run_grid(paper: Paper, setting: str, seeds: Sequence[int], rounds: int, out: Path,
             lrs: Mapping[str, float] | None = None, progress: Progress | None = None) -> list[dict[str, Any]]:
    """Run every (entry, seed) of ``paper`` on ``setting``; return the result rows (also for skipped methods)."""
    methods = load_methods()
    runs_dir = out / "runs"
    results: list[dict[str, Any]] = []
    for entry in paper.entries:
        base = {"paper": paper.key, "setting": setting, "label": entry.label, "method": entry.method}
        if entry.method not in methods:
            results.append({**base, "seed": "", "status": "skipped", "error": "method not registered"})
            continue
        lr = (lrs or {}).get(entry.label)
        for seed in seeds:
            cfg = run_config_for(paper, setting, entry, seed, rounds, runs_dir, lr)
            if progress:
                progress.start(f"{paper.key}/{setting} {entry.label} seed {seed}")
            t = time.monotonic()
            row = {**base, "seed": seed, "client_lr": cfg["client-lr"], "run_dir": str(runs_dir / cfg["run-name"])}
            try:
                _, metrics = run_one(cfg, paper.num_nodes)
                row.update(summarize(metrics, paper.target), status="ok")
            except Exception as err:  # a broken method must not stop the suite; the row says why
                row.update(status="error", error=f"{type(err).__name__}: {err}"[:300])
            row["seconds"] = round(time.monotonic() - t, 2)
            results.append(row)
            if progress:
                progress.finish()
    return results


# ------------------------------------------------------------------------------------------ outputs
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
        for col in ("final_test_accuracy", "best_test_accuracy", "final_train_loss", "mean_train_loss_last",
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
    return out


def judge(claim: Claim, agg: Mapping[str, Mapping[str, Any]]) -> tuple[str, str]:
    """``(verdict, numbers)`` for one claim.

    ``reproduced`` = the paper's direction by more than the seed noise (the larger of the two std over seeds);
    ``same direction, within seed noise``; ``NOT reproduced`` = the opposite direction by more than the noise;
    ``opposite, within seed noise``; ``no difference`` (identical means); ``n/a`` when a side is missing or neither side reached the target.
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


def fmt(v: Any) -> str:
    if v is None:
        return "–"
    v = float(v)
    if math.isinf(v):
        return "∞"
    return f"{v:.4g}"


def markdown_table(paper: Paper, setting: str, results: Sequence[Mapping[str, Any]], command: str) -> str:
    agg = aggregate(results)
    seeds = sorted({r["seed"] for r in results if r["status"] == "ok"})
    rounds = next((r["rounds"] for r in results if r["status"] == "ok"), 0)
    lines = [
        f"### Paper {paper.key} — {paper.title} — setting `{setting}`",
        "",
        f"`{command}` · {len(seeds)} seed(s) {seeds} · {rounds} rounds · {paper.num_nodes} clients · "
        f"target test accuracy {paper.target:g}",
        "",
        "| entry | method | client lr | final test acc (mean ± std) | best test acc | rounds to target | "
        "train loss (last rounds) | bytes/round (up+down) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in paper.entries:
        a = agg.get(entry.label, {})
        if a.get("status") != "ok":
            lines.append(f"| {entry.label} | `{entry.method}` | – | {a.get('status', 'skipped')} | – | – | – | – |")
            continue
        rt = a["rounds_to_target"]
        rts = "∞" if math.isinf(rt) else f"{rt:.1f}"
        rts += f" ({a['reached']}/{a['n']} reached)"
        lines.append(
            f"| {entry.label} | `{entry.method}` | {a['client_lr']:g} | {a['final_test_accuracy']:.4f} ± "
            f"{a['final_test_accuracy_std']:.4f} | {a['best_test_accuracy']:.4f} | {rts} | "
            f"{a['mean_train_loss_last']:.4f} | {a['bytes_per_round'] / 1e3:.1f} kB |"
        )
    if paper.claims:
        lines += ["", "| paper's claim | on our data | numbers (mean over seeds) |", "|---|---|---|"]
        for c in paper.claims:
            verdict, numbers = judge(c, agg)
            lines.append(f"| {c.text} | **{verdict}** | {numbers} |")
    return "\n".join(lines) + "\n"


def write_outputs(paper: Paper, setting: str, results: list[dict[str, Any]], out: Path, command: str,
                  plots: bool = True) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = {"csv": out / "results.csv", "json": out / "results.json", "table": out / "table.md"}
    with files["csv"].open("w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        wr.writeheader()
        for r in results:
            wr.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in COLUMNS})
    agg = aggregate(results)
    files["json"].write_text(json.dumps(
        {"paper": paper.key, "title": paper.title, "setting": setting, "command": command, "target": paper.target,
         "results": results, "aggregate": agg,
         "claims": [{"claim": c.text, "verdict": judge(c, agg)[0], "numbers": judge(c, agg)[1]} for c in paper.claims]},
        indent=2, default=_json_default))
    files["table"].write_text(markdown_table(paper, setting, results, command))
    if plots:
        files.update(plot_curves(paper, setting, results, out))
    return files


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
        out[label] = (rounds_of[label], list(np.nanmean(arr, 0)), list(np.nanstd(arr, 0)))
    return out


def plot_curves(paper: Paper, setting: str, results: Sequence[Mapping[str, Any]], out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    files = {}
    n_seeds = len({r["seed"] for r in results if r["status"] == "ok"})
    for name, column, ylabel in (("accuracy", "test-accuracy", "test accuracy (fraction correct)"),
                                 ("loss", "test-loss", "test loss (cross-entropy, nats)")):
        fig, ax = plt.subplots(figsize=(8, 5))
        for i, (label, (rounds, mean, std)) in enumerate(curves(results, column).items()):
            m, s = np.array(mean), np.array(std)
            # 10 distinct colours; entries beyond the 10th repeat them dashed so no two lines look alike
            line, = ax.plot(rounds, m, label=label, lw=1.5, color=plt.cm.tab10(i % 10), ls="-" if i < 10 else "--")
            ax.fill_between(rounds, m - s, m + s, color=line.get_color(), alpha=0.18, lw=0)
        if column == "test-accuracy":
            ax.axhline(paper.target, color="grey", ls=":", lw=1, label=f"target {paper.target:g}")
        else:
            ax.set_yscale("log")
        ax.set_xlabel("server round")
        ax.set_ylabel(ylabel)
        ax.set_title(f"Paper {paper.key} on digits ({setting}): mean ± std over {n_seeds} seed(s)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        files[name] = out / f"{name}.png"
        fig.savefig(files[name], dpi=110)
        plt.close(fig)
    return files


# ------------------------------------------------------------------------------------------ sweep
SWEEP_SGD = (0.03, 0.1, 0.3, 1.0)
SWEEP_ADAPTIVE = (0.001, 0.003, 0.01, 0.03)
# Entries whose client runs an adaptive optimizer get the adaptive grid (step sizes of Adam-type updates are ~lr).
ADAPTIVE_CLIENT = ("localadam", "fedlada", "fedams", "fedlamb")


def sweep_grid(entry: Entry) -> tuple[float, ...]:
    if entry.method in ADAPTIVE_CLIENT:
        return SWEEP_ADAPTIVE
    if entry.method.startswith("fedlocal") and entry.overrides.get(f"{entry.method}.client-opt", "adagrad") in ("adam", "yogi"):
        return SWEEP_ADAPTIVE
    if entry.method.startswith("localupdate"):  # γ is the object of study in paper 003: sweep the server lr η instead
        return ()
    return SWEEP_SGD


def sweep(paper: Paper, setting: str, seeds: Sequence[int], rounds: int, out: Path,
          grid: Sequence[float] | None = None) -> dict[str, Any]:
    """Pick each entry's client lr: lowest mean ``train-loss-before`` over the last rounds (mean over seeds).

    Divergent runs (non-finite loss or a failed run) rank last.  Entries of paper 003 (γ is what it studies) keep γ.
    """
    methods = load_methods()
    todo = [(e, tuple(grid) if grid else sweep_grid(e)) for e in paper.entries if e.method in methods]
    todo = [(e, g) for e, g in todo if g]
    prog = Progress(sum(len(g) for _, g in todo) * len(seeds))
    chosen: dict[str, Any] = {}
    for entry, g in todo:
        scores = {}
        for lr in g:
            losses = []
            for seed in seeds:
                prog.start(f"sweep {paper.key}/{setting} {entry.label} lr={lr:g} seed {seed}")
                cfg = run_config_for(paper, setting, entry, seed, rounds, out / "runs" / f"lr{lr:g}", lr)
                try:
                    _, rows = run_one(cfg, paper.num_nodes)
                    v = summarize(rows, paper.target)["mean_train_loss_last"]
                except Exception:
                    v = math.inf
                losses.append(v if math.isfinite(v) else math.inf)
                prog.finish()
            scores[lr] = statistics.fmean(losses)
        best = min(scores, key=lambda k: (scores[k], k))
        chosen[entry.label] = {"client_lr": best, "scores": {f"{k:g}": v for k, v in scores.items()}}
    result = {"paper": paper.key, "setting": setting, "seeds": list(seeds), "rounds": rounds,
              "rule": f"lowest mean train-loss-before over the last {last_window(rounds)} rounds, mean over seeds",
              "chosen": chosen}
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=2, default=_json_default))
    return result



# ------------------------------------------------------------------------------------------ theory plots
FIXED_POINT_LRS = (0.01, 0.03, 0.1, 0.3)
# Server lrs only set the speed, not the fixed point (mean D = 0); local correction uploads ≈ gradients, so a smaller α.
FIXED_POINT_SERVER_LR = {"none": 1.0, "local": 0.3, "joint": 1.0}
FIXED_POINT_ROUNDS = 150


def fixed_point_runs(out: Path, *, lrs: Sequence[float] = FIXED_POINT_LRS, rounds: int = FIXED_POINT_ROUNDS, local_steps: int = 10,
                     seed: int = 0, dim: int = 5, heterogeneity: float = 1.0) -> dict[str, list[float]]:
    """Paper 000 Fig. 1 on our synthetic least-squares federation: ‖x_T − x*‖ per correction and client lr.

    Clients run ``local_steps`` full-batch steps of restarted local AdaGrad (``fedlocal``, float64, server SGD); x* is the
    minimiser of the example-weighted global loss (ordinary least squares on all clients' training data, the objective
    of ``weighting = examples``).  Without correction the fixed point moves with the client lr and does not reach x*
    as the lr decays; local / joint correction remove the preconditioner bias.
    """
    import numpy as np
    import torch

    from client_app.task import synthetic_client

    clients = 10
    parts = [synthetic_client(i, dim, heterogeneity, seed) for i in range(clients)]
    a = np.concatenate([p[0] for p in parts]).astype(np.float64)
    y = np.concatenate([p[1] for p in parts]).astype(np.float64)[:, 0]
    x_star = np.linalg.lstsq(a, y, rcond=None)[0]
    dist: dict[str, list[float]] = {}
    for corr, server_lr in FIXED_POINT_SERVER_LR.items():
        dist[corr] = []
        for lr in lrs:
            cfg = {
                "task": "synthetic-linear", "synthetic-dim": dim, "synthetic-clients": clients,
                "synthetic-heterogeneity": heterogeneity, "precision": "float64", "seed": seed, "method": "fedlocal",
                "num-server-rounds": rounds, "local-steps": local_steps, "batch-size": 1000, "client-lr": lr,
                "weighting": "examples", "fedlocal.client-opt": "adagrad", "fedlocal.correction": corr,
                "fedlocal.server-opt": "sgd", "fedlocal.server-lr": server_lr,
                "output-dir": str(out / "runs"), "run-name": f"fixedpoint-{corr}-lr{lr:g}",
            }
            run_one(cfg, clients)
            w = torch.load(out / "runs" / cfg["run-name"] / "model.pt")["w.weight"].numpy()[0]
            dist[corr].append(float(np.linalg.norm(w - x_star)))
    return dist


def theory(out: Path) -> list[Path]:
    """Write ``fixed_point_bias.png`` (+ ``fixed_point_bias.json``) and paper 003's ``surrogate_fixed_point.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from simulations import surrogate_plot

    load_methods()
    out.mkdir(parents=True, exist_ok=True)
    dist = fixed_point_runs(out)
    (out / "fixed_point_bias.json").write_text(json.dumps({"client_lr": list(FIXED_POINT_LRS), "distance": dist,
                                                            "server_lr": FIXED_POINT_SERVER_LR}, indent=2))
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for corr, d in dist.items():
        ax.plot(FIXED_POINT_LRS, d, marker="o", label=f"correction = {corr}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("client learning rate η (restarted local AdaGrad, K = 10 full-batch steps)")
    ax.set_ylabel(f"‖x_T − x*‖ after {FIXED_POINT_ROUNDS} rounds")
    ax.set_title("Paper 000 Fig. 1: fixed-point bias on heterogeneous least squares", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fixed_point_bias.png", dpi=110)
    plt.close(fig)
    surrogate = surrogate_plot.main([str(out / "surrogate_fixed_point.png")])
    return [out / "fixed_point_bias.png", out / "fixed_point_bias.json", surrogate]


# ------------------------------------------------------------------------------------------ CLI
def reproduce(keys: Sequence[str], *, quick: bool, seeds: int, rounds: int | None, out: Path,
              lrs_from: Path | None = None, command: str = "") -> dict[str, dict[str, Path]]:
    table = papers()
    plan = []
    for key in keys:
        p = table[key]
        for setting in (p.settings[:1] if quick else p.settings):
            plan.append((p, setting))
    r = rounds or (8 if quick else 50)
    seed_list = list(range(seeds))
    methods = load_methods()
    total = sum(sum(1 for e in p.entries if e.method in methods) * len(seed_list) for p, _ in plan)
    prog = Progress(total)
    lrs_all = json.loads(lrs_from.read_text()) if lrs_from else None
    written: dict[str, dict[str, Path]] = {}
    t0 = time.monotonic()
    for p, setting in plan:
        lrs = None
        if lrs_all and lrs_all.get("paper") == p.key:
            lrs = {k: v["client_lr"] for k, v in lrs_all["chosen"].items()}
        sub = out / p.key / setting
        results = run_grid(p, setting, seed_list, r, sub, lrs, prog)
        written[f"{p.key}/{setting}"] = write_outputs(p, setting, results, sub, command)
        print(markdown_table(p, setting, results, command), flush=True)
    print(f"[reproduce] {prog.done} runs in {time.monotonic() - t0:.1f}s → {out}", flush=True)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "python -m simulations.reproduce " + " ".join(argv)
    ap = argparse.ArgumentParser(prog="python -m simulations.reproduce", description=__doc__.splitlines()[0])
    ap.add_argument("what", help="paper key (000..004), 'all', 'sweep', 'theory' or 'report' (re-tabulate --out)")
    ap.add_argument("paper", nargs="?", help="for 'sweep': the paper key")
    ap.add_argument("--quick", action="store_true", help="first data setting only, 8 rounds (CI-sized)")
    ap.add_argument("--seeds", type=int, default=None, help="number of seeds 0..N-1 (default 3, quick 2)")
    ap.add_argument("--rounds", type=int, default=None, help="server rounds (default 50, quick 8; sweep 20)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--setting", default=None, help=f"sweep: data setting (default: the paper's first; one of {', '.join(SETTINGS)})")
    ap.add_argument("--lrs", default=None, help="sweep: comma-separated client lrs for every entry (default: per-entry grid)")
    ap.add_argument("--lrs-from", type=Path, default=None, help="use the client lrs chosen in a sweep.json")
    args = ap.parse_args(argv)
    table = papers()
    seeds = args.seeds or (2 if args.quick else 3)
    if args.what == "theory":
        for path in theory(args.out / "theory"):
            print(f"wrote {path}")
        return 0
    if args.what == "report":  # rewrite tables/plots from the results.json files under --out (no runs)
        for path in sorted(args.out.glob("*/*/results.json")):
            data = json.loads(path.read_text())
            p = table[data["paper"]]
            write_outputs(p, data["setting"], data["results"], path.parent, data["command"])
            print(f"rewrote {path.parent}")
        return 0
    if args.what == "sweep":
        if args.paper not in table:
            ap.error(f"sweep needs a paper key: one of {', '.join(table)}")
        p = table[args.paper]
        setting = args.setting or p.settings[0]
        grid = [float(v) for v in args.lrs.split(",")] if args.lrs else None
        res = sweep(p, setting, list(range(args.seeds or 2)), args.rounds or (8 if args.quick else 20),
                    args.out / "sweep" / p.key / setting, grid)
        for label, c in res["chosen"].items():
            print(f"{label}: client-lr {c['client_lr']:g}  (scores {c['scores']})")
        return 0
    keys = list(table) if args.what == "all" else [args.what]
    if any(k not in table for k in keys):
        ap.error(f"unknown paper {args.what!r}; choose one of {', '.join(table)}, all, sweep, theory")
    reproduce(keys, quick=args.quick, seeds=seeds, rounds=args.rounds, out=args.out, lrs_from=args.lrs_from,
              command=command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
