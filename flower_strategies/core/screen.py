"""The reply screen: from a round's train replies to the usable ones, their weights and the round's aggregates.

Every defence of the server sits here, in this order:

1. **client half** — a reply naming another method, or (for methods with a client half) naming none, is rejected;
   if every reply of the round lacks it the run cannot train (:class:`ClientHalfMissing`);
2. **structure** — :func:`.validation.parse_reply` (``num-examples``/``num-steps`` whole and ≥ 1, keys/shapes/
   dtypes, every payload against its own metadata before it is viewed);
3. **weight clipping** — ``num-steps`` clipped at what the round planned (``local-steps``; always on), and with
   ``max_weight_ratio`` > 0 (``defence = "robust"``) ``num-examples`` clipped at that multiple of the round's median
   (:meth:`ScreenPolicy.weights`) and epochs-mode ``num-steps`` at the plan of the clipped weight
   (:meth:`ScreenPolicy.step_caps`), so that one reply cannot move the weights or K̄, the mean step count the server
   math reads;
4. **norm screening** — NaN/Inf, ``max_update_norm``, ``update_norm_ratio`` × the round's median norm, measured
   before anything is aggregated (:func:`.ops.update_norms`);
5. **direction screen** — with ``update_cosine_floor`` > −1 (opt-in), a reply whose model update has a cosine
   below it with the round's robust centre (:func:`.robust.centre_cosines`) is rejected;
6. **norm clip** — each surviving reply's record scaled back onto ``update_clip_ratio`` × the round's median norm
   (:func:`.robust.clip_scales`; a model record around the global model, i.e. its update);
7. **robust aggregation** — ``aggregator`` = krum / multi-krum keeps the best-scored replies
   (:func:`.robust.krum_select`), median / trimmed-mean / centered-clip / bucketing replaces the aggregate of every
   ``"mean"``-rule record; each needs enough replies for ``byzantine_fraction`` (:func:`.robust.min_replies`), else
   the round's replies are rejected with the reason.  ``aggregator = fltrust`` (before step 5) weighs each reply by
   its trust, ReLU(cosine) of its model update with the server's own update on its root set (``root``), rescales its
   model update onto that update's norm and rejects a reply of trust 0 (:func:`.robust.fltrust_scores`);
   ``fltrust-gate`` (the ``defence = "robust"`` profile) only rejects the replies of trust 0 — the kept ones keep
   the method's weights, and their norms are bounded by the norm clip.

:class:`ReplyScreen` is built per round from the round's model, the method's uplink specs and a
:class:`ScreenPolicy`; :meth:`ReplyScreen.run` returns a :class:`Screened`.  No strategy state is read or written.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord
from flwr.common import log

from . import records as R
from .aggregation import aggregate
from .ops import NamedArrays, is_float, update_norms
from .privacy import rewritten_reply_reason
from .rejections import Kind, Rejection
from .robust import RECORD_RULES, SELECTION_RULES, TRUST_RULES, TooFewReplies, byzantine_count, centre_cosines, \
    check_replies, clip_scales, clipped, flat_updates, fltrust_scores, krum_select, lower_median
from .validation import RecordSpec, check_update_norms, invariant_reason, layout, nonfinite_reason, parse_reply

#: A usable reply: the message and its parsed records (zero-copy views of the payload).
Parsed = tuple[Message, dict[str, NamedArrays]]


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


@dataclass
class Screened:
    """What :meth:`ReplyScreen.run` kept: usable replies, their (clipped) weights, ``{record: aggregate}`` and the
    rejections (:class:`~.rejections.Rejection`, in the order they were decided)."""

    kept: list[Parsed]
    weights: list[float]
    aggregates: dict[str, NamedArrays]
    rejections: list[Rejection] = field(default_factory=list)
    #: Each kept reply's cap on ``num-steps`` (:meth:`ScreenPolicy.step_caps`; empty = none).
    step_caps: list[float] = field(default_factory=list)
    #: How many kept replies the norm clip scaled (``update_clip_ratio``).
    updates_clipped: int = 0

    def reply_metrics(self) -> tuple[list[dict[str, Any]], int]:
        """``(each kept reply's metrics with its weight as num-examples, its num-steps capped and its node-id,
        weights clipped)``."""
        out: list[dict[str, Any]] = []
        clipped = 0
        caps = self.step_caps or [math.inf] * len(self.kept)
        for (msg, _), weight, cap in zip(self.kept, self.weights, caps, strict=True):
            metrics: dict[str, Any] = dict(_metrics(msg).items())  # the record's dict, copied in C
            clipped += weight < float(metrics[R.NUM_EXAMPLES])
            if R.NUM_STEPS in metrics and metrics[R.NUM_STEPS] > cap:
                metrics[R.NUM_STEPS] = cap
            out.append({**metrics, R.NUM_EXAMPLES: weight, "node-id": msg.metadata.src_node_id})
        return out, clipped


@dataclass(frozen=True)
class ReplyScreen:
    """One round's screen: the global arrays ``current`` the replies answer, the method's uplink ``specs``, its
    ``trainable`` keys (layout of ``keys="params"`` records), the :class:`ScreenPolicy`, and the method's client half
    (registry name, and whether a reply naming no method is suspect)."""

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
    #: ``False``: screen only, leave :attr:`Screened.aggregates` empty (native DP aggregates the kept replies itself).
    aggregate: bool = True
    #: The round's downlink records (``{record: arrays}``, besides the model): what a record's
    #: :attr:`~.validation.RecordSpec.at_least` invariant compares with, and the reference of its root gate.
    sent: dict[str, NamedArrays] = field(default_factory=dict)

    def run(self, server_round: int, replies: Sequence[Message]) -> Screened:
        """Validate the replies, screen their update norms and aggregate the usable ones.

        The replies' norms are measured first (:func:`.ops.update_norms`; a finite norm proves the record finite); the
        replies that pass every check are then aggregated once (:func:`.aggregation.aggregate`)."""
        out = Screened([], [], {})
        expected = {s.name: layout(self.current, self.trainable if s.keys == "params" else None) for s in self.specs}
        kept: list[Parsed] = []
        missing_half = 0
        for msg in replies:
            reason = self.client_half_reason(msg)
            parsed: dict[str, NamedArrays] = {}
            if reason is None:
                reason, parsed = parse_reply(msg, expected)
            if reason is not None:
                missing_half += reason.kind is Kind.CLIENT_HALF or (
                    self.needs_client_half and reason.kind is Kind.MISSING_RECORD)
                self._reject(out, server_round, msg, reason)
                continue
            kept.append((msg, parsed))
        if replies and missing_half == len(replies):
            raise ClientHalfMissing(
                f"every reply of round {server_round} lacks the client half of method '{self.method}' (the ClientApp "
                f"returned its own reply, without fedadapt's records, or trained with its own optimizer). Fix: build "
                f"the reply with rnd.reply(...): in @app.train(), rnd = flower_strategies.ClientRound(msg.content, "
                f"context.state, trainloader, loss_fn); opt = rnd.optimizer(model) if rnd.needs_client_half else "
                f"None; train over rnd.loader with opt; return Message(rnd.reply(model, opt, train_loss=loss), "
                f"reply_to=msg) — if your app already builds a ClientRound, return rnd.reply(...)'s content, not a "
                f"RecordDict of your own. Or build the reply with flower_strategies.train_reply(...) (legacy apps: "
                f"FedAdaptNumPyClient); see docs/plugin.md ('Use fedadapt in your own Flower app')."
            )
        norms = [update_norms([parsed[spec.name] for _, parsed in kept], self.current if spec.keys == "model" else None)
                 for spec in self.specs]
        survivors = [j for j in range(len(kept)) if self._norm_ok(out, server_round, kept[j], [n[j] for n in norms])]
        ratio = self.policy.update_norm_ratio
        if ratio > 0 and len(survivors) > 2:
            for i, spec in enumerate(self.specs):
                median = lower_median([norms[i][j] for j in survivors])
                bound = ratio * median
                for j in [j for j in survivors if not norms[i][j] <= bound]:
                    survivors.remove(j)
                    self._reject(out, server_round, kept[j][0], Rejection(
                        None, Kind.NORM_RATIO, f"record '{spec.name}' norm {norms[i][j]:.4g} exceeds update-norm-ratio "
                                               f"{ratio:g} × the round's median {median:.4g}"))
        for j in list(survivors):  # last of the validity checks, so that a corrupt reply is named for what it holds
            info = R.get(kept[j][0].content, R.REPLY_INFO, ConfigRecord)
            if info is not None and (reason := rewritten_reply_reason(kept[j][0].content, info)) is not None:
                survivors.remove(j)  # a DP mod rewrote a well-formed reply after the client half built it
                self._reject(out, server_round, kept[j][0], reason)
        trust = self._trust(out, server_round, kept, survivors)
        survivors = self._direction_screen(out, server_round, kept, survivors, norms)
        kept = [kept[j] for j in survivors]
        trusted = [trust[j] for j in survivors] if trust else None
        out.updates_clipped = self._clip(server_round, kept, [[n[j] for j in survivors] for n in norms])
        kept = self._select(out, server_round, kept, len(replies))
        weights = self.policy.weights([float(_metrics(msg)[R.NUM_EXAMPLES]) for msg, _ in kept])
        trim = self.byzantine_left(len(replies), len(out.rejections))
        out.kept, out.weights = kept, weights
        out.aggregates = {spec.name: self._aggregate(server_round, spec, kept, weights, trusted, trim)
                          for spec in self.specs} if kept and self.aggregate else {}
        out.step_caps = self._step_caps(server_round, kept, weights)
        return out

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

    def _aggregate(self, server_round: int, spec: RecordSpec, kept: Sequence[Parsed], weights: Sequence[float],
                   trust: Sequence[float] | None, trim: int) -> NamedArrays:
        """The aggregate of one record of the kept replies under the policy's rule (:func:`.aggregation.aggregate`);
        with ``trust`` (FLTrust) a mean is weighted by it instead of ``weights``."""
        rule, by = self.policy.rule(spec), weights
        if trust is not None and rule in ("wmean", "umean"):
            rule, by = "wmean", trust
        model = spec.keys == "model"
        reference, centre = (self.current, self.centre) if model else (None, None)
        return aggregate([p[spec.name] for _, p in kept], by, rule, trim=trim, reference=reference, centre=centre,
                         seed=self.seed + server_round)

    def _trust(self, out: Screened, server_round: int, kept: Sequence[Parsed], survivors: list[int]
               ) -> dict[int, float]:
        """FLTrust (``aggregator = fltrust``): ``{reply: trust}`` of the survivors, trust = ReLU(cosine) of the
        model update (:meth:`trust_spec`) with the server's (:attr:`root`); each such update is rescaled, in place in
        ``kept``, onto that update's norm; a reply of trust 0 is rejected (and removed from ``survivors``).
        ``fltrust-gate``: only the rejections (``{}``: the method's own weights)."""
        if self.policy.aggregator not in TRUST_RULES or not survivors:
            return {}
        if self.root is None:
            raise RuntimeError("aggregator fltrust needs the server's root-set model of the round (ReplyScreen.root; "
                               "FedAdaptStrategy.root_update)")
        spec = self.trust_spec()
        reference = self.gate_reference(spec)
        like = self.root[spec.name]
        keys = [k for k, v in like.items() if is_float(np.asarray(v))]
        updates = flat_updates([kept[j][1][spec.name] for j in survivors], reference, keys)
        trust, scales = fltrust_scores(updates, flat_updates([like], reference, keys)[0])
        gated = self._record_gate(kept, survivors, spec)
        weights: dict[int, float] = {}
        for j, t, scale in zip(list(survivors), trust, scales, strict=True):
            if t <= 0 or j in gated:
                survivors.remove(j)
                self._reject(out, server_round, kept[j][0], Rejection(
                    None, Kind.UNTRUSTED, f"record '{spec.name}' update has FLTrust trust 0 (its cosine with the "
                    f"server's root-set update is <= 0)" if t <= 0 else gated[j]))
                continue
            if self.policy.aggregator != "fltrust":
                continue  # fltrust-gate: only the gate; weights and the norm clip stay the method's and the policy's
            parsed = kept[j][1]
            parsed[spec.name] = clipped(parsed[spec.name], scale, reference)
            weights[j] = t
        return weights

    def gate_reference(self, spec: RecordSpec) -> NamedArrays | None:
        """What a record's update is measured from in the trust gate: the round's model (a ``keys="model"``
        record), the downlink record its ``at_least`` names (v̂: the increase over the v̂ sent), else zero."""
        if spec.keys == "model":
            return self.current
        return self.sent.get(spec.at_least) if spec.at_least is not None else None

    def _record_gate(self, kept: Sequence[Parsed], survivors: Sequence[int], trusted: RecordSpec) -> dict[int, str]:
        """``{reply: why}`` for the replies whose update of some record besides ``trusted`` (:meth:`trust_spec`)
        points against the root run's record of the same name (cosine < 0; a zero update, e.g. a v̂ that did not
        grow, passes) *and*, in a round of 3 or more replies, against the round's robust centre of that record
        (:func:`.robust.centre_cosines`): FLTrust's gate on every uplink record the server's own reply has
        (SCAFFOLD's control delta, FedLADA's v̂, MimeLite's gradient, Fed-LAMB/FedAMS's v, FedDA's momenta), so that
        an in-gate model cannot carry a poisoned record.  The centre keeps the honest outliers of label-skewed data:
        their control deltas and gradients have cosine down to −0.03 with the root's (measured), with the round's
        centre a positive one."""
        assert self.root is not None
        out: dict[int, str] = {}
        for spec in self.specs:
            like = self.root.get(spec.name)
            if spec == trusted or like is None:
                continue
            reference = self.gate_reference(spec)
            keys = [k for k, v in like.items() if is_float(np.asarray(v))]
            rows = [j for j in survivors if j not in out]
            if not rows:
                break
            updates = flat_updates([kept[j][1][spec.name] for j in rows], reference, keys)
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

    def _direction_screen(self, out: Screened, server_round: int, kept: Sequence[Parsed], survivors: list[int],
                          norms: list[list[float]]) -> list[int]:
        """The survivors whose model update does not point against the round's robust centre: a reply whose cosine
        with it (:func:`.robust.centre_cosines`) is below ``update_cosine_floor`` is rejected.  Model records only;
        needs at least 3 replies (with 2 the centre is as much the attacker's as the other's)."""
        floor = self.policy.update_cosine_floor
        if floor <= -1 or len(survivors) < 3:
            return survivors
        for i, spec in enumerate(self.specs):
            if spec.keys != "model":
                continue
            cosines = centre_cosines([kept[j][1][spec.name] for j in survivors], self.current,
                                     [norms[i][j] for j in survivors])
            for j, cos in list(zip(survivors, cosines, strict=True)):
                if cos < floor:
                    survivors.remove(j)
                    self._reject(out, server_round, kept[j][0], Rejection(
                        None, Kind.DIRECTION, f"record '{spec.name}' update points against the round's centre "
                                              f"(cosine {cos:.3f} < update-cosine-floor {floor:g})"))
        return survivors

    def _clip(self, server_round: int, kept: Sequence[Parsed], norms: list[list[float]]) -> int:
        """Scale every record whose norm exceeds ``update_clip_ratio`` × the round's lower-median norm of that record
        back onto that bound, in place in ``kept`` (``norms[spec][reply]``); how many replies were clipped.  Like the
        ratio rejection it needs more than 2 replies (with 2 the median is one of them)."""
        ratio = self.policy.update_clip_ratio
        if ratio <= 0 or len(kept) <= 2:
            return 0
        hit: set[int] = set()
        for spec, record_norms in zip(self.specs, norms, strict=True):
            if self.policy.aggregator == "fltrust" and spec == self.trust_spec():
                continue  # FLTrust has rescaled every model update onto the server update's norm
            scales, bound = clip_scales(record_norms, ratio)
            for j, scale in enumerate(scales):
                if scale < 1.0:
                    msg, parsed = kept[j]
                    reference = self.current if spec.keys == "model" else None
                    parsed[spec.name] = clipped(parsed[spec.name], scale, reference)
                    hit.add(j)
                    log(INFO, "Round %d: node %s record '%s' norm %.4g clipped to %.4g (update-clip-ratio %g × the "
                        "round's median)", server_round, msg.metadata.src_node_id, spec.name, record_norms[j], bound,
                        ratio)
        return len(hit)

    def _select(self, out: Screened, server_round: int, kept: list[Parsed], received: int) -> list[Parsed]:
        """The replies the aggregator uses: all but those Krum / multi-Krum leave out (each rejected with its score),
        or none (each rejected with the reason) when the round has too few for ``byzantine_fraction``.  The
        tolerated number is ``⌈f·received⌉`` less the replies already rejected (:meth:`byzantine_left`)."""
        aggregator, fraction = self.policy.aggregator, self.policy.byzantine_fraction
        if aggregator == "mean" or not kept:
            return kept
        t = self.byzantine_left(received, len(out.rejections))
        try:
            check_replies(aggregator, t, len(kept), fraction)
        except TooFewReplies as err:
            for msg, _ in kept:
                self._reject(out, server_round, msg, Rejection(None, Kind.TOO_FEW, str(err)))
            return []
        if aggregator not in SELECTION_RULES:
            return kept
        names = [s.name for s in self.specs if s.rule == "mean"]
        vectors = np.stack([np.concatenate([np.asarray(a, np.float64).reshape(-1) for name in names
                                            for a in parsed[name].values() if is_float(np.asarray(a))])
                            for _, parsed in kept])
        chosen, scores = krum_select(vectors, t, multi=aggregator == "multi-krum")
        for j, (msg, _) in enumerate(kept):
            if j not in chosen:
                self._reject(out, server_round, msg, Rejection(
                    None, Kind.LEFT_OUT, f"left out by aggregator {aggregator} (score {scores[j]:.4g}, best "
                                         f"{min(scores):.4g}; byzantine-fraction {fraction:g})"))
        return [kept[j] for j in chosen]

    def byzantine_left(self, received: int, rejected: int) -> int:
        """How many of the usable replies the robust aggregators treat as possibly Byzantine: ``⌈f·received⌉`` of the
        round's replies, less those the screen already rejected (a reply rejected for its norm is one of them)."""
        return max(0, byzantine_count(self.policy.byzantine_fraction, received) - rejected)

    def _step_caps(self, server_round: int, kept: Sequence[Parsed], weights: Sequence[float]) -> list[float]:
        """:meth:`ScreenPolicy.step_caps` of the kept replies (a capped reply is logged)."""
        steps = [_metrics(msg).get(R.NUM_STEPS) for msg, _ in kept]
        caps = self.policy.step_caps([None if k is None else float(k) for k in steps], weights)
        for (msg, _), k, cap in zip(kept, steps, caps, strict=True):
            if k is not None and k > cap:
                log(WARNING, "Round %d: node %s reported num-steps %g, counted as %g (the round's plan)",
                    server_round, msg.metadata.src_node_id, k, cap)
        return caps

    def _norm_ok(self, out: Screened, server_round: int, item: Parsed, norms: list[float]) -> bool:
        """Reject (and say why) a reply whose records hold NaN/Inf, break their spec's invariants
        (:func:`.validation.invariant_reason`) or exceed ``max-update-norm``."""
        msg, parsed = item
        reason = nonfinite_reason(parsed, norms, [s.name for s in self.specs])
        if reason is None:  # structural invariants (every defence: no honest reply breaks one)
            reason = invariant_reason(parsed, self.specs, self.sent)
        if reason is not None:
            self._reject(out, server_round, msg, reason)
            return False
        if self.policy.max_update_norm > 0:
            reason = check_update_norms(parsed, self.specs, self.current, self.policy.max_update_norm, norms)
        if reason is not None:
            self._reject(out, server_round, msg, reason)
        return reason is None

    @staticmethod
    def _reject(out: Screened, server_round: int, msg: Message, reason: Rejection) -> None:
        """Record ``reason`` as the rejection of ``msg`` (its node) and log it."""
        out.rejections.append(reason.at(msg.metadata.src_node_id))
        log(WARNING, "Round %d: rejected reply from node %s: %s", server_round, msg.metadata.src_node_id,
            reason.detail)
