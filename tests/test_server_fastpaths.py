"""The server's per-round shortcuts give exactly what the code they replace gives: the lower median by ``sorted``
(``np.quantile(..., method="lower")``), the cached ``is_float`` and dtype lookups, direct record reads on the probed
fast path, ``content_nbytes`` without memoryviews, and the reply/model fingerprints of ``bytes`` payloads without
NumPy views."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from flower_strategies.core import binding
from flower_strategies.core import records as R
from flower_strategies.core.ops import is_float
from flower_strategies.core.robust import lower_median
from flower_strategies.core.rounds import robust_mean


@pytest.mark.parametrize("values", [
    [3.0], [2.0, 1.0], [5, 1, 4, 1, 5, 9, 2, 6], [1.5, 1.5, 1.5], [0.0, math.inf, 2.0], [math.inf, math.inf, 1.0],
    [1.0, math.nan, 2.0], [np.float32(0.1), np.float32(0.3), np.float32(0.2)], [-0.0, 0.0, 1.0],
    list(np.random.default_rng(0).normal(size=101)), list(np.random.default_rng(1).integers(0, 5, 40)),
])
def test_lower_median_is_numpys_lower_quantile(values):
    want = float(np.quantile(values, 0.5, method="lower"))
    got = lower_median(values)
    assert (math.isnan(got) and math.isnan(want)) or (got == want and math.copysign(1, got) == math.copysign(1, want))


def test_lower_median_of_nothing_fails_as_numpy_does():
    assert lower_median(np.array([[3.0, 1.0], [2.0, 0.0]])) == 1.0  # not flat: NumPy flattens
    with pytest.raises(IndexError):
        lower_median([])


def test_robust_mean_leaves_out_the_outlier_by_the_lower_median():
    pairs = [(1.0, 1.0), (2.0, 3.0), (1e300, 1.0), (3.0, 2.0)]
    kept = [(1.0, 1.0), (2.0, 3.0), (3.0, 2.0)]
    assert robust_mean(pairs) == sum(v * n for v, n in kept) / sum(n for _, n in kept)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.longdouble, np.int8, np.int64, np.uint8,
                                   np.bool_, np.complex64, "S3", "<U2", "V4", [("a", "<f4")], "datetime64[s]"])
def test_is_float_is_issubdtype_floating(dtype):
    arr = np.zeros(2, dtype)
    for _ in range(2):  # computed, then cached
        assert is_float(arr) == np.issubdtype(arr.dtype, np.floating)


def _reply() -> RecordDict:
    return RecordDict({R.MODEL: ArrayRecord({"w": Array(np.arange(6, dtype=np.float32))}),
                       R.METRICS: MetricRecord({R.NUM_EXAMPLES: 3, "xs": [1.0, 2.0]}),
                       R.REPLY_INFO: ConfigRecord({R.METHOD: "fedavg", "flag": True, "blob": b"abc",
                                                   "names": ["ab", "c"]})})


@pytest.mark.parametrize("fast", [False, True])
def test_get_reads_the_same_record_on_both_paths(fast):
    content = _reply()
    with R.record_path(fast):
        assert R.get(content, R.METRICS, MetricRecord) is content[R.METRICS]
        assert R.get(content, R.METRICS, ArrayRecord) is None and R.get(content, "absent", ArrayRecord) is None
        assert R.get(content, R.MODEL, ArrayRecord) is content[R.MODEL]


def test_content_nbytes_counts_every_payload_kind_as_before():
    content = _reply()
    arr = content[R.MODEL]["w"]
    payload = len(arr.data)
    numbers = len(R.NUM_EXAMPLES) + 8 + len("xs") + 16
    configs = len(R.METHOD) + len("fedavg") + len("flag") + 8 + len("blob") + 3 + len("names") + 3
    assert R.content_nbytes(content) == payload + numbers + configs
    for data, size in ((bytearray(b"x" * 10), 10), (memoryview(np.zeros(3, np.float64)), 24), ("not bytes", 0)):
        arr.__dict__["data"] = data  # what a malformed reply may hold
        assert R.content_nbytes(content) == size + numbers + configs


def test_checked_view_names_a_bad_dtype_as_numpy_does():
    arr = Array(np.zeros(2, np.float32))
    assert R.checked_view(arr, (2,), np.dtype(np.float32)) is not None
    for bad in ("float64", "<f8", [("a", "<f4")], "no-such-type"):
        arr.__dict__["dtype"] = bad
        got = R.checked_view(arr, (2,), np.dtype(np.float32))
        assert isinstance(got, str)
        try:
            want = f"has dtype {bad}, expected float32"
            np.dtype(bad)
        except TypeError as err:
            want = f"has unusable metadata (TypeError: {err})"
        assert got == want


@pytest.mark.parametrize("size", [0, 5, 8, 64, 4096 * 8 + 3, (1 << 18) * 8 + 8])
def test_a_bytes_payload_and_a_view_of_it_fingerprint_alike(size, monkeypatch):
    """``_fingerprints`` reads a ``bytes`` payload directly and any other buffer through NumPy: both give the
    same fingerprint, alone and stacked with others of the same length."""
    monkeypatch.setattr(binding, "_STACK_BYTES", 3 * max(8, size))
    rng = np.random.default_rng(size)
    datas = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(5)]
    as_bytes = binding._fingerprints(datas)
    as_views = binding._fingerprints([np.frombuffer(d, np.uint8) for d in datas])
    mixed = binding._fingerprints([d if i % 2 else bytearray(d) for i, d in enumerate(datas)])
    assert as_bytes == as_views == mixed
    assert as_bytes == [binding._fingerprints([d])[0] for d in datas]


def test_the_model_digest_is_its_definition():
    """The model digest is checkpointed with every remembered reply: keys, dtypes, shapes and the fingerprint of
    each array's bytes, in the arrays' order."""
    rng = np.random.default_rng(3)
    arrays = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": np.arange(5, dtype=np.int64),
              "t": np.asfortranarray(rng.normal(size=(3, 2))), "s": np.array(1.5)}
    h = hashlib.blake2b(digest_size=binding.DIGEST_BYTES)
    for key, value in arrays.items():
        arr = np.ascontiguousarray(value)
        h.update(repr((key, arr.dtype.str, arr.shape)).encode() + binding._fingerprints([arr.tobytes()])[0])
    assert binding.model_digest(arrays) == h.digest()
    changed = dict(arrays, b=arrays["b"] + 1)
    assert binding.model_digest(changed) != h.digest()


def _bits(arrays):
    return {k: (_bits(v) if isinstance(v, dict) else v.tobytes()) for k, v in arrays.items()}


@pytest.mark.parametrize("kind", ["sgd", "sgdm", "adagrad", "adam", "yogi"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_server_step_in_the_rounds_own_buffers_gives_the_same_bits(kind, dtype):
    """FedOpt's round writes D̄ and x_{t+1} into the aggregate's buffers and updates the state in place
    (``pseudo_gradient(in_place=True)``, ``ServerOptimizer.step(in_place=True)``): the same values, bit for bit, as
    the step into new arrays, across chunk boundaries; the model is not touched.  A step whose new values would not
    all be finite leaves the state as it was (new arrays, which the commit refuses)."""
    from flower_strategies.core.ops import pseudo_gradient
    from flower_strategies.core.server_opt import CHUNK, ServerOptimizer

    rng = np.random.default_rng(7)
    x = {"w": rng.normal(size=(2, CHUNK + 5)).astype(dtype), "b": rng.normal(size=3).astype(dtype)}
    mean = {k: (v + rng.normal(scale=0.1, size=v.shape)).astype(dtype) for k, v in x.items()}
    opt = ServerOptimizer(kind, lr=0.3, beta1=0.9, beta2=0.99, tau=1e-3)
    state = opt.step(x, pseudo_gradient(x, mean, list(x)), opt.init(x), step=1, server_round=1)[1]  # non-trivial
    x_bits = _bits(x)
    copy = {n: {k: v.copy() for k, v in a.items()} for n, a in state.items()}
    plain, plain_state = opt.step(x, pseudo_gradient(x, mean, list(x)), copy, step=2, server_round=2)
    assert _bits(copy) == _bits(state)  # by default nothing of the input moves
    buffers = {k: v.copy() for k, v in mean.items()}
    grad = pseudo_gradient(x, buffers, list(x), in_place=True)
    assert all(grad[k] is buffers[k] for k in x)
    new, new_state = opt.step(x, grad, state, step=2, server_round=2, in_place=True)
    assert all(new[k] is buffers[k] for k in x) and new_state is state  # the round's buffers and the state's own
    assert _bits(new) == _bits(plain) and _bits(new_state) == _bits(plain_state)
    assert _bits(x) == x_bits
    # the textbook expressions, whole arrays (the module docstring's float64 claim)
    d = {k: x[k] - mean[k] for k in x}
    if kind == "sgd":
        want = {k: x[k] - d[k] * 0.3 for k in x}
        assert _bits(new) == _bits(want)

    huge = {k: np.full_like(v, 1e30 if dtype == np.float32 else 1e300) for k, v in x.items()}
    copy = {n: {k: v.copy() for k, v in a.items()} for n, a in state.items()}
    plain, plain_state = opt.step(x, pseudo_gradient(x, huge, list(x)), copy, step=3, server_round=3)
    values = [*plain.values(), *(v for arrays in plain_state.values() for v in arrays.values())]
    finite = all(np.isfinite(a).all() for a in values)
    assert finite == (kind in ("sgd", "sgdm"))  # D̄² overflows for the adaptive three
    before = _bits(state)
    out, out_state = opt.step(x, pseudo_gradient(x, huge, list(x), in_place=True), state, step=3, server_round=3,
                              in_place=True)
    assert _bits(out) == _bits(plain) and _bits(out_state) == _bits(plain_state)
    assert (out_state is state) == finite  # not finite: new arrays, the state as it was
    if not finite:
        assert _bits(state) == before
