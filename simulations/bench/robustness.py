"""Attack × aggregator × partitioning matrix on digits-mlp (in-process engine, real ServerApp and ClientApp).

    flock /tmp/fedadapt-heavy.lock python -m simulations.bench.robustness --write-docs   # docs/robustness.md's matrix
    python -m simulations.bench.robustness --rounds 5 --attacks flip-50x --aggregators mean mean-clip1

One or two of 5 clients (partitions 0 and 1) rewrite their train replies (:data:`ATTACKS`); every other client is
honest.  Each cell is the final test accuracy; the clean column is the same aggregator without an attacker.  The
attacks and aggregators are the ones ``tests/test_robustness_matrix.py`` asserts.

``--write-docs`` runs the issue-36 matrix instead (:data:`SCENARIOS` × :data:`KINDS` × :data:`PROFILES`: 1 and 2
attackers of 5, 4 and 6 of 20, iid and Dirichlet-0.3) and rewrites the part of docs/robustness.md between its
``matrix`` markers: per cell the gap to the clean ``defence = "off"`` run of the same clients and partitioning.
``--write-docs --merge --profiles flwr-krum …`` runs only those rows and puts them into the table there (each
replacing its row of the same clients, data and profile; the other rows and the default-job table stay).

The ``flwr-*`` rows (:data:`FLOWER_ROWS`) are Flower's own classes, not fedadapt's look-alikes: under the defaults
(``defence = "off"``: only the always-on screen), the round's kept replies are aggregated by the Flower strategy's
``aggregate_train`` (:func:`flower_rule`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.logger import FLOWER_LOGGER
from flwr.serverapp.strategy import Bulyan, FedMedian, FedTrimmedAvg, Krum, MultiKrum, Strategy

import flower_strategies  # noqa: F401 - registers the methods
from flower_strategies.core import records as R
from flower_strategies.core.screen import ReplyScreen
from flower_strategies.core.validation import RecordSpec
from simulations.engine.inprocess import run_inprocess

NODES = 5
DIGITS = {"task": "digits-mlp", "local-epochs": 2, "client-lr": 0.1, "batch-size": 32,
          "learning-curve": False, "train-loss-before": False}
#: ``root-seed`` = the run's seed: reproducible robust rows (the root set and batch order the server drew from the
#: run's seed before the root secret, so the earlier figures stand).  No attacker of the matrix reads it but the
#: ``leaked`` diagnostic row's, which is exactly the case of a published seed.
PARTITIONS = {"iid": {"partitioner": "iid", "seed": 0, "root-seed": 0},
              "non-iid": {"partitioner": "dirichlet", "seed": 2, "root-seed": 2}}
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


def run_case(out: Path, partition: str, aggregator: str, attack: str | None, rounds: int, nodes: int = NODES,
             attackers: int = 0, engine: str = "inprocess", byzantine: int | None = None) -> dict[str, Any]:
    """One run; ``{"accuracy", "rejected", "clipped", "status"}`` (status: completed, or the failure's type).
    ``attackers`` > 0: ``attack`` is a :data:`KINDS` name played by partitions ``0 … attackers − 1``; else an
    :data:`ATTACKS` name; ``aggregator``: an :data:`AGGREGATORS` or :data:`PROFILES` name.  A :data:`FLOWER_ROWS`
    profile builds its Flower class for ``nodes`` replies of which ``byzantine`` (default: ``attackers``) may be
    malicious; ``{"status": "n/a (…)"}`` when the class cannot run with that many."""
    f = attackers if byzantine is None else byzantine
    name = f"{DIGITS.get('method', 'fedavg')}-{partition}-{aggregator}-{attack or 'clean'}-{attackers}of{nodes}"
    name += f"-f{f}" if aggregator in FLOWER_ROWS else ""  # a clean run of f = 4 and of f = 6 differ
    table = {**AGGREGATORS, **PROFILES}
    assert len(table) == len(AGGREGATORS) + len(PROFILES), "a profile name shadows an aggregator row"
    cfg = {**DIGITS, **PARTITIONS[partition], **table[aggregator], "num-server-rounds": rounds,
           "output-dir": str(out), "run-name": name}
    intercept: Any = None
    if attack == "absent":
        intercept = Absent(tuple(range(attackers)))
    elif attack and attackers:
        intercept = KINDS[attack](tuple(range(attackers)), cfg, nodes)
    elif attack:
        intercept = Coordinated(ATTACKS[attack])
    rule: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if aggregator in FLOWER_ROWS:
        flower = FLOWER_ROWS[aggregator](nodes, f)
        if isinstance(flower, str):
            return {"accuracy": None, "status": flower, "rejected": 0, "clipped": 0}
        rule = flower_rule(flower)
    try:
        with contextlib.redirect_stdout(io.StringIO()), rule:  # the ServerApp's per-round lines
            run_inprocess(cfg, nodes, engine=engine, intercept=intercept)
        status = "completed"
    except Exception as err:  # noqa: BLE001 - a failed run is a result of the matrix
        status = type(err).__name__
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    return {"accuracy": last.get("test-accuracy"), "status": status,
            "rejected": sum(r.get("replies-rejected", 0) for r in rows[1:]),
            "clipped": sum(r.get("updates-clipped", 0) for r in rows[1:])}


# ------------------------------------------------------------------------------------------ the issue-36 matrix
def ipm(epsilon: float = 0.5):
    """Inner-product manipulation (Xie, Koyejo, Gupta, UAI 2020): every attacker sends x_t − ε·(the mean of the
    attackers' own honest updates)."""
    def fn(cur, models):
        mean = {k: np.mean([m[k] - cur[k] for m in models.values()], axis=0) for k in cur}
        return {p: {k: cur[k] - epsilon * mean[k] for k in cur} for p in models}
    return fn


class NearReplay:
    """Each attacker sends its round-1 reply again every later round, one float nudged to the next representable
    value (a different element each round), so that no two of its replies have the same bytes."""

    def __init__(self, who: tuple[int, ...]) -> None:
        self.who, self.calls = who, 0
        self.first: dict[int, dict[str, np.ndarray]] = {}

    def __call__(self, request: Message, rep: Message, partition_id: int) -> Message:
        if partition_id not in self.who or rep.has_error() or "arrays" not in rep.content.array_records:
            return rep
        if partition_id not in self.first:
            self.first[partition_id] = {k: v.numpy().copy() for k, v in rep.content.array_records["arrays"].items()}
            return rep
        self.calls += 1
        old = {k: v.copy() for k, v in self.first[partition_id].items()}
        key = next(iter(old))
        flat = old[key].reshape(-1)
        at = self.calls % flat.size
        flat[at] = np.nextafter(flat[at], np.inf)
        rep.content["arrays"] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in old.items()})
        return rep


class LabelFlip:
    """Data poisoning: each attacker trains with the real client half on its own partition with every label y
    replaced by 9 − y (its reply is otherwise honest)."""

    def __init__(self, who: tuple[int, ...], cfg: dict[str, Any], nodes: int) -> None:
        from app_common.config import AppConfig
        from app_common.task import TASK_SPECS, build_model, load_client_data

        fed = AppConfig(**{k.replace("-", "_"): v for k, v in cfg.items()
                           if k.replace("-", "_") in AppConfig.__dataclass_fields__})
        self.who, self.fed = who, fed
        self.data = {p: load_client_data(fed.task, p, nodes, partitioner=fed.partitioner, seed=fed.seed,
                                         alpha=fed.dirichlet_alpha, classes_per_client=fed.classes_per_client)
                     for p in who}
        self.model = build_model(fed.task, fed.seed, fed.synthetic_dim, fed.precision)
        self.loss = TASK_SPECS[fed.task].loss_fn()
        self.state: dict[int, Any] = {}

    def __call__(self, request: Message, rep: Message, partition_id: int) -> Message:
        from flwr.app import RecordDict

        from flower_strategies.core.client import train_reply

        if partition_id not in self.who or rep.has_error():
            return rep
        x, y = self.data[partition_id]
        state = self.state.setdefault(partition_id, RecordDict())
        content = train_reply(self.model, request.content, x, 9 - y, self.loss, state=state, seed=self.fed.seed,
                              client_key=partition_id, loss_before=False)
        return Message(content=content, reply_to=request)


class Absent:
    """The attackers' replies never arrive (a client error each round): what the honest clients alone reach, the
    ceiling of any defence that leaves the attackers out (on label-skewed data their classes go with them)."""

    def __init__(self, who: tuple[int, ...]) -> None:
        self.who = who

    def __call__(self, request: Message, rep: Message, partition_id: int) -> Message:
        if partition_id not in self.who:
            return rep
        return Message(Error(code=0, reason="absent (bench_robustness)"), reply_to=request)


class Hijack:
    """Each attacker reports 1e12 examples with its honest model (the weight hijack)."""

    def __init__(self, who: tuple[int, ...]) -> None:
        self.who = who

    def __call__(self, request: Message, rep: Message, partition_id: int) -> Message:
        if partition_id in self.who and not rep.has_error() and "metrics" in rep.content.metric_records:
            rep.content.metric_records["metrics"]["num-examples"] = 1e12
        return rep


#: The issue's attacks: name → ``(attacking partitions, run-config, nodes) -> intercept``.
KINDS: dict[str, Callable[[tuple[int, ...], dict[str, Any], int], Any]] = {
    "flip-1x": lambda who, cfg, n: Coordinated((who, scaled(-1.0))),
    "flip-50x": lambda who, cfg, n: Coordinated((who, scaled(-50.0))),
    "boost-9x": lambda who, cfg, n: Coordinated((who, scaled(9.0))),
    "boost-50x": lambda who, cfg, n: Coordinated((who, scaled(50.0))),
    "alie": lambda who, cfg, n: Coordinated((who, alie(1.0))),
    "ipm": lambda who, cfg, n: Coordinated((who, ipm(0.5))),
    "near-replay": lambda who, cfg, n: NearReplay(who),
    "label-flip": LabelFlip,
    "hijack": lambda who, cfg, n: Hijack(who),
}
#: ``(nodes, attackers)`` of the matrix.
SCENARIOS = ((5, 1), (5, 2), (20, 4), (20, 6))
#: Rows of the matrix: the two ``defence`` profiles and the literature's rules (run-config overrides).
PROFILES: dict[str, dict[str, Any]] = {
    "off": {"defence": "off"},
    "robust": {"defence": "robust"},
    "fltrust": {"aggregator": "fltrust"},
    "centered-clip": {"aggregator": "centered-clip"},
    "bucketing": {"aggregator": "bucketing"},
    "multi-krum-f0.3": {"aggregator": "multi-krum", "byzantine-fraction": 0.3},
    "robust-before": {"max-weight-ratio": 1.5, "update-clip-ratio": 1.0, "update-cosine-floor": 0.0},
}


def bulyan(nodes: int, f: int) -> Strategy | str:
    """Flower's ``Bulyan`` for ``f`` malicious of ``nodes``, or why it cannot run (it needs n ≥ 4f + 3 replies and
    keeps the model otherwise; f = 0 would make it the plain unweighted mean)."""
    if nodes < 4 * f + 3 or f == 0:
        return f"n/a (needs {4 * max(f, 1) + 3} replies)"
    return Bulyan(num_malicious_nodes=f)


def trimmed_avg(nodes: int, f: int) -> Strategy:
    """Flower's ``FedTrimmedAvg`` cutting ``f`` of ``nodes`` replies per side: its ``beta`` is a fraction it floors,
    ``int(beta·n)``, so beta = f/n (checked to floor back to f)."""
    beta = f / nodes
    assert int(beta * nodes) == f, (f, nodes)
    return FedTrimmedAvg(beta=beta)


#: Reference rows: Flower 1.42's own robust strategies aggregate the replies fedadapt's always-on screen kept
#: (``defence = "off"``, :func:`flower_rule`).  ``fn(nodes, f) -> the Flower strategy`` (or why the row is n/a) for
#: ``f`` = the scenario's number of attackers; multi-Krum keeps n − f replies (Flower's default keeps 1: Krum).
FLOWER_ROWS: dict[str, Callable[[int, int], Strategy | str]] = {
    "flwr-krum": lambda n, f: Krum(num_malicious_nodes=f),
    "flwr-multikrum": lambda n, f: MultiKrum(num_malicious_nodes=f, num_nodes_to_select=n - f),
    "flwr-bulyan": bulyan,
    "flwr-median": lambda n, f: FedMedian(),
    "flwr-trimmedavg": trimmed_avg,
}
PROFILES.update({name: {"defence": "off"} for name in FLOWER_ROWS})
#: Rows run on every scenario; the other profiles on the 5-client scenarios only.
EVERY_SCENARIO = ("off", "robust", *FLOWER_ROWS)


@contextlib.contextmanager
def flower_rule(strategy: Strategy) -> Iterator[None]:
    """While active, every fedadapt strategy aggregates its model record by ``strategy.aggregate_train`` (a Flower
    strategy) on the replies its screen kept: one ``Message`` per reply holding its model as the only ArrayRecord and
    its weight (the reported ``num-examples`` under ``defence = "off"``) as the only MetricRecord.  When Flower
    returns no arrays (Bulyan with too few replies) the model stays, as in Flower's own loop.  A bench-side patch of
    :meth:`ReplyScreen._aggregate`: the ServerApp builds its strategy from the run-config, so no instance can be
    passed to it, and a library hook would be API for the bench alone."""
    own = ReplyScreen._aggregate

    def aggregate(screen: ReplyScreen, server_round: int, spec: RecordSpec, kept: Sequence[Any],
                  weights: Sequence[float], trust: Sequence[float] | None, trim: int) -> dict[str, np.ndarray]:
        if spec.name != R.MODEL:
            return own(screen, server_round, spec, kept, weights, trust, trim)
        replies = [Message(RecordDict({"arrays": ArrayRecord({k: Array(np.ascontiguousarray(v))
                                                              for k, v in parsed[spec.name].items()}),
                                       "metrics": MetricRecord({R.NUM_EXAMPLES: float(w)})}),
                           dst_node_id=msg.metadata.src_node_id, message_type="train")
                   for (msg, parsed), w in zip(kept, weights, strict=True)]
        arrays, _ = strategy.aggregate_train(server_round, replies)
        if arrays is None:
            return {k: np.array(v) for k, v in screen.current.items()}
        return {k: v.numpy() for k, v in arrays.items()}

    with mock.patch.object(ReplyScreen, "_aggregate", aggregate):
        yield


TARGET, CLEAN_TARGET = 0.05, 0.01
BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"


def matrix(out: Path, rounds: int, profiles: list[str], engine: str) -> list[str]:
    """The matrix as markdown lines: per scenario and partitioning, per profile, the gap of each cell to the clean
    ``off`` run (``—``: the run failed)."""
    kinds = list(KINDS)
    lines = ["| clients | data | profile | clean | attackers absent | " + " | ".join(kinds) + " | worst |",
             "|---|---|---|" + "---|" * (len(kinds) + 3)]
    for nodes, k in SCENARIOS:
        for partition in PARTITIONS:
            base = run_case(out, partition, "off", None, rounds, nodes, 0, engine)["accuracy"]
            absent = run_case(out, partition, "off", "absent", rounds, nodes, k, engine)["accuracy"] - base
            for profile in profiles:
                if nodes != NODES and profile not in EVERY_SCENARIO:
                    continue
                clean = run_case(out, partition, profile, None, rounds, nodes, 0, engine, byzantine=k)
                if clean["status"].startswith("n/a"):  # a Flower class that cannot run with this many replies
                    lines.append(f"| {k} of {nodes} | {partition} | {profile} | {clean['status']} | {absent:+.3f} | "
                                 + " | ".join("n/a" for _ in kinds) + " | n/a |")
                    print(lines[-1], flush=True)
                    continue
                cells, gaps = [], []
                for kind in kinds:
                    r = run_case(out, partition, profile, kind, rounds, nodes, k, engine)
                    if r["accuracy"] is None or r["status"] != "completed":
                        cells.append(f"— ({r['status']})")
                        continue
                    gap = r["accuracy"] - base
                    gaps.append(gap)
                    cells.append(f"{gap:+.3f}" if gap >= -TARGET else f"**{gap:+.3f}**")
                if clean["status"] == "completed":
                    ctxt = f"{clean['accuracy']:.3f} ({clean['accuracy'] - base:+.3f})"
                else:  # e.g. a run name already taken in ``out``: the run is refused, its metrics are another's
                    ctxt = f"— ({clean['status']})"
                lines.append(f"| {k} of {nodes} | {partition} | {profile} | {ctxt} | {absent:+.3f} | "
                             + " | ".join(cells)
                             + f" | {min(gaps):+.3f} |")
                print(lines[-1], flush=True)
    return lines


def default_jobs(out: Path, engine: str, seeds: tuple[int, ...] = (0, 2)) -> list[str]:
    """Every registered method's default job (the run-config defaults: 10 Dirichlet-0.3 digits clients, the
    method's presets) clean under ``defence = "off"`` and ``"robust"``, as markdown lines."""
    from flower_strategies.core.registry import METHODS

    lines = ["| method | " + " | ".join(f"off / robust (seed {s})" for s in seeds) + " | worst gap |",
             "|---|" + "---|" * (len(seeds) + 1)]
    for method in sorted(METHODS):
        cells, gaps = [], []
        for seed in seeds:
            acc = {}
            for defence in ("off", "robust"):
                cfg = {"method": method, "seed": seed, "defence": defence, "output-dir": str(out),
                       "run-name": f"default-{method}-{seed}-{defence}", "learning-curve": False}
                try:
                    with contextlib.redirect_stdout(io.StringIO()):
                        acc[defence] = run_inprocess(cfg, 10, engine=engine)["final"]["test-accuracy"]
                except Exception as err:  # noqa: BLE001 - a failed run is a result
                    acc[defence] = type(err).__name__
            if all(isinstance(a, float) for a in acc.values()):
                gaps.append(acc["robust"] - acc["off"])
                cells.append(f"{acc['off']:.3f} / {acc['robust']:.3f} ({gaps[-1]:+.3f})")
            else:
                cells.append(f"{acc['off']} / {acc['robust']}")
        worst = f"{min(gaps):+.3f}" if gaps else "—"
        if gaps and min(gaps) < -CLEAN_TARGET:
            worst = f"**{worst}**"
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {worst} |")
        print(lines[-1], flush=True)
    return lines


def write_docs(path: Path, lines: list[str], header: str) -> None:
    """Replace docs/robustness.md's text between :data:`BEGIN` and :data:`END` with ``header`` + ``lines``."""
    text = path.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    path.write_text(text[:start] + "\n" + header + "\n\n" + "\n".join(lines) + "\n" + text[end:])


def merge_docs(path: Path, rows: list[str], note: str) -> None:
    """Put the matrix ``rows`` into the table between docs/robustness.md's markers: each replaces the row of the
    same clients, data and profile, or follows the last row of its clients and data; ``note`` (``"Rows …: …"``) goes
    after the first paragraph (the command that made the other rows), replacing an earlier note for the same rows."""
    text = path.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    lines = text[start:end].strip("\n").split("\n")

    def key(line: str, cols: int) -> tuple[str, ...]:
        return tuple(c.strip() for c in line.strip("|").split("|")[:cols])

    for row in rows:
        same = [i for i, line in enumerate(lines) if line.startswith("| ") and key(line, 3) == key(row, 3)]
        group = [i for i, line in enumerate(lines) if line.startswith("| ") and key(line, 2) == key(row, 2)]
        if same:
            lines[same[0]] = row
        elif group:
            lines.insert(group[-1] + 1, row)
        else:
            raise ValueError(f"no rows of {key(row, 2)} in {path}'s matrix to merge into")
    old = [i for i, line in enumerate(lines) if line.startswith(note.split(": ")[0] + ": ")]  # this merge's last
    lines = [line for i, line in enumerate(lines) if i not in old and i + 1 not in old]  # (and its blank line)
    lines[1:1] = ["", note]
    path.write_text(text[:start] + "\n" + "\n".join(lines) + "\n" + text[end:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--partitions", nargs="+", default=list(PARTITIONS), choices=list(PARTITIONS))
    parser.add_argument("--aggregators", nargs="+", default=list(AGGREGATORS), choices=list(AGGREGATORS))
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra run-config overrides for every run (e.g. update-clip-ratio=1.5)")
    parser.add_argument("--write-docs", nargs="?", const="docs/robustness.md", default=None, metavar="PATH",
                        help="run the issue-36 matrix and write it into PATH between its matrix markers")
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    parser.add_argument("--merge", action="store_true",
                        help="with --write-docs: run only --profiles' rows and merge them into the table there")
    parser.add_argument("--engine", default="vectorized", choices=("inprocess", "vectorized"),
                        help="engine of --write-docs (the vectorized engine runs the same strategy, ~5× faster)")
    args = parser.parse_args(argv)
    for item in args.set:
        key, value = item.split("=", 1)
        DIGITS[key] = json.loads(value)
    torch.set_num_threads(1)
    FLOWER_LOGGER.setLevel(logging.ERROR)
    t0 = time.monotonic()
    if args.write_docs and args.merge:
        with tempfile.TemporaryDirectory() as tmp:
            rows = matrix(Path(tmp), args.rounds, args.profiles, args.engine)[2:]
        merge_docs(Path(args.write_docs), rows,
                   f"Rows {', '.join(f'`{p}`' for p in args.profiles)}: `flock /tmp/fedadapt-heavy.lock python -m "
                   f"simulations.bench.robustness --write-docs --merge --profiles {' '.join(args.profiles)}` "
                   f"({args.engine} engine, {time.monotonic() - t0:.0f} s).")
        return
    if args.write_docs:
        with tempfile.TemporaryDirectory() as tmp:
            jobs = default_jobs(Path(tmp), args.engine)
            lines = matrix(Path(tmp), args.rounds, args.profiles, args.engine)
        doc_header = (f"`flock /tmp/fedadapt-heavy.lock python -m simulations.bench.robustness --write-docs` "
                  f"({platform.machine()}, {os.cpu_count()} cores shared with other jobs, torch 1 thread, "
                  f"{args.engine} engine, {time.monotonic() - t0:.0f} s): digits-mlp, {args.rounds} rounds × 2 "
                  f"epochs, client-lr 0.1, batch 32, FedAvg.  Each cell: final test accuracy minus the clean "
                  f"`defence = \"off\"` run's of the same clients and partitioning; **bold** = more than "
                  f"{TARGET} below it (the target).  The clean column: the profile's clean accuracy (its gap; "
                  f"target within {CLEAN_TARGET}).")
        jobs_header = (f"Every method's default job (the run-config defaults: FedAvg's is 10 Dirichlet-0.3 digits "
                       f"clients, 10 rounds × 5 epochs, client-lr 0.5; each method with its presets), clean, final "
                       f"test accuracy under `defence = \"off\"` / `\"robust\"` (gap; **bold** = more than "
                       f"{CLEAN_TARGET} below):")
        write_docs(Path(args.write_docs), [*lines, "", jobs_header, "", *jobs], doc_header)
        return
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
