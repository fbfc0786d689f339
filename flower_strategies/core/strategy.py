"""The shared Message-API strategy every fedadapt method subclasses.

A method writes only its math, through five hooks (none of them touches Flower messages):

* :meth:`~FedAdaptStrategy.uplink_specs` — the records every train reply must carry and their aggregation rule;
* :meth:`~FedAdaptStrategy.init_server_state` — the server state before round 1 (``{name: arrays or scalar}``);
* :meth:`~FedAdaptStrategy.downlink` — named extra arrays sent with the model (read from the server state);
* :meth:`~FedAdaptStrategy.client_config` — per-round client values beyond the declared client hyper-parameters;
* :meth:`~FedAdaptStrategy.server_update` — ``(RoundInputs, state) → (arrays, state, round metrics)``.

The base wires four parts around them, each usable and tested on its own:

* :class:`.sampler.NodeSampler` — live nodes (heartbeats), the seeded draw, node order, silent nodes;
* :class:`.binding.ReplyBinder` — each reply bound to its round: stale, oversized and replayed replies rejected;
* :class:`.screen.ReplyScreen` — client half, reply validation, weight clipping, norm screening, robust selection,
  then one aggregation of the kept replies (:func:`.aggregation.aggregate`);
* :class:`.rounds.RoundBook` — round logs and history, the finite check before a commit, the update counter.

Memory and the in-place update contract: see :meth:`~FedAdaptStrategy.server_update`.  Everything a resumed run
needs is in :meth:`~FedAdaptStrategy.state_dict` (data only: arrays, numbers, strings).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from logging import ERROR, INFO, WARNING
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from . import records as R
from .binding import ReplyBinder
from .hparams import ConfigError, HParams, StrategyConfig
from .local import LocalOptimizer, SGDOptimizer, has_client_half
from .loop import run_rounds
from .ops import NamedArrays, cast_like, decayed_lr, is_float, merge_buffers
from .policy import RunFailed
from .privacy import PrivacyPolicy, refuse_flower_dp, released_rounds
from .rejections import Kind, Rejection, client_error_text
from .robust import TRUST_RULES, VECTOR_RULES, TooFewReplies, byzantine_count, check_replies
from .rounds import (RoundBook, RoundInputs, RoundLog, ServerState, ServerUpdate, loss_alarm, mean_reply_metrics,
                     stall_alarm, weighted_mean)
from .sampler import NodeSampler
from .screen import ClientHalfMissing, ReplyScreen, ScreenPolicy
from .validation import RecordSpec

__all__ = ["ClientHalfMissing", "FedAdaptStrategy", "RecordSpec", "RoundInputs", "RoundLog", "ServerState",
           "cast_like", "weighted_mean"]

#: The settings a strategy takes as keyword arguments (``FedAvg(client_lr=0.1)``) and reads as ``self.settings.x``;
#: ``method`` is the class's registry name and ``weighting`` resolves ``"default"`` to the method's own (see
#: :attr:`FedAdaptStrategy.weighting`).
SETTINGS = frozenset(f.name for f in dataclasses.fields(StrategyConfig)) - {"method", "num_server_rounds"}


class FedAdaptStrategy(Strategy):
    """Base class of all fedadapt strategies (Message API, ``flwr.serverapp.strategy``).

    ``FedLADA(FedLADA.make_hparams(amend_weight=0.05), client_lr=0.01, fraction_train=0.5, seed=0)``

    Parameters
    ----------
    hparams
        The method's frozen hyper-parameter dataclass (paper defaults when omitted).
    settings
        The run-wide settings (:class:`~flower_strategies.core.hparams.StrategyConfig` or an app's extension of it,
        documented as the run-config keys), kept as :attr:`settings` and read there (``self.settings.client_lr``;
        a key left unset for a profile to decide, e.g. ``aggregator``, through :meth:`.StrategyConfig.setting`).
        A change is an explicit, validated copy: ``s.settings = s.settings.replace(max_update_norm=5.0)``.
    overrides
        Settings fields by name, applied to ``settings`` (default ``StrategyConfig()``) in one validated replace.
    trainable_keys
        Keys of the global arrays that are trainable parameters.  Server optimizers act only on these (and only if
        floating point); other floating arrays (e.g. BatchNorm statistics) are averaged and integer arrays keep the
        server's value.  ``None`` = every floating-point array.  (A property of the model, not a run-config key.)
    min_evaluate_nodes
        Minimum nodes of client-side evaluation (``fraction_evaluate`` > 0; Flower's own default 1).
    num_rounds
        Total rounds (round-dependent schedules; ``None`` = unknown): set by :meth:`start` or ``num-server-rounds``.
    method
        Registry name sent to clients (default: the class's); aliases pass their own name.
    """

    #: Registry name; sent to clients so that the generic ClientApp picks the matching local optimizer.
    method: ClassVar[str] = ""
    hparams_class: ClassVar[type[HParams]] = HParams
    #: The client half: the local optimizer the ClientApp builds for this method.
    local_optimizer: ClassVar[type[LocalOptimizer]] = SGDOptimizer
    default_weighting: ClassVar[str] = "examples"
    #: Whether :meth:`server_update` reads the clients' ``train-loss-before`` metric (the app then asks clients for it).
    needs_train_loss_before: ClassVar[bool] = False
    #: Whether ``client-lr = 0`` is a meaningful setting (LocalUpdate's γ = 0); elsewhere clients would not train.
    accepts_zero_client_lr: ClassVar[bool] = False
    #: Hyper-parameter defaults of this class (and its registry name) that differ from :attr:`hparams_class`'s
    #: declaration, by field name: an alias class's (``FedAdam``: ``{"server_opt": "adam", "server_lr": 0.01}``).
    hparam_defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    #: Set when :meth:`summary` runs outside :meth:`driven`: another strategy's ``start()`` (a wrapper's, e.g. one
    #: of Flower's DP wrappers) runs this one (:func:`.privacy.refuse_flower_dp`).
    started_by_another: bool = False
    #: Set by :meth:`start`: the clients are the app's own ClientApp (:meth:`client_settings`).
    apps_clients: bool = False
    _driving: int = 0
    _stall_warned: bool = False
    #: ``aggregator = fltrust`` (``defence = "robust"``): the server's own local procedure on its trusted root set —
    #: given a round's train content (what the clients receive), the reply's records it trains from it
    #: (``{record name: named arrays}``, e.g. ``{"arrays": model}``: at least the records :meth:`uplink_specs` names
    #: first).  The fedadapt ServerApp sets it from the task and ``root-set-size``; a library user sets their own.
    root_update: Callable[[RecordDict], dict[str, NamedArrays]] | None = None

    @classmethod
    def make_hparams(cls, **changes: Any) -> HParams:
        """This class's hyper-parameters: the declaration's defaults, then :attr:`hparam_defaults`, then
        ``changes``."""
        return cls.hparams_class(**{**cls.hparam_defaults, **changes})

    def __init__(
        self,
        hparams: HParams | None = None,
        *,
        settings: StrategyConfig | None = None,
        trainable_keys: Iterable[str] | None = None,
        min_evaluate_nodes: int = 1,
        num_rounds: int | None = None,
        method: str | None = None,
        **overrides: Any,
    ) -> None:
        self.hparams = hparams if hparams is not None else self.make_hparams()
        if not isinstance(self.hparams, self.hparams_class):
            raise TypeError(f"{type(self).__name__} needs {self.hparams_class.__name__}, got {self.hparams!r}")
        unknown = sorted(set(overrides) - SETTINGS)
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unknown setting(s) {unknown}; "
                            f"settings: {', '.join(sorted(SETTINGS))}")
        if "weighting" in overrides and overrides["weighting"] is None:
            overrides["weighting"] = "default"
        base = settings if settings is not None else StrategyConfig(method=method or self.method or "fedavg")
        self.settings: StrategyConfig = base.replace(**overrides) if overrides else base
        if method is not None:
            self.method = method  # type: ignore[misc]  # an alias's registry name
        if self.settings.client_lr == 0 and not self.accepts_zero_client_lr:
            raise ConfigError(f"client-lr = 0.0 is out of range; must be > 0.0 ({self.method} would not train)")
        self.trainable_keys = None if trainable_keys is None else list(trainable_keys)
        self.min_evaluate_nodes = int(min_evaluate_nodes)
        self.num_rounds = num_rounds
        self.sampler = NodeSampler(self.settings.seed)
        self.rounds = RoundBook()
        self.binder = ReplyBinder()  # replies bound to their round (stale, oversized, replayed: rejected)
        self.current: NamedArrays | None = None
        self.server_state: ServerState | None = None
        self.root: dict[str, NamedArrays] | None = None  # the server's root-set reply of the round (FLTrust)
        self.centre: NamedArrays | None = None  # the last round's model update (centered clipping's momentum)
        self._previous: NamedArrays | None = None

    @property
    def weighting(self) -> str:
        """``"examples"`` or ``"uniform"``: the settings' ``weighting`` (:meth:`.StrategyConfig.setting`: native DP's
        when left ``"default"``), else (``"default"``) the method's own, :attr:`default_weighting`."""
        weighting = self.settings.setting("weighting")
        return self.default_weighting if weighting == "default" else weighting

    # the parts' state, under the names callers use
    nodes_seen = property(lambda self: self.sampler.nodes_seen)
    history = property(lambda self: self.rounds.history)
    num_updates = property(lambda self: self.rounds.num_updates)

    # ------------------------------------------------------------------ hooks for subclasses
    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        """Records every train reply must carry (besides ``metrics``)."""
        return (RecordSpec(R.MODEL, "mean", "model"),)

    def init_server_state(self, arrays: NamedArrays) -> ServerState:
        """The server state before round 1 (default: none)."""
        return {}

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        """Named extra arrays sent with the model this round (default: none); the base casts every array whose key
        the model has to the model's dtype of that key."""
        return {}

    def client_config(self, server_round: int) -> dict[str, Any]:
        """Per-round client values beyond the declared client hyper-parameters (default: none)."""
        return {}

    def client_lr_at(self, server_round: int) -> float:
        """Client learning rate of ``server_round``: ``client_lr``, times ``client_lr_decay`` after every round when
        the method's hyper-parameters declare that field (:func:`.hparams.client_lr_decay_param`)."""
        decay = getattr(self.hparams, "client_lr_decay", None)
        client_lr = self.settings.client_lr
        return client_lr if decay is None else decayed_lr(client_lr, decay, server_round)

    def server_update(self, inputs: RoundInputs, state: ServerState) -> ServerUpdate:
        """The server math: ``(new global arrays, new server state, round metrics)``.  It may write into
        ``inputs.aggregates`` (the round's own buffers) but returns its new state in new arrays; the base commits the
        result only when every value is finite."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers for subclasses
    def trainable(self, arrays: Mapping[str, np.ndarray]) -> list[str]:
        """Trainable floating-point keys of ``arrays`` (what server optimizers act on)."""
        keys = self.trainable_keys if self.trainable_keys is not None else list(arrays)
        return [k for k in keys if k in arrays and is_float(np.asarray(arrays[k]))]

    #: Complete new trainable arrays with the non-trainable ones (:func:`.ops.merge_buffers`).
    merge_buffers = staticmethod(merge_buffers)

    def round_config(self, server_round: int) -> dict[str, Any]:
        """The round's ConfigRecord entries: plan + declared client hyper-parameters + :meth:`client_config`."""
        s = self.settings
        cfg: dict[str, Any] = {R.METHOD: self.method, R.CLIENT_LR: self.client_lr_at(server_round),
                               R.LOCAL_EPOCHS: s.local_epochs, R.LOCAL_STEPS: s.local_steps, R.BATCH_SIZE: s.batch_size}
        # what the client half must know (core/client/wire.py), so that a client imports no server-side module
        cfg.update({R.CLIENT_HALF: self.needs_client_half, R.LOCAL_OPTIMIZER: self.local_optimizer.__name__,
                    R.LOSS_BEFORE: self.needs_train_loss_before,
                    R.FULL_GRADIENT: self.local_optimizer.needs_full_gradient})
        if s.loss_before_max_examples > 0:
            cfg[R.LOSS_BEFORE_MAX] = s.loss_before_max_examples
        cfg.update(self.hparams.to_wire(self.method))
        cfg.update(self.client_config(server_round))
        return cfg

    def log_settings(self) -> list[str]:
        return [f"{k} = {v}" for k, v in vars(self.hparams).items()]

    @property
    def needs_client_half(self) -> bool:
        """Whether replies must come from this method's client half (:func:`.local.has_client_half`)."""
        return has_client_half(self.local_optimizer, self.hparams.client_values())

    # ------------------------------------------------------------------ sampling (NodeSampler)
    def order_nodes(self, order: Mapping[int, Any]) -> None:
        """Order nodes by ``order[node_id]`` (e.g. their partition id) before sampling (fallback: node id)."""
        self.sampler.order_nodes(order)

    def sample(self, grid: Grid, fraction: float, minimum: int) -> list[int]:
        """Wait (at most ``wait_for_nodes`` s) for ``min_available_nodes`` live nodes, then draw from them
        (:meth:`.NodeSampler.sample`: live = heartbeat since any missed reply; seeded; in :attr:`node_order`)."""
        return self.sampler.sample(grid, fraction, minimum, min_available=self.settings.min_available_nodes,
                                   wait_s=self.settings.wait_for_nodes)

    # ------------------------------------------------------------------ Strategy API
    def summary(self) -> None:
        if not self._driving:  # Flower's Strategy.start of a wrapper calls the wrapped strategy's summary()
            self.started_by_another = True
        s = self.settings
        log(INFO, "\t├──> %s (%s) settings:", type(self).__name__, self.method)
        for line in self.log_settings():
            log(INFO, "\t│\t├── %s", line)
        log(INFO, "\t│\t└── %s | weighting %s | seed %s", self.client_settings(), self.weighting, s.seed)

    def client_settings(self) -> str:
        """The client-side settings as the summary shows them.  fedadapt's ServerApp runs fedadapt's ClientApp, which
        trains as they say; under :meth:`start` or another strategy's (a user's ServerApp: :attr:`apps_clients`) the
        app's own ClientApp decides its optimizer, batch size and loop: only the lr it is sent (``rnd.lr``) and the
        batches ``rnd.loader`` yields come from here."""
        s = self.settings
        if not (self.apps_clients or self.started_by_another):
            return (f"client-lr {s.client_lr} | local-steps {s.local_steps} | local-epochs {s.local_epochs} | "
                    f"batch-size {s.batch_size}")
        plan = (f"local-steps {s.local_steps} batches" if s.local_steps else
                f"local-epochs {s.local_epochs} × ⌈n / batch-size {s.batch_size}⌉ batches")
        return (f"client-side (the app decides): client-lr {s.client_lr} sent as rnd.lr; rnd.loader yields {plan} "
                f"of the app's loader; the clients' num-steps and train-loss follow in each round's MetricRecord")

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's ``Strategy.start`` (same arguments, same loop, the same log lines: each round's aggregated
        client evaluate metrics and central ``evaluate_fn`` MetricRecord, the final results), run by fedadapt's one
        round loop (:func:`.loop.run_rounds`), which fails a run that trains nothing (:mod:`.policy`; logged and
        raised)."""
        self.apps_clients = True
        try:
            with self.driven():
                return run_rounds(self, grid, initial_arrays, num_rounds, timeout, evaluate_fn,
                                  train_config=train_config, evaluate_config=evaluate_config, flower_log=True)
        except RunFailed as err:
            log(ERROR, "fedadapt: run FAILED: %s", err)
            raise

    @contextmanager
    def driven(self) -> Iterator[None]:
        """fedadapt's own drivers (:meth:`start`, the app's round loops) run the strategy inside this: a
        :meth:`summary` outside it came from another strategy's ``start()`` (:attr:`started_by_another`)."""
        self._driving += 1
        try:
            yield
        finally:
            self._driving -= 1

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        node_ids = self.sample(grid, self.settings.fraction_train, self.settings.min_train_nodes)
        content = self.prepare_round(server_round, arrays, config, len(node_ids))
        self.sampler.expect(node_ids)
        log(INFO, "configure_train: sampled %d of %d nodes", len(node_ids), self.sampler.population)
        return self.binder.expect(Message(content, n, MessageType.TRAIN) for n in node_ids)

    def prepare_round(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                      num_sampled: int) -> RecordDict:
        """The train content of this round: model + downlink extras (in the model's dtypes) + round ConfigRecord
        (transport-agnostic; the legacy adapter uses it too)."""
        refuse_flower_dp(self, config)  # Flower's DP wrappers compose only with model averaging (core/privacy.py)
        self.check_sample_size(num_sampled)
        rlog = self.rounds.open(server_round, num_sampled)  # the round's clock starts here
        self.current = R.views(arrays)  # read-only, zero-copy: the server math never writes into x_t
        if self.server_state is None:
            self.server_state = self.init_server_state(self.current)
        cfg = ConfigRecord(dict(config))
        cfg[R.SERVER_ROUND] = server_round
        cfg.update(self.round_config(server_round))  # ConfigRecord validates each value as on item assignment
        extras = {name: cast_like(v, self.current) for name, v in self.downlink(server_round).items()}
        clash = set(extras) & {R.MODEL, R.CONFIG}
        if clash:
            raise ValueError(f"downlink record names clash with reserved names: {sorted(clash)}")
        content = RecordDict({R.MODEL: arrays, **{k: R.to_record(v) for k, v in extras.items()}, R.CONFIG: cfg})
        rlog.bytes_down = R.arrays_nbytes(content) * num_sampled
        self.robust_references(content)
        return content

    def robust_references(self, content: RecordDict) -> None:
        """What a robust aggregator compares the round's replies with: FLTrust's root-set model (:attr:`root`, from
        :attr:`root_update` on the round's train ``content``), centered clipping's centre (:attr:`centre`, the last
        round's model update).  Nothing under the other aggregators."""
        assert self.current is not None
        aggregator = self.settings.setting("aggregator")
        if aggregator in TRUST_RULES:
            if self.root_update is None:
                raise ConfigError(
                    f"aggregator {aggregator} (defence = robust) needs the server's own update on a trusted root set: "
                    f"set root-set-size > 0 (the fedadapt ServerApp), or give the strategy a root_update callable "
                    f"(docs/robustness.md); or choose another aggregator")
            self.root = dict(self.root_update(content))
        if aggregator in VECTOR_RULES:
            previous = self._previous
            self.centre = None if previous is None else {
                k: np.asarray(v, np.float64) - previous[k] for k, v in self.current.items()
                if is_float(np.asarray(v)) and k in previous}
            self._previous = {k: np.array(v, np.float64) for k, v in self.current.items() if is_float(np.asarray(v))}

    def check_sample_size(self, num_sampled: int) -> None:
        """A robust ``aggregator`` whose sample is too small for its ``byzantine-fraction`` (:func:`.robust.
        min_replies`) would refuse every round: before the run's first round that is a :class:`ConfigError` naming
        the fix (nothing has been sent); later (nodes lost) a warning, and the round's replies are refused with the
        reason as they arrive."""
        aggregator, fraction = self.settings.setting("aggregator"), self.settings.byzantine_fraction
        if aggregator == "mean" or num_sampled <= 0:
            return
        try:
            check_replies(aggregator, byzantine_count(fraction, num_sampled), num_sampled, fraction)
        except TooFewReplies as err:
            if not self.history:
                raise ConfigError(f"{err} (with {num_sampled} sampled nodes every round would be refused)") from None
            log(WARNING, "%s (%d nodes sampled this round)", err, num_sampled)

    def reply_screen(self) -> ReplyScreen:
        """This round's :class:`.ReplyScreen` (the current model, uplink specs, trainable keys and settings)."""
        assert self.current is not None
        policy = ScreenPolicy.from_settings(self.settings, self.weighting)
        return ReplyScreen(self.current, self.uplink_specs(), self.trainable(self.current), policy, self.method,
                           self.needs_client_half, root=self.root, centre=self.centre, seed=self.settings.seed,
                           aggregate=not PrivacyPolicy.from_settings(self.settings).enabled)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        rlog = self.rounds.take(server_round)
        replies = self.sampler.settle(server_round, replies)  # in node order, less the never-answered
        rlog.bytes_up = sum(R.arrays_nbytes(m.content) for m in replies if not m.has_error())
        screen = self.reply_screen()
        screened = self.binder.run(server_round, replies, screen, self.settings.max_reply_bytes)
        privacy = PrivacyPolicy.from_settings(self.settings)
        dp_metrics: dict[str, float] = {}
        if privacy.enabled and screened.kept:  # native DP: clipped, noised aggregates
            screened.aggregates, dp_metrics = privacy.privatize(
                self.method, screen.specs, [parsed for _, parsed in screened.kept], screen.current, rlog.sampled,
                max(self.sampler.population, rlog.sampled), released_rounds(self.history))
        rlog.rejections += screened.rejections
        rlog.replies_rejected += len(screened.rejections)
        reply_metrics, clipped = screened.reply_metrics()
        rlog.replies_used = len(reply_metrics)
        metrics_out: dict[str, Any] = {**mean_reply_metrics(reply_metrics), "replies-used": rlog.replies_used,
                                       "replies-rejected": rlog.replies_rejected, "weights-clipped": clipped,
                                       "updates-clipped": screened.updates_clipped}
        self._warn_divergence(server_round, reply_metrics, metrics_out,
                              [r for r in screened.rejections if r.kind is Kind.NONFINITE])
        new_arrays: ArrayRecord | None = None
        if rlog.replies_used < self.settings.min_replies:
            log(WARNING, "Round %d: %d valid replies < min-replies %d; keeping the previous model",
                server_round, rlog.replies_used, self.settings.min_replies)
        else:
            new_arrays, round_metrics = self._update(server_round, screened.aggregates, reply_metrics)
            rlog.round_metrics = {**round_metrics, **(dp_metrics if new_arrays is not None else {})}
            metrics_out.update(rlog.round_metrics)
            rlog.updated = new_arrays is not None
        self.rounds.close(rlog, metrics_out)
        self._warn_stall(server_round)
        return new_arrays, MetricRecord(metrics_out)

    def _warn_divergence(self, server_round: int, reply_metrics: list[dict[str, Any]], means: Mapping[str, Any],
                         nonfinite: list[Rejection]) -> None:
        """A warning naming the learning rates when the clients' training loss explodes (:func:`.rounds.loss_alarm`)
        or replies were rejected for NaN/Inf values (``nonfinite``: the round's :attr:`.rejections.Kind.NONFINITE`
        rejections): a run that goes on would otherwise "complete" at chance."""
        why = loss_alarm(reply_metrics, means, self.rounds.lowest_train_loss())
        if why is None and nonfinite:
            why = f"{len(nonfinite)} replies were rejected for non-finite values ({nonfinite[0]})"
        if why is None:
            return
        log(WARNING, "Round %d: training is diverging: %s. The learning rate is likely too high: %s; try it ÷10 "
            "(docs/plugin.md: client-lr factors)", server_round, why, self._lrs(server_round))

    def _warn_stall(self, server_round: int) -> None:
        """A warning naming the learning rates when the clients' train loss stays flat at round 1's level
        (:func:`.rounds.stall_alarm`), once per run: a run that goes on would otherwise "complete" at its initial
        accuracy, or at one predicted class."""
        why = None if self._stall_warned else stall_alarm(self.history)
        if why is not None:
            self._stall_warned = True
            log(WARNING, "Round %d: training is not progressing: %s. A learning rate far too low does this, and so "
                "does one so high that the model collapsed to one class: %s; try it ×3 and ÷3 (docs/plugin.md: "
                "client-lr factors)", server_round, why, self._lrs(server_round))

    def _lrs(self, server_round: int) -> str:
        lrs = f"client lr {self.client_lr_at(server_round):g} (run-config client-lr, or your app's name for it)"
        server_lr = getattr(self.hparams, "server_lr", None)
        if isinstance(server_lr, (int, float)):
            lrs += f", server lr {server_lr:g} ({self.method}.server-lr)"
        return lrs

    def _update(
        self, server_round: int, aggregates: dict[str, NamedArrays], reply_metrics: list[dict[str, Any]]
    ) -> tuple[ArrayRecord | None, dict[str, float]]:
        assert self.current is not None and self.server_state is not None
        steps = [(float(m.get(R.NUM_STEPS, 0.0)), float(m[R.NUM_EXAMPLES])) for m in reply_metrics]
        inputs = RoundInputs(
            server_round=server_round, current=self.current, aggregates=aggregates,
            reply_metrics=tuple(reply_metrics), mean_steps=weighted_mean(steps, self.weighting),
            trainable=tuple(self.trainable(self.current)), num_updates=self.num_updates, nodes_seen=self.nodes_seen,
        )
        new, state, round_metrics = self.server_update(inputs, self.server_state)
        aggregates.clear()  # the round's buffers live on only where the update kept them (e.g. as the new model)
        if not self.rounds.commit(server_round, new, state):
            return None, {}
        self.server_state = state
        return R.to_record(new, consume=True), {k: float(v) for k, v in round_metrics.items()}

    # ------------------------------------------------------------------ checkpoint state (data only)
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit-exactly, as data: the server state (arrays and
        scalars), the sampling RNG, the update counter, the nodes seen, the per-round history and the reply digests."""
        parts = (self.sampler, self.rounds, self.binder)
        return {"server_state": self.server_state, **{k: v for p in parts for k, v in p.state_dict().items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict` on a freshly built strategy of the same class and settings."""
        for part in (self.sampler, self.rounds, self.binder):
            part.load_state_dict(state)
        self.server_state = None if state["server_state"] is None else dict(state["server_state"])

    # ------------------------------------------------------------------ client-side evaluation (off by default)
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if self.settings.fraction_evaluate <= 0.0:
            return []
        node_ids = self.sample(grid, self.settings.fraction_evaluate, self.min_evaluate_nodes)
        content = RecordDict({R.MODEL: arrays, R.CONFIG: ConfigRecord({**config, R.SERVER_ROUND: server_round})})
        return [Message(content, n, MessageType.EVALUATE) for n in node_ids]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted means of the clients' evaluation metrics (each reply's ``"metrics"`` MetricRecord, or its
        only MetricRecord, with ``num-examples`` > 0).  Logs, as Flower's own strategies do, how many replies came
        back and failed (the failures' reasons, grouped), and warns when no reply carried usable metrics."""
        replies = list(replies)
        failed = [m for m in replies if m.has_error()]
        log(INFO, "aggregate_evaluate: Received %d results and %d failures", len(replies) - len(failed), len(failed))
        for line in failure_summary(failed):
            log(INFO, "\t> %s", line)
        usable: list[dict[str, Any]] = []
        for m in replies:
            rec = None if m.has_error() else evaluate_metrics(m.content)
            n = None if rec is None else rec.get(R.NUM_EXAMPLES)
            if rec is not None and isinstance(n, (int, float)) and n > 0:
                usable.append(dict(rec))
        if replies and not usable:
            if len(failed) == len(replies):
                why = f"all {len(failed)} client evaluations failed ({failure_summary(failed)[0]})"
            else:
                why = (f"{len(replies) - len(failed)} client evaluation reply(ies) carried no usable metrics: "
                       f"@app.evaluate() must reply with a MetricRecord under "
                       f"'{R.METRICS}' holding '{R.NUM_EXAMPLES}' > 0, e.g. RecordDict({{'{R.METRICS}': "
                       f"MetricRecord({{'eval_acc': acc, '{R.NUM_EXAMPLES}': n}})}})")
            log(WARNING, "Round %d: no client-side evaluate metrics: %s", server_round, why)
        return MetricRecord({**mean_reply_metrics(usable)}) if usable else None


class _InSettings:
    """A run setting's name on a strategy (``strategy.client_lr``): reading or assigning it raises an AttributeError
    that says where the setting lives (``strategy.settings``) and how to change it (``settings.replace``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _error(self, owner: type) -> AttributeError:
        return AttributeError(f"{owner.__name__} keeps its run settings in .settings: read strategy.settings."
                              f"{self.name}; change it with strategy.settings = strategy.settings.replace("
                              f"{self.name}=...) (validated)")

    def __get__(self, obj: Any, owner: type) -> Any:
        raise self._error(owner)

    def __set__(self, obj: Any, value: Any) -> None:
        raise self._error(type(obj))


for _name in SETTINGS - {"weighting"}:  # ``weighting`` is a real property (the method's default resolved)
    setattr(FedAdaptStrategy, _name, _InSettings(_name))


def evaluate_metrics(content: RecordDict) -> MetricRecord | None:
    """An evaluate reply's metrics: its ``"metrics"`` MetricRecord, else its only MetricRecord, else ``None``."""
    rec = R.get(content, R.METRICS, MetricRecord)
    if rec is not None:
        return rec
    found = [r for _, r in R.of_type(content, MetricRecord)]
    return found[0] if len(found) == 1 else None


def failure_summary(failed: Iterable[Message], width: int = 300) -> list[str]:
    """One line per distinct error reason of ``failed`` replies: how many, from which nodes, the reason (the user's
    exception first, :func:`.rejections.client_error_text`; its first ``width`` characters)."""
    by_reason: dict[str, list[int]] = {}
    for m in failed:
        reason = client_error_text(m.error.reason)
        by_reason.setdefault(reason[:width] + ("…" if len(reason) > width else ""), []).append(m.metadata.src_node_id)
    return [f"{len(nodes)} failure{'s' if len(nodes) > 1 else ''} from node{'s' if len(nodes) > 1 else ''} "
            f"{', '.join(map(str, nodes[:8]))}{', …' if len(nodes) > 8 else ''}: {reason}"
            for reason, nodes in by_reason.items()]
