"""Pure NumPy kernels shared by the server side of every method.

Nothing in this module imports Flower or torch: the functions operate on ``dict[str, np.ndarray]``
("named arrays", one entry per model tensor) so that they can be unit-tested in isolation and reused
by both the Message-API strategies and the legacy wrappers.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

NamedArrays = dict[str, np.ndarray]

#: Elements per chunk of the chunked kernels (256 KiB of float32: stays in cache between the fused operations).
CHUNK = 1 << 16

#: :func:`fold` splits every array into segments of this many elements and folds them on ``WORKERS`` threads (each
#: element's operations and their order are the same on any number of threads: results are bit-identical).
SEGMENT = 16 * CHUNK
WORKERS = min(4, os.cpu_count() or 1)
#: Below this many element-visits (elements × items) :func:`fold` stays on the calling thread.
PARALLEL_MIN = 1 << 22

#: Aggregation rules understood by :func:`fold`.
AGGREGATION_RULES = ("wmean", "umean", "max", "sum")


def is_float(arr: np.ndarray) -> bool:
    """True for floating-point arrays (the only ones adaptive server math touches)."""
    return np.issubdtype(arr.dtype, np.floating)


def fold(
    items: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float] | None,
    rule: str | None,
    reference: Mapping[str, np.ndarray] | None = None,
    norms: bool = False,
) -> tuple[NamedArrays, list[float]]:
    """Aggregate ``items`` (named arrays with identical keys) with ``rule`` and, with ``norms``, measure every
    item's L2 norm, in ONE chunk-major pass: for each cache-sized chunk every item is read once, the accumulator
    chunk stays in cache, and nothing model-sized is allocated beyond the result (one accumulator per key, the
    item's own dtype for floating arrays, float64 for integer ones; cast back at the end).

    Rules (``rule=None``: norms only, no aggregate)
    ``wmean``  ``Σ w_i a_i / Σ w_i`` (``weights`` positive)
    ``umean``  ``(1/n) Σ a_i`` (weights ignored)
    ``max``    elementwise ``max_i a_i``
    ``sum``    ``Σ a_i``

    Every element is folded in item order with the same operations as a reply-by-reply loop
    (``acc = w_0·a_0; acc += w_i·a_i``), so the result depends neither on the chunking nor on the number of threads
    the segments are spread over (:data:`WORKERS`).

    Norms: ``‖a_i − reference‖`` over the floating keys ``reference`` has (``‖a_i‖`` for the others), summed per
    chunk in each array's dtype — screening, not math: NaN/Inf values, or a sum of squares that overflows, give a
    non-finite norm.  Integer arrays are not measured.
    """
    if rule is not None and rule not in AGGREGATION_RULES:
        raise ValueError(f"unknown aggregation rule {rule!r}; valid: {', '.join(AGGREGATION_RULES)}")
    n = len(items)
    if rule is not None and n == 0:
        raise ValueError("no arrays were folded into the aggregate")
    if rule == "wmean":
        assert weights is not None and len(weights) == n
        ws = [float(w) for w in weights]
        bad = [w for w in ws if not w > 0]
        if bad:
            raise ValueError(f"wmean needs positive weights, got {bad[0]}")
    else:
        ws = [1.0] * n
    total = sum(ws)
    plans = []  # per key: (key, items' arrays, flat reference or None, accumulator or None, measure?)
    for key in (items[0] if n else {}):
        srcs = [np.asarray(item[key]) for item in items]
        first = srcs[0]
        measure = norms and is_float(first)
        ref = np.asarray(reference[key]).reshape(-1) if measure and reference is not None and key in reference else None
        acc = None if rule is None else np.empty(first.shape, dtype=first.dtype if is_float(first) else np.float64)
        plans.append((key, srcs, ref, acc, measure))  # flat views are made per segment: N × keys fewer live objects
    segments = [(p, lo, min(lo + SEGMENT, p[1][0].size)) for p in plans for lo in range(0, p[1][0].size, SEGMENT)]

    def run(segment) -> list[float]:
        """Fold one segment of one key (a few chunks) for every item; its items' partial sums of squares."""
        (_, srcs, ref, acc, measure), start, stop = segment
        flats = [a.reshape(-1) for a in srcs]
        sq = [0.0] * n
        flat_acc = None if acc is None else acc.reshape(-1)
        width = min(CHUNK, stop - start)
        dtype = flats[0].dtype
        diff = np.empty(width if ref is not None else 0, dtype)  # scratch of the norms' differences
        scaled = np.empty(width if acc is not None and rule == "wmean" else 0, dtype if acc is None else acc.dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            for lo in range(start, stop, CHUNK):
                hi = min(lo + CHUNK, stop)
                refc = ref[lo:hi] if ref is not None else None
                accc = flat_acc[lo:hi] if flat_acc is not None else None
                for i, flat in enumerate(flats):
                    ac = flat[lo:hi]
                    if measure:
                        if refc is None:
                            sq[i] += float(np.dot(ac, ac))
                        else:
                            d = np.subtract(ac, refc, out=diff[: hi - lo])
                            sq[i] += float(np.dot(d, d))
                    if accc is None:
                        continue
                    w = ws[i]
                    if i == 0:
                        np.multiply(ac, w, out=accc) if w != 1.0 else np.copyto(accc, ac)
                    elif rule == "max":
                        np.maximum(accc, ac, out=accc)
                    elif w == 1.0:
                        np.add(accc, ac, out=accc)
                    else:
                        np.add(accc, np.multiply(ac, w, out=scaled[: hi - lo]), out=accc)
                if accc is not None and rule in ("wmean", "umean"):
                    np.divide(accc, total, out=accc)
        return sq

    work = sum(stop - start for _, start, stop in segments) * max(n, 1)
    if WORKERS > 1 and len(segments) > 1 and work >= PARALLEL_MIN:
        with ThreadPoolExecutor(WORKERS) as pool:  # NumPy releases the GIL inside each chunk operation
            partial = list(pool.map(run, segments))
    else:
        partial = [run(seg) for seg in segments]
    squares = [sum(p[i] for p in partial) for i in range(n)]  # in segment order: deterministic
    out: NamedArrays = {}
    for key, srcs, _, acc, _ in plans:
        if acc is not None:
            out[key] = acc.astype(srcs[0].dtype, copy=False)
    return out, [float(np.sqrt(v)) for v in squares]


def aggregate(items: Iterable[tuple[Mapping[str, np.ndarray], float]], rule: str) -> NamedArrays:
    """Aggregate ``(arrays, weight)`` pairs with ``rule`` (see :func:`fold`)."""
    pairs = list(items)
    return fold([a for a, _ in pairs], [w for _, w in pairs], rule)[0]


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


def chunked(kernel, outs: Sequence[np.ndarray], ins: Sequence[np.ndarray], *, temps: int = 0,
            check_only: bool = False) -> bool:
    """Run ``kernel(o, i, t)`` over matching cache-sized chunks of the (same-sized, contiguous) ``outs`` and ``ins``:
    ``o``/``i`` are the chunks, ``t`` ``temps`` scratch chunks in the outputs' dtype.  ``outs`` may alias ``ins``
    (in-place updates): the kernel must read an input chunk before writing the output that aliases it.

    ``check_only=True`` writes nothing: the kernel runs into scratch outputs and the return value says whether
    every output value would be finite.  An in-place update of persistent state checks every key this way first
    and writes only if all are finite (:func:`update_in_place`): the commit-only-finite contract of the strategy
    base without a model-sized copy of the state, for the price of computing the update twice."""
    size, dtype = outs[0].size, outs[0].dtype
    flat_in = [np.asarray(a).reshape(-1) for a in ins]
    width = max(1, min(CHUNK, size))
    scratch = [np.empty(width, dtype) for _ in range(temps)]
    trial = [np.empty(width, o.dtype) for o in outs] if check_only else None
    flat_out = [] if check_only else [o.reshape(-1) for o in outs]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for lo in range(0, size, CHUNK):
            hi = min(lo + CHUNK, size)
            n = hi - lo
            o = [t[:n] for t in trial] if trial is not None else [f[lo:hi] for f in flat_out]
            kernel(o, [f[lo:hi] for f in flat_in], [t[:n] for t in scratch])
            if trial is not None and not all(_finite(c) for c in o):
                return False
    return True


def update_in_place(kernel, jobs: Sequence[tuple[list[np.ndarray], list[np.ndarray]]], temps: int) -> bool:
    """``jobs`` = ``[(outs, ins), ...]`` (one per key) whose ``outs`` include persistent state updated in place:
    check every job (:func:`chunked` ``check_only``), then write them all — or write nothing and return False
    when some value would be NaN/Inf."""
    if not all(chunked(kernel, outs, ins, temps=temps, check_only=True) for outs, ins in jobs):
        return False
    for outs, ins in jobs:
        chunked(kernel, outs, ins, temps=temps)
    return True


def apply_update(kernel, jobs: Sequence[tuple[list[np.ndarray | None], list[np.ndarray]]], *, temps: int,
                 persistent: Sequence[int] = ()) -> list[list[np.ndarray]]:
    """Run ``kernel`` (see :func:`chunked`) for every job ``(outs, ins)`` (one per key) and return each job's output
    arrays.  An ``outs`` entry is the array to write into (the round's own buffer, or persistent state) or None for a
    new array shaped like ``ins[0]`` in :func:`dtype_of` it.  ``persistent``: the positions in ``outs`` that are
    persistent state; they are written in place only when every job has them and a check pass shows every new value
    finite (:func:`update_in_place`) — if some value would not be, nothing given is written and every output gets a
    new array (whose non-finite values the strategy base then refuses to commit); if some job lacks a persistent
    output, those get new arrays.  Without persistent outputs there is nothing to protect and the kernel runs once."""

    def new(ins: list[np.ndarray]) -> np.ndarray:
        return np.empty(np.shape(ins[0]), dtype_of(ins[0]))

    in_place = bool(persistent) and all(outs[i] is not None for outs, _ in jobs for i in persistent)
    resolved = [([o if o is not None and (in_place or i not in persistent) else new(ins) for i, o in enumerate(outs)],
                 ins) for outs, ins in jobs]
    if in_place and update_in_place(kernel, resolved, temps=temps):
        return [outs for outs, _ in resolved]
    if in_place:  # some value would be NaN/Inf: write nothing given, new arrays for every output
        resolved = [([new(ins) for _ in outs], ins) for outs, ins in resolved]
    for outs, ins in resolved:
        chunked(kernel, outs, ins, temps=temps)
    return [outs for outs, _ in resolved]


def owned(arr: np.ndarray | None, like: np.ndarray) -> bool:
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


def pseudo_gradient(current: Mapping[str, np.ndarray], mean: NamedArrays, keys: Iterable[str]) -> NamedArrays:
    """``D̄ = x_t − mean_i x_i`` over ``keys`` in the parameters' dtype, written into ``mean``'s buffers (the round's
    own aggregate, not needed afterwards for these keys): no model-sized allocation.  float64 runs: the float64
    difference, bit for bit."""
    out: NamedArrays = {}
    for k in keys:
        x, m = np.asarray(current[k]), mean[k]
        out[k] = np.subtract(x, m, out=m) if owned(m, x) else np.subtract(x, m, dtype=x.dtype)
    return out


def averaging_step(
    current: Mapping[str, np.ndarray], mean: NamedArrays, keys: Iterable[str], server_lr: float,
    offset: NamedArrays | None = None, client_lr: float = 0.0, mean_steps: float = 0.0,
) -> tuple[NamedArrays, NamedArrays]:
    """``x_{t+1} = x_t − η_g·Δ̄`` with ``Δ̄ = x_t − mean_i x_i`` over ``keys``, in the parameters' dtype, written into
    ``mean``'s buffers (the round's own aggregate).  Returns ``(x_{t+1}, new offset)``.

    With ``offset`` (the previous global offset, e.g. FedLADA's ``g_a`` / FedCM's ``Δ_t``) the new offset
    ``Δ̄ / (η_l·K̄)`` (zero when ``η_l·K̄ = 0``: no direction to estimate) replaces it, in place when it is owned
    (after a check that every new value is finite, :func:`update_in_place`), else in new arrays.  float64 runs:
    the textbook float64 expressions, bit for bit."""
    scale = client_lr * mean_steps

    def kernel(o, i, t):
        d = np.subtract(i[0], i[1], out=t[0])  # Δ̄ = x − mean
        if len(o) > 1:
            if scale == 0:
                o[1].fill(0.0)
            else:
                np.divide(d, scale, out=o[1])
        np.subtract(i[0], np.multiply(d, server_lr, out=d), out=o[0])  # x − η_g·Δ̄ (may be mean's chunk)

    keys = list(keys)
    jobs = []
    for k in keys:
        x, m = np.asarray(current[k]), mean[k]
        outs = [m if owned(m, x) else None]
        if offset is not None:
            outs.append(offset[k] if owned(offset.get(k), x) else None)
        jobs.append((outs, [x, m]))
    results = apply_update(kernel, jobs, temps=1, persistent=(1,) if offset is not None else ())
    new = {k: outs[0] for k, outs in zip(keys, results)}
    return new, ({k: outs[1] for k, outs in zip(keys, results)} if offset is not None else {})


def decayed_lr(lr: float, decay: float, server_round: int) -> float:
    """``lr · decay^(round−1)``: a per-round exponential client-lr schedule (round 1 uses ``lr``)."""
    return lr * decay ** max(server_round - 1, 0)
