"""Pure NumPy kernels shared by the server side of every method.

Nothing in this module imports Flower or torch: the functions operate on ``dict[str, np.ndarray]``
("named arrays", one entry per model tensor) so that they can be unit-tested in isolation and reused
by both the Message-API strategies and the legacy wrappers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

NamedArrays = dict[str, np.ndarray]

#: Aggregation rules understood by :func:`fold`.
AGGREGATION_RULES = ("wmean", "umean", "max", "sum")


def is_float(arr: np.ndarray) -> bool:
    """True for floating-point arrays (the only ones adaptive server math touches)."""
    dtype = arr.dtype
    known = _IS_FLOAT.get(dtype)
    if known is None:
        known = _IS_FLOAT[dtype] = bool(np.issubdtype(dtype, np.floating))
    return known


#: ``np.issubdtype(dtype, np.floating)`` of the dtypes :func:`is_float` has seen (a few per run; the NumPy call costs
#: µs, and the server asks it for every array of every reply).
_IS_FLOAT: dict[np.dtype, bool] = {}


#: Elements per chunk of :func:`norms_and_fold`: a chunk of every item stays in the core's cache between the norm
#: and the fold that read it (16 Ki–64 Ki float32 measured equally fast, 256 Ki 25 % slower, whole arrays 40 %).
CHUNK = 1 << 16


def fold(items: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float] | None, rule: str) -> NamedArrays:
    """Aggregate ``items`` (named arrays with identical keys) with ``rule``, reply by reply in item order:
    ``acc = w_0·a_0; acc += w_i·a_i`` (``max``: ``acc = max(acc, a_i)``), then ``acc / Σ w_i`` for the means.  The
    accumulator has each floating array's dtype (float64 for integer arrays, cast back at the end).

    ``wmean``  ``Σ w_i a_i / Σ w_i`` (``weights`` positive)
    ``umean``  ``(1/n) Σ a_i`` (weights ignored)
    ``max``    elementwise ``max_i a_i``
    ``sum``    ``Σ a_i``
    """
    sums = norms_and_fold(items, None, weights, rule, measure=False)[1]
    return finish_fold(sums, items[0] if items else {}, weights, rule, len(items))


def update_norms(items: Sequence[Mapping[str, np.ndarray]],
                 reference: Mapping[str, np.ndarray] | None = None) -> list[float]:
    """Every item's L2 norm over its floating arrays: ``‖a_i − reference‖`` for the keys ``reference`` has, ``‖a_i‖``
    for the others, the sum of squares in each array's dtype — screening, not math: NaN/Inf values, or a sum of
    squares that overflows, give a non-finite norm.  Integer arrays are not measured."""
    return norms_and_fold(items, reference, None, None)[0]


def fold_weights(weights: Sequence[float] | None, rule: str, n: int) -> list[float]:
    """The weight each of ``n`` items gets in :func:`fold` under ``rule`` (checked: one positive weight per item)."""
    if rule not in AGGREGATION_RULES:
        raise ValueError(f"unknown aggregation rule {rule!r}; valid: {', '.join(AGGREGATION_RULES)}")
    if not n:
        raise ValueError("no arrays were folded into the aggregate")
    ws = [float(w) for w in weights] if rule == "wmean" and weights is not None else [1.0] * n
    if len(ws) != n or not all(w > 0 for w in ws):
        raise ValueError(f"wmean needs one positive weight per item, got {list(ws)}")
    return ws


def norms_and_fold(items: Sequence[Mapping[str, np.ndarray]], reference: Mapping[str, np.ndarray] | None,
                   weights: Sequence[float] | None, rule: str | None, *,
                   measure: bool = True) -> tuple[list[float], NamedArrays | None]:
    """``(norms, sums)``, reading each array of each item once: every item's norm (:func:`update_norms`; ``[]``
    with ``measure=False``) and, with a ``rule`` of :func:`fold`, the fold's sums before a mean's division
    (:func:`finish_fold` completes them).  Array by array and, within an array, :data:`CHUNK` elements at a time for
    every item, so that the norm and the fold read a chunk while it is in cache; one scratch chunk, and the sums are
    the only arrays allocated."""
    ws = fold_weights(weights, rule, len(items)) if rule is not None else []
    squares = [0.0] * len(items) if measure else []
    sums: NamedArrays | None = {} if rule is not None else None
    if not items:
        return squares, sums
    scratch: dict[np.dtype, np.ndarray] = {}
    with np.errstate(over="ignore", invalid="ignore"):
        for key, first in items[0].items():
            first = np.asarray(first)
            if not is_float(first):  # integer arrays: not measured; folded in float64
                if sums is not None:
                    sums[key] = _fold_whole([_as_float(item[key]) for item in items], ws, rule)
                continue
            flat = [np.asarray(item[key]).reshape(-1) for item in items]
            ref = np.asarray(reference[key]).reshape(-1) if reference is not None and key in reference else None
            acc = np.empty(first.size, first.dtype) if sums is not None else None
            tmp = scratch.setdefault(first.dtype, np.empty(CHUNK, first.dtype))
            for start in range(0, first.size, CHUNK):
                stop = min(start + CHUNK, first.size)
                t = tmp[: stop - start]
                for i, arr in enumerate(flat):
                    a = arr[start:stop]
                    if measure:
                        d = a if ref is None else np.subtract(a, ref[start:stop], out=t)
                        squares[i] += float(np.dot(d, d))
                    if acc is not None:
                        _fold_into(acc[start:stop], a, ws[i], rule, i == 0, t)
            if sums is not None and acc is not None:
                sums[key] = acc.reshape(first.shape)
    return [math.sqrt(s) for s in squares], sums


def _fold_into(acc: np.ndarray, a: np.ndarray, w: float, rule: str | None, first: bool, tmp: np.ndarray) -> None:
    """One item's step of the fold, in place: ``acc = w·a`` (the first), ``acc = max(acc, a)``, ``acc += w·a``."""
    if first:
        np.multiply(a, w, out=acc)
    elif rule == "max":
        np.maximum(acc, a, out=acc)
    elif w == 1.0:
        np.add(acc, a, out=acc)
    else:
        np.add(acc, np.multiply(a, w, out=tmp), out=acc)


def _fold_whole(arrays: Sequence[np.ndarray], ws: Sequence[float], rule: str | None) -> np.ndarray:
    acc = np.asarray(arrays[0] * ws[0])  # (0-d arrays: an array, not a NumPy scalar)
    for a, w in zip(arrays[1:], ws[1:], strict=True):
        _fold_into(acc, a, w, rule, False, np.empty_like(acc))
    return acc


def finish_fold(sums: NamedArrays | None, like: Mapping[str, np.ndarray], weights: Sequence[float] | None,
                rule: str, n: int) -> NamedArrays:
    """The aggregate from :func:`norms_and_fold`'s ``sums`` of ``n`` items like ``like`` (divided in place for the
    means; integer arrays cast back to their dtype)."""
    total = sum(fold_weights(weights, rule, n))
    assert sums is not None
    out: NamedArrays = {}
    for key, acc in sums.items():
        if rule in ("wmean", "umean"):
            acc /= total
        out[key] = acc.astype(np.asarray(like[key]).dtype, copy=False)
    return out


def _as_float(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a if is_float(a) else a.astype(np.float64)


def safe_divide(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Elementwise ``num / den`` with 0 where ``den == 0`` (TensorFlow's ``divide_no_nan``)."""
    out = np.zeros(np.broadcast(num, den).shape, dtype=np.result_type(num, den))
    np.divide(num, den, out=out, where=den != 0)
    return out


def cast_like(arrays: Mapping[str, np.ndarray], like: Mapping[str, np.ndarray]) -> NamedArrays:
    """``arrays`` cast to the dtypes of the same keys in ``like`` (keys ``like`` lacks are left as they are)."""
    return {k: np.asarray(v).astype(np.asarray(like[k]).dtype, copy=False) if k in like else v
            for k, v in arrays.items()}


def merge_buffers(new_params: NamedArrays, current: NamedArrays, averaged: NamedArrays | None) -> NamedArrays:
    """Complete ``new_params`` (trainable keys) with the non-trainable arrays of ``current``: floating buffers take
    the clients' average ``averaged`` when available; integer arrays keep the server's value."""
    out: NamedArrays = {}
    for k, x in current.items():
        if k in new_params:
            out[k] = new_params[k]
        elif averaged is not None and k in averaged and is_float(np.asarray(x)):
            out[k] = averaged[k]
        else:
            out[k] = x
    return out


def all_finite(arrays: Mapping[str, np.ndarray]) -> str | None:
    """Return the first key holding a NaN/Inf (floating arrays only), or None.

    One read per array: ``a·a`` is finite whenever every value is (only an overflow of the sum of squares is
    re-checked value by value, with ``min``/``max``, which are NaN or ±inf exactly when some value is)."""
    for key, arr in arrays.items():
        a = np.asarray(arr)
        if is_float(a) and a.size and not _finite(a.reshape(-1)):
            return key
    return None


def _finite(flat: np.ndarray) -> bool:
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.dot(flat, flat)):
            return True
    return bool(np.isfinite(flat.min()) and np.isfinite(flat.max()))


def writable_like(arr: np.ndarray | None, like: np.ndarray) -> bool:
    """Whether ``arr`` can take an in-place result for ``like``: a writable contiguous array of its shape and dtype."""
    return (arr is not None and isinstance(arr, np.ndarray) and arr.flags.writeable and arr.flags.c_contiguous
            and arr.shape == np.shape(like) and arr.dtype == dtype_of(like))


def dtype_of(p: np.ndarray) -> np.dtype:
    """The dtype server math and state use for parameter ``p``: its own when floating, else float64."""
    dt = np.asarray(p).dtype
    return dt if np.issubdtype(dt, np.floating) else np.dtype(np.float64)


def state_like(arrays: Mapping[str, np.ndarray], keys: Iterable[str], fill: float = 0.0) -> NamedArrays:
    """Server-state arrays for ``keys`` of ``arrays``: filled with ``fill``, in each parameter's dtype (float64 runs:
    float64; float32 models: float32)."""
    return {k: np.full(np.shape(arrays[k]), fill, dtype=dtype_of(arrays[k])) for k in keys}


def pseudo_gradient(current: Mapping[str, np.ndarray], mean: NamedArrays, keys: Iterable[str],
                    in_place: bool = False) -> NamedArrays:
    """``D̄ = x_t − mean_i x_i`` over ``keys`` in the parameters' dtype (float64 runs: the float64 difference);
    ``in_place=True``: written into ``mean``'s own arrays where they can take it (the round's buffers)."""
    return {k: np.subtract(current[k], mean[k], dtype=np.asarray(current[k]).dtype,
                           out=mean[k] if in_place and writable_like(mean[k], current[k]) else None) for k in keys}


def averaging_step(
    current: Mapping[str, np.ndarray], mean: NamedArrays, keys: Iterable[str], server_lr: float,
    offset: NamedArrays | None = None, client_lr: float = 0.0, mean_steps: float = 0.0,
) -> tuple[NamedArrays, NamedArrays]:
    """``x_{t+1} = x_t − η_g·Δ̄`` with ``Δ̄ = x_t − mean_i x_i`` over ``keys``, in the parameters' dtype, in new arrays.
    Returns ``(x_{t+1}, new offset)``.

    With ``offset`` (the previous global offset, e.g. FedLADA's ``g_a`` / FedCM's ``Δ_t``) the new offset is
    ``Δ̄ / (η_l·K̄)`` (zero when ``η_l·K̄ = 0``: no direction to estimate).  float64 runs: the textbook float64
    expressions, bit for bit."""
    scale = client_lr * mean_steps
    new: NamedArrays = {}
    new_offset: NamedArrays = {}
    with np.errstate(over="ignore", invalid="ignore"):
        for k in keys:
            x = np.asarray(current[k])
            d = x - mean[k]
            if offset is not None:
                new_offset[k] = np.zeros_like(d) if scale == 0 else d / scale
            new[k] = x - d * server_lr
    return new, new_offset


def decayed_lr(lr: float, decay: float, server_round: int) -> float:
    """``lr · decay^(round−1)``: a per-round exponential client-lr schedule (round 1 uses ``lr``)."""
    return lr * decay ** max(server_round - 1, 0)
