"""Pure NumPy kernels shared by the server side of every method.

Nothing in this module imports Flower or torch: the functions operate on ``dict[str, np.ndarray]``
("named arrays", one entry per model tensor) so that they can be unit-tested in isolation and reused
by both the Message-API strategies and the legacy wrappers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

NamedArrays = dict[str, np.ndarray]

#: Elements per chunk of the chunked kernels (256 KiB of float32: stays in cache between the fused operations).
CHUNK = 1 << 16

#: Aggregation rules understood by :class:`StreamingAggregator`.
AGGREGATION_RULES = ("wmean", "umean", "max", "sum")


def is_float(arr: np.ndarray) -> bool:
    """True for floating-point arrays (the only ones adaptive server math touches)."""
    return np.issubdtype(arr.dtype, np.floating)


class StreamingAggregator:
    """Fold named arrays into a running aggregate, one reply at a time, in place.

    Memory: one accumulator per key (one model copy whatever the number of replies) plus a cache-sized scratch
    chunk (``wmean``); no per-reply temporaries.  Floating arrays accumulate in their own dtype (float32
    models in float32, float64 models — the exactness runs — in float64); integer arrays in float64.

    Rules
    -----
    ``wmean``  ``Σ w_i a_i / Σ w_i`` (``w_i`` = the weight passed to :meth:`add`)
    ``umean``  ``(1/n) Σ a_i`` (weights ignored)
    ``max``    elementwise ``max_i a_i``
    ``sum``    ``Σ a_i``

    The result is cast back to each key's reference dtype (the dtype of the first array folded in).
    """

    def __init__(self, rule: str) -> None:
        if rule not in AGGREGATION_RULES:
            raise ValueError(f"unknown aggregation rule {rule!r}; valid: {', '.join(AGGREGATION_RULES)}")
        self.rule = rule
        self._acc: NamedArrays = {}
        self._scratch: dict[np.dtype, np.ndarray] = {}
        self._dtypes: dict[str, np.dtype] = {}
        self._total_weight = 0.0
        self.count = 0

    def add(self, arrays: Mapping[str, np.ndarray], weight: float = 1.0) -> None:
        if self.rule == "wmean" and not weight > 0:
            raise ValueError(f"wmean needs a positive weight, got {weight}")
        w = weight if self.rule == "wmean" else 1.0
        for key, value in arrays.items():
            arr = np.asarray(value)
            acc = self._acc.get(key)
            if acc is None:
                self._dtypes[key] = arr.dtype
                dtype = arr.dtype if is_float(arr) else np.dtype(np.float64)
                acc = self._acc[key] = np.empty(arr.shape, dtype=dtype)
                np.multiply(arr, w, out=acc) if w != 1.0 else np.copyto(acc, arr)
            elif self.rule == "max":
                np.maximum(acc, arr, out=acc)
            elif w == 1.0:
                np.add(acc, arr, out=acc)
            else:  # acc += w·arr, a cache-sized chunk at a time (no model-sized scratch)
                a, src = acc.reshape(-1), arr.reshape(-1)
                scratch = self._scratch.get(acc.dtype)
                if scratch is None:
                    scratch = self._scratch[acc.dtype] = np.empty(CHUNK, dtype=acc.dtype)
                for i in range(0, a.size, CHUNK):
                    seg = a[i : i + CHUNK]
                    tmp = np.multiply(src[i : i + CHUNK], w, out=scratch[: seg.size])
                    np.add(seg, tmp, out=seg)
        self._total_weight += w
        self.count += 1

    def result(self) -> NamedArrays:
        if self.count == 0:
            raise ValueError("no arrays were folded into the aggregator")
        self._scratch.clear()
        out: NamedArrays = {}
        for key, acc in self._acc.items():
            if self.rule in ("wmean", "umean"):
                np.divide(acc, self._total_weight, out=acc)
            out[key] = acc.astype(self._dtypes[key], copy=False)
        self._acc = {}
        return out


def aggregate(items: Iterable[tuple[Mapping[str, np.ndarray], float]], rule: str) -> NamedArrays:
    """Aggregate ``(arrays, weight)`` pairs with ``rule`` (see :class:`StreamingAggregator`)."""
    agg = StreamingAggregator(rule)
    for arrays, weight in items:
        agg.add(arrays, weight)
    return agg.result()


def safe_divide(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Elementwise ``num / den`` with 0 where ``den == 0`` (TensorFlow's ``divide_no_nan``)."""
    out = np.zeros(np.broadcast(num, den).shape, dtype=np.result_type(num, den))
    np.divide(num, den, out=out, where=den != 0)
    return out


def tree_map(fn, *trees: Mapping[str, np.ndarray]) -> NamedArrays:
    """Apply ``fn`` key by key over one or more named-array dicts with identical keys."""
    first = trees[0]
    return {k: fn(*(t[k] for t in trees)) for k in first}


def all_finite(arrays: Mapping[str, np.ndarray]) -> str | None:
    """Return the first key holding a NaN/Inf (floating arrays only), or None.

    ``min`` and ``max`` are NaN when any element is, ``±inf`` when any element is: two reductions, no temporaries."""
    for key, arr in arrays.items():
        a = np.asarray(arr)
        if is_float(a) and a.size and not (np.isfinite(a.min()) and np.isfinite(a.max())):
            return key
    return None


def nbytes(arrays: Mapping[str, np.ndarray]) -> int:
    return int(sum(np.asarray(a).nbytes for a in arrays.values()))


def pseudo_gradient(current: Mapping[str, np.ndarray], mean: NamedArrays, keys: Iterable[str]) -> NamedArrays:
    """``D̄ = x_t − mean_i x_i`` over ``keys`` in the parameters' dtype, written into ``mean``'s buffers (the round's
    own aggregate, not needed afterwards for these keys): no model-sized allocation.  float64 runs: the float64
    difference, bit for bit."""
    out: NamedArrays = {}
    for k in keys:
        x, m = np.asarray(current[k]), mean[k]
        if m.dtype == x.dtype and m.flags.writeable:
            out[k] = np.subtract(x, m, out=m)
        else:
            out[k] = np.subtract(x, m, dtype=x.dtype)
    return out


def averaging_step(
    current: Mapping[str, np.ndarray], mean_model: Mapping[str, np.ndarray], keys: Iterable[str], server_lr: float
) -> tuple[NamedArrays, NamedArrays]:
    """``Δ̄ = x_t − mean_i x_i`` and ``x_{t+1} = x_t − η_g·Δ̄`` (float64) over ``keys``."""
    delta = {k: np.asarray(current[k], np.float64) - np.asarray(mean_model[k], np.float64) for k in keys}
    new = {k: np.asarray(current[k], np.float64) - server_lr * delta[k] for k in keys}
    return delta, new


def global_offset(mean_delta: Mapping[str, np.ndarray], client_lr: float, mean_steps: float) -> NamedArrays:
    """``Δ̄ / (η_l·K̄)`` = ``(x_t − x_{t+1}) / (η_g·η_l·K̄)``: the average per-step global direction.

    Zero when ``η_l·K̄ = 0`` (no local progress is possible, so there is no direction to estimate).
    """
    scale = client_lr * mean_steps
    if scale == 0:
        return {k: np.zeros_like(np.asarray(v, dtype=np.float64)) for k, v in mean_delta.items()}
    return {k: np.asarray(v, dtype=np.float64) / scale for k, v in mean_delta.items()}


def decayed_lr(lr: float, decay: float, server_round: int) -> float:
    """``lr · decay^(round−1)``: a per-round exponential client-lr schedule (round 1 uses ``lr``)."""
    return lr * decay ** max(server_round - 1, 0)


#: Robust replacements of the (weighted) mean for ``"mean"``-rule records.
ROBUST_RULES = ("median", "trimmed-mean")


class RobustAggregator:
    """Coordinate-wise median or trimmed mean of the folded arrays (weights ignored).

    Unlike :class:`StreamingAggregator` this keeps every reply's arrays until :meth:`result`: memory is
    O(N·model).  ``trimmed-mean`` drops the ``floor(trim·N)`` smallest and largest values per coordinate.
    """

    def __init__(self, rule: str, trim: float = 0.1) -> None:
        if rule not in ROBUST_RULES:
            raise ValueError(f"unknown robust rule {rule!r}; valid: {', '.join(ROBUST_RULES)}")
        if not 0.0 <= trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {trim}")
        self.rule, self.trim = rule, trim
        self._items: list[Mapping[str, np.ndarray]] = []
        self.count = 0

    def add(self, arrays: Mapping[str, np.ndarray], weight: float = 1.0) -> None:
        self._items.append(arrays)
        self.count += 1

    def result(self) -> NamedArrays:
        if not self._items:
            raise ValueError("no arrays were folded into the aggregator")
        out: NamedArrays = {}
        for key, first in self._items[0].items():
            stack = np.stack([np.asarray(item[key], dtype=np.float64) for item in self._items])
            if self.rule == "median":
                value = np.median(stack, axis=0)
            else:
                k = int(np.floor(self.trim * len(self._items)))
                value = np.sort(stack, axis=0)[k : len(self._items) - k].mean(axis=0)
            out[key] = value.astype(np.asarray(first).dtype, copy=False)
        return out
