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

    def add_replies(self, rejections: Sequence[Rejection], reply_metrics: Sequence[Mapping[str, Any]],
                    weights_clipped: int, updates_clipped: int) -> dict[str, Any]:
        """Note the round's rejections and the replies it uses (``reply_metrics``: one per kept reply); the round's
        MetricRecord entries so far (the replies' mean metrics and the counters)."""
        self.rejections += rejections
        self.replies_rejected += len(rejections)
        self.replies_used = len(reply_metrics)
        return {**mean_reply_metrics(reply_metrics), "replies-used": self.replies_used,
                "replies-rejected": self.replies_rejected, "weights-clipped": weights_clipped,
                "updates-clipped": updates_clipped}


@dataclass(frozen=True)
class RoundInputs:
    """Everything :meth:`FedAdaptStrategy.server_update` may use (explicit; no attributes set elsewhere)."""

    server_round: int
    current: NamedArrays
    #: The round's aggregated uplink records: fresh buffers owned by this round, which ``server_update`` may reuse
    #: (e.g. SCAFFOLD writes ``c + Σ Δc_i / N`` into the round's ``Σ Δc_i`` arrays, FedLADA's per-client offset
    #: divides the ``delta-per-step`` record's arrays in place).
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


def _finite_number(value: object) -> bool:
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
    pairs = [(float(v), float(n)) for v, n in values if _finite_number(v)]
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
    usable = [m for m in reply_metrics if _finite_number(m.get(R.NUM_EXAMPLES)) and float(m[R.NUM_EXAMPLES]) > 0]
    values: dict[str, list[tuple[float, float]]] = {}
    for m in usable:
        n = float(m[R.NUM_EXAMPLES])
        for key, value in m.items():
            if key not in NOT_AVERAGED and _finite_number(value):
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
    bad = [m for m in reply_metrics if R.TRAIN_LOSS in m and not _finite_number(m[R.TRAIN_LOSS])]
    if bad:
        return f"{len(bad)} of {len(reply_metrics)} clients reported a non-finite train loss"
    if not _finite_number(round_mean.get(R.TRAIN_LOSS)):
        return None
    mean = float(round_mean[R.TRAIN_LOSS])
    if lowest is None:
        for key in (R.TRAIN_LOSS_BEFORE, FIRST_BATCH_LOSS):
            start = float(round_mean[key]) if _finite_number(round_mean.get(key)) else 0.0
            if start > 0 and mean > LOSS_RISE_RATIO * start:
                return (f"the clients' mean train loss {mean:.4g} is {mean / start:.3g} × the loss they started "
                        f"from ({key} {start:.4g}): local training made the initial model worse")
    elif mean > LOSS_GROWTH_RATIO * lowest:
        return (f"the clients' mean train loss {mean:.4g} is {mean / lowest:.3g} × the lowest of the earlier "
                f"rounds ({lowest:.4g})")
    return None


def _lrs(client_lr: float, server_lr: Any, method: str) -> str:
    lrs = f"client lr {client_lr:g} (run-config client-lr, or your app's name for it)"
    if isinstance(server_lr, (int, float)):
        lrs += f", server lr {server_lr:g} ({method}.server-lr)"
    return lrs


def warn_divergence(server_round: int, why: str | None, nonfinite: Sequence[Rejection], client_lr: float,
                    server_lr: Any, method: str) -> None:
    """A warning naming the learning rates when the clients' training loss explodes (``why``: :func:`loss_alarm`)
    or replies were rejected for NaN/Inf values (``nonfinite``: the round's :attr:`.rejections.Kind.NONFINITE`
    rejections): a run that goes on would otherwise "complete" at chance.  ``server_lr``: the method's
    ``server_lr`` hyper-parameter, when it has one."""
    if why is None and nonfinite:
        why = f"{len(nonfinite)} replies were rejected for non-finite values ({nonfinite[0]})"
    if why is None:
        return
    log(WARNING, "Round %d: training is diverging: %s. The learning rate is likely too high: %s; try it ÷10 "
        "(docs/plugin.md: client-lr factors)", server_round, why, _lrs(client_lr, server_lr, method))


def warn_stall(server_round: int, why: str | None, client_lr: float, server_lr: Any, method: str) -> bool:
    """A warning naming the learning rates when the clients' train loss stays flat at round 1's level (``why``:
    :func:`stall_alarm`): a run that goes on would otherwise "complete" at its initial accuracy, or at one predicted
    class.  Whether it warned."""
    if why is None:
        return False
    log(WARNING, "Round %d: training is not progressing: %s. A learning rate far too low does this, and so does one "
        "so high that the model collapsed to one class: %s; try it ×3 and ÷3 (docs/plugin.md: client-lr factors)",
        server_round, why, _lrs(client_lr, server_lr, method))
    return True


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
    if not all(_finite_number(v) and float(cast(float, v)) > 0 for v in losses):
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

    ``open`` (when the round's train messages are built) → ``pop_open_log`` (when its replies arrive) → ``commit``
    (finite check of the server update) → ``close`` (the log joins :attr:`history`).  Whoever reads a round's
    outcome reads its :meth:`report`; an adapter around the strategy adds its own findings with :meth:`note`
    before the round closes, never by editing the history."""

    def __init__(self) -> None:
        self.history: list[RoundLog] = []
        #: Server updates committed so far (the server optimizer's step counter).
        self.num_updates = 0
        self._open: RoundLog | None = None
        self._notes: list[tuple[int, list[Rejection], int, dict[str, float]]] = []
        self._t0 = 0.0
        #: (rounds of :attr:`history` read, the lowest mean train loss among them) for :meth:`lowest_train_loss`.
        self._lowest: tuple[int, float | None] = (0, None)

    def open(self, server_round: int, sampled: int = 0, bytes_down: int = 0) -> RoundLog:
        """Start the clock of ``server_round`` and its log."""
        self._t0 = time.monotonic()
        self._open = RoundLog(server_round, sampled=sampled, bytes_down=bytes_down)
        return self._open

    def pop_open_log(self, server_round: int) -> RoundLog:
        """The open round's log (a fresh one when no round was opened, e.g. replies without a configure step)."""
        round_log = self._open or RoundLog(server_round)
        self._open = None
        return round_log

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
            if _finite_number(value) and 0 < float(cast(float, value)) < (math.inf if low is None else low):
                low = float(cast(float, value))
        self._lowest = (len(self.history), low)
        return low

    def note(self, server_round: int, *, rejections: Sequence[Rejection] = (), replies_rejected: int = 0,
             round_metrics: Mapping[str, float] | None = None) -> None:
        """An adapter's findings about ``server_round`` (e.g. SecAgg+: the decoded aggregate of ``replies_rejected``
        replies rejected, its counters), joined to the round's log when it closes."""
        self._notes.append((server_round, list(rejections), replies_rejected, dict(round_metrics or {})))

    def close(self, round_log: RoundLog, train_metrics: dict[str, float]) -> None:
        round_log.train_metrics = train_metrics
        round_log.seconds = time.monotonic() - self._t0
        for server_round, rejections, rejected, round_metrics in self._notes:
            if server_round == round_log.server_round:
                round_log.rejections += rejections
                round_log.replies_rejected += rejected
                round_log.round_metrics.update(round_metrics)
        self._notes.clear()
        self.history.append(round_log)

    def report(self, server_round: int) -> RoundLog | None:
        """The closed log of ``server_round`` (its report: replies, bytes, rejections, round metrics), or ``None``
        when that round has not closed (yet)."""
        last = self.history[-1] if self.history else None
        return last if last is not None and last.server_round == server_round else None

    def state_dict(self) -> dict[str, Any]:
        history = [{**dataclasses.asdict(h), "rejections": [r.to_state() for r in h.rejections]} for h in self.history]
        return {"num_updates": self.num_updates, "history": history}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.num_updates = int(state["num_updates"])
        self.history = [RoundLog(**{**h, "rejections": [Rejection.from_state(r) for r in h.get("rejections", [])]})
                        for h in state["history"]]
        self._lowest = (0, None)
