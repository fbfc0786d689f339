"""ReplyScreen on its own: client half, structure, weight clipping, norm screening, refold, robust aggregation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flower_strategies.core import records as R
from flower_strategies.core.rejections import Kind
from flower_strategies.core.screen import ClientHalfMissing, ReplyScreen, ScreenPolicy
from flower_strategies.core.validation import RecordSpec
from tests.helpers import RoundScreen, error_reply, reply

CURRENT = {"w": np.zeros(4, np.float32), "n": np.array(3, np.int64)}
MODEL = (RecordSpec(R.MODEL, "mean", "model"),)


def model_reply(src, value, n=10, **kw):
    return reply(src, {R.MODEL: {"w": np.full(4, value, np.float32), "n": np.array(7, np.int64)}}, num_examples=n, **kw)


def screen(policy=ScreenPolicy(), specs=MODEL, **kw):
    return RoundScreen(ReplyScreen(CURRENT, specs, ["w"], policy, method="fedavg", **kw))


def test_mean_of_valid_replies_and_structural_rejections():
    bad_shape = reply(5, {R.MODEL: {"w": np.zeros(3, np.float32), "n": np.array(1, np.int64)}})
    out = screen().run(1, [model_reply(1, 1.0, n=10), error_reply(4), bad_shape, model_reply(2, 4.0, n=30)])
    assert [r.node for r in out.kept] == [1, 2]
    assert out.weights == [10.0, 30.0]
    np.testing.assert_array_equal(out.aggregates[R.MODEL]["w"], np.full(4, (10 * 1.0 + 30 * 4.0) / 40, np.float32))
    assert out.aggregates[R.MODEL]["n"].dtype == np.int64
    assert len(out.rejections) == 2
    assert [r.kind for r in out.rejections] == [Kind.CLIENT_ERROR, Kind.BAD_RECORD]
    assert str(out.rejections[0]).startswith("node 4: client error") and "shape" in str(out.rejections[1])


def test_policy_rules_and_weights():
    spec = RecordSpec("x", "mean")
    assert ScreenPolicy().rule(spec) == "wmean"
    assert ScreenPolicy(weighting="uniform").rule(spec) == "umean"
    assert ScreenPolicy(aggregator="median").rule(spec) == "median"
    assert ScreenPolicy(aggregator="median").rule(RecordSpec("x", "sum")) == "sum"  # only mean-rule records
    assert ScreenPolicy(max_weight_ratio=1.5).weights([10, 10, 1e12]) == [10, 10, 15.0]
    assert ScreenPolicy(max_weight_ratio=0).weights([10, 10, 1e12]) == [10, 10, 1e12]


def test_defence_profiles_resolve_unset_keys_and_an_explicit_key_wins():
    from flower_strategies.core.hparams import DEFENCES, StrategyConfig
    from flower_strategies.core.registry import parse_run_config
    from flower_strategies.methods.baselines import FedAvg

    off = StrategyConfig()
    assert off.defence == "off" and off.max_weight_ratio == 0.0  # unset: the profile decided
    assert off.decided_by_profile == {"max_weight_ratio", "update_clip_ratio", "update_cosine_floor", "aggregator",
                                      "update_norm_ratio"}
    assert ScreenPolicy.from_settings(off, "examples") == ScreenPolicy()  # off = the paper algorithms
    assert ScreenPolicy() == ScreenPolicy(max_weight_ratio=0.0, update_clip_ratio=0.0, update_cosine_floor=-1.0,
                                          aggregator="mean")
    robust = off.replace(defence="robust")
    assert {k: getattr(robust, k) for k in DEFENCES["robust"]} == {
        "max_weight_ratio": 1.5, "update_clip_ratio": 3.0, "update_cosine_floor": -1.0, "aggregator": "fltrust-gate"}
    assert robust.replace(max_weight_ratio=0.0).max_weight_ratio == 0.0  # an explicit key wins
    assert off.replace(update_clip_ratio=2).update_clip_ratio == 2.0
    assert off.replace(update_clip_ratio=2).replace(defence="robust").update_clip_ratio == 2.0  # and stays given
    fed, _, _ = parse_run_config({"defence": "robust", "max-weight-ratio": "", "update-clip-ratio": 2.0})
    assert (fed.max_weight_ratio, fed.update_clip_ratio) == (1.5, 2.0)
    from server_app.provenance import resolved_config

    ran = resolved_config(fed, "fedavg", FedAvg.make_hparams())  # summary.json: the values the run ran with
    assert (ran["defence"], ran["max-weight-ratio"], ran["update-clip-ratio"], ran["aggregator"]) == (
        "robust", 1.5, 2.0, "fltrust-gate")
    assert FedAvg(defence="robust").settings.aggregator == "fltrust-gate"
    assert FedAvg().settings.max_weight_ratio == 0.0
    with pytest.raises(Exception, match="defence = 'strong' is not valid; choose one of: off, robust"):
        parse_run_config({"defence": "strong"})


def test_weight_clipping_bounds_a_liar_and_is_counted():
    replies = [model_reply(1, 1.0), model_reply(2, 1.0), model_reply(3, 100.0, n=1e12)]
    out = screen(ScreenPolicy(max_weight_ratio=1.5, update_norm_ratio=0)).run(1, replies)
    assert out.weights == [10, 10, 15.0]
    metrics, clipped = out.reply_metrics()
    assert clipped == 1 and [m[R.NUM_EXAMPLES] for m in metrics] == [10, 10, 15.0]
    assert [m["node-id"] for m in metrics] == [1, 2, 3]
    np.testing.assert_allclose(out.aggregates[R.MODEL]["w"], (10 + 10 + 15 * 100.0) / 35, rtol=1e-6)


def test_norm_screens_refold_exactly_as_if_the_rejected_never_came():
    honest = [model_reply(i, 0.1 * i, n=5 + i) for i in range(1, 5)]
    nan = reply(8, {R.MODEL: {"w": np.full(4, np.nan, np.float32), "n": np.array(1, np.int64)}})
    huge = model_reply(9, 1e30)
    out = screen(ScreenPolicy(update_norm_ratio=100.0)).run(2, [*honest[:2], nan, huge, *honest[2:]])
    clean = screen().run(2, honest)
    assert [r.node for r in out.kept] == [1, 2, 3, 4]
    assert out.aggregates[R.MODEL]["w"].tobytes() == clean.aggregates[R.MODEL]["w"].tobytes()  # bit for bit
    assert [r.kind for r in out.rejections] == [Kind.NONFINITE, Kind.NORM_RATIO]
    assert "NaN/Inf" in str(out.rejections[0]) and "update-norm-ratio 100" in str(out.rejections[1])


def test_max_update_norm_measures_the_update_not_the_model():
    current_far = dict(CURRENT, w=np.full(4, 50.0, np.float32))
    s = RoundScreen(ReplyScreen(current_far, MODEL, ["w"], ScreenPolicy(max_update_norm=5.0, update_norm_ratio=0)))
    out = s.run(1, [model_reply(1, 51.0), model_reply(2, 40.0)])  # ‖1‖·2 = 2 ok; ‖10‖·2 = 20 > 5
    assert [r.node for r in out.kept] == [1]
    assert out.rejections[0].kind is Kind.MAX_NORM and "update norm 20 exceeds max-update-norm 5" in str(
        out.rejections[0])


@pytest.mark.parametrize("rule", ["median", "trimmed-mean"])
def test_robust_aggregation_ignores_one_outlier(rule):
    replies = [model_reply(1, 1.0), model_reply(2, 2.0), model_reply(3, 3.0), model_reply(4, 1e6)]
    policy = ScreenPolicy(aggregator=rule, byzantine_fraction=0.25, update_norm_ratio=0)
    out = screen(policy).run(1, replies)
    assert len(out.kept) == 4
    # median of 4 = mean of the middle two; trimmed-mean(0.25) drops floor(0.25·4) = 1 value at each end
    np.testing.assert_array_equal(out.aggregates[R.MODEL]["w"], np.full(4, 2.5, np.float32))
    assert out.aggregates[R.MODEL]["n"].dtype == np.int64


def test_client_half():
    s = screen(needs_client_half=True)
    unnamed = s.client_half_reason(model_reply(1, 1.0))  # names no method, model only
    assert unnamed is not None and unnamed.kind is Kind.CLIENT_HALF
    assert str(unnamed).startswith("node 1: reply was not produced by the client half of fedadapt method 'fedavg'")
    assert s.client_half_reason(model_reply(1, 1.0, method="fedavg")) is None
    other = s.client_half_reason(model_reply(1, 1.0, method="fedlada"))
    assert other is not None and other.kind is Kind.CLIENT_HALF and "names 'fedlada'" in other.detail
    assert screen().client_half_reason(model_reply(1, 1.0)) is None  # plain SGD methods accept any client
    with pytest.raises(ClientHalfMissing, match="every reply of round 3 lacks the client half of method 'fedavg'"):
        s.run(3, [model_reply(1, 1.0), model_reply(2, 1.0)])
    out = s.run(3, [model_reply(1, 1.0), model_reply(2, 2.0, method="fedavg")])  # one good reply: the round goes on
    assert len(out.kept) == 1 and len(out.rejections) == 1


def test_params_records_have_the_trainable_layout():
    specs = (*MODEL, RecordSpec("v", "max", "params"))
    ok = reply(1, {R.MODEL: {"w": np.ones(4, np.float32), "n": np.array(1, np.int64)},
                   "v": {"w": np.ones(4, np.float32)}})
    with_int = reply(2, {R.MODEL: {"w": np.ones(4, np.float32), "n": np.array(1, np.int64)},
                         "v": {"w": np.full(4, 3.0, np.float32), "n": np.array(1, np.int64)}})
    out = screen(specs=specs).run(1, [ok, with_int])
    assert len(out.kept) == 1 and "wrong keys" in str(out.rejections[0])
    np.testing.assert_array_equal(out.aggregates["v"]["w"], np.ones(4, np.float32))


# ------------------------------------------------------------------------------------------ update clip, Krum, f
def test_update_clip_scales_only_replies_above_ratio_times_the_median_and_is_counted():
    """Norms 2·(0.1, 0.2, 0.3, 5): median (lower) 0.4; at ratio 1 the 0.6 and 10 updates are scaled onto 0.4 (around
    the global model), the others are untouched and the aggregate is the mean of the clipped replies."""
    current = dict(CURRENT, w=np.full(4, 1.0, np.float32))
    values = [1.1, 1.2, 1.3, 6.0]
    out = RoundScreen(ReplyScreen(current, MODEL, ["w"], ScreenPolicy(update_clip_ratio=1.0))).run(
        1, [model_reply(i + 1, v) for i, v in enumerate(values)])
    assert out.updates_clipped == 2 and not out.rejections
    clipped = [1.1, 1.2, 1.2, 1.2]  # 1 + 0.2·sign(update): scaled onto the median norm
    np.testing.assert_allclose(out.aggregates[R.MODEL]["w"], np.full(4, np.mean(clipped)), rtol=1e-6)
    off = RoundScreen(ReplyScreen(current, MODEL, ["w"], ScreenPolicy(update_clip_ratio=0))).run(
        1, [model_reply(i + 1, v) for i, v in enumerate(values)])
    assert off.updates_clipped == 0
    np.testing.assert_allclose(off.aggregates[R.MODEL]["w"], np.full(4, np.mean(values)), rtol=1e-6)


def test_update_clip_leaves_replies_within_the_bound_bit_for_bit():
    honest = [model_reply(i, 0.1 * i, n=5 + i) for i in range(1, 5)]
    wide = screen(ScreenPolicy(update_clip_ratio=4.0)).run(1, honest)  # max/median = 0.4/0.2 = 2 < 4
    off = screen(ScreenPolicy(update_clip_ratio=0)).run(1, honest)
    assert wide.updates_clipped == 0
    assert wide.aggregates[R.MODEL]["w"].tobytes() == off.aggregates[R.MODEL]["w"].tobytes()


def test_update_clip_of_a_non_model_record_scales_it_towards_zero():
    specs = (*MODEL, RecordSpec("v", "mean", "params"))
    replies = [reply(i, {R.MODEL: {"w": np.zeros(4, np.float32), "n": np.array(1, np.int64)},
                         "v": {"w": np.full(4, v, np.float32)}}) for i, v in enumerate([1.0, 2.0, 3.0, 100.0], 1)]
    out = screen(ScreenPolicy(update_clip_ratio=1.0, update_norm_ratio=0), specs=specs).run(1, replies)
    np.testing.assert_allclose(out.aggregates["v"]["w"], np.full(4, (1 + 2 + 2 + 2) / 4), rtol=1e-6)


def test_krum_and_multi_krum_keep_the_replies_closest_to_their_neighbours():
    """5 replies, f = 0.2 (t = 1): each score sums the squared distances to the n − t − 2 = 2 nearest others."""
    from flower_strategies.core.robust import krum_scores

    values = [1.0, 1.1, 0.9, 1.3, -20.0]
    vectors = np.array([np.full(4, v) for v in values])
    brute = [sorted(float(np.sum((vectors[i] - vectors[j]) ** 2)) for j in range(5) if j != i)[:2] for i in range(5)]
    assert krum_scores(vectors, 1) == pytest.approx([sum(b) for b in brute], rel=1e-12)
    replies = [model_reply(i + 1, v) for i, v in enumerate(values)]
    krum = screen(ScreenPolicy(aggregator="krum", update_norm_ratio=0)).run(1, replies)
    assert [r.node for r in krum.kept] == [1]  # 1.0: nearest to 1.1 and 0.9
    np.testing.assert_array_equal(krum.aggregates[R.MODEL]["w"], np.full(4, 1.0, np.float32))
    multi = screen(ScreenPolicy(aggregator="multi-krum", update_norm_ratio=0)).run(1, replies)
    assert [r.node for r in multi.kept] == [1, 2, 3, 4]
    assert len(multi.rejections) == 1 and "node 5: left out by aggregator multi-krum" in str(multi.rejections[0])
    np.testing.assert_allclose(multi.aggregates[R.MODEL]["w"], np.full(4, 1.075), rtol=1e-6)


@pytest.mark.parametrize("aggregator,need", [("trimmed-mean", 3), ("krum", 3), ("multi-krum", 3)])
def test_too_few_replies_for_the_byzantine_fraction_are_rejected_with_the_fix(aggregator, need):
    replies = [model_reply(i, 1.0 + 0.1 * i) for i in range(1, need)]  # one short: t = ⌈0.2·(need − 1)⌉ = 1
    out = screen(ScreenPolicy(aggregator=aggregator, byzantine_fraction=0.2)).run(1, replies)
    assert not out.kept and len(out.rejections) == need - 1
    assert all(r.kind is Kind.TOO_FEW for r in out.rejections)
    text = str(out.rejections[0])
    assert f"aggregator {aggregator} needs at least {need} usable replies to tolerate 1 Byzantine" in text
    assert "lower byzantine-fraction" in text
    ok = screen(ScreenPolicy(aggregator=aggregator, byzantine_fraction=0.0)).run(1, replies)  # f = 0: t = 0
    assert len(ok.kept) == (1 if aggregator == "krum" else need - 1)


def test_a_reply_rejected_for_its_norm_counts_against_the_tolerated_byzantine_ones():
    """f = 0.2 of 5 received = 1 tolerated; the 1e6 reply is rejected (update-norm-ratio), so Krum runs on the 4
    others with t = 0 (needs 3) instead of refusing the round."""
    replies = [model_reply(i, 1.0 + 0.1 * i) for i in range(1, 5)] + [model_reply(5, 1e6)]
    out = screen(ScreenPolicy(aggregator="multi-krum", byzantine_fraction=0.2)).run(1, replies)
    assert [r.node for r in out.kept] == [1, 2, 3, 4]
    assert len(out.rejections) == 1 and out.rejections[0].kind is Kind.NORM_RATIO


def test_byzantine_count_is_the_ceiling_of_f_times_n():
    from flower_strategies.core.robust import byzantine_count

    assert [byzantine_count(0.2, n) for n in (1, 4, 5, 6, 10, 11)] == [1, 1, 1, 2, 2, 3]
    assert byzantine_count(0.1, 30) == 3 and byzantine_count(0.0, 7) == 0  # 0.1·30 = 3.0000000000000004
    with pytest.raises(ValueError, match=r"byzantine-fraction must be in \[0, 0.5\)"):
        byzantine_count(0.5, 4)


# ------------------------------------------------------------------------------------------ direction screen
def vector_reply(src, w, n=10):
    return reply(src, {R.MODEL: {"w": np.asarray(w, np.float32), "n": np.array(7, np.int64)}}, num_examples=n)


HONEST_W = [[1.0, 0.2, 0.0, 0.1], [0.8, 0.4, 0.1, 0.0], [1.2, 0.0, -0.1, 0.2], [0.9, 0.3, 0.2, 0.1]]


def test_centre_cosines_match_a_float64_closed_form():
    """Centre = mean of the updates, each scaled down onto the lower-median norm; cosine of each update with it."""
    from flower_strategies.core.robust import centre_cosines

    ref = {"w": np.array([0.5, -0.5, 0.0, 1.0]), "n": np.array(3, np.int64)}
    updates = np.array([*HONEST_W, [-50.0, -10.0, 0.0, -5.0]])
    items = [{"w": ref["w"] + u, "n": np.array(1, np.int64)} for u in updates]
    norms = [float(np.linalg.norm(u)) for u in updates]
    median = sorted(norms)[2]
    centre = sum(min(1.0, median / n) * u for u, n in zip(updates, norms, strict=True)) / 5
    expected = [float(u @ centre / (np.linalg.norm(u) * np.linalg.norm(centre))) for u in updates]
    got = centre_cosines(items, ref, norms)
    assert got == pytest.approx(expected, rel=1e-12)
    assert expected[4] < -0.9 and min(expected[:4]) > 0.9
    with pytest.MonkeyPatch.context() as mp:  # updates too large to keep between the passes: computed in each
        mp.setattr("flower_strategies.core.robust.CENTRE_DIFF_BYTES", 0)
        assert centre_cosines(items, ref, norms) == got  # the same values, bit for bit
    zero = [{"w": ref["w"].copy(), "n": np.array(1, np.int64)} for _ in range(3)]
    assert centre_cosines(zero, ref, [0.0, 0.0, 0.0]) == [0.0, 0.0, 0.0]  # no direction: never below a floor


@pytest.mark.parametrize("scale", [1.0, 50.0])
def test_direction_screen_rejects_a_sign_flipped_update_with_its_reason(scale):
    flipped = vector_reply(5, -scale * np.asarray(HONEST_W[0]))
    replies = [vector_reply(i + 1, w) for i, w in enumerate(HONEST_W)] + [flipped]
    out = screen(ScreenPolicy(update_cosine_floor=0.0)).run(3, replies)
    clean = screen().run(3, replies[:4])
    assert [r.node for r in out.kept] == [1, 2, 3, 4]
    assert len(out.rejections) == 1
    text = str(out.rejections[0])
    assert out.rejections[0].kind is Kind.DIRECTION
    assert text.startswith("node 5: record 'arrays' update points against the round's centre (cosine -0.")
    assert text.endswith("< update-cosine-floor 0)")
    assert out.aggregates[R.MODEL]["w"].tobytes() == clean.aggregates[R.MODEL]["w"].tobytes()  # as if never sent


def test_direction_screen_stays_off_on_honest_replies_by_default_and_with_two_replies():
    honest = [vector_reply(i + 1, w) for i, w in enumerate(HONEST_W)]
    on = screen(ScreenPolicy(update_cosine_floor=0.0)).run(1, honest)
    off = screen().run(1, honest)
    assert ScreenPolicy().update_cosine_floor == -1.0  # off by default: the paper algorithms
    assert not on.rejections and on.aggregates[R.MODEL]["w"].tobytes() == off.aggregates[R.MODEL]["w"].tobytes()
    flipped = vector_reply(5, -np.asarray(HONEST_W[0]))
    assert len(screen().run(1, [*honest, flipped]).kept) == 5  # default: not screened
    two = screen(ScreenPolicy(update_cosine_floor=0.0)).run(1, [honest[0], flipped])  # no centre without a majority
    assert len(two.kept) == 2 and not two.rejections


def test_direction_screen_is_refused_with_native_dp():
    from flower_strategies.core.hparams import ConfigError, StrategyConfig

    with pytest.raises(ConfigError, match="update-cosine-floor = -1: .* rejection set by the other clients"):
        StrategyConfig(dp_clip=1.0, update_cosine_floor=0.0)
    with pytest.raises(ConfigError, match="defence = off"):
        StrategyConfig(dp_clip=1.0, defence="robust")
    assert StrategyConfig(dp_clip=1.0).update_cosine_floor == -1.0


# ------------------------------------------------------------------------------------------ Krum size, sample bounds
def test_krum_counts_its_neighbours_as_flower_does_and_picks_the_same_reply():
    """max(1, n − t − 2) nearest neighbours (Flower's ``aggregate_krum``): 6 replies at the default fraction
    (t = ⌈0.2·6⌉ = 2) run, where n ≥ 2t + 3 = 7 refused every round."""
    from flwr.server.strategy.aggregate import aggregate_krum

    from flower_strategies.core.robust import krum_select

    rng = np.random.default_rng(3)
    for n, t in ((6, 2), (5, 2), (4, 1), (3, 1)):
        vectors = rng.normal(size=(n, 7))
        chosen, _ = krum_select(vectors, t, multi=False)
        flower = aggregate_krum([([v], 1) for v in vectors], num_malicious=t, to_keep=0)[0]
        np.testing.assert_array_equal(vectors[chosen[0]], flower)
    replies = [model_reply(i, 1.0 + 0.1 * i) for i in range(1, 7)]
    out = screen(ScreenPolicy(aggregator="krum", byzantine_fraction=0.2, update_norm_ratio=0)).run(1, replies)
    assert len(out.kept) == 1 and len(out.rejections) == 5
    assert all(r.kind is Kind.LEFT_OUT and "left out by aggregator krum" in r.detail for r in out.rejections)


SMALL = {"task": "synthetic-linear", "synthetic-dim": 4, "precision": "float64", "local-steps": 2, "batch-size": 8,
         "num-server-rounds": 2, "client-lr": 0.05}


def test_krum_at_the_default_fraction_with_6_nodes_runs(tmp_path):
    from simulations.engine.inprocess import run_inprocess

    cfg = {**SMALL, "aggregator": "krum", "output-dir": str(tmp_path), "run-name": "krum6"}
    assert run_inprocess(cfg, 6)["status"] == "completed"
    rows = [json.loads(line) for line in (tmp_path / "krum6" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["updated"] and r["replies-used"] == 1 and r["replies-rejected"] == 5 for r in rows[1:])


@pytest.mark.parametrize("aggregator,nodes,message", [
    ("trimmed-mean", 4, "aggregator trimmed-mean needs at least 5 usable replies to tolerate 2 Byzantine "
                        r"\(byzantine-fraction 0.4\), got 4"),
    ("multi-krum", 4, "aggregator multi-krum needs at least 5 usable replies to tolerate 2 Byzantine"),
])
def test_a_byzantine_fraction_the_sample_cannot_hold_fails_at_start(tmp_path, aggregator, nodes, message):
    """Formerly every round was refused and the run failed after max-idle-rounds; now before round 1, nothing sent."""
    from flower_strategies.core.hparams import ConfigError
    from simulations.engine.inprocess import run_inprocess

    sent = []

    def count(request, rep, partition_id):
        sent.append(partition_id)
        return rep

    cfg = {**SMALL, "aggregator": aggregator, "byzantine-fraction": 0.4, "output-dir": str(tmp_path),
           "run-name": "small"}
    with pytest.raises(ConfigError, match=message + r".* every round would be refused"):
        run_inprocess(cfg, nodes, intercept=count)
    assert not sent
    summary = json.loads((tmp_path / "small" / "summary.json").read_text())
    assert summary["status"] == "failed" and "byzantine-fraction 0.4" in summary["failure"]
    assert run_inprocess({**cfg, "run-name": "five"}, 5)["status"] == "completed"  # 0.4 of 5: t = 2, needs 5
