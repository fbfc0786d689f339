"""Running the grid: one run = the real ServerApp + ClientApp in this process (or a spawned worker); result rows."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .catalogue import Paper, registered, run_config_for, settings


def run_one(cfg: Mapping[str, Any], num_nodes: int,
            engine: str = "vectorized", **grid_kwargs: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run one configuration quietly; return the engine's summary and the per-round rows it wrote.  ``engine``: the
    in-process engine (``vectorized`` by default: equal results, faster; a task it cannot train runs on
    ``inprocess``)."""
    import torch

    from app_common.config import parse as app_config
    from server_app.app import run_dir
    from simulations.engine.inprocess import run_inprocess
    from simulations.engine.vectorized import vectorizable

    flwr_logger = logging.getLogger("flwr")
    level, threads = flwr_logger.level, torch.get_num_threads()
    flwr_logger.setLevel(logging.WARNING)
    torch.set_num_threads(1)  # tiny models: intra-op threads only add contention (≈20× slower on 2 busy cores)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            if engine == "vectorized" and not vectorizable(app_config(cfg)):
                engine, grid_kwargs = "inprocess", {}
            # a tool's grid owns its run directories: a rerun moves its earlier runs aside (server_app.rundir)
            summary = run_inprocess({"overwrite": True, **cfg}, num_nodes, engine=engine, **grid_kwargs)
    finally:
        flwr_logger.setLevel(level)
        torch.set_num_threads(threads)
    return summary, read_metrics(run_dir(app_config(cfg), cfg) / "metrics.jsonl")


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
    mean = lambda xs: statistics.fmean(xs) if xs else math.nan  # noqa: E731
    return {
        "rounds": len(trained),
        "final_test_accuracy": _num(final.get("test-accuracy")),
        "final_test_loss": _num(final.get("test-loss")),
        "best_test_accuracy": max((_num(r.get("test-accuracy")) for r in rows), default=math.nan),
        "mean_test_accuracy_last": mean(acc[-w:]),
        "final_train_loss": _num(trained[-1].get("train-loss-before")) if trained else math.nan,
        "mean_train_loss_last": mean(tl[-w:]),
        "early_train_loss": mean(tl[:early]),
        "target": target,
        "rounds_to_target": reach,
        "bytes_up_per_round": mean(up),
        "bytes_down_per_round": mean(down),
        "bytes_per_round": mean([a + b for a, b in zip(up, down, strict=True)]),
    }


def server_lr_of(cfg: Mapping[str, Any]) -> float | None:
    """The effective server lr of a run-config (its method's ``server_lr`` field after defaults), or ``None``."""
    hp = registered()[cfg["method"]].hparams_from_run_config(cfg)
    v = getattr(hp, "server_lr", None)  # generic over methods: not every method declares one
    return float(v) if v is not None else None


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
    engine: str = "vectorized"  # the setting's (catalogue/settings.toml `engine`)


RunResult = tuple[list[dict[str, Any]] | None, str | None, float]


def _run_task(task: Task) -> RunResult:
    """``(metrics rows, None, seconds)`` or ``(None, error, seconds)``: a failing run never raises."""
    t = time.monotonic()
    try:
        _, rows = run_one(task.cfg, task.num_nodes, task.engine)
        return rows, None, time.monotonic() - t
    except Exception as err:  # a broken method must not stop the suite; the row says why
        return None, f"{type(err).__name__}: {err}"[:300], time.monotonic() - t


def execute(tasks: Sequence[Task], jobs: int = 1, progress: Progress | None = None) -> list[RunResult]:
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

    results: list[RunResult | None] = [None] * len(tasks)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_task, task): i for i, task in enumerate(tasks)}
        for fut in as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            if progress:
                progress.finish(tasks[i].what)
    return results  # type: ignore[return-value]


def run_grid(paper: Paper, setting: str, seeds: Sequence[int], rounds: int, out: Path,
             lrs: Mapping[str, Mapping[str, float]] | None = None,
             progress: Progress | None = None, jobs: int = 1) -> list[dict[str, Any]]:
    """Run every (entry, seed) of ``paper`` on ``setting``; return the result rows (also for skipped methods).

    ``lrs``: per label the run-config overrides a sweep chose (``client-lr`` and a server-lr key).
    """
    methods = registered()
    runs_dir = out / "runs"
    results: list[dict[str, Any]] = []
    not_ready = settings()[setting].ready()
    num_nodes = paper.num_nodes if not_ready else paper.nodes_for(setting)
    tasks: list[Task] = []
    for entry in paper.entries_for(setting):
        base = {"paper": paper.key, "setting": setting, "label": entry.label, "method": entry.method}
        if entry.method not in methods or not_ready:
            results.append({**base, "seed": "", "status": "skipped", "error": not_ready or "method not registered"})
            if progress:
                progress.skip(len(seeds) if entry.method in methods else 0)
            continue
        for seed in seeds:
            cfg = run_config_for(paper, setting, entry, seed, rounds, runs_dir, (lrs or {}).get(entry.label))
            results.append({**base, "seed": seed, "client_lr": cfg["client-lr"], "server_lr": server_lr_of(cfg),
                            "run_dir": str(runs_dir / cfg["run-name"])})
            tasks.append(Task(f"{paper.key}/{setting} {entry.label} seed {seed}", cfg, num_nodes,
                              settings()[setting].engine))
    pending = [r for r in results if "run_dir" in r]
    for row, (metrics, error, seconds) in zip(pending, execute(tasks, jobs, progress), strict=True):
        if error is None:
            assert metrics is not None  # a run without an error has its metrics
            row.update(summarize(metrics, paper.target_for(setting)), status="ok")
        else:
            row.update(status="error", error=error)
        row["seconds"] = round(seconds, 2)
    return results
