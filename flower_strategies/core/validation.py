"""Reply validation and update-norm screening as free functions (no strategy state).

A train reply is usable when it carries no error, a ``metrics`` MetricRecord with a whole ``num-examples`` ≥ 1
(and, when present, a whole ``num-steps`` ≥ 1), and every declared uplink record with exactly the expected keys,
shapes and dtypes, payloads that agree with their own metadata, and only finite values.  :func:`parse_reply`
returns the :class:`~.rejections.Rejection` saying why it is not, or the records as zero-copy NumPy views of the
payloads.  The checks here that see no message return rejections of no node (``node=None``); the screen names it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.common.constant import ErrorCode

from . import records as R
from .ops import NamedArrays, all_finite, update_norms
from .rejections import Kind, Rejection, client_error_text

#: ``{key: (shape, dtype)}`` a record must match exactly.
Layout = dict[str, tuple[tuple[int, ...], np.dtype]]


@dataclass(frozen=True)
class RecordSpec:
    """An uplink record a method expects in every train reply.

    ``rule``: ``"mean"`` (weighted per the strategy's ``weighting``), ``"wmean"``, ``"umean"``, ``"max"``, ``"sum"``.
    ``keys``: ``"model"`` = same keys/shapes/dtypes as the global arrays; ``"params"`` = only the trainable
    floating-point keys.

    The record's structural invariants, which no honest client can break (the screen rejects a reply that breaks
    one under every defence, :func:`invariant_reason`): ``floor`` — every value ≥ it (``0.0``: a second moment, v̂;
    ``1.0``: a count); ``at_least`` — the name of the round's downlink record whose values it may not fall below
    (a running max, e.g. AMSGrad's v̂ = max(v̂ received, v)).
    """

    name: str
    rule: str = "mean"
    keys: str = "model"
    floor: float | None = None
    at_least: str | None = None


def layout(arrays: Mapping[str, np.ndarray], keys: Sequence[str] | None = None) -> Layout:
    """The ``(shape, dtype)`` of ``keys`` (default: all) of ``arrays``."""
    names = keys if keys is not None else arrays
    return {k: (tuple(np.shape(arrays[k])), np.asarray(arrays[k]).dtype) for k in names}


def _number(value: object) -> float | None:
    """``value`` as a float when it is a finite int/float (not a bool), else ``None``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        return None
    return number if math.isfinite(number) else None


def check_num_examples(value: object) -> Rejection | None:
    """Why ``num-examples`` is unusable: it must be a finite whole number ≥ 1 (a count of examples)."""
    number = _number(value)
    if number is None or number < 1 or not number.is_integer():
        return Rejection(None, Kind.METRICS, f"metric '{R.NUM_EXAMPLES}' missing or not a positive whole number: "
                                             f"{value!r}")
    return None


def check_num_steps(value: object) -> Rejection | None:
    """Why ``num-steps`` is unusable: absent is allowed (it then counts as 0 in K̄, as before), present it must be
    a finite whole number ≥ 1 (a client that trained took at least one step)."""
    if value is None:
        return None
    number = _number(value)
    if number is None or number < 1 or not number.is_integer():
        return Rejection(None, Kind.METRICS, f"metric '{R.NUM_STEPS}' not a whole number >= 1: {value!r}")
    return None


def parse_reply(msg: Message, expected: Mapping[str, Layout]) -> tuple[Rejection | None, dict[str, NamedArrays]]:
    """``(rejection, {})`` for a structurally unusable reply, else ``(None, {record: arrays})`` for the ``expected``
    records (zero-copy read-only views).  Each Array's payload is checked against its own metadata and the expected
    layout before it is viewed (:func:`.records.checked_view`: header only, no pass over the data).  The values are
    checked later, from the update norms the strategy computes anyway (a finite norm proves every value finite, see
    :func:`nonfinite_reason`).  Nothing a client sends makes this raise."""
    node = msg.metadata.src_node_id
    try:
        reason, parsed = _parse_reply(msg, expected)
    except Exception as err:  # noqa: BLE001  # a last line: a reply the checks below did not foresee is rejected
        reason, parsed = Rejection(None, Kind.UNREADABLE, f"unreadable reply ({type(err).__name__}: {err})"), {}
    return (None if reason is None else reason.at(node)), parsed


def _parse_reply(msg: Message, expected: Mapping[str, Layout]) -> tuple[Rejection | None, dict[str, NamedArrays]]:
    if msg.has_error():
        kind = Kind.MOD_REFUSED if msg.error.code == ErrorCode.MOD_FAILED_PRECONDITION else Kind.CLIENT_ERROR
        return Rejection(None, kind, f"client error: {client_error_text(msg.error.reason)}"), {}
    content = msg.content
    metrics = R.get(content, R.METRICS, MetricRecord)
    if metrics is None:
        return Rejection(None, Kind.METRICS, f"missing MetricRecord '{R.METRICS}'"), {}
    reason = check_num_examples(metrics.get(R.NUM_EXAMPLES)) or check_num_steps(metrics.get(R.NUM_STEPS))
    if reason:
        return reason, {}
    parsed: dict[str, NamedArrays] = {}
    for name, want in expected.items():
        rec = R.get(content, name, ArrayRecord)
        if rec is None:
            return Rejection(None, Kind.MISSING_RECORD, f"missing ArrayRecord '{name}'"), {}
        items = dict(rec.items())  # one copy in C: the lookups below skip the record's checked __getitem__
        if items.keys() != want.keys():
            missing = sorted(set(want) - set(items))[:3]
            extra = sorted(map(str, set(items) - set(want)))[:3]
            return Rejection(None, Kind.BAD_RECORD,
                             f"record '{name}' has wrong keys (missing {missing}, unexpected {extra})"), {}
        arrays: NamedArrays = {}
        for key, (shape, dtype) in want.items():
            arr = items[key]
            got = R.checked_view(arr, shape, dtype) if isinstance(arr, Array) else f"is a {type(arr).__name__}"
            if isinstance(got, str):
                return Rejection(None, Kind.BAD_RECORD, f"record '{name}' key '{key}' {got}"), {}
            arrays[key] = got  # zero-copy, read-only: validation and aggregation only read it
        parsed[name] = arrays
    return None, parsed


def update_norm(arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray] | None) -> float:
    """L2 norm over the floating arrays of ``arrays − reference`` (``reference=None``: of ``arrays`` itself), in each
    array's dtype (:func:`.ops.update_norms`).  Non-finite exactly when some value is NaN/Inf
    or the sum of squares overflows (screening, not math: that is a rejection, as it should be)."""
    return update_norms([arrays], reference)[0]


def nonfinite_reason(parsed: Mapping[str, NamedArrays], norms: Sequence[float],
                     names: Sequence[str]) -> Rejection | None:
    """The NaN/Inf rejection of :func:`parse_reply`, decided from the records' update norms: a finite norm proves
    every value of its record finite; only a non-finite one (NaN/Inf, or a sum of squares that overflowed) is
    re-checked value by value."""
    for name, norm in zip(names, norms, strict=True):
        if not np.isfinite(norm):
            bad = all_finite(parsed[name])
            if bad is not None:
                return Rejection(None, Kind.NONFINITE, f"record '{name}' key '{bad}' holds NaN/Inf")
    return None


def invariant_reason(parsed: Mapping[str, NamedArrays], specs: Sequence[RecordSpec],
                     sent: Mapping[str, NamedArrays]) -> Rejection | None:
    """The :attr:`Kind.INVARIANT` rejection of a reply whose record breaks its spec's ``floor`` or ``at_least``
    (``sent``: the round's downlink records, by name), else ``None``.  Values compared in the record's dtype."""
    for spec in specs:
        record = parsed.get(spec.name)
        if record is None:
            continue
        for key, value in record.items():
            arr = np.asarray(value)
            if spec.floor is not None and arr.size and not (arr >= spec.floor).all():
                return Rejection(None, Kind.INVARIANT, f"record '{spec.name}' key '{key}' has values below "
                                 f"{spec.floor:g} (min {float(arr.min()):.4g}), which no honest client sends")
            below = None if spec.at_least is None else sent.get(spec.at_least, {}).get(key)
            if below is not None and arr.size and not (arr >= np.asarray(below, arr.dtype)).all():
                return Rejection(None, Kind.INVARIANT, f"record '{spec.name}' key '{key}' falls below the "
                                 f"'{spec.at_least}' the server sent (a running max no honest client lowers)")
    return None


def check_update_norms(
    parsed: Mapping[str, NamedArrays], specs: Sequence[RecordSpec], current: Mapping[str, np.ndarray], bound: float,
    norms: Sequence[float] | None = None,
) -> Rejection | None:
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
            return Rejection(None, Kind.MAX_NORM, f"record '{spec.name}' {what} {norm:.4g} exceeds max-update-norm "
                                                  f"{bound:g}")
    return None
