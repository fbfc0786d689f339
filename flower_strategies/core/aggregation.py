"""One entry point for every aggregation of a round's records: :func:`aggregate` (items, weights, rule).

Rules:

* ``wmean`` / ``umean`` / ``sum`` / ``max`` — the plain reply-by-reply fold (:func:`.ops.fold`);
* ``median`` / ``trimmed-mean`` — the coordinate-wise robust rules (:func:`.robust.robust_aggregate`; weights ignored,
  ``trim`` values dropped per side);
* ``centered-clip`` / ``bucketing`` — the whole-record robust rules (:func:`.robust.record_aggregate`; weights
  ignored; the updates ``item − reference`` clipped around ``centre``, buckets drawn from ``seed``);
* a :class:`Private` rule — native DP's clipped, noised sum or mean (``weights``: each reply's clip scale).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .ops import NamedArrays, fold, is_float
from .robust import COORDINATE_RULES, VECTOR_RULES, record_aggregate, robust_aggregate


@dataclass(frozen=True)
class Private:
    """Native DP's rule (:mod:`.privacy`): ``(Σ_i w_i·(a_i − reference) + N(0, sum_std²)) / denominator + reference``
    per floating coordinate, in float64, cast to each array's dtype; integer arrays take ``reference``'s value (its
    own without a reference).  ``reference=None``: around zero."""

    sum_std: float
    denominator: float
    rng: np.random.Generator
    reference: Mapping[str, np.ndarray] | None = None


def aggregate(items: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float] | None, rule: str | Private, *,
              trim: int = 0, reference: Mapping[str, np.ndarray] | None = None,
              centre: Mapping[str, np.ndarray] | None = None, seed: int = 0) -> NamedArrays:
    """The aggregate of ``items`` (named arrays with identical keys, one per reply) under ``rule``."""
    if isinstance(rule, Private):
        return _private(items, weights or [1.0] * len(items), rule)
    if rule in COORDINATE_RULES:
        return robust_aggregate(items, rule, trim)
    if rule in VECTOR_RULES:
        return record_aggregate(items, rule, reference, centre, seed)
    return fold(items, weights, rule)


def _private(items: Sequence[Mapping[str, np.ndarray]], scales: Sequence[float], rule: Private) -> NamedArrays:
    out: NamedArrays = {}
    for key, first in items[0].items():
        ref = None if rule.reference is None else np.asarray(rule.reference[key])
        if not is_float(first):
            out[key] = np.array(ref if ref is not None else first)
            continue
        acc = np.zeros(first.shape, np.float64)
        for item, scale in zip(items, scales, strict=True):
            acc += scale * (np.asarray(item[key], np.float64) - (0.0 if ref is None else ref))
        if rule.sum_std > 0:
            acc += rule.rng.normal(0.0, rule.sum_std, acc.shape)
        acc /= rule.denominator
        out[key] = (acc if ref is None else acc + ref).astype(first.dtype)
    return out
