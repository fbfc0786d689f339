"""Metric attacks: one client lying about the metrics the server math reads (``num-steps``, ``train-loss-before``).

Every case runs the real ServerApp logic against the real ClientApp in-process on the synthetic-linear task; one
client (partition 0 of 5) rewrites its train replies.  The rules under test are in docs/robustness.md
("Metrics the server reads"):

* ``num-steps`` that is not a whole number ≥ 1 (NaN, −1e6, …): the reply is rejected with a reason, exactly as if
  it had been rejected for any other reason;
* ``num-steps`` above the round's plan (1e300): counted as the plan — with ``local-steps`` set, exactly what an
  honest client reports, so the run is bit-identical to the clean one;
* ``train-loss-before`` of 1e6·round: LocalUpdateDecay's plateau controller reads the outlier-filtered mean, so
  the attacker forces no decay.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import MetricRecord
from flwr.common.logger import FLOWER_LOGGER

import flower_strategies  # noqa: F401 - registers the methods
from flower_strategies.core.rounds import robust_mean, weighted_mean
from flower_strategies.core.screen import ScreenPolicy
from simulations.engine.inprocess import run_inprocess

NODES = 5
BASE = {
    "task": "synthetic-linear", "synthetic-dim": 4, "precision": "float64", "local-steps": 3, "batch-size": 8,
    "seed": 0, "num-server-rounds": 3, "client-lr": 0.05,
}
#: The methods whose server math reads K̄ (RoundInputs.mean_steps).
MEAN_STEPS = ["fedams", "fedcm", "fedlada", "fedlamb", "fedlocal-sync"]


@pytest.fixture(scope="module", autouse=True)
def quiet():
    level = FLOWER_LOGGER.level
    FLOWER_LOGGER.setLevel(logging.ERROR)
    yield
    FLOWER_LOGGER.setLevel(level)


def attacker(**values):
    """``intercept`` setting metrics ``values`` in every train reply of partition 0."""
    def intercept(request, rep, partition_id):
        if partition_id != 0 or rep.has_error():
            return rep
        rep.content["metrics"] = MetricRecord({**dict(rep.content.metric_records["metrics"]), **values})
        return rep
    return intercept


def go(out: Path, name: str, cfg: dict, intercept=None) -> tuple[list[dict], dict[str, torch.Tensor]]:
    summary = run_inprocess({**cfg, "output-dir": str(out), "run-name": name}, NODES, intercept=intercept)
    assert summary["status"] == "completed", summary
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return rows, torch.load(out / name / "model.pt")


def assert_same_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("method", MEAN_STEPS)
def test_invalid_num_steps_is_rejected_and_the_run_trains_as_without_the_reply(tmp_path, method):
    """NaN or −1e6 steps (formerly: K̄ non-finite or negative, every update refused, RunFailed) are rejected like a
    reply without examples."""
    cfg = {**BASE, "method": method}
    ref_rows, ref_model = go(tmp_path, "dropped", cfg, attacker(**{"num-examples": 0}))
    for steps in (float("nan"), -1e6):
        rows, model = go(tmp_path, f"steps-{steps}", cfg, attacker(**{"num-steps": steps}))
        for row in rows[1:]:
            assert row["updated"] and row["replies-used"] == NODES - 1 and row["replies-rejected"] == 1, row
            assert "metric 'num-steps' not a whole number >= 1" in row["rejections"], row["rejections"]
        assert [r["test-loss"] for r in rows] == [r["test-loss"] for r in ref_rows]
        assert_same_model(model, ref_model)


@pytest.mark.parametrize("method", MEAN_STEPS)
def test_huge_num_steps_counts_as_the_plan_and_changes_nothing(tmp_path, method):
    """1e300 steps (formerly: fedcm's offset Δ̄/(η·K̄) vanished) count as local-steps: the run is the clean one."""
    cfg = {**BASE, "method": method}
    clean_rows, clean_model = go(tmp_path, "clean", cfg)
    rows, model = go(tmp_path, "huge", cfg, attacker(**{"num-steps": 1e300}))
    assert all(r["replies-rejected"] == 0 for r in rows[1:])
    assert [r["test-loss"] for r in rows] == [r["test-loss"] for r in clean_rows]
    assert_same_model(model, clean_model)


def test_huge_num_steps_in_epochs_mode_moves_the_run_less_than_leaving_the_client_out(tmp_path):
    """Epochs mode (K_i = E·⌈n_i/B⌉ differs by client), with the robust profile's weight clip (max-weight-ratio 1.5;
    under defence = off there is no epochs-mode cap: an honest client's own loader may take more steps than the
    run's plan): the cap is max(E·⌈w_i/B⌉, max-weight-ratio × median), so K̄ stays within the honest clients'
    range.  Honest noise here = how far the run moves when the attacker's reply is simply left out; 1e300 steps
    move it less than that."""
    cfg = {**BASE, "method": "fedcm", "local-steps": 0, "local-epochs": 1, "batch-size": 4, "max-weight-ratio": 1.5}
    clean = go(tmp_path, "clean", cfg)[0][-1]["test-loss"]
    dropped = go(tmp_path, "dropped", cfg, attacker(**{"num-examples": 0}))[0][-1]["test-loss"]
    rows, _ = go(tmp_path, "huge", cfg, attacker(**{"num-steps": 1e300}))
    assert all(r["updated"] and r["replies-rejected"] == 0 for r in rows[1:])
    assert abs(rows[-1]["test-loss"] - clean) <= abs(dropped - clean), (rows[-1]["test-loss"], clean, dropped)


def test_an_outlying_train_loss_before_forces_no_decay(tmp_path):
    """1e6·round as one client's train-loss-before (formerly: a rising mean, a decay every round) is left out of
    the plateau controller's mean: no decay, and the run is the clean one."""
    cfg = {**BASE, "method": "localupdatedecay", "localupdatedecay.window": 1, "localupdatedecay.patience": 1,
           "localupdatedecay.cooldown": 0}
    clean_rows, clean_model = go(tmp_path, "clean", cfg)
    assert not any(r["decayed"] for r in clean_rows[1:])

    def rising(request, rep, partition_id):
        if partition_id == 0 and not rep.has_error():
            server_round = int(request.content["config"]["server-round"])
            metrics = dict(rep.content.metric_records["metrics"])
            rep.content["metrics"] = MetricRecord({**metrics, "train-loss-before": 1e6 * server_round})
        return rep

    rows, model = go(tmp_path, "rising", cfg, rising)
    assert not any(r["decayed"] for r in rows[1:])
    assert [r["next-client-lr"] for r in rows[1:]] == [r["next-client-lr"] for r in clean_rows[1:]]
    assert all(r["plateau-loss"] < 10 for r in rows[1:])
    assert_same_model(model, clean_model)


# ------------------------------------------------------------------------------------------ the rules on their own
def test_step_caps_rule():
    assert ScreenPolicy(local_steps=3).step_caps([3.0, 1e300, None], [10, 10, 10]) == [3.0, 3.0, 3.0]
    epochs = ScreenPolicy(local_steps=0, local_epochs=2, batch_size=4, max_weight_ratio=1.5)
    # plans of the clipped weights 8, 12, 15: 4, 6, 8; 1.5 × the median reported (4, 6, 1e300) = 9
    assert epochs.step_caps([4.0, 6.0, 1e300], [8, 12, 15]) == [9.0, 9.0, 9.0]
    assert epochs.step_caps([40.0, 60.0, 80.0], [80, 120, 160]) == [90.0, 90.0, 90.0]  # plans 40, 60, 80 < 90
    assert epochs.step_caps([None, None], [8, 12]) == [math.inf, math.inf]
    assert ScreenPolicy(max_weight_ratio=0).step_caps([1e300], [10]) == [math.inf]


def test_robust_mean_equals_weighted_mean_bit_for_bit_when_nothing_is_left_out():
    rng = np.random.default_rng(0)
    for _ in range(50):
        pairs = [(float(v), float(n)) for v, n in zip(rng.random(4) * 3, rng.integers(1, 100, 4), strict=True)]
        for weighting in ("examples", "uniform"):
            assert robust_mean(pairs, weighting) == weighted_mean(pairs, weighting)
    assert robust_mean([(2.0, 1.0), (2.2, 1.0), (1e6, 1.0)], "uniform") == pytest.approx(2.1)
    assert robust_mean([(float("nan"), 1.0), ("x", 1.0), (True, 1.0), (None, 1.0)]) is None
    assert robust_mean([(2**1100, 1.0), (1.0, 3.0)]) == 1.0
