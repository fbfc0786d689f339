"""The literature's robust rules of core/robust.py against closed forms and hand cases (FLTrust, centered clipping,
bucketing), and their place in the reply screen and the strategy (FLTrust's root-set update, its ConfigError)."""

from __future__ import annotations

import numpy as np
import pytest

from flower_strategies.core import records as R
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.robust import bucket_means, centered_clip, fltrust_aggregate, fltrust_scores, \
    record_aggregate
from flower_strategies.core.screen import ReplyScreen, ScreenPolicy
from flower_strategies.core.validation import RecordSpec
from flower_strategies.core.loop import own_loop_config
from tests.helpers import RoundScreen, reply

CURRENT = {"w": np.zeros(2, np.float64), "n": np.array(3, np.int64)}
MODEL = (RecordSpec(R.MODEL, "mean", "model"),)
#: Client-half record (a control variate, v̂, …): aggregated around zero.
STAT = RecordSpec("stat", "mean", "params")


def test_fltrust_scores_and_aggregate_closed_form():
    root = np.array([3.0, 4.0])  # ‖Δ0‖ = 5
    updates = np.array([[1.0, 0.0], [0.0, 2.0], [-1.0, 0.0], [0.0, 0.0]])
    trust, scales = fltrust_scores(updates, root)
    assert trust == pytest.approx([0.6, 0.8, 0.0, 0.0]) and scales == pytest.approx([5.0, 2.5, 5.0, 1.0])
    # Σ trust·scale·Δ / Σ trust = (0.6·5·[1, 0] + 0.8·2.5·[0, 2]) / 1.4
    np.testing.assert_allclose(fltrust_aggregate(updates, root), [3 / 1.4, 4 / 1.4], rtol=1e-15)
    np.testing.assert_array_equal(fltrust_aggregate(-updates[:2], root), [0.0, 0.0])  # every trust 0: no update
    assert fltrust_scores(updates, np.zeros(2))[0] == [0.0] * 4


def test_centered_clip_hand_case_and_the_bound_on_one_reply():
    updates = np.array([[0.0], [0.0], [10.0]])
    # one iteration from 0 at τ = 1: mean of (0, 0, 1) = 1/3; a second: mean of (−1/3, −1/3, 1) = 1/9 more
    assert centered_clip(updates, np.zeros(1), 1.0, iterations=1) == pytest.approx([1 / 3])
    assert centered_clip(updates, np.zeros(1), 1.0, iterations=2) == pytest.approx([4 / 9])
    for scale in (1e3, 1e9):  # however far the outlier, it moves the centre by at most τ/N per iteration
        far = np.array([[0.0], [0.0], [scale]])
        assert centered_clip(far, np.zeros(1), 1.0, iterations=3)[0] <= 3 * 1.0 / 3 + 1e-12
    np.testing.assert_array_equal(centered_clip(updates, np.array([5.0]), 0.0), [5.0])  # τ = 0: the centre


def test_bucket_means_are_means_of_a_seeded_permutation():
    rows = np.arange(10.0).reshape(5, 2)
    order = np.random.default_rng(7).permutation(5)
    expected = [rows[order[0:2]].mean(0), rows[order[2:4]].mean(0), rows[order[4:5]].mean(0)]
    np.testing.assert_array_equal(bucket_means(rows, 2, 7), np.stack(expected))


def test_record_aggregate_centered_clip_on_named_arrays():
    ref = {"w": np.array([1.0, 1.0]), "n": np.array(3, np.int64)}
    items = [{"w": ref["w"] + d, "n": np.array(7, np.int64)} for d in ([1.0, 0.0], [0.0, 1.0], [100.0, 0.0])]
    out = record_aggregate(items, "centered-clip", ref, None)
    # τ = lower median of the update norms (1, 1, 100) = 1; the same as centered_clip on the flat updates
    flat = np.array([[1.0, 0.0], [0.0, 1.0], [100.0, 0.0]])
    np.testing.assert_allclose(out["w"], ref["w"] + centered_clip(flat, np.zeros(2), 1.0), rtol=1e-15)
    assert out["n"] == 7 and out["w"][0] < 1.0 + 3.0  # the 100× reply moved it by at most τ per iteration
    centre = {"w": np.array([0.5, 0.5])}
    moved = record_aggregate(items, "centered-clip", ref, centre)
    tau = float(np.quantile(np.linalg.norm(flat - 0.5, axis=1), 0.5, method="lower"))
    np.testing.assert_allclose(moved["w"], ref["w"] + centered_clip(flat, np.array([0.5, 0.5]), tau), rtol=1e-15)


def model_reply(src, update, n=10, stat=None):
    records = {R.MODEL: {"w": np.asarray(update, np.float64), "n": np.array(7, np.int64)}}
    if stat is not None:
        records["stat"] = {"w": np.asarray(stat, np.float64)}
    return reply(src, records, num_examples=n)


def test_screen_fltrust_weights_by_trust_and_rescales_onto_the_root_update():
    root = {R.MODEL: {"w": np.array([3.0, 4.0]), "n": np.array(3, np.int64)}}
    replies = [model_reply(1, [1.0, 0.0], n=10), model_reply(2, [0.0, 2.0], n=1e12), model_reply(3, [-50.0, 0.0])]
    out = RoundScreen(ReplyScreen(CURRENT, MODEL, ["w"], ScreenPolicy(aggregator="fltrust"), root=root)).run(1,
                                                                                                            replies)
    np.testing.assert_allclose(out.aggregates[R.MODEL]["w"], [3 / 1.4, 4 / 1.4], rtol=1e-15)  # n_k ignored
    assert [r.node for r in out.kept] == [1, 2]
    assert [str(r) for r in out.rejections] == [
        "node 3: record 'arrays' update has FLTrust trust 0 (its cosine with the server's root-set update is <= 0)"]


def test_screen_fltrust_gate_rejects_only_and_trust_weights_cover_client_half_records():
    root = {R.MODEL: {"w": np.array([3.0, 4.0]), "n": np.array(3, np.int64)}}
    specs = (*MODEL, STAT)
    replies = [model_reply(1, [1.0, 0.0], n=10, stat=[1.0, 1.0]), model_reply(2, [0.0, 2.0], n=30, stat=[3.0, 3.0]),
               model_reply(3, [-1.0, 0.0], n=10, stat=[1e6, 1e6])]
    gate = RoundScreen(ReplyScreen(CURRENT, specs, ["w"], ScreenPolicy(aggregator="fltrust-gate"),
                                   root=root)).run(1, replies)
    np.testing.assert_allclose(gate.aggregates[R.MODEL]["w"], [10 / 40, 60 / 40], rtol=1e-15)  # n_k weights
    np.testing.assert_allclose(gate.aggregates["stat"]["w"], [100 / 40] * 2, rtol=1e-15)  # node 3's left out too
    full = RoundScreen(ReplyScreen(CURRENT, specs, ["w"], ScreenPolicy(aggregator="fltrust"),
                                   root=root)).run(1, replies)
    np.testing.assert_allclose(full.aggregates["stat"]["w"], [(0.6 * 1 + 0.8 * 3) / 1.4] * 2, rtol=1e-15)
    assert len(gate.rejections) == len(full.rejections) == 1


def test_fltrust_without_a_root_set_is_a_config_error_before_anything_is_sent():
    from flwr.app import ArrayRecord

    from flower_strategies.methods.baselines import FedAvg

    strategy = FedAvg(aggregator="fltrust")
    with pytest.raises(ConfigError, match="needs the server's own update on a trusted root set: set root-set-size"):
        strategy.prepare_round(1, ArrayRecord([np.zeros(2, np.float32)]), own_loop_config(), 5)
    strategy = FedAvg(aggregator="fltrust")
    strategy.root_update = lambda content: {R.MODEL: {"0": np.ones(2, np.float32)}}
    strategy.prepare_round(1, ArrayRecord([np.zeros(2, np.float32)]), own_loop_config(), 5)
    assert strategy.root is not None
    np.testing.assert_array_equal(strategy.root[R.MODEL]["0"], [1.0, 1.0])
