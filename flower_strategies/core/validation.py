"""Reply validation and update-norm screening as free functions (no strategy state).

A train reply is usable when it carries no error, a ``metrics`` MetricRecord with a positive finite
``num-examples``, and every declared uplink record with exactly the expected keys, shapes and dtypes and only
finite values.  :func:`parse_reply` returns the reason it is not, or the records as NumPy arrays (each
deserialised once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord

from . import records as R
from .ops import NamedArrays, all_finite, fold

#: ``{key: (shape, dtype)}`` a record must match exactly.
Layout = dict[str, tuple[tuple[int, ...], np.dtype]]


@dataclass(frozen=True)
class RecordSpec:
    """An uplink record a method expects in every train reply.

    ``rule``: ``"mean"`` (weighted per the strategy's ``weighting``), ``"wmean"``, ``"umean"``, ``"max"``, ``"sum"``.
    ``keys``: ``"model"`` = same keys/shapes/dtypes as the global arrays; ``"params"`` = only the trainable
    floating-point keys.
    """

    name: str
    rule: str = "mean"
    keys: str = "model"


def layout(arrays: Mapping[str, np.ndarray], keys: Sequence[str] | None = None) -> Layout:
    """The ``(shape, dtype)`` of ``keys`` (default: all) of ``arrays``."""
    names = keys if keys is not None else arrays
    return {k: (tuple(np.shape(arrays[k])), np.asarray(arrays[k]).dtype) for k in names}


def check_num_examples(value: object) -> str | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not np.isfinite(value) or value <= 0:
        return f"metric '{R.NUM_EXAMPLES}' missing or not positive: {value!r}"
    return None


def parse_reply(msg: Message, expected: Mapping[str, Layout]) -> tuple[str | None, dict[str, NamedArrays]]:
    """``(reason, {})`` for a structurally unusable reply, else ``(None, {record: arrays})`` for the ``expected``
    records (zero-copy read-only views).  The values are checked later, from the update norms the strategy computes
    anyway (a finite norm proves every value finite, see :func:`nonfinite_reason`)."""
    if msg.has_error():
        return f"client error: {msg.error.reason}", {}
    content = msg.content
    metrics = R.get(content, R.METRICS, MetricRecord)
    if metrics is None:
        return f"missing MetricRecord '{R.METRICS}'", {}
    reason = check_num_examples(metrics.get(R.NUM_EXAMPLES))
    if reason:
        return reason, {}
    parsed: dict[str, NamedArrays] = {}
    for name, want in expected.items():
        rec = R.get(content, name, ArrayRecord)
        if rec is None:
            return f"missing ArrayRecord '{name}'", {}
        if set(rec.keys()) != set(want):
            missing = sorted(set(want) - set(rec.keys()))[:3]
            extra = sorted(set(rec.keys()) - set(want))[:3]
            return f"record '{name}' has wrong keys (missing {missing}, unexpected {extra})", {}
        for key, (shape, dtype) in want.items():
            arr = rec[key]
            if tuple(arr.shape) != tuple(shape):
                return f"record '{name}' key '{key}' has shape {tuple(arr.shape)}, expected {tuple(shape)}", {}
            if np.dtype(arr.dtype) != dtype:
                return f"record '{name}' key '{key}' has dtype {arr.dtype}, expected {dtype}", {}
        parsed[name] = R.views(rec)  # zero-copy, read-only: validation and aggregation only read them
    return None, parsed


def update_norm(arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray] | None) -> float:
    """L2 norm over the floating arrays of ``arrays − reference`` (``reference=None``: of ``arrays`` itself), in each
    array's dtype, a cache-sized chunk at a time (:func:`.ops.fold`).  Non-finite exactly when some value is NaN/Inf
    or the sum of squares overflows (screening, not math: that is a rejection, as it should be)."""
    return fold([arrays], None, None, reference, norms=True)[1][0]


def nonfinite_reason(parsed: Mapping[str, NamedArrays], norms: Sequence[float], names: Sequence[str]) -> str | None:
    """The NaN/Inf rejection of :func:`parse_reply`, decided from the records' update norms: a finite norm proves
    every value of its record finite; only a non-finite one (NaN/Inf, or a sum of squares that overflowed) is
    re-checked value by value."""
    for name, norm in zip(names, norms):
        if not np.isfinite(norm):
            bad = all_finite(parsed[name])
            if bad is not None:
                return f"record '{name}' key '{bad}' holds NaN/Inf"
    return None


def check_update_norms(
    parsed: Mapping[str, NamedArrays], specs: Sequence[RecordSpec], current: Mapping[str, np.ndarray], bound: float,
    norms: Sequence[float] | None = None,
) -> str | None:
    """Reason to reject when a record's norm exceeds ``bound``: a ``keys="model"`` record (a local model) is
    measured as the update ``record − current``, any other record (momenta, gradients, …) by its own norm
    (``norms``: the same, already computed, one per spec)."""
    for i, spec in enumerate(specs):
        if spec.name not in parsed:
            continue
        reference = current if spec.keys == "model" else None
        norm = norms[i] if norms is not None else update_norm(parsed[spec.name], reference)
        if not np.isfinite(norm) or norm > bound:
            what = "update norm" if spec.keys == "model" else "norm"
            return f"record '{spec.name}' {what} {norm:.4g} exceeds max-update-norm {bound:g}"
    return None
