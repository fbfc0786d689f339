"""Attack × aggregator × partitioning matrix on digits-mlp (in-process engine, real ServerApp and ClientApp).

    flock /tmp/fedadapt-heavy.lock python -m simulations.bench.robustness            # the table of docs/robustness.md
    python -m simulations.bench.robustness --rounds 5 --attacks flip-50x --aggregators mean mean-off

One or two of 5 clients (partitions 0 and 1) rewrite their train replies (:data:`ATTACKS`); every other client is
honest.  Each cell is the final test accuracy; the clean column is the same aggregator without an attacker.  The
attacks and aggregators are the ones ``tests/test_robustness_matrix.py`` asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message
from flwr.common.logger import FLOWER_LOGGER

import flower_strategies  # noqa: F401 - registers the methods
from simulations.engine.inprocess import run_inprocess

NODES = 5
DIGITS = {"task": "digits-mlp", "local-epochs": 2, "client-lr": 0.1, "batch-size": 32,
          "learning-curve": False, "train-loss-before": False}
PARTITIONS = {"iid": {"partitioner": "iid", "seed": 0}, "non-iid": {"partitioner": "dirichlet", "seed": 2}}
#: Aggregators: run-config overrides (``mean`` = the defaults: the methods' own mean, no update clip, only the 100×
#: rejection; ``mean-clip1`` / ``mean-clip2`` = the update clip at 1× / 2× the round's median norm; the robust
#: aggregators with the clip at 1×).
AGGREGATORS: dict[str, dict[str, Any]] = {
    "mean": {},
    "mean-clip1": {"update-clip-ratio": 1.0},
    "mean-clip2": {"update-clip-ratio": 2.0},
    "mean-cos0": {"update-cosine-floor": 0.0},
    "mean-cos0-clip1": {"update-cosine-floor": 0.0, "update-clip-ratio": 1.0},
    "trimmed-mean": {"aggregator": "trimmed-mean", "update-clip-ratio": 1.0},
    "median": {"aggregator": "median", "update-clip-ratio": 1.0},
    "krum": {"aggregator": "krum", "update-clip-ratio": 1.0},
    "multi-krum": {"aggregator": "multi-krum", "update-clip-ratio": 1.0},
}

#: ``(attacking partitions, fn(x_t, {partition: its honest model}) -> {partition: the model it sends})``.
Attack = tuple[tuple[int, ...], Callable[[dict[str, np.ndarray], dict[int, dict[str, np.ndarray]]],
                                         dict[int, dict[str, np.ndarray]]]]


def norm(arrays: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays.values())))


def scaled(scale: float):
    """Each attacker sends x_t + scale·Δ, Δ its honest update (scale < 0: sign-flipped)."""
    return lambda cur, models: {p: {k: cur[k] + scale * (x[k] - cur[k]) for k in x} for p, x in models.items()}


def alie(z: float = 1.0):
    """A little is enough (Baruch et al., 2019): every attacker sends mean − z·std of the attackers' own honest
    models, coordinate-wise (a shift within the spread of honest replies)."""
    def fn(cur, models):
        stack = {k: np.stack([m[k] for m in models.values()]) for k in cur}
        return {p: {k: stack[k].mean(axis=0) - z * stack[k].std(axis=0) for k in cur} for p in models}
    return fn


def gaussian(scale: float):
    """x_t plus Gaussian noise of ``scale`` × the attacker's own update norm."""
    def fn(cur, models):
        rng = np.random.default_rng(0)
        out = {}
        for p, x in models.items():
            noise = {k: rng.normal(size=np.shape(v)) for k, v in x.items()}
            factor = scale * norm({k: x[k] - cur[k] for k in x}) / max(norm(noise), 1e-30)
            out[p] = {k: cur[k] + factor * noise[k] for k in x}
        return out
    return fn


ATTACKS: dict[str, Attack] = {
    "flip-1x": ((0,), scaled(-1.0)),
    "flip-3x": ((0,), scaled(-3.0)),
    "flip-50x": ((0,), scaled(-50.0)),
    "flip-1e4x": ((0,), scaled(-1e4)),
    "boost-9x": ((0,), scaled(9.0)),
    "boost-50x": ((0,), scaled(50.0)),
    "noise-50x": ((0,), gaussian(50.0)),
    "flip-2of5-1x": ((0, 1), scaled(-1.0)),
    "flip-2of5-99x": ((0, 1), scaled(-99.0)),
    "alie-2of5": ((0, 1), alie(1.0)),
}


class Coordinated:
    """``intercept`` of :class:`~simulations.engine.inprocess.LoopbackGrid` making an attack's replies.  The grid keeps
    each reply object, so the attackers' replies are held until the last attacker's has arrived and then rewritten
    together (colluding attackers that see each other's honest models)."""

    def __init__(self, attack: Attack) -> None:
        self.who, self.fn = attack
        self.held: dict[int, Message] = {}

    def __call__(self, request: Message, rep: Message, partition_id: int) -> Message:
        if partition_id not in self.who or rep.has_error() or "arrays" not in rep.content.array_records:
            return rep
        self.held[partition_id] = rep
        if len(self.held) == len(self.who):
            cur = {k: v.numpy() for k, v in request.content.array_records["arrays"].items()}
            honest = {p: {k: v.numpy() for k, v in m.content.array_records["arrays"].items()}
                      for p, m in self.held.items()}
            for p, new in self.fn(cur, honest).items():
                self.held[p].content["arrays"] = ArrayRecord(
                    {k: Array(np.ascontiguousarray(v.astype(cur[k].dtype))) for k, v in new.items()})
            self.held = {}
        return rep


def run_case(out: Path, partition: str, aggregator: str, attack: str | None, rounds: int) -> dict[str, Any]:
    """One run; ``{"accuracy", "rejected", "clipped", "status"}`` (status: completed, or the failure's type)."""
    name = f"{partition}-{aggregator}-{attack or 'clean'}"
    cfg = {**DIGITS, **PARTITIONS[partition], **AGGREGATORS[aggregator], "num-server-rounds": rounds,
           "output-dir": str(out), "run-name": name}
    intercept = Coordinated(ATTACKS[attack]) if attack else None
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the ServerApp's per-round lines
            run_inprocess(cfg, NODES, intercept=intercept)
        status = "completed"
    except Exception as err:  # noqa: BLE001 - a failed run is a result of the matrix
        status = type(err).__name__
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    return {"accuracy": last.get("test-accuracy"), "status": status,
            "rejected": sum(r.get("replies-rejected", 0) for r in rows[1:]),
            "clipped": sum(r.get("updates-clipped", 0) for r in rows[1:])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--partitions", nargs="+", default=list(PARTITIONS), choices=list(PARTITIONS))
    parser.add_argument("--aggregators", nargs="+", default=list(AGGREGATORS), choices=list(AGGREGATORS))
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra run-config overrides for every run (e.g. update-clip-ratio=1.5)")
    args = parser.parse_args(argv)
    for item in args.set:
        key, value = item.split("=", 1)
        DIGITS[key] = json.loads(value)
    torch.set_num_threads(1)
    FLOWER_LOGGER.setLevel(logging.ERROR)
    t0 = time.monotonic()
    header = ["partition", "aggregator", "clean", *args.attacks]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for partition in args.partitions:
            for aggregator in args.aggregators:
                cells = []
                for attack in [None, *args.attacks]:
                    r = run_case(Path(tmp), partition, aggregator, attack, args.rounds)
                    cell = "—" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
                    cells.append(cell if r["status"] == "completed" else f"{cell} ({r['status']})")
                print(f"| {partition} | {aggregator} | " + " | ".join(cells) + " |", flush=True)
    print(f"\n{args.rounds} rounds × 2 local epochs, {NODES} clients; {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
