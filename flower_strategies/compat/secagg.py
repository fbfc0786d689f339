"""Secure aggregation (SecAgg+) for fedadapt methods, through Flower's own implementation.

Flower 1.42 offers SecAgg+ only on the legacy path: the server workflow :class:`flwr.server.workflow.SecAggPlusWorkflow`
(inside :class:`flwr.server.workflow.DefaultWorkflow`, driving a legacy ``Strategy``) and the client mod
:func:`flwr.client.mod.secaggplus_mod`.  Each client multiplies its *whole* reply (one flat array list) by its weight
``w_i = num_examples_i / max_weight`` (quantized to 1/``quantization_range``), clips every value to
±``clipping_range``, quantizes it stochastically to ``quantization_range`` levels and masks it; the server learns only
``Σ_i clip(w_i·p_i) / Σ_i w_i`` and hands that same list, as every client's parameters, to ``aggregate_fit``.  The
clients' metrics (``num_examples``, train loss, …) travel in the clear.

Here that is :class:`SecAggStrategy` (a :class:`~.legacy.LegacyStrategy`: the fedadapt strategy sees every reply
carry the averaged records, whose example-weighted mean is that average) and :func:`secagg_mod` on the client.  It is
right only for methods whose server needs nothing but the example-weighted mean of every uplink record
(:func:`check_secagg` refuses the others, and the settings that need individual replies, naming what to use).

The quantization error of one round is bounded (:func:`error_bound`): each client's value has a stochastic-rounding
error below one level ``2c/Q`` (``c`` = clipping range, ``Q`` = quantization range) and its weight one below
``1/(2Q)``, so for reply values within ±c the mean over ``n`` clients is off by at most ``3·n·c / (Q·Σ_i w_i)``.
A value whose weighted magnitude exceeds ``c`` is clipped by Flower silently; :func:`secagg_mod` counts such values
on each client and the server reports their total per round (``secagg-clipped``) with a warning that names the fix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import FitRes, Parameters, Scalar, log, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_proxy import ClientProxy

from ..core import records as R
from ..core.hparams import ConfigError
from ..core.ops import is_float
from ..core.rejections import Kind, Rejection
from ..core.strategy import FedAdaptStrategy
from .legacy import LAYOUT, LegacyStrategy, unpack

#: Flower's SecAgg+ record names (``flwr.common.secure_aggregation.secaggplus_constants``, flwr 1.42).
SECAGG_CONFIGS = "secaggplus_configs"
SECAGG_STATE = "secaggplus_state"
#: The client's count of values Flower's quantizer clips (``FitRes.metrics``, in the clear) and the round's total.
CLIPPED = "secagg-clipped"
#: Uplink records that are second-moment estimates (squared gradients: v of FedAMS/Fed-LAMB, v̂ of FedLADA/local
#: Adam).  Their entries are often far below one quantization level 2c/Q (3.8e-6 at Flower's defaults), so SecAgg+'s
#: fixed-point mean of them loses its relative precision (stochastic rounding makes entries of a few levels or
#: negative), and the adaptive denominator built from it breaks: measured on digits-mlp, 3 nodes, 2 rounds, these
#: methods fall to 0.09–0.58 in round 2 where the plain run reaches 0.53–0.81 (docs/privacy.md section 4).
SECOND_MOMENT_RECORDS = frozenset({"v", "v-hat"})
#: What a refused method or setting should use instead.
INSTEAD = ("run it with secure-aggregation = off (and, for privacy against whoever sees the released model, "
           "fedadapt's native DP: dp-clip / dp-noise-multiplier, docs/privacy.md)")


# ------------------------------------------------------------------------------------------ eligibility
def secagg_refusal(strategy: FedAdaptStrategy) -> str | None:
    """Why SecAgg+ cannot run ``strategy`` (``None`` = it can): SecAgg+ yields only the example-weighted mean of the
    whole reply, and hides the individual replies that per-reply defences and native DP need."""
    s = strategy.settings
    name = strategy.method
    if s.dp_clip > 0:
        return ("dp-clip > 0 (native DP) clips each client's reply on the server, which SecAgg+ hides from it; "
                "use one of the two")
    bad = [f"'{r.name}' ({r.rule})" for r in strategy.uplink_specs() if r.rule not in ("mean", "wmean")]
    if bad:
        return (f"{name} aggregates the uplink record(s) {', '.join(bad)} by another rule than the example-weighted "
                f"mean, the only aggregate SecAgg+ computes (n copies of a mean are not a sum); {INSTEAD}")
    moments = [f"'{r.name}'" for r in strategy.uplink_specs() if r.name in SECOND_MOMENT_RECORDS]
    if moments:
        return (f"{name} sends the second-moment record(s) {', '.join(moments)}, whose entries lie below SecAgg+'s "
                f"fixed-point resolution (clipping-range / quantization-range): their secure mean loses its relative "
                f"precision and the adaptive step built on it breaks; {INSTEAD}")
    if strategy.weighting != "examples":
        return (f"{name} averages with weighting = uniform, but SecAgg+ always weights each client by its "
                f"num-examples; set weighting = examples (an example-weighted variant of {name}) or {INSTEAD}")
    if s.defence != "off":
        return (f"defence = {s.defence} screens, clips and weighs the individual replies, which SecAgg+ hides from "
                f"the server (every reply it sees is the same average); set defence = off, or {INSTEAD}")
    needs_replies = {"aggregator": s.aggregator != "mean",
                     "update-clip-ratio": s.update_clip_ratio > 0,
                     "max-update-norm": s.max_update_norm > 0,
                     "update-cosine-floor": s.update_cosine_floor > -1}
    named = [key for key, on in needs_replies.items() if on]
    if named:
        return (f"{', '.join(named)} need(s) the individual replies, which SecAgg+ hides from the server (every reply "
                f"it sees is the same average): set aggregator = mean, update-clip-ratio = 0, max-update-norm = 0, "
                f"update-cosine-floor = -1, or {INSTEAD}")
    if s.min_train_nodes < 2:
        return "SecAgg+ needs at least 2 clients per round; set min-train-nodes >= 2"
    return None


def check_secagg(strategy: FedAdaptStrategy) -> None:
    """Raise :class:`~..core.hparams.ConfigError` when SecAgg+ cannot run ``strategy``; else switch off the two
    per-reply screens that have no effect under it (every reply the server sees is the same average):
    ``update-norm-ratio`` (n copies of one vector are never beyond a multiple of their median norm) and
    ``max-weight-ratio`` (the clients weight themselves by their unclipped num-examples inside the protocol; clipping
    the clear counts on the server would change only the mean step count K̄ and the train metrics, not the model)."""
    reason = secagg_refusal(strategy)
    if reason is not None:
        raise ConfigError(f"secure-aggregation = secaggplus: {reason} (docs/privacy.md section 4)")
    s = strategy.settings
    off = [k for k, v in (("update-norm-ratio", s.update_norm_ratio),
                          ("max-weight-ratio", s.max_weight_ratio)) if v > 0]
    if off:
        log(INFO, "secure-aggregation: %s switched off (no effect on replies that are all the same average)",
            " and ".join(off))
        strategy.settings = s.replace(update_norm_ratio=0.0, max_weight_ratio=0.0)


def error_bound(num_examples: list[int], clipping_range: float, quantization_range: int,
                max_weight: float) -> float:
    """Largest error (any coordinate) of one SecAgg+ round's mean against the exact example-weighted mean of the same
    replies, when every reply value is within ±``clipping_range`` c and every num-examples at most ``max_weight``
    (so nothing is clipped): ``3·n·c / (Q·Σ_i w_i)`` with the quantized weights ``w_i = round(Q·n_i/max_weight)/Q``.
    Each client's weighted value is off by less than one level 2c/Q (stochastic rounding) and its weight by at most
    1/(2Q), which moves the mean by at most ``|p_i − mean|/(2Q·Σ_i w_i) ≤ 2c/(2Q·Σ_i w_i)`` per client."""
    q = quantization_range
    total = sum(round(n / max_weight * q) / q for n in num_examples)
    return 3.0 * len(num_examples) * clipping_range / (q * total)


# ------------------------------------------------------------------------------------------ server
class SecAggStrategy(LegacyStrategy):
    """:class:`~.legacy.LegacyStrategy` for Flower's ``SecAggPlusWorkflow``: the averaged records arrive in float64
    (Flower's dequantizer) and are cast back to the global arrays' dtypes; the clients' counts of values clipped by
    the quantizer are summed into the round's metrics (``secagg-clipped``, with a warning).

    The decoded aggregate is checked before it is applied (:meth:`check_aggregate`; ``clipping_range``,
    ``quantization_range`` and ``max_weight``: the workflow's settings): a failed check fails the round with the
    reason (no update; every used reply counted rejected).  The round's counters say what happened to the sampled
    clients: ``secagg-sampled`` / ``secagg-used`` / ``secagg-dropped`` (a client that dropped out of the protocol
    is counted missing, once, not rejected once per stage)."""

    def __init__(self, strategy: FedAdaptStrategy, initial_arrays: dict[str, np.ndarray], *args: Any,
                 clipping_range: float = 8.0, quantization_range: int = 4194304, max_weight: float = 1000.0,
                 **kwargs: Any) -> None:
        #: The plain path's median-relative bound, kept for the aggregate's norm check (check_secagg switches the
        #: per-reply screen off: every reply the server sees is the same average).
        self.norm_ratio = float(strategy.settings.update_norm_ratio)
        check_secagg(strategy)
        super().__init__(strategy, initial_arrays, *args, **kwargs)
        self.clipping_range, self.quantization_range, self.max_weight = clipping_range, quantization_range, max_weight
        self.sampled = 0
        self._norm: float | None = None  # the last checked aggregate's update norm
        #: The update norm of each applied round's aggregate (model records), for :meth:`check_aggregate`.
        self.update_norms: list[float] = []

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> list[Any]:
        picked = super().configure_fit(server_round, parameters, client_manager)
        self.sampled = len(picked)
        return picked

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[tuple[ClientProxy, FitRes] | BaseException],
                      ) -> tuple[Parameters | None, dict[str, Scalar]]:
        clipped = sum(int(res.metrics.get(CLIPPED, 0)) for _, res in results)
        used = len(results)
        dropped = max(0, self.sampled - used)
        if dropped:
            log(WARNING, "secure-aggregation: round %d: %d of %d sampled clients dropped out of the SecAgg+ protocol "
                "(%s); the aggregate is of the %d others", server_round, dropped, self.sampled,
                "; ".join(sorted({str(f) for f in failures}))[:300] or "no masked vector", used)
        self._norm = None
        reason = self.check_aggregate(results) if results else None
        counters = {CLIPPED: float(clipped), "secagg-sampled": float(self.sampled), "secagg-used": float(used),
                    "secagg-dropped": float(dropped)}
        # this adapter's findings join the round's log when the wrapped strategy closes it (its round report)
        rejected = [] if reason is None else [
            Rejection(None, Kind.SECURE_AGGREGATE, f"secure aggregate of {used} replies rejected: {reason}")]
        self.inner.rounds.note(server_round, rejections=rejected, replies_rejected=len(rejected) and used,
                               round_metrics=counters)
        if reason is not None:
            log(WARNING, "secure-aggregation: round %d: the decoded aggregate is rejected: %s", server_round, reason)
            out, metrics = super().aggregate_fit(server_round, [], [])  # no update
        else:
            if results:
                averaged = self._cast(results[0][1])
                for _, res in results:
                    res.parameters = averaged
            # a dropout is missing, not rejected (Flower lists a failure per protocol stage it missed)
            out, metrics = super().aggregate_fit(server_round, results, [])
        report = self.inner.rounds.report(server_round)
        if reason is not None:
            metrics["replies-rejected"] = used
        elif report is not None and report.updated and self._norm is not None:
            self.update_norms.append(self._norm)
        metrics.update(counters)
        if clipped:
            log(WARNING, "secure-aggregation: round %d: %d reply value(s) beyond ±clipping-range were clipped by "
                "SecAgg+ (the mean is off there); raise secagg-clipping-range (or lower secagg-max-weight)",
                server_round, clipped)
        return out, metrics

    def check_aggregate(self, results: list[tuple[ClientProxy, FitRes]]) -> str | None:
        """Why the decoded aggregate of ``results`` cannot be the protocol's honest output (``None``: it can).  It
        strips the clients' canary (:func:`secagg_mod`) from the parameters when present.

        * **range** — every client's weighted, clipped value is within ±c before quantisation, so every coordinate
          of the decoded mean is within ``n·c / Σ w_i`` (``w_i``: the quantised weights of the clear num-examples);
        * **canary** — each client appends the constant 1 (weighted, clipped and masked like its values), so the
          decoded canary is ``Σ min(w_i, c) / Σ w_i`` up to :func:`error_bound`: a shifted weight factor or
          canary shows here;
        * **norm** — the aggregate's update norm (model records, ``x̄ − x_t``) is at most ``update-norm-ratio`` (the
          plain path's bound, default 100) × the lower median of the applied rounds' aggregate update norms."""
        res = results[0][1]
        arrays = parameters_to_ndarrays(res.parameters)
        entries = layout_entries(res.metrics.get(LAYOUT, "[]"))
        if entries is None:
            return f"its '{LAYOUT}' is not a JSON list of [record, key] string pairs (a client sent a malformed layout)"
        n, c, q = len(results), self.clipping_range, self.quantization_range
        weights = [round(float(r.num_examples) / self.max_weight * q) / q for _, r in results]
        total = sum(weights)
        if total <= 0:
            return "the clients' weights sum to 0 (num-examples far below secagg-max-weight)"
        tolerance = error_bound([int(r.num_examples) for _, r in results], c, q, self.max_weight)
        if len(arrays) == len(entries) + 1:
            canary = float(np.asarray(arrays[-1], np.float64).reshape(-1)[0])
            expected = sum(min(w, c) for w in weights) / total
            arrays = arrays[:-1]
            res.parameters = ndarrays_to_parameters(arrays)
            if not abs(canary - expected) <= tolerance:
                return (f"its canary decodes to {canary:.6g}, expected {expected:.6g} ± {tolerance:.2g} (a client's "
                        f"masked vector or weight factor was tampered with, or the clients' num-examples in the clear "
                        f"are not the weights they used)")
        limit = n * c / total * (1 + 1e-9) + tolerance
        for i, a in enumerate(arrays):
            worst = float(np.max(np.abs(a))) if np.size(a) else 0.0
            if not worst <= limit:
                name = ".".join(entries[i]) if i < len(entries) else str(i)
                return (f"'{name}' holds {worst:.4g}, beyond the ±{limit:.4g} that {n} clients' values clipped at "
                        f"±secagg-clipping-range {c:g} can average to (a client's masked vector was tampered with)")
        self._norm = norm = self._update_norm(arrays, entries)
        if self.norm_ratio > 0 and self.update_norms and norm is not None:
            median = float(np.quantile(self.update_norms, 0.5, method="lower"))
            if not norm <= self.norm_ratio * median:
                return (f"its update norm {norm:.4g} exceeds update-norm-ratio {self.norm_ratio:g} × the median "
                        f"{median:.4g} of the earlier rounds' aggregates")
        return None

    def _update_norm(self, arrays: list[np.ndarray], entries: list[list[str]]) -> float | None:
        """The update norm ``‖x̄ − x_t‖`` of the model record of a (canary-free) decoded aggregate (``None``: no
        model record, or no current model)."""
        current = self.inner.current
        if current is None:
            return None
        total, seen = 0.0, False
        for (name, key), arr in zip(entries, arrays, strict=True):
            if name == R.MODEL and key in current and is_float(np.asarray(current[key])):
                diff = np.asarray(arr, np.float64) - np.asarray(current[key], np.float64)
                total, seen = total + float(np.vdot(diff, diff)), True
        return float(np.sqrt(total)) if seen else None

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """As :meth:`LegacyStrategy.evaluate`; a round in which the workflow halted (too few clients answered one of
        its stages, so ``aggregate_fit`` never ran) first counts as a round whose every reply failed."""
        if server_round > 0 and self.inner.rounds.report(server_round) is None:
            reason = "the SecAgg+ protocol halted (too few clients answered one of its stages; see the log)"
            log(WARNING, "secure-aggregation: round %d: %s", server_round, reason)
            super().aggregate_fit(server_round, [], [RuntimeError(reason)])
        return super().evaluate(server_round, parameters)

    def _cast(self, res: FitRes) -> Parameters:
        """The averaged list in the dtypes of the global arrays of the same keys (integers rounded)."""
        layout = str(res.metrics.get(LAYOUT, "[]"))
        arrays = parameters_to_ndarrays(res.parameters)
        try:
            records = unpack(arrays, layout)
        except (ValueError, TypeError):
            return res.parameters  # rejected by the strategy's own layout check
        out: list[np.ndarray] = []
        for named in records.values():
            for key, arr in named.items():
                dtype = self.initial[key].dtype if key in self.initial else arr.dtype
                out.append((np.rint(arr) if np.issubdtype(dtype, np.integer) else arr).astype(dtype))
        return ndarrays_to_parameters(out)


def secaggplus_workflow(num_shares: float, reconstruction_threshold: float, *, clipping_range: float = 8.0,
                        quantization_range: int = 4194304, max_weight: float = 1000.0,
                        timeout: float | None = None) -> Any:
    """Flower's ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))``.  ``num_shares`` / ``reconstruction_
    threshold``: a whole number (> 2 shares) or a fraction in (0, 1] (of the sampled clients / of the shares), as
    Flower reads an int or a float; Flower's own checks raise :class:`ConfigError` here."""
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    def as_flower(value: float) -> int | float:
        return int(value) if float(value).is_integer() and value > 1 else float(value)

    try:
        fit = SecAggPlusWorkflow(as_flower(num_shares), as_flower(reconstruction_threshold),
                                 clipping_range=float(clipping_range), quantization_range=int(quantization_range),
                                 max_weight=float(max_weight), timeout=timeout)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"secure-aggregation = secaggplus: {err}") from None
    return DefaultWorkflow(fit_workflow=fit)


def run_secagg(grid: Any, strategy: SecAggStrategy, num_rounds: int, workflow: Any,
               context: Context | None = None) -> None:
    """Run ``num_rounds`` rounds of ``strategy`` under ``workflow`` (:func:`secaggplus_workflow`) on ``grid``."""
    from flwr.server import LegacyContext, ServerConfig

    base = context or Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    workflow(grid, LegacyContext(context=base, config=ServerConfig(num_rounds=num_rounds), strategy=strategy))


# ------------------------------------------------------------------------------------------ client
def is_secagg(msg: Message) -> bool:
    """Whether ``msg`` is a message of the SecAgg+ protocol (a train message with Flower's SecAgg+ config record)."""
    return msg.metadata.message_type == MessageType.TRAIN and SECAGG_CONFIGS in msg.content.config_records


def secagg_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Client mod: Flower's ``secaggplus_mod`` for SecAgg+ messages, every other message passed on unchanged (so
    one ClientApp serves ordinary and SecAgg+ runs).  The reply's metrics also get :data:`CLIPPED`: how many of its
    values Flower's quantizer will clip (beyond ±clipping-range once multiplied by the client's weight)."""
    if not is_secagg(msg):
        return call_next(msg, context)
    from flwr.client.mod import secaggplus_mod

    # Flower's mod pops entries of the SecAgg+ config record: give it this message's own copy (a SuperNode receives
    # its own deserialized message anyway; an in-process grid may share one content between nodes).
    own = RecordDict(dict(msg.content.items()))
    own[SECAGG_CONFIGS] = ConfigRecord(dict(msg.content.config_records[SECAGG_CONFIGS]))
    msg.content = own

    def counted(inner: Message, ctx: Context) -> Message:
        reply = call_next(inner, ctx)
        if not reply.has_error():
            count_clipped(reply.content, ctx.state.config_records[SECAGG_STATE])
            add_canary(reply.content)
        return reply

    return secaggplus_mod(msg, context, counted)


def layout_entries(layout: Any) -> list[list[str]] | None:
    """The ``[record, key]`` pairs of a reply's layout (:func:`.legacy.pack`), or ``None`` when it is not a JSON list
    of string pairs (the layout comes from a client: a malformed one is a reason, never an exception)."""
    try:
        entries = json.loads(str(layout))
    except ValueError:
        return None
    ok = isinstance(entries, list) and all(
        isinstance(e, list) and len(e) == 2 and all(isinstance(part, str) for part in e) for e in entries)
    return entries if ok else None


def add_canary(fitres: RecordDict) -> None:
    """Append the canary, a constant 1, to a legacy ``FitRes`` record dict's parameters: weighted, clipped, quantised
    and masked like every value, its decoded mean is known to the server (:meth:`SecAggStrategy.check_aggregate`)."""
    record: ArrayRecord = fitres.array_records["fitres.parameters"]
    record[str(len(record))] = Array(np.ones(1, np.float64))


def count_clipped(fitres: RecordDict, state: Mapping[str, Any]) -> int:
    """Count the values of a legacy ``FitRes`` record dict that SecAgg+ clips (state: the mod's saved setup) and
    write the count into its metrics."""
    q = int(state["target_range"])
    n = float(cast(float, fitres.metric_records["fitres.num_examples"]["num_examples"]))
    weight = round(n / float(state["max_weight"]) * q) / q
    limit = float(state["clipping_range"])
    record: ArrayRecord = fitres.array_records["fitres.parameters"]
    count = sum(int(np.count_nonzero(np.abs(a.numpy() * weight) > limit)) for a in record.values())
    fitres.config_records["fitres.metrics"][CLIPPED] = count
    return count
