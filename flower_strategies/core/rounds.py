"""The round commit: round accounting (:class:`RoundLog`, history, update counter), the finite check before a new
model and server state are committed, and the means of the replies' metrics (outliers left out).

:class:`RoundBook` holds everything here that lives across rounds; it knows nothing of sampling, Flower messages or
the method's math.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, cast

import numpy as np
from flwr.common import log

from . import records as R
from .ops import NamedArrays, all_finite
from .rejections import Rejection
from .robust import lower_median

#: A reply metric above this multiple of max(1, the round's lower-median magnitude) is left out of its mean.
METRIC_OUTLIER_RATIO = 1e3

#: Reply metrics that are identifiers or weights, not quantities to average.
NOT_AVERAGED = frozenset({R.NUM_EXAMPLES, "partition-id", "num-partitions", "node-id"})

FIRST_BATCH_LOSS = R.FIRST_BATCH_LOSS
#: :func:`loss_alarm`: a round's mean train loss above this multiple of the loss the clients started from.
LOSS_RISE_RATIO = 1.5
#: :func:`loss_alarm`: a round's mean train loss above this multiple of the lowest mean of an earlier round.
LOSS_GROWTH_RATIO = 10.0

#: :func:`stall_alarm`: how many rounds in a row the mean train loss must stay flat.
STALL_ROUNDS = 4
#: :func:`stall_alarm`: "flat": those rounds' mean train losses within this fraction of round 1's loss of each other.
STALL_TOLERANCE = 0.002
#: :func:`stall_alarm`: "at round 1's level": less than this fraction below round 1's mean train loss.
STALL_DROP = 0.05

#: Server state: named arrays (``{key: ndarray}``) or JSON-able scalars/lists, by name.
ServerState = dict[str, Any]


@dataclass
class RoundLog:
    """What happened in one training round (read by the ServerApp's metrics writer)."""

    server_round: int
    sampled: int = 0
    replies_used: int = 0
    replies_rejected: int = 0
    rejections: list[Rejection] = field(default_factory=list)
    bytes_down: int = 0
    bytes_up: int = 0
    updated: bool = False
    seconds: float = 0.0
    train_metrics: dict[str, float] = field(default_factory=dict)
    #: The method's own per-round values returned by ``server_update`` (e.g. decayed learning rates).
    round_metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundInputs:
    """Everything :meth:`FedAdaptStrategy.server_update` may use (explicit; no attributes set elsewhere)."""

    server_round: int
    current: NamedArrays
    #: The round's aggregated uplink records: fresh buffers owned by this round, which ``server_update`` may reuse
    #: (e.g. :func:`.ops.pseudo_gradient` writes ``D̄`` into the mean model's arrays).
    aggregates: Mapping[str, NamedArrays]
    #: Metrics of each valid reply (``num-examples``, ``num-steps``, ``train-loss-before``, …, ``node-id``).
    reply_metrics: tuple[Mapping[str, Any], ...]
    #: K̄: mean of the replies' ``num-steps`` with the strategy's weighting.
    mean_steps: float
    #: Trainable floating-point keys of ``current`` (what server optimizers act on).
    trainable: tuple[str, ...]
    #: Number of server updates before this one (server optimizer step counter).
    num_updates: int
    #: Most nodes ever seen available when sampling (SCAFFOLD's N).
    nodes_seen: int


#: What :meth:`FedAdaptStrategy.server_update` returns: ``(new global arrays, new server state, round metrics)``.
ServerUpdate = tuple[NamedArrays, ServerState, dict[str, float]]


def weighted_mean(values: Sequence[tuple[float, float]], weighting: str) -> float:
    """Mean of ``(value, num_examples)`` pairs, example-weighted or uniform; NaN when empty."""
    if not values:
        return float("nan")
    if weighting == "uniform":
        return float(sum(v for v, _ in values) / len(values))
    total = sum(n for _, n in values)
    return float(sum(v * n for v, n in values) / total)


def _finite(value: object) -> bool:
    """Whether ``value`` is a finite int/float (not a bool)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float range
        return False


def robust_mean(values: Sequence[tuple[Any, float]], weighting: str = "examples") -> float | None:
    """Mean of ``(value, num_examples)`` pairs, example-weighted or uniform, with what one reply could poison it
    with left out: non-numbers and NaN/Inf, and with 3 or more values any value above ``METRIC_OUTLIER_RATIO`` ×
    max(1, the lower median of the values' magnitudes); ``None`` when nothing is left.  With nothing left out it
    equals :func:`weighted_mean` bit for bit."""
    pairs = [(float(v), float(n)) for v, n in values if _finite(v)]
    if len(pairs) >= 3:
        scale = max(1.0, lower_median([abs(v) for v, _ in pairs]))
        pairs = [(v, n) for v, n in pairs if abs(v) <= METRIC_OUTLIER_RATIO * scale]
    if not pairs:
        return None
    if weighting == "uniform":
        return float(sum(v for v, _ in pairs) / len(pairs))
    total = sum(n for _, n in pairs)
    return float(sum(v * n for v, n in pairs) / total) if total > 0 else None


def mean_reply_metrics(reply_metrics: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Example-weighted means of the replies' numeric metrics, plus the total ``num-examples``.

    One reply cannot poison a metric (:func:`robust_mean`): NaN/Inf values are left out, and with 3 or more values
    so is any value above ``METRIC_OUTLIER_RATIO`` × max(1, the lower median of the values' magnitudes) (e.g. a
    train-loss of 1e300).  A reply without a finite positive ``num-examples`` is left out altogether."""
    usable = [m for m in reply_metrics if _finite(m.get(R.NUM_EXAMPLES)) and float(m[R.NUM_EXAMPLES]) > 0]
    values: dict[str, list[tuple[float, float]]] = {}
    for m in usable:
        n = float(m[R.NUM_EXAMPLES])
        for key, value in m.items():
            if key not in NOT_AVERAGED and _finite(value):
                values.setdefault(key, []).append((float(value), n))
    out: dict[str, float] = {}
    for key, pairs in values.items():
        mean = robust_mean(pairs)
        if mean is not None:
            out[key] = mean
    out[R.NUM_EXAMPLES] = float(sum(float(m[R.NUM_EXAMPLES]) for m in usable))
    return out


def loss_alarm(reply_metrics: Sequence[Mapping[str, Any]], round_mean: Mapping[str, Any],
               lowest: float | None) -> str | None:
    """Why the clients' training looks divergent this round, or ``None`` (the rule, docs/plugin.md):

    * a valid reply reports a non-finite ``train-loss``;
    * in the run's first round with train losses, the mean ``train-loss`` exceeds :data:`LOSS_RISE_RATIO` × the mean
      loss the clients started from (``train-loss-before``, else ``train-loss-first-batch``): local training made the
      initial model worse.  Only there: later, a well-trained model's starting loss is small and noisy, and some
      local optimizers (e.g. Fed-LAMB's) raise it within a round and still converge;
    * the round's mean ``train-loss`` exceeds :data:`LOSS_GROWTH_RATIO` × ``lowest``, the lowest mean
      ``train-loss`` of an earlier round (:meth:`RoundBook.lowest_train_loss`; ``None``: no earlier round has one).

    ``round_mean``: the round's metric means (:func:`mean_reply_metrics`: non-finite values and outliers left out)."""
    bad = [m for m in reply_metrics if R.TRAIN_LOSS in m and not _finite(m[R.TRAIN_LOSS])]
    if bad:
        return f"{len(bad)} of {len(reply_metrics)} clients reported a non-finite train loss"
    if not _finite(round_mean.get(R.TRAIN_LOSS)):
        return None
    mean = float(round_mean[R.TRAIN_LOSS])
    if lowest is None:
        for key in (R.TRAIN_LOSS_BEFORE, FIRST_BATCH_LOSS):
            start = float(round_mean[key]) if _finite(round_mean.get(key)) else 0.0
            if start > 0 and mean > LOSS_RISE_RATIO * start:
                return (f"the clients' mean train loss {mean:.4g} is {mean / start:.3g} × the loss they started "
                        f"from ({key} {start:.4g}): local training made the initial model worse")
    elif mean > LOSS_GROWTH_RATIO * lowest:
        return (f"the clients' mean train loss {mean:.4g} is {mean / lowest:.3g} × the lowest of the earlier "
                f"rounds ({lowest:.4g})")
    return None


def stall_alarm(history: Sequence[RoundLog]) -> str | None:
    """Why the run looks stalled, or ``None`` (the rule, docs/plugin.md): the last :data:`STALL_ROUNDS` rounds after
    round 1 all have a finite mean ``train-loss``, lie within :data:`STALL_TOLERANCE` × round 1's of each other
    (flat) and less than :data:`STALL_DROP` below round 1's (at its level).  A learning rate far too low does this,
    and so does one that collapsed the model to predicting one class (its loss drops a little in round 2, then stays
    at the class prior's entropy); stock FedAvg on the quickstart shape, slow as it is there, moves more, and so do
    slow starts that go on to learn (SCAFFOLD's loss sits flat for 3 rounds: hence 4).  Checked on the 470 method
    runs and 212 stock runs of docs/results/plugin-factors.md: it warned 19 method runs, none of which ended within
    0.05 of stock FedAvg, and no stock run."""
    if len(history) < STALL_ROUNDS + 1:
        return None
    losses = [h.train_metrics.get(R.TRAIN_LOSS) for h in (history[0], *history[-STALL_ROUNDS:])]
    if not all(_finite(v) and float(cast(float, v)) > 0 for v in losses):
        return None
    first, later = float(cast(float, losses[0])), [float(cast(float, v)) for v in losses[1:]]
    if max(later) - min(later) > STALL_TOLERANCE * first or min(later) < (1.0 - STALL_DROP) * first:
        return None
    return (f"the clients' mean train loss has stayed at round 1's level ({first:.4g}) for the last {STALL_ROUNDS} "
            f"rounds ({', '.join(f'{v:.4g}' for v in later)}: within {STALL_TOLERANCE:.1%} of it of each other)")


def nonfinite_state(state: Mapping[str, Any]) -> str | None:
    """The first name (``record/key`` for arrays) of ``state`` holding NaN/Inf, or ``None``."""
    for name, value in state.items():
        if isinstance(value, Mapping):
            bad = all_finite(value)
            if bad is not None:
                return f"{name}/{bad}"
        elif isinstance(value, float) and not np.isfinite(value):
            return name
    return None


class RoundBook:
    """Round accounting across a run: the open round's :class:`RoundLog`, the history and the update counter.

    ``open`` (when the round's train messages are built) → ``take`` (when its replies arrive) → ``commit`` (finite
    check of the server update) → ``close`` (the log joins :attr:`history`)."""

    def __init__(self) -> None:
        self.history: list[RoundLog] = []
        #: Server updates committed so far (the server optimizer's step counter).
        self.num_updates = 0
        self._open: RoundLog | None = None
        self._t0 = 0.0
        #: (rounds of :attr:`history` read, the lowest mean train loss among them) for :meth:`lowest_train_loss`.
        self._lowest: tuple[int, float | None] = (0, None)

    def open(self, server_round: int, sampled: int = 0, bytes_down: int = 0) -> RoundLog:
        """Start the clock of ``server_round`` and its log."""
        self._t0 = time.monotonic()
        self._open = RoundLog(server_round, sampled=sampled, bytes_down=bytes_down)
        return self._open

    def take(self, server_round: int) -> RoundLog:
        """The open round's log (a fresh one when no round was opened, e.g. replies without a configure step)."""
        rlog = self._open or RoundLog(server_round)
        self._open = None
        return rlog

    def commit(self, server_round: int, new: NamedArrays, state: Mapping[str, Any]) -> bool:
        """Whether the server update's ``new`` arrays and ``state`` are all finite (then it counts as an update);
        a corrupted model is never published nor a corrupted state kept."""
        bad = all_finite(new) or nonfinite_state(state)
        if bad is not None:
            log(WARNING, "Round %d: server update produced NaN/Inf in '%s'; keeping the previous model and state",
                server_round, bad)
            return False
        self.num_updates += 1
        return True

    def lowest_train_loss(self) -> float | None:
        """The lowest positive finite mean ``train-loss`` of the rounds in :attr:`history` (``None``: none has one),
        reading each round once over a run (a run of 10,000 rounds would otherwise walk its history every round)."""
        read, low = self._lowest if self._lowest[0] <= len(self.history) else (0, None)
        for h in self.history[read:]:
            value = h.train_metrics.get(R.TRAIN_LOSS)
            if _finite(value) and 0 < float(cast(float, value)) < (math.inf if low is None else low):
                low = float(cast(float, value))
        self._lowest = (len(self.history), low)
        return low

    def close(self, rlog: RoundLog, train_metrics: dict[str, float]) -> None:
        rlog.train_metrics = train_metrics
        rlog.seconds = time.monotonic() - self._t0
        self.history.append(rlog)

    def state_dict(self) -> dict[str, Any]:
        history = [{**dataclasses.asdict(h), "rejections": [r.to_state() for r in h.rejections]} for h in self.history]
        return {"num_updates": self.num_updates, "history": history}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.num_updates = int(state["num_updates"])
        self.history = [RoundLog(**{**h, "rejections": [Rejection.from_state(r) for r in h.get("rejections", [])]})
                        for h in state["history"]]
        self._lowest = (0, None)
