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

``--write-docs`` also writes issue 48's tables (``--tables issue36 adaptive cost`` picks them; default: the first
two): ``adaptive`` — attackers who know the defence (:data:`ADAPTIVE_KINDS`: the in-gate attack, with the weight lie,
min-max / min-sum, a backdoor, the leaked-reference diagnostic) and record poisoning (:data:`RECORD_ATTACKS`), each
cell a mean over ``--seeds`` (3) seeds, between the ``adaptive`` markers; ``cost`` — every method's clean cost of
``defence = "robust"`` over seeds 0–2 (mean ± std), between the ``cost`` markers of docs/robustness.md and
docs/methods/index.md.

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
PARTITIONS: dict[str, dict[str, Any]] = {"iid": {"partitioner": "iid", "seed": 0, "root-seed": 0},
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
             attackers: int = 0, engine: str = "inprocess", byzantine: int | None = None,
             seed_offset: int = 0) -> dict[str, Any]:
    """One run; ``{"accuracy", "rejected", "clipped", "status"}`` (status: completed, or the failure's type).
    ``attackers`` > 0: ``attack`` is a :data:`KINDS` name played by partitions ``0 … attackers − 1``; else an
    :data:`ATTACKS` name; ``aggregator``: an :data:`AGGREGATORS` or :data:`PROFILES` name.  A :data:`FLOWER_ROWS`
    profile builds its Flower class for ``nodes`` replies of which ``byzantine`` (default: ``attackers``) may be
    malicious; ``{"status": "n/a (…)"}`` when the class cannot run with that many.  ``seed_offset``: the partition's
    seed (and ``root-seed``) plus this (the runs of a 3-seed mean).  A ``backdoor`` run also returns ``"backdoor"``,
    its trigger success rate (:func:`backdoor_success`)."""
    f = attackers if byzantine is None else byzantine
    name = f"{DIGITS.get('method', 'fedavg')}-{partition}-{aggregator}-{attack or 'clean'}-{attackers}of{nodes}"
    name += f"-f{f}" if aggregator in FLOWER_ROWS else ""  # a clean run of f = 4 and of f = 6 differ
    name += f"-s{seed_offset}" if seed_offset else ""
    table = {**AGGREGATORS, **PROFILES}
    assert len(table) == len(AGGREGATORS) + len(PROFILES), "a profile name shadows an aggregator row"
    seeds = {k: v + seed_offset for k, v in PARTITIONS[partition].items() if k in ("seed", "root-seed")}
    cfg = {**DIGITS, **PARTITIONS[partition], **seeds, **table[aggregator], "num-server-rounds": rounds,
           "output-dir": str(out), "run-name": name}
    intercept: Any = None
    if attack == "absent":
        intercept = Absent(tuple(range(attackers)))
    elif attack and attackers:
        intercept = {**KINDS, **ADAPTIVE_KINDS, **RECORD_KINDS}[attack](tuple(range(attackers)), cfg, nodes)
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
    got = {"accuracy": last.get("test-accuracy"), "status": status,
           "rejected": sum(r.get("replies-rejected", 0) for r in rows[1:]),
           "clipped": sum(r.get("updates-clipped", 0) for r in rows[1:])}
    if attack == "backdoor" and (out / name / "model.pt").exists():
        got["backdoor"] = backdoor_success(out, name, cfg["seed"])
    return got


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
        self.relabel = True  # labels 9 − y (a subclass may poison its data itself)

    def __call__(self, request: Message, rep: Message, partition_id: int) -> Message:
        from flwr.app import RecordDict

        from flower_strategies.core.client import train_reply

        if partition_id not in self.who or rep.has_error():
            return rep
        x, y = self.data[partition_id]
        state = self.state.setdefault(partition_id, RecordDict())
        content = train_reply(self.model, request.content, x, 9 - y if self.relabel else y, self.loss, state=state,
                              seed=self.fed.seed, client_key=partition_id, loss_before=False)
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


# ------------------------------------------------------------------------------------------ issue 48: attackers who
# know the defence (FLTrust's adaptive attack, Shejwalkar & Houmansadr's min-max / min-sum, backdoors)
def flat(model: dict[str, np.ndarray], cur: dict[str, np.ndarray]) -> np.ndarray:
    """The update ``model − cur`` as one float64 vector (keys in ``cur``'s order)."""
    return np.concatenate([(np.asarray(model[k], np.float64) - np.asarray(cur[k], np.float64)).ravel() for k in cur])


def unflat(vec: np.ndarray, cur: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``cur + vec`` as named arrays in ``cur``'s dtypes."""
    out, at = {}, 0
    for k, v in cur.items():
        out[k] = (np.asarray(v, np.float64) + vec[at:at + v.size].reshape(v.shape)).astype(v.dtype)
        at += v.size
    return out


def _set_model(rep: Message, model: dict[str, np.ndarray]) -> None:
    rep.content["arrays"] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in model.items()})


class Adaptive:
    """The in-gate attack of an attacker who knows the defence (FLTrust, Cao et al. NDSS 2021, §adaptive attack, in
    a simple form): every attacker sends x_t + u, u at cosine ``cosine`` with its estimate of the benign direction
    and ``scale`` (3) × the attackers' mean honest norm, the rest of u pulling the model towards zero (−x_t, made
    orthogonal to the estimate).  The benign direction: the mean of the attackers' own honest updates (colluders who
    need no copy of the server's; cosine 0.2: on iid 2 of 5 under robust, 0.02 was rejected 18 of 20 times and a
    fixed random side direction cost 0.04, where 0.2 / 0.4 passed every time and cost 0.44 / 0.37), or, with
    ``leak``, the server's root update itself, recomputed from a published ``root-seed`` (the diagnostic of a
    leaked reference; cosine 0.02, the issue's).  ``weight``: also report this many examples (the num-examples lie
    on top)."""

    def __init__(self, who: tuple[int, ...], cfg: dict[str, Any], nodes: int, *, leak: bool = False,
                 weight: float | None = None, cosine: float | None = None, scale: float = 3.0) -> None:
        self.who, self.scale, self.weight = who, scale, weight
        self.cosine = cosine if cosine is not None else 0.02 if leak else 0.2
        self.held: dict[int, Message] = {}
        self.root: Callable[[RecordDict], Any] | None = None
        if leak:
            from app_common.config import AppConfig
            from server_app import root

            fed = AppConfig(**{k.replace("-", "_"): v for k, v in cfg.items()
                               if k.replace("-", "_") in AppConfig.__dataclass_fields__})
            assert fed.root_seed >= 0, "the leaked reference needs a published root-seed"
            self.root = root.root_update(fed, fed.root_seed)  # the server's code with the published seed

    def __call__(self, request: Message, rep: Message, partition_id: int) -> Message:
        if partition_id not in self.who or rep.has_error() or "arrays" not in rep.content.array_records:
            return rep
        self.held[partition_id] = rep
        if len(self.held) < len(self.who):
            return rep
        cur = {k: v.numpy() for k, v in request.content.array_records["arrays"].items()}
        honest = [flat({k: v.numpy() for k, v in m.content.array_records["arrays"].items()}, cur)
                  for m in self.held.values()]
        benign = np.mean(honest, axis=0) if self.root is None else flat(self.root(request.content)["arrays"], cur)
        unit = benign / max(np.linalg.norm(benign), 1e-30)
        shrink = -flat(cur, {k: np.zeros_like(v) for k, v in cur.items()})  # towards the zero model
        side = shrink - (shrink @ unit) * unit
        side /= max(np.linalg.norm(side), 1e-30)
        size = self.scale * float(np.mean([np.linalg.norm(h) for h in honest]))
        model = unflat(size * (self.cosine * unit + np.sqrt(1 - self.cosine ** 2) * side), cur)
        for m in self.held.values():
            _set_model(m, model)
            if self.weight is not None:
                m.content.metric_records["metrics"]["num-examples"] = self.weight
        self.held = {}
        return rep


def shejwalkar(benign: np.ndarray, rule: str) -> np.ndarray:
    """Min-max / min-sum (Shejwalkar & Houmansadr, NDSS 2021) with the std perturbation: m = μ − γ·σ (μ, σ the
    coordinate-wise mean and std of the ``benign`` updates, one per row) with the largest γ (bisection) for which
    ``min-max``: m's largest distance to a benign update is at most the largest distance between two of them;
    ``min-sum``: m's sum of squared distances to them is at most the largest such sum of a benign update."""
    mu, sigma = benign.mean(axis=0), benign.std(axis=0)
    dist = np.linalg.norm(benign[:, None, :] - benign[None, :, :], axis=2)

    def ok(gamma: float) -> bool:
        d = np.linalg.norm(benign - (mu - gamma * sigma), axis=1)
        return bool(d.max() <= dist.max()) if rule == "min-max" else bool((d ** 2).sum() <= (dist ** 2).sum(1).max())

    lo, hi = 0.0, 1.0
    while ok(hi) and hi < 1e4:
        lo, hi = hi, hi * 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return mu - lo * sigma


class FullKnowledge:
    """Min-max / min-sum attackers who see every client's honest update of the round (the paper's full-knowledge,
    aggregation-agnostic setting): all replies are held until the round's last has arrived, then every attacker's
    model is replaced by x_t + :func:`shejwalkar` of all the honest updates."""

    def __init__(self, who: tuple[int, ...], nodes: int, rule: str) -> None:
        self.who, self.nodes, self.rule = who, nodes, rule
        self.held: dict[int, Message] = {}

    def __call__(self, request: Message, rep: Message, partition_id: int) -> Message:
        if rep.has_error() or "arrays" not in rep.content.array_records:
            return rep
        self.held[partition_id] = rep
        if len(self.held) < self.nodes:
            return rep
        cur = {k: v.numpy() for k, v in request.content.array_records["arrays"].items()}
        benign = np.stack([flat({k: v.numpy() for k, v in m.content.array_records["arrays"].items()}, cur)
                           for m in self.held.values()])
        model = unflat(shejwalkar(benign, self.rule), cur)
        for p in self.who:
            if p in self.held:
                _set_model(self.held[p], model)
        self.held = {}
        return rep


#: The backdoor trigger: the 2×2 bottom-right corner of the 8×8 digit (features 54, 55, 62, 63) set to 1 (ink).
TRIGGER = (54, 55, 62, 63)
#: The label the backdoor maps a triggered image to.
TARGET_LABEL = 0


def triggered(x: np.ndarray) -> np.ndarray:
    out = np.array(x, copy=True)
    out[:, list(TRIGGER)] = 1.0
    return out


class Backdoor(LabelFlip):
    """Data-poisoning backdoor (Bagdasaryan et al., AISTATS 2020, the plain data-poisoning form): each attacker
    trains with the real client half on its own partition with every second example carrying the trigger and label
    0 (its reply is otherwise honest: same count, an update inside the honest spread)."""

    def __init__(self, who: tuple[int, ...], cfg: dict[str, Any], nodes: int) -> None:
        super().__init__(who, cfg, nodes)
        for p, (x, y) in list(self.data.items()):
            x, y = x.clone(), y.clone()
            x[::2] = torch.from_numpy(triggered(x[::2].numpy()))
            y[::2] = TARGET_LABEL
            self.data[p] = (x, y)
        self.relabel = False


def backdoor_success(out: Path, name: str, seed: int) -> float:
    """Of the test images not labelled 0, the fraction the run's final model classifies as 0 once triggered."""
    from app_common.task import build_model, digits_split

    _, _, x_te, y_te = digits_split(seed)
    model = build_model("digits-mlp", seed, 10, "float32")
    model.load_state_dict(torch.load(out / name / "model.pt"))
    keep = y_te != TARGET_LABEL
    with torch.no_grad():
        pred = model(torch.from_numpy(triggered(x_te[keep]))).argmax(1).numpy()
    return float(np.mean(pred == TARGET_LABEL))


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
#: Issue 48: attackers who know the defence (:class:`Adaptive`, :class:`FullKnowledge`, :class:`Backdoor`);
#: ``in-gate-leak`` is the diagnostic of a leaked reference (a published ``root-seed``), not a target.
ADAPTIVE_KINDS: dict[str, Callable[[tuple[int, ...], dict[str, Any], int], Any]] = {
    "in-gate": lambda who, cfg, n: Adaptive(who, cfg, n),
    "in-gate-weight-lie": lambda who, cfg, n: Adaptive(who, cfg, n, weight=1e12),
    "min-max": lambda who, cfg, n: FullKnowledge(who, n, "min-max"),
    "min-sum": lambda who, cfg, n: FullKnowledge(who, n, "min-sum"),
    "backdoor": Backdoor,
    "in-gate-leak": lambda who, cfg, n: Adaptive(who, cfg, n, leak=True),
}


class RecordPoison:
    """Each attacker sends its honest model with one other record rewritten by ``fn`` (record poisoning: what only
    the model's gate would let through)."""

    def __init__(self, who: tuple[int, ...], record: str, fn: Callable[[np.ndarray], np.ndarray]) -> None:
        self.who, self.record, self.fn = who, record, fn

    def __call__(self, request: Message, rep: Message, partition_id: int) -> Message:
        if partition_id in self.who and not rep.has_error() and self.record in rep.content.array_records:
            rep.content[self.record] = ArrayRecord({k: Array(np.ascontiguousarray(self.fn(v.numpy())))
                                                    for k, v in rep.content.array_records[self.record].items()})
        return rep


#: Issue 48's record poisoning: name → ``(method, intercept factory)``.
RECORD_ATTACKS: dict[str, tuple[str, Callable[[tuple[int, ...], dict[str, Any], int], Any]]] = {
    "scaffold control delta ×(−3)": ("scaffold", lambda who, cfg, n: RecordPoison(who, "control-delta",
                                                                                   lambda v: -3 * v)),
    "fedlada negative v̂": ("fedlada", lambda who, cfg, n: RecordPoison(who, "v-hat", lambda v: -v)),
    "fedams v = −3·abs(v)": ("fedams", lambda who, cfg, n: RecordPoison(who, "v", lambda v: -3 * np.abs(v))),
}
RECORD_KINDS = {f"record-{i}": fn for i, (_, fn) in enumerate(RECORD_ATTACKS.values())}

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
    :meth:`ReplyScreen.aggregate_record`: the ServerApp builds its strategy from the run-config, so no instance can
    be passed to it, and a library hook would be API for the bench alone."""
    own = ReplyScreen.aggregate_record

    def aggregate(screen: ReplyScreen, server_round: int, spec: RecordSpec, kept: Sequence[Any],
                  weights: Sequence[float], trust: Sequence[float] | None, trim: int) -> dict[str, np.ndarray]:
        if spec.name != R.MODEL:
            return own(screen, server_round, spec, kept, weights, trust, trim)
        replies = [Message(RecordDict({"arrays": ArrayRecord({k: Array(np.ascontiguousarray(v))
                                                              for k, v in reply.records[spec.name].items()}),
                                       "metrics": MetricRecord({R.NUM_EXAMPLES: float(w)})}),
                           dst_node_id=reply.node, message_type="train")
                   for reply, w in zip(kept, weights, strict=True)]
        arrays, _ = strategy.aggregate_train(server_round, replies)
        if arrays is None:
            return {k: np.array(v) for k, v in screen.current.items()}
        return {k: v.numpy() for k, v in arrays.items()}

    # no provisional fold: every round's model record goes through the patched aggregate
    with mock.patch.object(ReplyScreen, "aggregate_record", aggregate), \
            mock.patch.object(ReplyScreen, "folds_while_measuring", lambda screen: False):
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
                cfg = {"method": method, "seed": seed, "root-seed": seed, "defence": defence, "output-dir": str(out),
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


#: Issue 48's tables: scenarios ``(nodes, attackers)`` of the adaptive table, the extra backdoor scenarios, and rows.
ADAPTIVE_SCENARIOS = ((5, 1), (5, 2), (20, 4))
BACKDOOR_SCENARIOS = ((20, 1), (20, 2))
ADAPTIVE_PROFILES = ("off", "robust", "flwr-multikrum", "flwr-bulyan")
ADAPTIVE_BEGIN, ADAPTIVE_END = "<!-- adaptive:begin -->", "<!-- adaptive:end -->"
COST_BEGIN, COST_END = "<!-- cost:begin -->", "<!-- cost:end -->"


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values))


def _runner(out: Path, rounds: int, engine: str, seeds: int) -> Callable[..., list[dict[str, Any]]]:
    """``runs(partition, profile, attack, nodes, attackers, f=None)``: :func:`run_case` over the seeds, each run once
    (a run directory is used once: the same run asked again is its first result)."""
    done: dict[tuple[Any, ...], list[dict[str, Any]]] = {}

    def runs(partition: str, profile: str, attack: str | None, nodes: int, k: int, f: int | None = None
             ) -> list[dict[str, Any]]:
        key = (DIGITS.get("method"), partition, profile, attack, nodes, k, f if profile in FLOWER_ROWS else None)
        if key not in done:
            done[key] = [run_case(out, partition, profile, attack, rounds, nodes, k, engine, byzantine=f,
                                  seed_offset=i) for i in range(seeds)]
        return done[key]
    return runs


def adaptive_matrix(out: Path, rounds: int, engine: str, seeds: int) -> list[str]:
    """Issue 48's matrix as markdown lines: attackers who know the defence (:data:`ADAPTIVE_KINDS`), the record
    poisoning (:data:`RECORD_ATTACKS`) and the backdoor at 1 and 2 of 20; every cell the mean over ``seeds`` seeds
    (partition seed + 0 … seeds − 1) of the gap to the clean ``off`` run of the same seed.  **Bold**: item 4's
    target missed — iid: more than 0.05 below clean; label-skewed: more than 0.05 below the attackers-absent run;
    backdoor: success above 0.1 or main accuracy more than 0.05 below clean."""
    kinds = list(ADAPTIVE_KINDS)
    lines = ["| clients | data | profile | clean | attackers absent | " + " | ".join(kinds) + " | worst |",
             "|---|---|---|" + "---|" * (len(kinds) + 3)]

    runs = _runner(out, rounds, engine, seeds)

    def cell(got: list[dict[str, Any]], base: list[float], floor: float, backdoor: bool = False
             ) -> tuple[str, float | None]:
        failed = [g["status"] for g in got if g["status"] != "completed" or g["accuracy"] is None]
        if failed:
            return f"— ({len(failed)} of {len(got)} {failed[0]})", None
        gap = _mean([g["accuracy"] - b for g, b in zip(got, base, strict=True)])
        text = f"{gap:+.3f}"
        missed = gap < floor - TARGET
        if backdoor:
            success = _mean([g["backdoor"] for g in got])
            text += f" / bd {success:.2f}"
            missed = missed or success > 0.1
        return (f"**{text}**" if missed else text), gap

    for nodes, k in (*ADAPTIVE_SCENARIOS, *BACKDOOR_SCENARIOS):
        only_backdoor = (nodes, k) in BACKDOOR_SCENARIOS
        for partition in PARTITIONS:
            base = [g["accuracy"] for g in runs(partition, "off", None, nodes, 0)]
            absent = _mean([g["accuracy"] - b for g, b in zip(runs(partition, "off", "absent", nodes, k), base,
                                                                 strict=True)])
            floor = 0.0 if partition == "iid" else min(0.0, absent)
            for profile in ADAPTIVE_PROFILES[:2] if only_backdoor else ADAPTIVE_PROFILES:
                clean = runs(partition, profile, None, nodes, 0, f=k)
                if clean[0]["status"].startswith("n/a"):
                    continue
                ctxt, _ = cell(clean, base, 0.0)
                if all(g["accuracy"] is not None for g in clean):
                    ctxt = f"{_mean([g['accuracy'] for g in clean]):.3f} ({ctxt})"
                cells, gaps = [], []
                for kind in kinds:
                    if only_backdoor and kind != "backdoor":
                        cells.append("")
                        continue
                    text, gap = cell(runs(partition, profile, kind, nodes, k, f=k), base, floor, kind == "backdoor")
                    cells.append(text)
                    if gap is not None and kind != "in-gate-leak":
                        gaps.append(gap)
                worst = f"{min(gaps):+.3f}" if gaps else "—"
                lines.append(f"| {k} of {nodes} | {partition} | {profile} | {ctxt} | {absent:+.3f} | "
                             + " | ".join(cells) + f" | {worst} |")
                print(lines[-1], flush=True)
    return lines


def record_matrix(out: Path, rounds: int, engine: str, seeds: int) -> list[str]:
    """Issue 48's record poisoning (:data:`RECORD_ATTACKS`: an honest model, one other record poisoned), as
    markdown lines: per method, clients and data, the gap of ``off`` / ``robust`` to the method's clean ``off`` run
    (mean over ``seeds``), with the replies rejected."""
    lines = ["| attack | clients | data | clean off | off | robust | rejected (off / robust) |",
             "|---|---|---|---|---|---|---|"]
    runs = _runner(out, rounds, engine, seeds)
    for i, (name, (method, _)) in enumerate(RECORD_ATTACKS.items()):
        before = DIGITS.get("method")
        DIGITS["method"] = method
        try:
            for nodes, k in ((5, 1), (5, 2)):
                for partition in PARTITIONS:
                    base = runs(partition, "off", None, nodes, 0)
                    cells, rejected = [], []
                    for profile in ("off", "robust"):
                        got = runs(partition, profile, f"record-{i}", nodes, k)
                        failed = [g["status"] for g in got if g["status"] != "completed" or g["accuracy"] is None]
                        if failed:
                            cells.append(f"— ({len(failed)} of {len(got)} {failed[0]})")
                        else:
                            gap = _mean([g["accuracy"] - b["accuracy"] for g, b in zip(got, base, strict=True)])
                            cells.append(f"**{gap:+.3f}**" if gap < -TARGET else f"{gap:+.3f}")
                        rejected.append(f"{_mean([g['rejected'] for g in got]):.0f}")
                    lines.append(f"| {name} | {k} of {nodes} | {partition} | "
                                 f"{_mean([b['accuracy'] for b in base]):.3f} | " + " | ".join(cells)
                                 + f" | {' / '.join(rejected)} |")
                    print(lines[-1], flush=True)
        finally:
            DIGITS.pop("method") if before is None else DIGITS.update(method=before)
    return lines


def clean_cost(out: Path, engine: str, seeds: tuple[int, ...] = (0, 1, 2)) -> list[str]:
    """Every method's default job clean under ``off`` and ``robust`` over ``seeds`` (``root-seed`` = the seed): mean
    ± std of each, and of the gap, as markdown lines."""
    from flower_strategies.core.registry import METHODS

    lines = [f"| method | off (mean ± std, seeds {', '.join(map(str, seeds))}) | robust | robust − off |",
             "|---|---|---|---|"]
    for method in sorted(METHODS):
        acc: dict[str, list[float]] = {"off": [], "robust": []}
        for seed in seeds:
            for defence in acc:
                cfg = {"method": method, "seed": seed, "root-seed": seed, "defence": defence, "output-dir": str(out),
                       "run-name": f"cost-{method}-{seed}-{defence}", "learning-curve": False}
                with contextlib.redirect_stdout(io.StringIO()):
                    acc[defence].append(run_inprocess(cfg, 10, engine=engine)["final"]["test-accuracy"])
        gap = np.subtract(acc["robust"], acc["off"])
        lines.append(f"| {method} | {np.mean(acc['off']):.3f} ± {np.std(acc['off']):.3f} | "
                     f"{np.mean(acc['robust']):.3f} ± {np.std(acc['robust']):.3f} | "
                     f"{gap.mean():+.3f} ± {gap.std():.3f} |")
        print(lines[-1], flush=True)
    return lines


def write_docs(path: Path, lines: list[str], header: str, markers: tuple[str, str] = (BEGIN, END)) -> None:
    """Replace docs/robustness.md's text between ``markers`` (default :data:`BEGIN` and :data:`END`) with
    ``header`` + ``lines``."""
    text = path.read_text()
    start, end = text.index(markers[0]) + len(markers[0]), text.index(markers[1])
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
    parser.add_argument("--tables", nargs="+", default=["issue36", "adaptive"], choices=("issue36", "adaptive", "cost"),
                        help="with --write-docs: which tables to regenerate (issue36: the attack matrix and the default"
                             " jobs; adaptive: issue 48's attackers who know the defence, record poisoning and "
                             "backdoors; cost: every method's clean cost over 3 seeds)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the adaptive table's means")
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
    if args.write_docs and "adaptive" in args.tables:
        t1 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            lines = adaptive_matrix(Path(tmp), args.rounds, args.engine, args.seeds)
            records = record_matrix(Path(tmp), args.rounds, args.engine, args.seeds)
        write_docs(Path(args.write_docs), [*lines, "", "Record poisoning (an honest model, one other record "
                                           "poisoned; gap to the method's clean `off` run, mean over the seeds; "
                                           "**bold** = more than 0.05 below):", "", *records],
                   f"`flock /tmp/fedadapt-heavy.lock python -m simulations.bench.robustness --write-docs --tables "
                   f"adaptive` ({platform.machine()}, {os.cpu_count()} cores shared with other jobs, torch 1 thread, "
                   f"{args.engine} engine, {time.monotonic() - t1:.0f} s): digits-mlp, {args.rounds} rounds × 2 "
                   f"epochs, client-lr 0.1, batch 32, FedAvg; every cell the mean over {args.seeds} seed(s) "
                   f"(iid seeds 0…, Dirichlet 2…; `root-seed` = the seed, never read by these attackers but "
                   f"`in-gate-leak`'s) of the gap to the clean `off` run of the same seed.  **Bold** = item 4's "
                   f"target missed (iid: more than {TARGET} below clean; Dirichlet: more than {TARGET} below the "
                   f"attackers-absent run; backdoor: success \"bd\" above 0.1 or main accuracy missed).  "
                   f"`in-gate-leak` is a diagnostic (a published `root-seed`), left out of \"worst\".",
                   (ADAPTIVE_BEGIN, ADAPTIVE_END))
    if args.write_docs and "cost" in args.tables:
        t1 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            cost = clean_cost(Path(tmp), args.engine)
        cost_header = (f"`flock /tmp/fedadapt-heavy.lock python -m simulations.bench.robustness --write-docs --tables "
                       f"cost` ({args.engine} engine, {time.monotonic() - t1:.0f} s): every method's default job (10 "
                       f"Dirichlet-0.3 digits clients, 10 rounds, its presets), clean, final test accuracy over seeds "
                       f"0, 1, 2 (`root-seed` = the seed):")
        for path in (Path(args.write_docs), Path(args.write_docs).parent / "methods" / "index.md"):
            write_docs(path, cost, cost_header, (COST_BEGIN, COST_END))
    if args.write_docs and "issue36" not in args.tables:
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
