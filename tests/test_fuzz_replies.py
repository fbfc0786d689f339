"""Property-based: no single train reply can crash the server or change what the honest replies produce.

For every registered method, a round of three honest replies (built from the method's uplink specs) is aggregated
with and without a fourth, hostile reply: random, truncated, mislabelled or re-typed payloads, broken record
structure, and invalid counts, each with random junk in its other metrics (NaN, ±inf, negative, huge, strings,
bools, lists, missing keys).  The hostile reply must be rejected with a reason, nothing may raise, and the new
model must equal the honest-only one bit for bit.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import flower_strategies  # noqa: F401 - registers the methods
from flower_strategies.core import records as R
from flower_strategies.core.registry import METHODS
from flower_strategies.core.validation import layout
from tests.helpers import NodesGrid, config, every_method, metadata

START = {"w": np.linspace(-0.5, 0.5, 12, dtype=np.float32).reshape(3, 4), "b": np.zeros(4, np.float32),
         "n": np.array(5, np.int64)}
TRAINABLE = ["w", "b"]
HONEST = (1, 2, 3)
HOSTILE = 4
FUZZ = settings(max_examples=12, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def build(method: str):
    s = METHODS[method].build(client_lr=0.1, local_steps=3, fraction_train=1.0, min_available_nodes=1,
                              min_train_nodes=1, seed=0, trainable_keys=TRAINABLE, num_rounds=5)
    list(s.configure_train(1, ArrayRecord({k: R.to_array(v) for k, v in START.items()}), config(),
                           NodesGrid([*HONEST, HOSTILE])))
    return s


def expected_records(s) -> dict[str, dict[str, tuple[tuple[int, ...], np.dtype]]]:
    return {spec.name: layout(START, TRAINABLE if spec.keys == "params" else None) for spec in s.uplink_specs()}


def honest_arrays(s, node: int) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(node)
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, want in expected_records(s).items():
        arrays = {}
        for key, (shape, dtype) in want.items():
            if np.issubdtype(dtype, np.integer):
                arrays[key] = np.full(shape, node, dtype)
            elif name == R.MODEL:
                arrays[key] = (START[key] + 0.01 * rng.standard_normal(shape)).astype(dtype)
            else:  # momenta, second moments, gradients: small and positive suits them all
                arrays[key] = (0.01 + 0.01 * rng.random(shape)).astype(dtype)
        out[name] = arrays
    return out


def message(s, node: int, records: dict[str, ArrayRecord], metrics: dict[str, Any]) -> Message:
    content = RecordDict(dict(records))
    rec = MetricRecord()
    rec.__dict__["_data"].update(metrics)  # past MetricRecord's type check: a hostile client need not use Flower
    content[R.METRICS] = rec
    content[R.REPLY_INFO] = ConfigRecord({R.METHOD: s.method})
    return Message(content=content, metadata=metadata(node))


def honest_metrics(s, node: int) -> dict[str, Any]:
    return {R.NUM_EXAMPLES: 10 * node, R.NUM_STEPS: float(s.settings.local_steps), R.TRAIN_LOSS: 1.0 / node,
            R.TRAIN_LOSS_BEFORE: 2.0 / node}


def honest(s, node: int) -> Message:
    arrays = honest_arrays(s, node)
    return message(s, node, {name: R.to_record(a) for name, a in arrays.items()}, honest_metrics(s, node))


def npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------ hostile parts
JUNK = st.one_of(
    st.sampled_from([float("nan"), float("inf"), float("-inf"), -1.0, -1e6, 0.0, 1e300, 2.5, 1e-300, True, False,
                     "ten", "", None, [1.0, 2.0], [], 2**70, -(2**70), b"\x00"]),
    st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.text(max_size=5),
)
BAD_EXAMPLES = st.sampled_from([float("nan"), float("inf"), float("-inf"), 0, -5, 0.5, 2.5, -1e6, True, "10",
                                [10], None, 2**1100, "missing"])
BAD_STEPS = st.sampled_from([float("nan"), float("inf"), float("-inf"), 0, -1e6, 0.5, 2.5, False, "3", [3.0]])

PAYLOAD_FAULTS = ("wrong-size", "truncate", "extend", "garbage", "payload-dtype", "metadata-dtype", "metadata-shape",
                  "object", "stype", "header-bytes", "empty", "not-bytes", "nan")
STRUCTURE_FAULTS = ("missing-key", "extra-key", "missing-record", "not-an-array-record", "no-metrics")


@st.composite
def hostile_payload(draw, want_shape: tuple[int, ...], dtype: np.dtype, good: Array) -> Array:
    fault = draw(st.sampled_from(PAYLOAD_FAULTS))
    if fault == "nan" and not np.issubdtype(dtype, np.inexact):
        fault = "garbage"
    meta = {"dtype": good.dtype, "shape": good.shape, "stype": good.stype}
    data = good.data
    if fault == "wrong-size":
        size = draw(st.integers(0, 40).filter(lambda n: n != int(np.prod(want_shape))))
        data = npy(np.ones(size, dtype))
    elif fault == "truncate":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif fault == "extend":
        data = data + draw(st.binary(min_size=1, max_size=16))
    elif fault == "garbage":
        data = draw(st.binary(max_size=200))
    elif fault == "payload-dtype":
        other = draw(st.sampled_from(["float64", "float16", "int32", "int64", "uint8", "complex64", "bool", ">f4"])
                     .filter(lambda d: np.dtype(d) != dtype))
        data = npy(np.ones(want_shape, other))
    elif fault == "metadata-dtype":
        meta["dtype"] = draw(st.sampled_from(["float64", "float16", "int8", "object", "nonsense", "", "O", "V4"])
                             .filter(lambda d: d != str(dtype)))
    elif fault == "metadata-shape":
        meta["shape"] = draw(st.lists(st.integers(0, 6), max_size=3).map(tuple).filter(lambda t: t != want_shape))
    elif fault == "object":
        data = npy(np.empty(want_shape, object))
    elif fault == "stype":
        meta["stype"] = draw(st.sampled_from(["torch.Tensor", "", "numpy.ndarray ", "pickle"]))
    elif fault == "header-bytes":  # magic, version or header length: each change leaves no consistent payload
        i = draw(st.integers(0, 9))
        data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
    elif fault == "empty":
        data = b""
    elif fault == "not-bytes":
        arr = Array(**meta, data=data)
        arr.__dict__["data"] = draw(st.sampled_from([None, "text", 3, bytearray(data), memoryview(data)]))
        return arr
    elif fault == "nan":
        data = npy(np.full(want_shape, draw(st.sampled_from([np.nan, np.inf, -np.inf])), dtype))
    return Array(**meta, data=data)


@st.composite
def hostile_reply(draw, s) -> tuple[Message, str]:
    """A reply of node HOSTILE that is malformed in at least one way, and a word of the reason it must get."""
    records = {name: R.to_record(a) for name, a in honest_arrays(s, HOSTILE).items()}
    metrics: dict[str, Any] = honest_metrics(s, HOSTILE)
    for key in draw(st.lists(st.sampled_from([R.TRAIN_LOSS, R.TRAIN_LOSS_BEFORE, "accuracy", "x"]), max_size=3)):
        metrics[key] = draw(JUNK)
    for key in draw(st.lists(st.sampled_from([R.TRAIN_LOSS, R.TRAIN_LOSS_BEFORE]), max_size=2)):
        metrics.pop(key, None)
    kind = draw(st.sampled_from(["payload", "structure", "examples", "steps"]))
    names = sorted(records)
    if kind == "payload":
        name = draw(st.sampled_from(names))
        key = draw(st.sampled_from(sorted(records[name].keys())))
        good = records[name][key]
        want = expected_records(s)[name][key]
        records[name][key] = draw(hostile_payload(want[0], want[1], good))
        return message(s, HOSTILE, records, metrics), f"key '{key}'"
    if kind == "structure":
        fault = draw(st.sampled_from(STRUCTURE_FAULTS))
        name = draw(st.sampled_from(names))
        if fault == "missing-key":
            del records[name][draw(st.sampled_from(sorted(records[name].keys())))]
            word = "wrong keys"
        elif fault == "extra-key":
            records[name]["extra"] = R.to_array(np.zeros(2, np.float32))
            word = "wrong keys"
        elif fault == "missing-record":
            del records[name]
            word = "missing ArrayRecord"
        elif fault == "not-an-array-record":
            msg = message(s, HOSTILE, {k: v for k, v in records.items() if k != name}, metrics)
            msg.content[name] = ConfigRecord({"x": 1})
            return msg, "missing ArrayRecord"
        else:
            msg = message(s, HOSTILE, records, metrics)
            del msg.content[R.METRICS]
            return msg, "missing MetricRecord"
        return message(s, HOSTILE, records, metrics), word
    if kind == "examples":
        value = draw(BAD_EXAMPLES)
        if value == "missing":
            del metrics[R.NUM_EXAMPLES]
        else:
            metrics[R.NUM_EXAMPLES] = value
        return message(s, HOSTILE, records, metrics), R.NUM_EXAMPLES
    metrics[R.NUM_STEPS] = draw(BAD_STEPS)
    return message(s, HOSTILE, records, metrics), R.NUM_STEPS


# ------------------------------------------------------------------------------------------ the property
_BASELINE: dict[str, tuple[dict[str, np.ndarray], dict[str, Any]]] = {}


def baseline(method: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The honest replies' model (node HOSTILE sampled and silent), once per method."""
    if method not in _BASELINE:
        s = build(method)
        new, metrics = s.aggregate_train(1, [honest(s, n) for n in HONEST])
        assert new is not None and metrics is not None and metrics["replies-used"] == len(HONEST)
        _BASELINE[method] = ({k: v.numpy() for k, v in new.items()}, dict(metrics))
    return _BASELINE[method]


def assert_same_model(new: ArrayRecord | None, ref: dict[str, np.ndarray]) -> None:
    assert new is not None
    got = {k: v.numpy() for k, v in new.items()}
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].dtype == ref[k].dtype and np.array_equal(got[k], ref[k]), k


@pytest.mark.parametrize("method", every_method())
@FUZZ
@given(data=st.data())
def test_a_hostile_reply_is_rejected_with_a_reason_and_changes_nothing(method, data):
    ref, ref_metrics = baseline(method)
    s = build(method)
    bad, word = data.draw(hostile_reply(s))
    position = data.draw(st.integers(0, len(HONEST)))
    replies = [honest(s, n) for n in HONEST]
    replies.insert(position, bad)
    new, metrics = s.aggregate_train(1, replies)  # must not raise
    assert metrics is not None and metrics["replies-used"] == len(HONEST) and metrics["replies-rejected"] == 1
    (reason,) = map(str, s.history[-1].rejections)
    assert reason.startswith(f"node {HOSTILE}: ") and len(reason) > len(f"node {HOSTILE}: ")
    assert word in reason, reason
    assert_same_model(new, ref)
    assert metrics["num-steps"] == ref_metrics["num-steps"]


@pytest.mark.parametrize("method", ["fedcm", "fedlada", "localupdatedecay", "fedlocal-sync"])
@FUZZ
@given(junk=st.lists(st.tuples(st.sampled_from([R.TRAIN_LOSS, R.TRAIN_LOSS_BEFORE, "accuracy"]), JUNK), max_size=6))
@example(junk=[(R.TRAIN_LOSS, 2**70), (R.TRAIN_LOSS_BEFORE, "x"), ("accuracy", float("nan")), (R.TRAIN_LOSS, 2**1100),
               (R.TRAIN_LOSS_BEFORE, True), ("accuracy", [1.0])])
def test_junk_in_optional_metrics_never_raises_and_leaves_the_model(method, junk):
    """Optional metrics may hold anything: the honest replies are still used and give the same model."""
    ref, _ = baseline(method)
    s = build(method)
    replies = [honest(s, n) for n in HONEST]
    for i, (key, value) in enumerate(junk):
        replies[i % len(HONEST)].content[R.METRICS].__dict__["_data"][key] = value
    new, metrics = s.aggregate_train(1, replies)
    assert metrics is not None and metrics["replies-used"] == len(HONEST)
    assert_same_model(new, ref)
    assert all(isinstance(v, (int, float)) for v in metrics.values())


def test_a_fortran_ordered_payload_is_used_like_the_c_ordered_one():
    """Flower's ``Array`` of a transposed ndarray writes ``fortran_order: True``: same checks, same values."""
    ref, _ = baseline("fedavg")
    s = build("fedavg")
    replies = [honest(s, n) for n in HONEST]
    w = replies[0].content[R.MODEL]["w"]
    fortran = Array(np.asfortranarray(R.view(w)))
    assert b"'fortran_order': True" in fortran.data
    replies[0].content[R.MODEL]["w"] = fortran
    new, metrics = s.aggregate_train(1, replies)
    assert metrics is not None and metrics["replies-used"] == len(HONEST)
    assert_same_model(new, ref)
