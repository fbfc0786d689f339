"""Fault/attack matrix: what a lying or broken client can do to a run, with the defences on and off.

Every end-to-end case runs the real ServerApp logic against the real ClientApp in-process
(:func:`simulations.engine.inprocess.run_inprocess`); one client (partition 0 of 5) is rewritten by ``intercept``.
Setting: digits-mlp, 5 clients, 10 rounds × 2 local epochs (the clean run clearly learns: 0.09 → 0.79–0.91).
"Within noise" = |Δ test accuracy| ≤ :data:`NOISE` against the clean run of the same seed and partition (the
clean accuracy itself varies by ≈ 0.08 over seeds 0–4 on Dirichlet partitions, ≈ 0.04 on iid ones).
The figures are in docs/robustness.md.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.common.logger import FLOWER_LOGGER

import flower_strategies  # noqa: F401 - registers the methods
from flower_strategies.core import checkpoint as ckpt
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.validation import RecordSpec
from flower_strategies.methods.baselines import FedAvg
from server_app.app import RunFailed
from simulations.engine.inprocess import run_inprocess
from tests.helpers import NodesGrid, config, record, reply

pytestmark = pytest.mark.slow  # the attack matrix runs many short federated runs; the full suite (CI) runs it

NOISE = 0.05
NODES = 5
ROUNDS = 10
DIGITS = {"task": "digits-mlp", "num-server-rounds": ROUNDS, "local-epochs": 2, "client-lr": 0.1, "batch-size": 32}
#: Dirichlet partitions (α = 0.3): a hijacker's own model is biased to its classes, so a take-over shows.
NONIID = {**DIGITS, "partitioner": "dirichlet", "seed": 2, "root-seed": 2}  # root-seed: reproducible robust runs
#: iid partitions: coordinate-wise median/trimmed mean are fair estimators here (on label-skewed partitions
#: the clean median itself loses ≈ 0.27 accuracy, see docs/robustness.md).
IID = {**DIGITS, "partitioner": "iid", "seed": 0, "root-seed": 0}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: intra-op threads only contend on the shared CPUs (≈ 5× faster with one)."""
    threads, level = torch.get_num_threads(), FLOWER_LOGGER.level
    torch.set_num_threads(1)
    FLOWER_LOGGER.setLevel(logging.ERROR)
    yield
    torch.set_num_threads(threads)
    FLOWER_LOGGER.setLevel(level)


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("attacks")


def strict_rows(path: Path) -> list[dict]:
    """metrics.jsonl parsed as strict JSON (a NaN/Infinity token is an error)."""
    def refuse(token):
        raise ValueError(f"non-JSON token {token} in {path}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def go(out: Path, name: str, cfg: dict, intercept=None) -> list[dict]:
    run_inprocess({**cfg, "output-dir": str(out), "run-name": name}, NODES, intercept=intercept)
    return strict_rows(out / name / "metrics.jsonl")


def acc(rows: list[dict]) -> float:
    return rows[-1]["test-accuracy"]


@pytest.fixture(scope="module")
def clean_noniid(out):
    return go(out, "clean-noniid", NONIID)


@pytest.fixture(scope="module")
def clean_iid(out):
    return go(out, "clean-iid", IID)


# ------------------------------------------------------------------------------------------ reply rewriting
def attacker(fn, pid: int = 0):
    """``intercept`` rewriting the train replies of partition ``pid`` with ``fn(request, reply)``."""
    def intercept(request, rep, partition_id):
        if partition_id != pid or rep.has_error() or "arrays" not in rep.content.array_records:
            return rep
        return fn(request, rep) or rep
    return intercept


def set_metrics(rep, **values):
    rep.content["metrics"] = MetricRecord({**dict(rep.content.metric_records["metrics"]), **values})


def map_model(request, rep, fn):
    """Replace the reply's model x by ``fn(x, x_t)`` (x_t = the global model the client received)."""
    cur = {k: v.numpy() for k, v in request.content.array_records["arrays"].items()}
    new = {k: v.numpy() for k, v in rep.content.array_records["arrays"].items()}
    rep.content["arrays"] = ArrayRecord({k: Array(np.ascontiguousarray(fn(x, cur[k]).astype(x.dtype)))
                                         for k, x in new.items()})


def hijack(n):
    return attacker(lambda req, rep: set_metrics(rep, **{"num-examples": n}))


# ------------------------------------------------------------------------------------------ 1. weight hijack
def test_weight_hijack_takes_over_under_defence_off_and_is_held_under_robust(out, clean_noniid):
    """One of 5 clients (honest model) reports 1e12 examples.  ``defence = "off"`` (the default: the paper's n_k
    weighting, nothing clipped): the hijacker's class-skewed model becomes the global one.  ``"robust"``: within
    noise of clean, and so is the profile's weight clip alone (max-weight-ratio 1.5 × the round's median count); at
    3 (a former default) it is not: why the profile's ratio is 1.5."""
    robust = go(out, "hijack-robust", {**NONIID, "defence": "robust"}, hijack(1e12))
    clip_only = go(out, "hijack", {**NONIID, "max-weight-ratio": 1.5}, hijack(1e12))
    ratio_3 = go(out, "hijack-3", {**NONIID, "max-weight-ratio": 3.0}, hijack(1e12))
    off = go(out, "hijack-off", NONIID, hijack(1e12))
    assert abs(acc(robust) - acc(clean_noniid)) <= NOISE, (acc(robust), acc(clean_noniid))
    assert abs(acc(clip_only) - acc(clean_noniid)) <= NOISE, (acc(clip_only), acc(clean_noniid))
    assert acc(ratio_3) < acc(clean_noniid) - NOISE
    assert acc(off) < acc(clean_noniid) - 0.3
    assert all(r["weights-clipped"] == 1 and r["replies-used"] == NODES for r in clip_only[1:])
    assert all(r["weights-clipped"] == 0 for r in off[1:] + clean_noniid[1:])


@pytest.mark.parametrize("n", [1e308, 2**62], ids=["1e308", "2**62"])
def test_any_absurd_count_gets_the_same_clipped_weight(out, n):
    """1e308 (n·x overflows without the clip) and 2**62 (an int64 MetricRecord value): the same capped weight
    as 1e12, so the same rounds bit for bit."""
    short = {**NONIID, "num-server-rounds": 2, "max-weight-ratio": 1.5}
    ref = go(out, "hijack-1e12-short", {**short, "overwrite": True}, hijack(1e12))  # once per parameter
    got = go(out, f"hijack-{n:g}", short, hijack(n))
    assert [r["test-loss"] for r in got] == [r["test-loss"] for r in ref]
    assert all(r["weights-clipped"] == 1 and np.isfinite(r["test-loss"]) for r in got[1:])


# ------------------------------------------------------------------------------------------ 2. magnitude
def test_a_1e38_reply_is_rejected_by_default_and_wrecks_the_model_with_every_bound_off(out, clean_iid):
    big = attacker(lambda req, rep: map_model(req, rep, lambda x, c: np.full_like(x, 1e38)))
    defended = go(out, "magnitude", IID, big)
    assert all(r["replies-rejected"] == 1 and r["replies-used"] == NODES - 1 for r in defended[1:])
    assert all("node 1: record 'arrays' norm" in r["rejections"] and "exceeds update-norm-ratio 100" in r["rejections"]
               for r in defended[1:])
    assert all(np.isfinite(r["test-loss"]) for r in defended)
    assert abs(acc(defended) - acc(clean_iid)) <= NOISE  # iid: 4 of 5 clients learn as well
    assert torch.isfinite(torch.load(out / "magnitude" / "model.pt")["fc1.weight"]).all()
    off = {**IID, "num-server-rounds": 1, "update-norm-ratio": 0.0, "max-update-norm": 0.0}
    huge = attacker(lambda req, rep: map_model(req, rep, lambda x, c: np.full_like(x, 1e30)))
    wrecked = go(out, "magnitude-off", off, huge)
    assert wrecked[1]["replies-rejected"] == 0 and wrecked[1]["updated"]
    assert wrecked[1]["test-accuracy"] <= 0.15
    assert wrecked[1]["test-loss"] is None or wrecked[1]["test-loss"] > 1e6  # NaN is written as null (strict JSON)
    # 1e38 itself, bounds off: n·1e38 overflows float32 in the weighted mean, the finiteness guard keeps the old
    # model, and a run in which no round updated the model fails
    with pytest.raises(RunFailed, match="no round of the run updated the model"):
        go(out, "magnitude-off-1e38", off, big)


# ------------------------------------------------------------------------------------------ 3. robust aggregators
def _robust(aggregator: str, trim: float, replies: list[np.ndarray], weights: list[float]) -> np.ndarray:
    strategy = FedAvg(min_available_nodes=1, min_train_nodes=1, aggregator=aggregator, byzantine_fraction=trim,
                      update_norm_ratio=0.0)
    x0 = np.zeros((2, 3))
    list(strategy.configure_train(1, record({"w": x0}), config(), NodesGrid(range(1, len(replies) + 1))))
    msgs = [reply(i + 1, {"arrays": {"w": r}}, num_examples=n)
            for i, (r, n) in enumerate(zip(replies, weights, strict=True))]
    new, metrics = strategy.aggregate_train(1, msgs)
    assert metrics["replies-used"] == len(replies)
    return new["w"].numpy()


@pytest.mark.parametrize("n", [4, 5, 7])
def test_median_and_trimmed_mean_equal_numpy(n):
    rng = np.random.default_rng(n)
    replies = [rng.normal(size=(2, 3)) * (100.0 if i == 0 else 1.0) for i in range(n)]  # one outlier
    weights = list(rng.integers(1, 50, size=n).astype(float))  # ignored by the robust rules
    stack = np.stack(replies)
    np.testing.assert_allclose(_robust("median", 0.1, replies, weights), np.median(stack, axis=0), rtol=0, atol=1e-12)
    for trim in (0.0, 0.2, 0.3, 0.49):
        k = int(np.ceil(trim * n))  # byzantine-fraction f: ⌈f·n⌉ trimmed at each end
        if n < 2 * k + 1:
            continue  # too few replies for f (tests/test_screen.py: every reply rejected with the reason)
        expected = np.sort(stack, axis=0)[k:n - k].mean(axis=0)
        np.testing.assert_allclose(_robust("trimmed-mean", trim, replies, weights), expected, rtol=0, atol=1e-12)


def test_robust_aggregators_change_only_mean_rule_records():
    """A method's "max"/"sum" records keep their rule under aggregator = median / trimmed-mean."""
    seen: dict[str, dict] = {}

    class WithMaxAndSum(FedAvg):
        def uplink_specs(self):
            return (*super().uplink_specs(), RecordSpec("peak", "max", "params"), RecordSpec("count", "sum", "params"))

        def server_update(self, inputs, state):
            seen[self.settings.aggregator] = {k: dict(v) for k, v in inputs.aggregates.items()}
            return super().server_update(inputs, state)

    rng = np.random.default_rng(0)
    data = [{name: {"w": rng.normal(size=3)} for name in ("arrays", "peak", "count")} for _ in range(5)]
    for aggregator in ("mean", "median", "trimmed-mean"):
        strategy = WithMaxAndSum(min_available_nodes=1, min_train_nodes=1, aggregator=aggregator,
                                 byzantine_fraction=0.2, update_norm_ratio=0.0)
        list(strategy.configure_train(1, record({"w": np.zeros(3)}), config(), NodesGrid(range(1, 6))))
        strategy.aggregate_train(1, [reply(i + 1, d) for i, d in enumerate(data)])
    stack = {name: np.stack([d[name]["w"] for d in data]) for name in ("arrays", "peak", "count")}
    for aggregator in ("mean", "median", "trimmed-mean"):
        np.testing.assert_array_equal(seen[aggregator]["peak"]["w"], stack["peak"].max(axis=0))
        np.testing.assert_allclose(seen[aggregator]["count"]["w"], stack["count"].sum(axis=0), rtol=1e-15)
    np.testing.assert_allclose(seen["median"]["arrays"]["w"], np.median(stack["arrays"], axis=0), rtol=1e-15)
    np.testing.assert_allclose(seen["trimmed-mean"]["arrays"]["w"],
                               np.sort(stack["arrays"], axis=0)[1:4].mean(axis=0), rtol=1e-15)


def test_a_sign_flipped_model_hurts_the_mean_not_the_median_or_the_trimmed_mean(out, clean_iid):
    """One of 5 clients sends x_t − 3·Δ (its update flipped and tripled: 3× an honest norm, so no rejection bound
    catches it; the mean here is the methods' own, without the update clip — tests/test_robustness_matrix.py has the
    defaults)."""
    flip = attacker(lambda req, rep: map_model(req, rep, lambda x, c: c - 3.0 * (x - c)))
    mean = go(out, "flip-mean", IID, flip)
    median = go(out, "flip-median", {**IID, "aggregator": "median"}, flip)
    trimmed = go(out, "flip-trimmed", {**IID, "aggregator": "trimmed-mean", "byzantine-fraction": 0.2}, flip)
    assert acc(mean) < acc(clean_iid) - 0.3
    assert abs(acc(median) - acc(clean_iid)) <= NOISE, acc(median)
    assert abs(acc(trimmed) - acc(clean_iid)) <= NOISE, acc(trimmed)
    assert all(r["replies-rejected"] == 0 for r in mean[1:] + median[1:] + trimmed[1:])


# ------------------------------------------------------------------------------------------ 4. failures are failures
def never_called(request, rep, partition_id):
    raise AssertionError("a client was reached before the configuration error")


def test_every_reply_nan_fails_the_run_within_max_idle_rounds(out):
    cfg = {**IID, "client-lr": 1e30, "max-idle-rounds": 2, "output-dir": str(out), "run-name": "lr1e30"}
    with pytest.raises(RunFailed, match=r"the last 2 rounds updated nothing \(max-idle-rounds = 2\).*holds NaN/Inf"):
        run_inprocess(cfg, NODES)
    rows = strict_rows(out / "lr1e30" / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2]  # stopped after max-idle-rounds, not after num-server-rounds
    assert all(r["replies-rejected"] == NODES and not r["updated"] for r in rows[1:])
    summary = json.loads((out / "lr1e30" / "summary.json").read_text())
    assert summary["status"] == "failed" and "max-idle-rounds" in summary["failure"]


@pytest.mark.parametrize("cfg,message", [
    ({"client-lr": 0.0}, r"client-lr = 0.0 is out of range; must be > 0.0"),
    ({"client-lrr": 0.1}, r"unknown run-config key\(s\) \['client-lrr'\]"),
    ({"fedavg.server-lrr": 1.0}, r"unknown run-config key\(s\) \['fedavg.server-lrr'\]"),
    ({"output-dir": "/proc/x"}, r"output-dir: cannot write the run's metrics to /proc/x/"),
], ids=["client-lr-0", "unknown-key", "unknown-method-key", "unwritable-output-dir"])
def test_bad_settings_are_refused_before_round_1(tmp_path, cfg, message):
    run_config = {**IID, "output-dir": str(tmp_path), "run-name": "bad", **cfg}
    with pytest.raises(ConfigError, match=message):
        run_inprocess(run_config, NODES, intercept=never_called)


@pytest.mark.parametrize("bad", [float("nan"), 1e300], ids=["nan", "1e300"])
def test_a_bad_train_loss_does_not_poison_the_metrics_or_the_model(out, clean_iid, bad):
    losses: dict[int, float] = {}

    def intercept(request, rep, partition_id):
        if not rep.has_error() and "arrays" in rep.content.array_records:
            m = rep.content.metric_records["metrics"]
            losses[partition_id] = (float(m["train-loss"]), float(m["num-examples"]))
            if partition_id == 0:
                set_metrics(rep, **{"train-loss": bad})
        return rep

    rows = go(out, f"loss-{bad:g}", {**IID, "num-server-rounds": 1}, intercept)  # strict JSON
    assert rows[1]["test-loss"] == clean_iid[1]["test-loss"]  # the model ignores metrics
    # NaN and an absurd finite value (> 1e3 × the round's median magnitude) are both left out of the mean:
    # it is the example-weighted mean of the 4 others
    honest = [losses[p] for p in range(1, NODES)]
    assert rows[1]["train-loss"] == pytest.approx(sum(v * n for v, n in honest) / sum(n for _, n in honest))


def test_a_checkpoint_with_nan_in_its_server_state_is_refused(tmp_path):
    """test_checkpoint covers NaN in the global arrays; here the server optimizer's state (FedAdam moments)."""
    cfg = {"task": "synthetic-linear", "synthetic-dim": 4, "precision": "float64", "local-steps": 2,
           "method": "fedadam", "num-server-rounds": 1, "checkpoint-every": 1, "output-dir": str(tmp_path),
           "run-name": "c"}
    run_inprocess(cfg, 3)
    path = tmp_path / "c" / "checkpoint.npz"
    with np.load(path, allow_pickle=False) as z:
        members = {n: z[n] for n in z.files}
    state = sorted(n for n in members if n.startswith("state/") and members[n].dtype.kind == "f")
    assert state, sorted(members)
    members[state[0]] = np.full_like(members[state[0]], np.nan)
    np.savez(tmp_path / "bad.npz", **members)
    with pytest.raises(ckpt.CheckpointError, match=f"'{state[0]}' holds NaN/Inf"):
        run_inprocess({**cfg, "num-server-rounds": 2, "resume": str(tmp_path / "bad.npz")}, 3, intercept=never_called)
