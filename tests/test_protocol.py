"""Strategy protocol with mocked replies: validation, rejection, min-replies, sampling, records, aggregation rules."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import MessageType

import flower_strategies as fs
from flower_strategies.core import records as R
from flower_strategies.core.aggregation import aggregate
from flower_strategies.core.ops import fold, safe_divide, update_norms
from flower_strategies.core.strategy import RecordSpec
from tests.helpers import NodesGrid, config, error_reply, record, reply

START = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32), "n": np.array(5, np.int64)}


def good(src, value, n=10):
    return reply(src, {"arrays": {"w": np.full((2, 3), value, np.float32), "b": np.full(3, value, np.float32),
                                  "n": np.array(9, np.int64)}}, num_examples=n)


def configured(strategy=None, nodes=(1, 2, 3, 4)):
    s = strategy or fs.FedAvg(trainable_keys=["w", "b"])
    msgs = list(s.configure_train(1, record(START), config(), NodesGrid(nodes)))
    return s, msgs


def test_train_message_carries_model_extras_and_round_config():
    class WithExtra(fs.FedProx):
        def downlink(self, server_round):
            return {"momentum": {"w": np.ones((2, 3), np.float32)}}

    s, msgs = configured(WithExtra(fs.FedProx.make_hparams(mu=0.3), client_lr=0.02, local_steps=4, batch_size=7))
    assert len(msgs) == 4
    c = msgs[0].content
    assert set(c.array_records) == {"arrays", "momentum"}
    assert msgs[0].metadata.message_type == MessageType.TRAIN
    cfg = c.config_records["config"]
    got = (cfg["server-round"], cfg["method"], cfg["client-lr"], cfg["local-steps"], cfg["batch-size"],
           cfg["fedprox.mu"])
    assert got == (1, "fedprox", 0.02, 4, 7, 0.3)
    assert c["momentum"]["w"].numpy().tolist() == np.ones((2, 3)).tolist()


@pytest.mark.parametrize(
    "bad,reason",
    [
        (error_reply(9, "client crashed"), "client error"),
        (reply(9, {"other": {"w": np.zeros((2, 3), np.float32)}}), "missing ArrayRecord"),
        (reply(9, {"arrays": {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}}), "wrong keys"),
        (reply(9, {"arrays": {"w": np.zeros((3, 2), np.float32), "b": np.zeros(3, np.float32),
                              "n": np.array(1)}}), "shape"),
        (reply(9, {"arrays": {"w": np.zeros((2, 3), np.float64), "b": np.zeros(3, np.float32),
                              "n": np.array(1)}}), "dtype"),
        (reply(9, {"arrays": {"w": np.full((2, 3), np.nan, np.float32), "b": np.zeros(3, np.float32),
                              "n": np.array(1)}}), "NaN"),
        (reply(9, {"arrays": {"w": np.full((2, 3), np.inf, np.float32), "b": np.zeros(3, np.float32),
                              "n": np.array(1)}}), "NaN"),
        (reply(9, {"arrays": {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32), "n": np.array(1)}},
               num_examples=None), "num-examples"),
        (reply(9, {"arrays": {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32), "n": np.array(1)}},
               num_examples=0), "num-examples"),
    ],
    ids=["error", "missing-record", "missing-key", "shape", "dtype", "nan", "inf", "no-num-examples", "zero-examples"],
)
def test_bad_reply_is_excluded_with_reason_and_counted(bad, reason, caplog):
    s, _ = configured()
    out, metrics = s.aggregate_train(1, [good(1, 1.0, n=10), bad, good(2, 4.0, n=30)])
    np.testing.assert_allclose(out["w"].numpy(), np.full((2, 3), 3.25))  # (10·1 + 30·4)/40
    assert int(out["n"].numpy()) == 5  # integer buffer keeps the server value
    assert metrics["replies-used"] == 2 and metrics["replies-rejected"] == 1
    h = s.history[-1]
    assert h.replies_rejected == 1 and reason in str(h.rejections[0]) and h.rejections[0].node == 9
    assert any(reason in r.getMessage() for r in caplog.records)


def test_too_few_valid_replies_keep_the_previous_model():
    s, _ = configured(fs.FedAvg(min_replies=2))
    out, metrics = s.aggregate_train(1, [good(1, 1.0), error_reply(2)])
    assert out is None  # Flower's Strategy.start keeps the previous arrays when None is returned
    assert metrics["replies-used"] == 1 and not s.history[-1].updated


def test_no_replies_at_all_keeps_model():
    s, _ = configured()
    out, _ = s.aggregate_train(1, [])
    assert out is None


def test_reply_order_does_not_change_the_result():
    s1, _ = configured()
    s2, _ = configured()
    rs = [good(i, float(i) / 3.0, n=i * 7) for i in range(1, 5)]
    a, _ = s1.aggregate_train(1, rs)
    b, _ = s2.aggregate_train(1, list(reversed(rs)))
    assert np.array_equal(a["w"].numpy(), b["w"].numpy())


def test_train_metrics_are_example_weighted_and_identifiers_not_averaged():
    s, _ = configured()
    r1 = good(1, 0.0, n=10)
    r1.content["metrics"]["train-loss"] = 1.0
    r1.content["metrics"]["partition-id"] = 3
    r2 = good(2, 0.0, n=30)
    r2.content["metrics"]["train-loss"] = 3.0
    r2.content["metrics"]["partition-id"] = 5
    _, m = s.aggregate_train(1, [r1, r2])
    assert m["train-loss"] == pytest.approx(2.5) and "partition-id" not in m and m["num-examples"] == 40


def test_sampling_is_reproducible_from_the_seed_and_independent_of_global_random():
    import random

    picks = []
    for _ in range(2):
        random.seed(12345 + len(picks))  # global random must not matter
        s = fs.FedAvg(fraction_train=0.5, seed=7)
        grid = NodesGrid([50, 10, 40, 20, 30, 60])
        picks.append([tuple(s.sample(grid, 0.5, 2)) for _ in range(5)])
    assert picks[0] == picks[1]
    assert len(set(picks[0])) > 1 and all(len(p) == 3 for p in picks[0])


def test_sampling_follows_node_order_not_node_ids():
    a = fs.FedAvg(fraction_train=0.5, seed=3)
    b = fs.FedAvg(fraction_train=0.5, seed=3)
    a.order_nodes({101: 0, 55: 1, 999: 2, 7: 3})   # partition ids reported by nodes
    b.order_nodes({8: 0, 3: 1, 12: 2, 1: 3})       # other node ids, same partitions
    pa = [a.sampler.node_order[n] for n in a.sample(NodesGrid([7, 55, 101, 999]), 0.5, 2)]
    pb = [b.sampler.node_order[n] for n in b.sample(NodesGrid([1, 3, 8, 12]), 0.5, 2)]
    assert pa == pb


@pytest.mark.parametrize("rule,expected", [("wmean", [2.5]), ("umean", [2.0]), ("max", [3.0]), ("sum", [4.0])])
def test_streaming_aggregation_rules(rule, expected):
    items = [({"a": np.array([1.0], np.float32)}, 1.0), ({"a": np.array([3.0], np.float32)}, 3.0)]
    out = aggregate([a for a, _ in items], [w for _, w in items], rule)
    assert out["a"].dtype == np.float32 and out["a"].tolist() == expected


def test_one_entry_point_routes_to_the_robust_rules_and_native_dp():
    from flower_strategies.core.aggregation import Private
    from flower_strategies.core.robust import record_aggregate, robust_aggregate

    rng = np.random.default_rng(1)
    items = [{"w": rng.normal(size=5), "n": np.array(i, np.int64)} for i in range(5)]
    for rule in ("median", "trimmed-mean"):
        want = robust_aggregate(items, rule, 1)
        got = aggregate(items, [1.0] * 5, rule, trim=1)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    ref = {"w": np.ones(5), "n": np.array(9, np.int64)}
    for rule in ("centered-clip", "bucketing"):
        want = record_aggregate(items, rule, ref, None, 7)
        got = aggregate(items, [1.0] * 5, rule, reference=ref, seed=7)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    got = aggregate(items, [0.5] * 5, Private(0.0, 4, rng, ref))  # no noise: Σ s_i (a_i − ref) / 4 + ref
    np.testing.assert_allclose(got["w"], sum(0.5 * (i["w"] - 1.0) for i in items) / 4 + 1.0, rtol=1e-15)
    assert got["n"] == 9  # integer arrays keep the reference's value


@pytest.mark.parametrize("rule", ["wmean", "umean", "max", "sum"])
def test_fold_is_bit_identical_to_a_reply_by_reply_loop_and_measures_norms(rule):
    """The fold does, per element, exactly the operations of a reply-by-reply loop (acc = w_0·a_0; acc += w_i·a_i),
    so its float32 result is bit-identical to it; the norms are ‖a_i − ref‖."""
    rng = np.random.default_rng(0)
    size = 2 * (1 << 16) + 123
    items = [{"w": rng.normal(size=size).astype(np.float32), "n": np.array(i, np.int64)} for i in range(5)]
    weights = [3.0, 1.0, 2.5, 7.0, 0.5]
    ref = {"w": rng.normal(size=size).astype(np.float32)}
    out, norms = fold(items, weights, rule), update_norms(items, ref)
    ws = weights if rule == "wmean" else [1.0] * 5
    acc = items[0]["w"] * np.float32(ws[0]) if ws[0] != 1.0 else items[0]["w"].copy()
    for item, w in zip(items[1:], ws[1:], strict=True):
        if rule == "max":
            acc = np.maximum(acc, item["w"])
        else:
            acc = acc + (item["w"] * np.float32(w) if w != 1.0 else item["w"])
    if rule in ("wmean", "umean"):
        acc = acc / np.float32(sum(ws))
    assert out["w"].dtype == np.float32 and np.array_equal(out["w"], acc)
    assert out["n"].dtype == np.int64  # integer arrays: float64 accumulator, cast back
    np.testing.assert_allclose(norms, [np.linalg.norm((i["w"] - ref["w"]).astype(np.float64)) for i in items],
                               rtol=1e-5)
    own = update_norms(items)  # no reference: the arrays' own norms
    np.testing.assert_allclose(own, [np.linalg.norm(i["w"].astype(np.float64)) for i in items], rtol=1e-5)


def test_fold_norm_is_nonfinite_for_nan_or_inf():
    bad = {"w": np.array([1.0, np.nan], np.float32)}
    inf = {"w": np.array([np.inf, 0.0], np.float32)}
    norms = update_norms([{"w": np.ones(2, np.float32)}, bad, inf])
    assert np.isfinite(norms[0]) and not np.isfinite(norms[1]) and not np.isfinite(norms[2])


def test_unknown_rule_and_bad_weight_rejected():
    with pytest.raises(ValueError, match="valid: wmean"):
        fold([{"a": np.ones(1)}], [1.0], "median")
    with pytest.raises(ValueError, match="positive"):
        fold([{"a": np.ones(1)}], [0.0], "wmean")
    with pytest.raises(ValueError, match="no arrays"):
        fold([], [], "wmean")


def test_safe_divide_is_divide_no_nan():
    assert safe_divide(np.array([1.0, 2.0]), np.array([0.0, 4.0])).tolist() == [0.0, 0.5]


def test_params_record_spec_expects_only_trainable_float_keys():
    class UploadsP(fs.FedAvg):
        def uplink_specs(self):
            return (RecordSpec("p", "umean", "params"),)

        def server_update(self, inputs, state):
            current, p = inputs.current, inputs.aggregates["p"]
            return {**current, "w": current["w"] - p["w"], "b": current["b"] - p["b"]}, state, {}

    s, _ = configured(UploadsP(trainable_keys=["w", "b"]))
    ok = reply(1, {"p": {"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32)}})
    with_int = reply(2, {"p": {"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32), "n": np.array(1)}})
    out, m = s.aggregate_train(1, [ok, with_int])
    assert m["replies-used"] == 1 and "unexpected ['n']" in str(s.history[-1].rejections[0])
    assert out["w"].numpy().tolist() == (-np.ones((2, 3))).tolist()


def test_zero_dim_arrays_keep_their_shape_on_the_wire():
    rec = R.to_record({"n": np.array(3, np.int64)})
    assert rec["n"].numpy().shape == ()


def test_server_update_producing_nan_keeps_previous_model():
    class Broken(fs.FedAvg):
        def server_update(self, inputs, state):
            nan = {k: np.full_like(v, np.nan) if v.dtype.kind == "f" else v for k, v in inputs.current.items()}
            return nan, state, {}

    s, _ = configured(Broken())
    out, _ = s.aggregate_train(1, [good(1, 1.0)])
    assert out is None and s.num_updates == 0


def test_client_serialisation_is_byte_identical_to_flowers_and_loads_the_same_tensors():
    """``tensor_record`` (cached .npy header, no np.save per array) gives the same bytes as ``ArrayRecord(state_dict)``;
    ``record_tensors`` (zero-copy views, no np.load) the same tensors as ``to_torch_state_dict``."""
    import torch
    from flwr.app import ArrayRecord

    from flower_strategies.core.client import record_tensors, tensor_record

    named = {"w": torch.randn(3, 4), "b": torch.randn(4, dtype=torch.float64), "n": torch.tensor(7),
             "s": torch.tensor(2.5), "e": torch.zeros(0, 3), "m": torch.tensor([True, False]),
             "t": torch.randn(4, 3).t()}  # not C-contiguous: Flower's own path
    ours, theirs = tensor_record(named), ArrayRecord(named)
    assert list(ours) == list(theirs)
    for k in named:
        assert (ours[k].dtype, ours[k].shape, ours[k].stype, ours[k].data) == \
               (theirs[k].dtype, theirs[k].shape, theirs[k].stype, theirs[k].data), k
    ref = theirs.to_torch_state_dict()
    for copy in (True, False):
        got = record_tensors(theirs, copy=copy)
        assert list(got) == list(ref)
        for k in ref:
            assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k
    fresh = record_tensors(theirs)["w"]
    fresh += 1  # copies are writable and do not touch the message
    assert torch.equal(theirs.to_torch_state_dict()["w"], named["w"])


def test_views_are_zero_copy_read_only_and_refuse_truncated_payloads():
    """``records.view`` reads a payload in place (one read-only array on the message's bytes); a payload shorter than
    its header says is an error, never a view past the end of the buffer."""
    from flwr.app import Array

    a = R.to_array(np.arange(12, dtype=np.float32).reshape(3, 4))
    v = R.view(a)
    assert np.array_equal(v, np.arange(12, dtype=np.float32).reshape(3, 4)) and not v.flags.writeable
    assert v.base is a.data  # the message's own bytes, no copy
    short = Array(dtype=a.dtype, shape=a.shape, stype=a.stype, data=a.data[:-4])
    with pytest.raises(ValueError):
        R.view(short)
