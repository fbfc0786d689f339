"""The reply screen: from a round's train replies to the usable ones and their weights, then their aggregates.

The screen is an ordered list of stages (:attr:`ReplyScreen.STAGES`), each a method ``stage(kept) → (kept,
rejections)`` that returns a new :class:`Kept` and never edits what it was given; docs/architecture.md quotes the
same order (a test compares the two):

1. ``parse`` — the client half (a reply naming another method, or for methods with a client half naming none; when
   every reply lacks it the run cannot train: :class:`ClientHalfMissing`) and the structure
   (:func:`.validation.parse_reply`: ``num-examples``/``num-steps`` whole and ≥ 1, keys/shapes/dtypes, every payload
   against its own metadata before it is viewed);
2. ``measure`` — each reply's norm of each record (a model record: of its update), reading each reply once
   (:func:`.ops.norms_and_fold`), which also folds the replies under a plain rule into provisional sums;
3. ``bounds`` — NaN/Inf, each method's record invariants (e.g. v̂ ≥ 0, under every defence) and
   ``max_update_norm``;
4. ``norm_ratio`` — ``update_norm_ratio`` × the round's lower-median norm (more than 2 replies);
5. ``rewritten`` — a reply a DP mod rewrote after the client half built it (its CRC, :mod:`.dpmods`);
6. ``trust`` — ``aggregator = fltrust``: trust = ReLU(cosine) of the model update with the server's own update on its
   root set (``root``); the update is rescaled onto that update's norm, a reply of trust 0 is rejected
   (:func:`.robust.fltrust_scores`); ``fltrust-gate`` (the ``defence = "robust"`` profile) only rejects: trust 0, or
   another record pointing against the root run's and the round's (:meth:`ReplyScreen.record_gate`);
7. ``direction`` — with ``update_cosine_floor`` > −1 (opt-in), a model update whose cosine with the round's robust
   centre (:func:`.robust.centre_cosines`) is below it;
8. ``clip`` — each record above ``update_clip_ratio`` × the round's lower-median norm is scaled back onto it
   (:func:`.robust.clip_scales`; a model record around the global model);
9. ``select`` — a robust aggregator needs enough replies for ``byzantine_fraction`` (:func:`.robust.min_replies`),
   else every reply is rejected with the reason; ``krum`` / ``multi-krum`` keep the best-scored replies.

Then the kept replies' weights: the reported ``num-examples``, with ``max_weight_ratio`` > 0 (the robust profile)
clipped at that multiple of their median (:meth:`ScreenPolicy.weights`), and each reply's cap on ``num-steps``
(:meth:`ScreenPolicy.step_caps`), so that one reply cannot move the weights or K̄.  :meth:`ReplyScreen.aggregate`
is the next step of the round: each record aggregated once under the policy's rule (:func:`.aggregation.aggregate`;
median / trimmed-mean / centered-clip / bucketing replace a ``"mean"`` record's rule), or the ``measure`` stage's
provisional sums when the screen kept exactly the replies it measured, unchanged.

:class:`ReplyScreen` is built per round from the round's model, the method's uplink specs and a
:class:`ScreenPolicy`.  No strategy state is read or written.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord
from flwr.common import log

from . import records as R
from .aggregation import aggregate
from .ops import AGGREGATION_RULES, NamedArrays, finish_fold, is_float, norms_and_fold
from .privacy import rewritten_reply_reason
from .rejections import Kind, Rejection
from .robust import RECORD_RULES, SELECTION_RULES, TRUST_RULES, TooFewReplies, byzantine_count, centre_cosines, \
    check_replies, clip_scales, clipped, flat_updates, fltrust_scores, krum_select, lower_median
from .validation import RecordSpec, check_update_norms, invariant_reason, layout, nonfinite_reason, parse_reply

def _metrics(msg: Message) -> Any:
    """The ``metrics`` MetricRecord of a reply :func:`.validation.parse_reply` accepted."""
    return R.get(msg.content, R.METRICS, MetricRecord)


class ClientHalfMissing(RuntimeError):
    """Every reply of a round came from a client without the method's client half: the run cannot train."""


@dataclass(frozen=True)
class ScreenPolicy:
    """The screening and aggregation settings (the run-config keys of the same names, a key left unset resolved by
    the ``defence`` profile; the defaults here are ``defence = "off"``: the paper algorithms)."""

    weighting: str = "examples"
    aggregator: str = "mean"
    byzantine_fraction: float = 0.2
    max_update_norm: float = 0.0
    update_norm_ratio: float = 100.0
    update_clip_ratio: float = 0.0
    update_cosine_floor: float = -1.0
    max_weight_ratio: float = 0.0
    #: The round's plan (what :func:`.client.num_local_steps` gives a client): K, else E·⌈n/B⌉.
    local_steps: int = 0
    local_epochs: int = 5
    batch_size: int = 16

    @classmethod
    def from_settings(cls, settings: Any, weighting: str) -> ScreenPolicy:
        """The policy of a :class:`~flower_strategies.core.hparams.StrategyConfig` (``weighting`` resolved)."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "weighting"]
        return cls(weighting=weighting, **{name: getattr(settings, name) for name in names})

    def rule(self, spec: RecordSpec) -> str:
        """The aggregation rule of ``spec`` under this policy."""
        if spec.rule == "mean":
            if self.aggregator in RECORD_RULES:
                return self.aggregator
            return "wmean" if self.weighting == "examples" else "umean"
        return spec.rule

    def weights(self, reported: Sequence[float]) -> list[float]:
        """The replies' weights: reported ``num-examples`` clipped at ``max_weight_ratio`` × their median."""
        if self.max_weight_ratio <= 0 or not reported:
            return list(reported)
        cap = self.max_weight_ratio * float(np.median(reported))
        return [min(n, cap) for n in reported]

    def step_caps(self, steps: Sequence[float | None], weights: Sequence[float]) -> list[float]:
        """The most ``num-steps`` each reply may count with in K̄ (``steps``: the reported values, ``None`` = absent;
        ``weights``: the clipped weights of :meth:`weights`).

        ``local-steps`` K > 0: K (a client never plans more; the full-batch phase plans 1).  Epochs mode: the larger
        of E·⌈w_i/B⌉ (the plan of a client with its clipped weight w_i) and ``max_weight_ratio`` × the median
        reported steps (no cap when ``max_weight_ratio`` ≤ 0).  An honest reply whose weight is not clipped reports
        exactly its plan and is never capped."""
        if self.local_steps > 0:
            return [float(self.local_steps)] * len(weights)
        present = [k for k in steps if k is not None]
        if self.max_weight_ratio <= 0 or not present:
            return [math.inf] * len(weights)
        floor = self.max_weight_ratio * float(np.median(present))
        return [max(float(self.local_epochs * math.ceil(w / self.batch_size)), floor) for w in weights]


@dataclass(frozen=True)
class Reply:
    """One reply as the screen sees it: the message, its parsed records (zero-copy views of the payload; ``{}``
    before ``parse``), its norm per uplink record (from ``measure``) and its FLTrust trust (``aggregator =
    fltrust``)."""

    msg: Message
    records: Mapping[str, NamedArrays] = field(default_factory=dict)
    norms: tuple[float, ...] = ()
    trust: float | None = None

    @property
    def node(self) -> int:
        return self.msg.metadata.src_node_id

    def with_record(self, name: str, arrays: NamedArrays) -> Reply:
        """A copy whose record ``name`` is ``arrays`` (the others shared)."""
        return dataclasses.replace(self, records={**self.records, name: arrays})


@dataclass(frozen=True)
class Provisional:
    """The ``measure`` stage's fold: the replies it folded and the sums of each record (:func:`.ops.norms_and_fold`).
    Valid for the aggregate only while the screen keeps exactly these replies."""

    replies: tuple[Reply, ...]
    sums: Mapping[str, NamedArrays]

    def valid_for(self, replies: Sequence[Reply]) -> bool:
        return len(replies) == len(self.replies) and all(a is b for a, b in zip(replies, self.replies, strict=True))


@dataclass(frozen=True)
class Kept:
    """What flows from stage to stage: the round, how many replies the screen was handed, the replies kept so far,
    the provisional fold (``measure``) and how many replies the norm clip scaled."""

    server_round: int
    received: int
    replies: tuple[Reply, ...]
    provisional: Provisional | None = None
    updates_clipped: int = 0

    def keep(self, replies: Iterable[Reply], **changes: Any) -> Kept:
        return dataclasses.replace(self, replies=tuple(replies), **changes)


def rejected(reply: Reply, kind: Kind, detail: str) -> Rejection:
    return Rejection(reply.node, kind, detail)


@dataclass
class Screened:
    """What :meth:`ReplyScreen.run` kept: usable replies, their (clipped) weights and the rejections
    (:class:`~.rejections.Rejection`, in the order they were decided)."""

    kept: list[Reply]
    weights: list[float]
    rejections: list[Rejection] = field(default_factory=list)
    #: Each kept reply's cap on ``num-steps`` (:meth:`ScreenPolicy.step_caps`; empty = none).
    step_caps: list[float] = field(default_factory=list)
    #: How many kept replies the norm clip scaled (``update_clip_ratio``).
    updates_clipped: int = 0
    #: What :meth:`ReplyScreen.aggregate` needs besides the kept replies: how many the screen was handed, the
    #: provisional fold.
    server_round: int = 0
    received: int = 0
    provisional: Provisional | None = None

    def reply_metrics(self) -> tuple[list[dict[str, Any]], int]:
        """``(each kept reply's metrics with its weight as num-examples, its num-steps capped and its node-id,
        weights clipped)``."""
        out: list[dict[str, Any]] = []
        clipped = 0
        caps = self.step_caps or [math.inf] * len(self.kept)
        for reply, weight, cap in zip(self.kept, self.weights, caps, strict=True):
            metrics: dict[str, Any] = dict(_metrics(reply.msg).items())  # the record's dict, copied in C
            clipped += weight < float(metrics[R.NUM_EXAMPLES])
            if R.NUM_STEPS in metrics and metrics[R.NUM_STEPS] > cap:
                metrics[R.NUM_STEPS] = cap
            out.append({**metrics, R.NUM_EXAMPLES: weight, "node-id": reply.node})
        return out, clipped


Stage = Callable[[Kept], tuple[Kept, list[Rejection]]]


@dataclass(frozen=True)
class ReplyScreen:
    """One round's screen: the global arrays ``current`` the replies answer, the method's uplink ``specs``, its
    ``trainable`` keys (layout of ``keys="params"`` records), the :class:`ScreenPolicy`, and the method's client half
    (registry name, and whether a reply naming no method is suspect)."""

    #: The stages, in the order :meth:`run` applies them (module docstring).
    STAGES: ClassVar[tuple[str, ...]] = ("parse", "measure", "bounds", "norm_ratio", "rewritten", "trust",
                                         "direction", "clip", "select")

    current: NamedArrays
    specs: tuple[RecordSpec, ...]
    trainable: Sequence[str]
    policy: ScreenPolicy = ScreenPolicy()
    method: str = ""
    needs_client_half: bool = False
    #: ``aggregator = fltrust``: the server's own reply (``{record: arrays}``) after the round's local procedure on
    #: its root set.
    root: dict[str, NamedArrays] | None = None
    #: ``aggregator = centered-clip / bucketing``: the centre of the model record's clipping (an update: the last
    #: round's, ``x_t − x_{t−1}``; ``None``: zero) and the seed of the buckets.
    centre: NamedArrays | None = None
    seed: int = 0
    #: Whether ``measure`` folds the replies as it reads them (``False``: native DP aggregates them itself).
    provisional: bool = True
    #: The round's downlink records (``{record: arrays}``, besides the model): what a record's
    #: :attr:`~.validation.RecordSpec.at_least` invariant compares with, and the reference of its root gate.
    sent: dict[str, NamedArrays] = field(default_factory=dict)

    def stages(self) -> list[Stage]:
        return [getattr(self, name) for name in self.STAGES]

    def run(self, server_round: int, replies: Sequence[Message]) -> Screened:
        """The stages in order, then the kept replies' weights and step caps (each rejection is logged)."""
        kept = Kept(server_round, len(replies), tuple(Reply(msg) for msg in replies))
        rejections: list[Rejection] = []
        for stage in self.stages():
            kept, refused = stage(kept)
            for reason in refused:
                log(WARNING, "Round %d: rejected reply from node %s: %s", server_round, reason.node, reason.detail)
            rejections += refused
        replies_kept = list(kept.replies)
        weights = self.reply_weights(replies_kept)
        return Screened(replies_kept, weights, rejections, self._step_caps(server_round, replies_kept, weights),
                        kept.updates_clipped, server_round, kept.received, kept.provisional)

    def reply_weights(self, replies: Sequence[Reply]) -> list[float]:
        return self.policy.weights([float(_metrics(r.msg)[R.NUM_EXAMPLES]) for r in replies])

    # ------------------------------------------------------------------ the stages, in order
    def parse(self, kept: Kept) -> tuple[Kept, list[Rejection]]:
        """The client half, then :func:`.validation.parse_reply` (module docstring, 1)."""
        expected = {s.name: layout(self.current, self.trainable if s.keys == "params" else None) for s in self.specs}
        out: list[Reply] = []
        refused: list[Rejection] = []
        missing_half = 0
        for reply in kept.replies:
            reason = self.client_half_reason(reply.msg)
            records: dict[str, NamedArrays] = {}
            if reason is None:
                reason, records = parse_reply(reply.msg, expected)
            if reason is None:
                out.append(dataclasses.replace(reply, records=records))
                continue
            missing_half += reason.kind is Kind.CLIENT_HALF or (
                self.needs_client_half and reason.kind is Kind.MISSING_RECORD)
            refused.append(reason.at(reply.node))
        if kept.replies and missing_half == len(kept.replies):
            raise ClientHalfMissing(
                f"every reply of round {kept.server_round} lacks the client half of method '{self.method}' (the "
                f"ClientApp returned its own reply, without fedadapt's records, or trained with its own optimizer). "
                f"Fix: build the reply with rnd.reply(...): in @app.train(), rnd = flower_strategies.ClientRound("
                f"msg.content, context.state, trainloader, loss_fn); opt = rnd.optimizer(model) if "
                f"rnd.needs_client_half else None; train over rnd.loader with opt; return Message(rnd.reply(model, "
                f"opt, train_loss=loss), reply_to=msg) — if your app already builds a ClientRound, return "
                f"rnd.reply(...)'s content, not a RecordDict of your own. Or build the reply with "
                f"flower_strategies.train_reply(...) (legacy apps: FedAdaptNumPyClient); see docs/plugin.md ('Use "
                f"fedadapt in your own Flower app')."
            )
        return kept.keep(out), refused

    def measure(self, kept: Kept) -> tuple[Kept, list[Rejection]]:
        """Each reply's norm per record, each reply read once; the same pass folds the replies into provisional sums
        when the aggregate is a plain fold of them (:meth:`folds_while_measuring`).  Rejects nothing."""
        if not kept.replies:
            return kept, []
        fold = self.folds_while_measuring()
        weights = self.reply_weights(kept.replies) if fold else None
        norms: list[list[float]] = []
        sums: dict[str, NamedArrays] = {}
        for spec in self.specs:
            rule = self.policy.rule(spec) if fold else None
            spec_norms, spec_sums = norms_and_fold([r.records[spec.name] for r in kept.replies],
                                                   self.current if spec.keys == "model" else None, weights, rule)
            norms.append(spec_norms)
            if spec_sums is not None:
                sums[spec.name] = spec_sums
        replies = tuple(dataclasses.replace(r, norms=tuple(n[j] for n in norms)) for j, r in enumerate(kept.replies))
        return kept.keep(replies, provisional=Provisional(replies, sums) if fold else None), []

    def bounds(self, kept: Kept) -> tuple[Kept, list[Rejection]]:
        """NaN/Inf (a finite norm proves its record finite), the records' invariants
        (:func:`.validation.invariant_reason`) and ``max-update-norm``."""
        names = [s.name for s in self.specs]
        out, refused = [], []
        for reply in kept.replies:
            reason = nonfinite_reason(reply.records, reply.norms, names)
            if reason is None:  # structural invariants (every defence: no honest reply breaks one)
                reason = invariant_reason(reply.records, self.specs, self.sent)
            if reason is None and self.policy.max_update_norm > 0:
                reason = check_update_norms(reply.records, self.specs, self.current, self.policy.max_update_norm,
                                            reply.norms)
            if reason is None:
                out.append(reply)
            else:
                refused.append(reason.at(reply.node))
        return kept.keep(out), refused

    def norm_ratio(self, kept: Kept) -> tuple[Kept, list[Rejection]]:
        """A record whose norm exceeds ``update_norm_ratio`` × the round's lower median of it (record by record,
        each median over the replies the earlier records left; more than 2 replies)."""
        ratio = self.policy.update_norm_ratio
        replies, refused = list(kept.replies), []
        if ratio <= 0 or len(replies) <= 2:
            return kept, []
        for i, spec in enumerate(self.specs):
            median = lower_median([r.norms[i] for r in replies])
            bound = ratio * median
            for reply in [r for r in replies if not r.norms[i] <= bound]:
                replies.remove(reply)
                refused.append(rejected(reply, Kind.NORM_RATIO, f"record '{spec.name}' norm {reply.norms[i]:.4g} "
                                        f"exceeds update-norm-ratio {ratio:g} × the round's median {median:.4g}"))
        return kept.keep(replies), refused

    def rewritten(self, kept: Kept) -> tuple[Kept, list[Rejection]]:
        """A well-formed reply a DP mod rewrote after the client half built it (the last validity check, so that a
        corrupt reply is named for what it holds)."""
        out, refused = [], []
        for reply in kept.replies:
            info = R.get(reply.msg.content, R.REPLY_INFO, ConfigRecord)
            reason = None if info is None else rewritten_reply_reason(reply.msg.content, info)
            if reason is None:
                out.append(reply)
            else:
                refused.append(reason.at(reply.node))
        return kept.keep(out), refused

    def trust(self, kept: Kept) -> tuple[Kept, list[Rejection]]:
        """FLTrust (``aggregator = fltrust``): each reply's trust, ReLU(cosine) of its model update
        (:meth:`trust_spec`) with the server's (:attr:`root`), and that update rescaled onto the server update's
        norm; a reply of trust 0 is rejected.  ``fltrust-gate``: only the rejections (and :meth:`record_gate`'s)."""
        if self.policy.aggregator not in TRUST_RULES or not kept.replies:
            return kept, []
        if self.root is None:
            raise RuntimeError("aggregator fltrust needs the server's root-set model of the round (ReplyScreen.root; "
                               "FedAdaptStrategy.root_update)")
        spec = self.trust_spec()
        reference = self.gate_reference(spec)
        like = self.root[spec.name]
        keys = [k for k, v in like.items() if is_float(np.asarray(v))]
        updates = flat_updates([r.records[spec.name] for r in kept.replies], reference, keys)
        trust, scales = fltrust_scores(updates, flat_updates([like], reference, keys)[0])
        gated = self.record_gate(kept.replies, spec)
        out, refused = [], []
        for j, (reply, t, scale) in enumerate(zip(kept.replies, trust, scales, strict=True)):
            if t <= 0 or j in gated:
                refused.append(rejected(reply, Kind.UNTRUSTED, f"record '{spec.name}' update has FLTrust trust 0 "
                                        f"(its cosine with the server's root-set update is <= 0)" if t <= 0
                                        else gated[j]))
            elif self.policy.aggregator == "fltrust":
                out.append(dataclasses.replace(reply.with_record(spec.name, clipped(reply.records[spec.name], scale,
                                                                                    reference)), trust=t))
            else:  # fltrust-gate: only the gate; weights and the norm clip stay the method's and the policy's
                out.append(reply)
        return kept.keep(out), refused

    def direction(self, kept: Kept) -> tuple[Kept, list[Rejection]]:
        """With ``update_cosine_floor`` > −1: a model update whose cosine with the round's robust centre
        (:func:`.robust.centre_cosines`) is below it.  Needs at least 3 replies (with 2 the centre is as much the
        attacker's as the other's)."""
        floor = self.policy.update_cosine_floor
        replies, refused = list(kept.replies), []
        if floor <= -1 or len(replies) < 3:
            return kept, []
        for i, spec in enumerate(self.specs):
            if spec.keys != "model":
                continue
            cosines = centre_cosines([r.records[spec.name] for r in replies], self.current,
                                     [r.norms[i] for r in replies])
            for reply, cos in list(zip(replies, cosines, strict=True)):
                if cos < floor:
                    replies.remove(reply)
                    refused.append(rejected(reply, Kind.DIRECTION, f"record '{spec.name}' update points against the "
                                            f"round's centre (cosine {cos:.3f} < update-cosine-floor {floor:g})"))
        return kept.keep(replies), refused

    def clip(self, kept: Kept) -> tuple[Kept, list[Rejection]]:
        """Each record whose norm exceeds ``update_clip_ratio`` × the round's lower-median norm of it, scaled back
        onto that bound (more than 2 replies: with 2 the median is one of them).  Rejects nothing."""
        ratio = self.policy.update_clip_ratio
        replies = list(kept.replies)
        if ratio <= 0 or len(replies) <= 2:
            return kept, []
        hit: set[int] = set()
        for i, spec in enumerate(self.specs):
            if self.policy.aggregator == "fltrust" and spec == self.trust_spec():
                continue  # FLTrust has rescaled every model update onto the server update's norm
            scales, bound = clip_scales([r.norms[i] for r in replies], ratio)
            reference = self.current if spec.keys == "model" else None
            for j, scale in enumerate(scales):
                if scale < 1.0:
                    replies[j] = replies[j].with_record(spec.name, clipped(replies[j].records[spec.name], scale,
                                                                           reference))
                    hit.add(j)
                    log(INFO, "Round %d: node %s record '%s' norm %.4g clipped to %.4g (update-clip-ratio %g × the "
                        "round's median)", kept.server_round, replies[j].node, spec.name, replies[j].norms[i], bound,
                        ratio)
        return kept.keep(replies, updates_clipped=len(hit)), []

    def select(self, kept: Kept) -> tuple[Kept, list[Rejection]]:
        """The replies the aggregator uses: all but those Krum / multi-Krum leave out (each rejected with its score),
        or none (each rejected with the reason) when the round has too few for ``byzantine_fraction``.  The
        tolerated number is ``⌈f·received⌉`` less the replies already rejected (:meth:`byzantine_left`)."""
        aggregator, fraction = self.policy.aggregator, self.policy.byzantine_fraction
        if aggregator == "mean" or not kept.replies:
            return kept, []
        t = self.byzantine_left(kept)
        try:
            check_replies(aggregator, t, len(kept.replies), fraction)
        except TooFewReplies as err:
            return kept.keep(()), [rejected(r, Kind.TOO_FEW, str(err)) for r in kept.replies]
        if aggregator not in SELECTION_RULES:
            return kept, []
        names = [s.name for s in self.specs if s.rule == "mean"]
        vectors = np.stack([np.concatenate([np.asarray(a, np.float64).reshape(-1) for name in names
                                            for a in r.records[name].values() if is_float(np.asarray(a))])
                            for r in kept.replies])
        chosen, scores = krum_select(vectors, t, multi=aggregator == "multi-krum")
        refused = [rejected(r, Kind.LEFT_OUT, f"left out by aggregator {aggregator} (score {scores[j]:.4g}, best "
                            f"{min(scores):.4g}; byzantine-fraction {fraction:g})")
                   for j, r in enumerate(kept.replies) if j not in chosen]
        return kept.keep(kept.replies[j] for j in chosen), refused

    # ------------------------------------------------------------------ the aggregate (the round's next step)
    def aggregate(self, screened: Screened) -> dict[str, NamedArrays]:
        """``{record: aggregate}`` of the kept replies (``{}``: none kept): each record once, under the policy's rule
        (:meth:`aggregate_record`), or from the provisional sums, divided in place, when the screen kept exactly the
        replies it folded (so a second call folds again)."""
        kept = screened.kept
        provisional, screened.provisional = screened.provisional, None  # its sums become the aggregates: used once
        if not kept:
            return {}
        if provisional is not None and provisional.valid_for(kept):
            return {spec.name: finish_fold(dict(provisional.sums[spec.name]), kept[0].records[spec.name],
                                           screened.weights, self.policy.rule(spec), len(kept))
                    for spec in self.specs}
        trim = self.byzantine_left(Kept(screened.server_round, screened.received, tuple(kept)))
        trusts = [r.trust for r in kept if r.trust is not None]  # FLTrust's weights (every kept reply has one)
        trust = trusts if len(trusts) == len(kept) else None
        return {spec.name: self.aggregate_record(screened.server_round, spec, kept, screened.weights, trust, trim)
                for spec in self.specs}

    def aggregate_record(self, server_round: int, spec: RecordSpec, kept: Sequence[Reply], weights: Sequence[float],
                         trust: Sequence[float] | None, trim: int) -> NamedArrays:
        """The aggregate of one record of the kept replies under the policy's rule (:func:`.aggregation.aggregate`);
        with ``trust`` (FLTrust) a mean is weighted by it instead of ``weights``."""
        rule, by = self.policy.rule(spec), weights
        if trust is not None and rule in ("wmean", "umean"):
            rule, by = "wmean", trust
        model = spec.keys == "model"
        reference, centre = (self.current, self.centre) if model else (None, None)
        return aggregate([r.records[spec.name] for r in kept], by, rule, trim=trim, reference=reference,
                         centre=centre, seed=self.seed + server_round)

    def folds_while_measuring(self) -> bool:
        """Whether ``measure`` folds the replies as it reads them: every record's rule a plain fold
        (:data:`.ops.AGGREGATION_RULES`), no selection, no FLTrust weights, and no native DP (:attr:`provisional`)."""
        return (self.provisional and self.policy.aggregator not in (*SELECTION_RULES, "fltrust")
                and all(self.policy.rule(spec) in AGGREGATION_RULES for spec in self.specs))

    # ------------------------------------------------------------------ what the stages share
    def client_half_reason(self, msg: Message) -> Rejection | None:
        """A reply naming another method is rejected; a reply naming none is rejected when nothing else shows the
        method's client half ran (its declared uplink is only the model)."""
        if msg.has_error():
            return None
        info = R.get(msg.content, R.REPLY_INFO, ConfigRecord)
        produced_by = None if info is None else info.get(R.METHOD)
        if produced_by is None:
            model_only = all(s.name == R.MODEL for s in self.specs)
            if not (self.needs_client_half and model_only):
                return None
        elif produced_by == self.method:
            return None
        return Rejection(msg.metadata.src_node_id, Kind.CLIENT_HALF,
                         f"reply was not produced by the client half of fedadapt method '{self.method}' (its "
                         f"'{R.REPLY_INFO}' ConfigRecord names {produced_by!r})")

    def gate_reference(self, spec: RecordSpec) -> NamedArrays | None:
        """What a record's update is measured from in the trust gate: the round's model (a ``keys="model"``
        record), the downlink record its ``at_least`` names (v̂: the increase over the v̂ sent), else zero."""
        if spec.keys == "model":
            return self.current
        return self.sent.get(spec.at_least) if spec.at_least is not None else None

    def record_gate(self, replies: Sequence[Reply], trusted: RecordSpec) -> dict[int, str]:
        """``{reply index: why}`` for the replies whose update of some record besides ``trusted``
        (:meth:`trust_spec`) points against the root run's record of the same name (cosine < 0; a zero update, e.g.
        a v̂ that did not grow, passes) *and*, in a round of 3 or more replies, against the round's robust centre of
        that record (:func:`.robust.centre_cosines`): FLTrust's gate on every uplink record the server's own reply
        has (SCAFFOLD's control delta, FedLADA's v̂, MimeLite's gradient, Fed-LAMB/FedAMS's v, FedDA's momenta), so
        that an in-gate model cannot carry a poisoned record.  The centre keeps the honest outliers of label-skewed
        data: their control deltas and gradients have cosine down to −0.03 with the root's (measured), with the
        round's centre a positive one."""
        assert self.root is not None
        out: dict[int, str] = {}
        for spec in self.specs:
            like = self.root.get(spec.name)
            if spec == trusted or like is None:
                continue
            reference = self.gate_reference(spec)
            keys = [k for k, v in like.items() if is_float(np.asarray(v))]
            rows = [j for j in range(len(replies)) if j not in out]
            if not rows:
                break
            updates = flat_updates([replies[j].records[spec.name] for j in rows], reference, keys)
            root = flat_updates([like], reference, keys)[0]
            against = [i for i, dot in enumerate(updates @ root) if dot < 0]
            if not against:
                continue
            centre = [-1.0] * len(rows)
            if len(rows) >= 3:
                centre = centre_cosines([{"u": u} for u in updates], {"u": np.zeros(updates.shape[1])},
                                        [float(n) for n in np.linalg.norm(updates, axis=1)])
            for i in against:
                if centre[i] < 0:
                    cos = float(updates[i] @ root) / float(np.linalg.norm(updates[i]) * np.linalg.norm(root))
                    out[rows[i]] = (f"record '{spec.name}' update points against the server's root-set record of "
                                    f"that name (cosine {cos:.3f}) and the round's centre of it ({centre[i]:.3f})")
        return out

    def trust_spec(self) -> RecordSpec:
        """The record FLTrust compares with the server's: the model record (its update), else (a method whose
        uplink has none, e.g. FedDA's momenta) the first record."""
        return next((s for s in self.specs if s.keys == "model" and s.name == R.MODEL), self.specs[0])

    def byzantine_left(self, kept: Kept) -> int:
        """How many of the kept replies the robust aggregators treat as possibly Byzantine: ``⌈f·received⌉`` of the
        replies the screen was handed, less those it already rejected (a reply rejected for its norm is one of
        them)."""
        rejected_so_far = kept.received - len(kept.replies)
        return max(0, byzantine_count(self.policy.byzantine_fraction, kept.received) - rejected_so_far)

    def _step_caps(self, server_round: int, kept: Sequence[Reply], weights: Sequence[float]) -> list[float]:
        """:meth:`ScreenPolicy.step_caps` of the kept replies (a capped reply is logged)."""
        steps = [_metrics(r.msg).get(R.NUM_STEPS) for r in kept]
        caps = self.policy.step_caps([None if k is None else float(k) for k in steps], weights)
        for reply, k, cap in zip(kept, steps, caps, strict=True):
            if k is not None and k > cap:
                log(WARNING, "Round %d: node %s reported num-steps %g, counted as %g (the round's plan)",
                    server_round, reply.node, k, cap)
        return caps
