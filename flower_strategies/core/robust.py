"""Byzantine-robust pieces of the reply screen, as free functions on named arrays (no Flower, no strategy state).

* :func:`clip_scales` / :func:`clipped` — the norm clip: every reply whose record norm exceeds ``ratio`` × the
  round's lower-median norm of that record is scaled back onto that bound (a ``keys="model"`` record around the
  round's global model, i.e. its update ``x_i − x_t`` is scaled; any other record around zero);
* :func:`centre_cosines` — the direction screen: each reply's cosine with the mean of the round's updates clipped
  onto their lower-median norm (a centre one reply moves by at most 1/N of an honest norm);
* :func:`byzantine_count` — how many of ``n`` replies a tolerated Byzantine fraction ``f`` means, ``⌈f·n⌉``;
* :func:`robust_aggregate` — coordinate-wise median / trimmed mean (trimming ``t`` values per side);
* :func:`krum_select` — Krum / multi-Krum (Blanchard et al., 2017): the replies whose updates are closest to their
  ``max(1, n − t − 2)`` nearest neighbours (as Flower's own ``Krum``);
* :func:`fltrust_scores` / :func:`fltrust_aggregate` — FLTrust (Cao et al., NDSS 2021): trust = ReLU(cosine) of each
  update with the server's own update on its root set, each update rescaled to the server update's norm;
* :func:`centered_clip` — centered clipping (Karimireddy, He, Jaggi, ICML 2021) around a momentum centre;
* :func:`bucket_means` — bucketing (Karimireddy et al., ICLR 2022): means of random buckets of ``s`` replies, the
  input of a robust rule on heterogeneous data.

Each aggregator states the fewest replies it needs to tolerate ``t`` Byzantine ones (:func:`min_replies`);
:class:`TooFewReplies` names the fix when a round has fewer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from .ops import NamedArrays, is_float

#: Coordinate-wise robust replacements of the (weighted) mean of ``"mean"``-rule records.
COORDINATE_RULES = ("median", "trimmed-mean")
#: Whole-record robust replacements of the mean (:func:`record_aggregate`): centered clipping around the last round's
#: update, and the same on the means of random buckets of 2 replies.
VECTOR_RULES = ("centered-clip", "bucketing")
#: Every rule that replaces the aggregate of the ``"mean"``-rule records.
RECORD_RULES = (*COORDINATE_RULES, *VECTOR_RULES)
#: Reply selections: the kept replies are then aggregated with the method's own rules.
SELECTION_RULES = ("krum", "multi-krum")
#: Rules against the server's own root-set update: ``fltrust`` (Cao et al.) weighs each kept reply's records by its
#: trust and rescales its model update onto the server update's norm; ``fltrust-gate`` keeps FLTrust's gate only
#: (a reply of trust 0 is rejected; the others keep the method's weights, their norms bounded by the norm clip).
TRUST_RULES = ("fltrust", "fltrust-gate")
AGGREGATORS = ("mean", *RECORD_RULES, *SELECTION_RULES, *TRUST_RULES)
#: Bucket size of ``bucketing`` (Karimireddy et al. use s = 2 for a Byzantine fraction up to 1/4).
BUCKET_SIZE = 2
#: Iterations of centered clipping (Karimireddy, He, Jaggi: one or a few suffice when the centre is the momentum).
CLIP_ITERATIONS = 3


class TooFewReplies(ValueError):
    """A round has fewer replies than the aggregator needs to tolerate its Byzantine fraction."""


def byzantine_count(fraction: float, n: int) -> int:
    """``⌈f·n⌉``: the replies of ``n`` a tolerated fraction ``f`` may be Byzantine (a product that is a whole number up
    to rounding, e.g. 0.2·5, counts as that number)."""
    if not 0.0 <= fraction < 0.5:
        raise ValueError(f"byzantine-fraction must be in [0, 0.5), got {fraction}")
    return max(0, math.ceil(fraction * n - 1e-9))


def min_replies(aggregator: str, t: int) -> int:
    """The fewest replies ``aggregator`` needs when ``t`` of them may be Byzantine: trimmed mean 2t+1 (one value left
    per coordinate), Krum / multi-Krum 2t+1 (the honest replies outnumber the others; each score sums the
    ``max(1, n−t−2)`` nearest distances, as Flower's ``Krum`` — Blanchard et al.'s bound n ≥ 2t+3 refused every round
    of 6 nodes at the default fraction), mean and median 1."""
    return {"trimmed-mean": 2 * t + 1, "krum": 2 * t + 1, "multi-krum": 2 * t + 1}.get(aggregator, 1)


def check_replies(aggregator: str, t: int, n: int, fraction: float) -> None:
    """Raise :class:`TooFewReplies` (naming the fix) when ``n`` replies are too few for ``aggregator`` to tolerate
    ``t`` Byzantine ones (``fraction``: the setting ``t`` comes from, for the message)."""
    need = min_replies(aggregator, t)
    if n < need:
        raise TooFewReplies(
            f"aggregator {aggregator} needs at least {need} usable replies to tolerate {t} Byzantine "
            f"(byzantine-fraction {fraction:g}), got {n}; sample more nodes (min-train-nodes), lower "
            f"byzantine-fraction, or use aggregator = median")


# ------------------------------------------------------------------------------------------ norm clip
def lower_median(values: Sequence[float]) -> float:
    """The lower median (an actual reply's value, never a mean of two): the reference of the round's norm bounds.

    ``np.quantile(values, 0.5, method="lower")``, i.e. the ``⌊(n−1)/2⌋``-th smallest value, taken from ``sorted``
    (a round has a few to a few hundred values: NumPy's call costs tens of µs); NumPy itself where it is not a plain
    order statistic (no values, or a NaN, which NumPy propagates)."""
    try:
        floats = [float(v) for v in values]
    except TypeError:  # not a flat sequence of numbers: NumPy's answer (or its error)
        floats = []
    if not floats or any(v != v for v in floats):
        return float(np.quantile(values, 0.5, method="lower"))
    return sorted(floats)[(len(floats) - 1) // 2]


def clip_scales(norms: Sequence[float], ratio: float) -> tuple[list[float], float]:
    """``(scale of each reply, bound)``: bound = ``ratio`` × the lower median of ``norms``; a reply above it gets
    ``bound / norm`` (< 1), every other reply exactly 1.0."""
    bound = ratio * lower_median(norms)
    return [bound / n if n > bound else 1.0 for n in norms], bound


def clipped(arrays: Mapping[str, np.ndarray], scale: float, reference: Mapping[str, np.ndarray] | None) -> NamedArrays:
    """``reference + scale·(arrays − reference)`` for the floating arrays (``reference=None``: ``scale·arrays``), in
    each array's dtype; integer arrays as they are (they are neither measured nor clipped)."""
    out: NamedArrays = {}
    for key, a in arrays.items():
        arr = np.asarray(a)
        if not is_float(arr):
            out[key] = arr
        elif reference is None:
            out[key] = (arr * scale).astype(arr.dtype, copy=False)
        else:
            ref = np.asarray(reference[key])
            out[key] = (ref + (arr - ref) * scale).astype(arr.dtype, copy=False)
    return out


# ------------------------------------------------------------------------------------------ direction screen
#: :func:`centre_cosines` keeps a key's updates (float64) between its two passes when they take at most this many
#: bytes; a larger key computes them again in the second pass (the same values either way).
CENTRE_DIFF_BYTES = 1 << 26


def centre_cosines(items: Sequence[Mapping[str, np.ndarray]], reference: Mapping[str, np.ndarray],
                   norms: Sequence[float]) -> list[float]:
    """Each item's cosine with the round's robust centre: the unweighted mean of the updates ``item − reference``,
    each first scaled down onto the lower median of ``norms`` (the items' update norms, as measured by the screen).
    One item moves the centre by at most 1/N of an honest norm, however it is scaled.  An item or a centre of norm 0
    has cosine 0.  Floating keys of ``reference`` only; float64; memory beyond the items: O(model), plus a key's
    updates of all items while they fit in :data:`CENTRE_DIFF_BYTES` (else they are computed once per pass)."""
    scales, _ = clip_scales(norms, 1.0)
    dots = [0.0] * len(items)
    centre_sq = 0.0
    for key, value in reference.items():
        ref = np.asarray(value, np.float64)
        if not is_float(np.asarray(value)):
            continue

        def update(item: Mapping[str, np.ndarray], key: str = key, ref: np.ndarray = ref) -> np.ndarray:
            return np.asarray(item[key], np.float64) - ref

        kept = [update(item) for item in items] if len(items) * ref.nbytes <= CENTRE_DIFF_BYTES else None
        centre = np.zeros_like(ref)
        for j, (scale, item) in enumerate(zip(scales, items, strict=True)):
            centre += scale * (update(item) if kept is None else kept[j])
        centre_sq += float(np.vdot(centre, centre))
        for j, item in enumerate(items):
            dots[j] += float(np.vdot(update(item) if kept is None else kept[j], centre))
    size = math.sqrt(centre_sq)
    return [d / (n * size) if n > 0 and size > 0 else 0.0 for d, n in zip(dots, norms, strict=True)]


# ------------------------------------------------------------------------------------------ coordinate-wise rules
def robust_aggregate(items: Sequence[Mapping[str, np.ndarray]], rule: str, t: int = 0) -> NamedArrays:
    """Coordinate-wise median, or trimmed mean dropping the ``t`` smallest and largest values per coordinate (weights
    are ignored).  Memory: O(N·model) in float64, one key at a time."""
    if rule not in COORDINATE_RULES:
        raise ValueError(f"unknown robust rule {rule!r}; valid: {', '.join(COORDINATE_RULES)}")
    n = len(items)
    if not n:
        raise ValueError("no arrays were folded into the aggregate")
    if rule == "trimmed-mean" and n < 2 * t + 1:
        raise TooFewReplies(f"trimmed-mean of {n} values cannot drop {t} at each end")
    out: NamedArrays = {}
    for key, first in items[0].items():
        stack = np.stack([np.asarray(item[key], dtype=np.float64) for item in items])
        value = np.median(stack, axis=0) if rule == "median" else np.sort(stack, axis=0)[t:n - t].mean(axis=0)
        out[key] = value.astype(np.asarray(first).dtype, copy=False)
    return out


# ------------------------------------------------------------------------------------------ Krum
def krum_scores(vectors: np.ndarray, t: int) -> list[float]:
    """Krum score of each reply: the sum of its squared distances to its ``max(1, n − t − 2)`` nearest other replies
    (``t`` of the ``n`` may be Byzantine; Flower's ``Krum`` counts its neighbours the same way).  ``vectors``: one
    row per reply (its floating arrays flattened, float64).  O(n²·d) time, O(n·d) memory."""
    n = len(vectors)
    if n < min_replies("krum", t):
        raise TooFewReplies(f"Krum needs at least {min_replies('krum', t)} replies to tolerate {t} Byzantine, got {n}")
    near = max(1, n - t - 2)
    scores = []
    for i in range(n):
        dist = np.square(vectors - vectors[i]).sum(axis=1)
        scores.append(float(np.sort(np.delete(dist, i))[:near].sum()))
    return scores


def krum_select(vectors: np.ndarray, t: int, multi: bool) -> tuple[list[int], list[float]]:
    """``(selected indices in reply order, scores)``: Krum keeps the best-scored reply, multi-Krum the ``n − t``
    best (ties: the earlier reply)."""
    scores = krum_scores(vectors, t)
    m = len(vectors) - t if multi else 1
    best = sorted(range(len(scores)), key=lambda i: (scores[i], i))[:m]
    return sorted(best), scores


# ------------------------------------------------------------------------------------------ vectors of named arrays
def _float_keys(reference: Mapping[str, np.ndarray]) -> list[str]:
    return [k for k, v in reference.items() if is_float(np.asarray(v))]


def flat_updates(items: Sequence[Mapping[str, np.ndarray]], reference: Mapping[str, np.ndarray] | None,
                 keys: Sequence[str]) -> np.ndarray:
    """One float64 row per item: its arrays of ``keys`` flattened, less ``reference`` (``None``: around zero)."""
    def row(item: Mapping[str, np.ndarray]) -> np.ndarray:
        parts = [np.asarray(item[k], np.float64).reshape(-1) for k in keys]
        if reference is not None:
            parts = [p - np.asarray(reference[k], np.float64).reshape(-1) for p, k in zip(parts, keys, strict=True)]
        return np.concatenate(parts) if parts else np.zeros(0)
    return np.stack([row(item) for item in items])


def unflatten(vector: np.ndarray, like: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray] | None
              ) -> NamedArrays:
    """The named arrays of ``like``'s layout holding ``reference + vector`` (floating keys, in their dtypes); the
    integer arrays of ``like`` as they are."""
    out: NamedArrays = {}
    at = 0
    for key, value in like.items():
        arr = np.asarray(value)
        if not is_float(arr):
            out[key] = arr
            continue
        part = vector[at:at + arr.size].reshape(arr.shape)
        at += arr.size
        base = 0.0 if reference is None else np.asarray(reference[key], np.float64)
        out[key] = (base + part).astype(arr.dtype, copy=False)
    return out


# ------------------------------------------------------------------------------------------ FLTrust
def fltrust_scores(updates: np.ndarray, root: np.ndarray) -> tuple[list[float], list[float]]:
    """``(trust, scale)`` of each row of ``updates`` (FLTrust, Cao et al., NDSS 2021): trust = ReLU(cos(Δ_i, Δ_0)),
    ``root`` = Δ_0 the server's own update on its root set; scale = ‖Δ_0‖ / ‖Δ_i‖ (each update is rescaled to the
    server update's norm).  A zero update, or a zero Δ_0, has trust 0 (and scale 1)."""
    root_norm = float(np.linalg.norm(root))
    trust, scales = [], []
    for row in updates:
        n = float(np.linalg.norm(row))
        if n == 0 or root_norm == 0:
            trust.append(0.0)
            scales.append(1.0)
            continue
        trust.append(max(0.0, float(np.dot(row, root)) / (n * root_norm)))
        scales.append(root_norm / n)
    return trust, scales


def fltrust_aggregate(updates: np.ndarray, root: np.ndarray) -> np.ndarray:
    """FLTrust's aggregate update ``Σ trust_i·scale_i·Δ_i / Σ trust_i`` (zero when every trust is 0)."""
    trust, scales = fltrust_scores(updates, root)
    total = sum(trust)
    if total == 0:
        return np.zeros_like(root, dtype=np.float64)
    return sum(t * s * row for t, s, row in zip(trust, scales, updates, strict=True)) / total


# ------------------------------------------------------------------------------------ centered clipping, bucketing
def centered_clip(updates: np.ndarray, centre: np.ndarray, tau: float, iterations: int = CLIP_ITERATIONS
                  ) -> np.ndarray:
    """Centered clipping (Karimireddy, He, Jaggi, ICML 2021): from ``v = centre`` (the momentum: last round's
    aggregate), ``iterations`` times ``v ← v + mean_i (Δ_i − v)·min(1, τ/‖Δ_i − v‖)``.  One reply moves ``v`` by at
    most τ/N per iteration, however large it is."""
    v = np.asarray(centre, np.float64).copy()
    for _ in range(iterations):
        diff = updates - v
        norms = np.linalg.norm(diff, axis=1)
        factor = np.minimum(1.0, tau / np.maximum(norms, 1e-300)) if tau > 0 else np.zeros_like(norms)
        v = v + (diff * factor[:, None]).mean(axis=0)
    return v


def bucket_means(updates: np.ndarray, size: int, seed: int) -> np.ndarray:
    """Bucketing (Karimireddy et al., ICLR 2022): the rows in a random order (``seed``), cut into ⌈N/size⌉ buckets
    of ``size`` consecutive rows (the last may hold fewer), one mean per bucket."""
    order = np.random.default_rng(seed).permutation(len(updates))
    return np.stack([updates[order[i:i + size]].mean(axis=0) for i in range(0, len(updates), size)])


def record_aggregate(items: Sequence[Mapping[str, np.ndarray]], rule: str, reference: Mapping[str, np.ndarray] | None,
                     centre: Mapping[str, np.ndarray] | None, seed: int = 0) -> NamedArrays:
    """A :data:`VECTOR_RULES` aggregate of one record: ``centered-clip`` clips the updates (``item − reference``;
    ``reference=None``: around zero) around ``centre`` (an update; ``None``: zero) at τ = the lower-median distance of
    the updates from the centre; ``bucketing`` does the same on :func:`bucket_means` of :data:`BUCKET_SIZE`.
    Weights are ignored.  Memory: O(N·record) float64."""
    if rule not in VECTOR_RULES:
        raise ValueError(f"unknown vector rule {rule!r}; valid: {', '.join(VECTOR_RULES)}")
    if not items:
        raise ValueError("no arrays were folded into the aggregate")
    like = items[0]
    keys = _float_keys(like)
    updates = flat_updates(items, reference, keys)
    start = np.zeros(updates.shape[1]) if centre is None else flat_updates([centre], None, keys)[0]
    if rule == "bucketing":
        updates = bucket_means(updates, BUCKET_SIZE, seed)
    tau = lower_median(list(np.linalg.norm(updates - start, axis=1)))
    return unflatten(centered_clip(updates, start, tau), like, reference)
