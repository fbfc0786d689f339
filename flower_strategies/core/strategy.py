"""The shared Message-API strategy every fedadapt method subclasses.

A method writes only its math, through the hooks of :attr:`FedAdaptStrategy.method_hooks` (none of them touches
Flower messages; the main one, :meth:`~FedAdaptStrategy.server_update`, maps ``(RoundInputs, state)`` to ``(arrays,
state, round metrics)``), and declares :attr:`FedAdaptStrategy.method_contract` (docs/extending.md).  The base wires
four parts around them, each usable and tested on its own: :class:`.sampler.NodeSampler` (live nodes, the seeded
draw, node order, silent nodes), :class:`.binding.ReplyBinder` (each reply bound to its round: stale, oversized and
replayed replies rejected), :class:`.screen.ReplyScreen` (client half, reply validation, weight clipping, norm
screening, robust selection, then one aggregation of the kept replies) and :class:`.rounds.RoundBook` (round logs
and history, the finite check before a commit, the update counter).  A resumed run needs only
:meth:`~FedAdaptStrategy.state_dict` (data: arrays, numbers, strings)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
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
from .evaluation import ClientEvaluation
from .hparams import ConfigError, HParams, StrategyConfig
from .local import LocalOptimizer, SGDOptimizer, has_client_half
from .loop import run_rounds
from .ops import NamedArrays, cast_like, decayed_lr, is_float, merge_buffers
from .policy import RunFailed
from .privacy import PrivacyPolicy, refuse_flower_dp, released_rounds
from .rejections import Kind
from .references import centre_reference, check_sample_size, root_reference
from .rootset import RootUpdateSlot
from .rounds import (RoundBook, RoundInputs, RoundLog, ServerState, ServerUpdate, loss_alarm,
                     stall_alarm, warn_divergence, warn_stall, weighted_mean)
from .sampler import NodeSampler
from .screen import ClientHalfMissing, ReplyScreen, ScreenPolicy
from .strategy_settings import SETTINGS, client_settings_line, point_to_settings, strategy_settings
from .validation import RecordSpec

__all__ = ["ClientHalfMissing", "FedAdaptStrategy", "RecordSpec", "RoundInputs", "RoundLog", "ServerState",
           "cast_like", "weighted_mean"]

class FedAdaptStrategy(RootUpdateSlot, ClientEvaluation, Strategy):
    """Base class of all fedadapt strategies (Message API, ``flwr.serverapp.strategy``).

    ``FedLADA(FedLADA.make_hparams(amend_weight=0.05), client_lr=0.01, fraction_train=0.5, seed=0)``

    * ``hparams``: the method's frozen hyper-parameter dataclass (paper defaults when omitted);
    * ``settings``: the run-wide settings (:class:`~flower_strategies.core.hparams.StrategyConfig` or an app's
      extension of it), kept as :attr:`settings` and read there (``self.settings.client_lr``, and a key a profile
      decided the same way: resolved once); a change is an explicit, validated copy
      (``s.settings = s.settings.replace(max_update_norm=5.0)``); ``**overrides``: settings fields by name, applied
      to ``settings`` (default ``StrategyConfig()``) in one validated replace;
    * ``trainable_keys``: the keys of the trainable parameters (a property of the model, not a run-config key).
      Server optimizers act only on these (if floating point); other floating arrays (e.g. BatchNorm statistics)
      are averaged, integer arrays keep the server's value.  ``None`` = every floating-point array;
    * ``min_evaluate_nodes``: the fewest nodes of client-side evaluation (Flower's own default 1);
    * ``num_rounds``: total rounds (``None`` = unknown), set by :meth:`start` or ``num-server-rounds``;
    * ``method``: the registry name sent to clients (default: the class's); an alias passes its own.
    """

    #: The method contract: what a method class declares besides its hooks, each declared (and documented) here
    #: and read as an attribute wherever it is needed, never probed; docs/extending.md lists the same names.
    method_contract: ClassVar[tuple[str, ...]] = (
        "method", "hparams_class", "local_optimizer", "default_weighting", "needs_train_loss_before",
        "accepts_zero_client_lr", "hparam_defaults", "averages_models")
    #: The hooks a method writes (its math; none of them touches Flower messages).
    method_hooks: ClassVar[tuple[str, ...]] = (
        "uplink_specs", "init_server_state", "downlink", "client_config", "client_lr_at", "server_update")
    #: Registry name; sent to clients so that the generic ClientApp picks the matching local optimizer.
    method: ClassVar[str] = ""
    #: The method's frozen hyper-parameter declaration (:mod:`flower_strategies.optimizers`): its fields are the
    #: ``<method>.<key>`` run-config keys; those declared ``client=True`` are the local optimizer's.
    hparams_class: ClassVar[type[HParams]] = HParams
    #: The client half: the local optimizer the ClientApp builds for this method.
    local_optimizer: ClassVar[type[LocalOptimizer]] = SGDOptimizer
    #: ``"examples"`` or ``"uniform"``: the client weights of the method's paper, used when ``weighting`` is left
    #: ``"default"`` (:attr:`weighting`).
    default_weighting: ClassVar[str] = "examples"
    #: Whether :meth:`server_update` reads the clients' ``train-loss-before`` metric (the app then asks clients for it).
    needs_train_loss_before: ClassVar[bool] = False
    #: Whether ``client-lr = 0`` is a meaningful setting (LocalUpdate's γ = 0); elsewhere clients would not train.
    accepts_zero_client_lr: ClassVar[bool] = False
    #: Hyper-parameter defaults of this class (and its registry name) that differ from :attr:`hparams_class`'s
    #: declaration, by field name: an alias class's (``FedAdam``: ``{"server_opt": "adam", "server_lr": 0.01}``).
    hparam_defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    #: Whether the clients are the app's own ClientApp, whose loop decides its optimizer, batch size and epochs
    #: (:meth:`client_settings`): a library user's app (the default, and :meth:`start`); fedadapt's ServerApp, which
    #: runs fedadapt's ClientApp, sets it False.
    apps_clients: bool = True
    _stall_warned: bool = False
    @property
    def averages_models(self) -> bool:
        """Whether the new model is the (weighted) mean of the replies' models and nothing else is uploaded or kept
        (FedAvg / FedProx with the plain server step): only then do Flower's DP wrappers compose with it."""
        return False

    @classmethod
    def make_hparams(cls, **changes: Any) -> HParams:
        """This class's hyper-parameters: the declaration's defaults, then :attr:`hparam_defaults`, then ``changes``."""
        return cls.hparams_class(**{**cls.hparam_defaults, **changes})

    def __init__(self, hparams: HParams | None = None, *, settings: StrategyConfig | None = None,
                 trainable_keys: Iterable[str] | None = None, min_evaluate_nodes: int = 1,
                 num_rounds: int | None = None, method: str | None = None, **overrides: Any) -> None:
        self.hparams = hparams if hparams is not None else self.make_hparams()
        if not isinstance(self.hparams, self.hparams_class):
            raise TypeError(f"{type(self).__name__} needs {self.hparams_class.__name__}, got {self.hparams!r}")
        self.settings: StrategyConfig = strategy_settings(type(self).__name__, settings,
                                                          method or self.method or "fedavg", overrides)
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
        self.sent: dict[str, NamedArrays] = {}  # the round's downlink records (the screen's invariants read them)
        self.centre: NamedArrays | None = None  # the last round's model update (centered clipping's momentum)
        self._previous: NamedArrays | None = None

    @property
    def weighting(self) -> str:
        """``"examples"`` or ``"uniform"``: the settings' ``weighting`` (already native DP's when DP is on), else
        (``"default"``) the method's own, :attr:`default_weighting`."""
        return self.default_weighting if self.settings.weighting == "default" else self.settings.weighting

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
        """The round's ConfigRecord entries: the plan, what the client half must know (core/client/wire.py: so that
        a client imports no server-side module), the declared client hyper-parameters, :meth:`client_config`."""
        s, opt, before_max = self.settings, self.local_optimizer, self.settings.loss_before_max_examples
        return {R.METHOD: self.method, R.CLIENT_LR: self.client_lr_at(server_round), R.LOCAL_EPOCHS: s.local_epochs,
                R.LOCAL_STEPS: s.local_steps, R.BATCH_SIZE: s.batch_size, R.CLIENT_HALF: self.needs_client_half,
                R.LOCAL_OPTIMIZER: opt.__name__, R.LOSS_BEFORE: self.needs_train_loss_before,
                R.FULL_GRADIENT: opt.needs_full_gradient, **({R.LOSS_BEFORE_MAX: before_max} if before_max > 0 else {}),
                **self.hparams.to_wire(self.method), **self.client_config(server_round)}

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
        s = self.settings
        log(INFO, "\t├──> %s (%s) settings:", type(self).__name__, self.method)
        for line in self.log_settings():
            log(INFO, "\t│\t├── %s", line)
        log(INFO, "\t│\t└── %s | weighting %s | seed %s", client_settings_line(s, self.apps_clients), self.weighting,
            s.seed)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's ``Strategy.start`` (same arguments, same loop, the same log lines: each round's aggregated
        client evaluate metrics and central ``evaluate_fn`` MetricRecord, the final results), run by fedadapt's one
        round loop (:func:`.loop.run_rounds`), which fails a run that trains nothing (:mod:`.policy`; logged and
        raised)."""
        self.apps_clients = True
        try:
            return run_rounds(self, grid, initial_arrays, num_rounds, timeout, evaluate_fn,
                              train_config=train_config, evaluate_config=evaluate_config, flower_log=True)
        except RunFailed as err:
            log(ERROR, "fedadapt: run FAILED: %s", err)
            raise

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        node_ids = self.sample(grid, self.settings.fraction_train, self.settings.min_train_nodes)
        content = self.prepare_round(server_round, arrays, config, len(node_ids))
        self.sampler.expect(node_ids)
        log(INFO, "configure_train: sampled %d of %d nodes", len(node_ids), self.sampler.population)
        return self.binder.expect(Message(content, n, MessageType.TRAIN) for n in node_ids)

    def prepare_round(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                      num_sampled: int) -> RecordDict:
        """The train content of this round: model + downlink extras (in the model's dtypes) + round ConfigRecord; then
        what robust aggregators compare the replies with (:mod:`.references`).  ``config``: what the loop hands down,
        marked by fedadapt's own loops (:func:`.loop.own_loop_config`; :func:`.privacy.refuse_flower_dp`)."""
        refuse_flower_dp(self, config)  # Flower's DP wrappers compose only with model averaging (core/privacy.py)
        check_sample_size(self.settings.aggregator, self.settings.byzantine_fraction, num_sampled, not self.history)
        round_log = self.rounds.open(server_round, num_sampled)  # the round's clock starts here
        self.current = R.views(arrays)  # read-only, zero-copy: the server math never writes into x_t
        if self.server_state is None:
            self.server_state = self.init_server_state(self.current)
        cfg = ConfigRecord({k: v for k, v in config.items() if k != R.OWN_LOOP})  # the loop's mark stays here
        cfg[R.SERVER_ROUND] = server_round
        cfg.update(self.round_config(server_round))  # ConfigRecord validates each value as on item assignment
        extras = {name: cast_like(v, self.current) for name, v in self.downlink(server_round).items()}
        content = R.train_content(arrays, extras, cfg)
        self.sent = extras
        round_log.bytes_down = R.arrays_nbytes(content) * num_sampled
        self.root = root_reference(self.settings.aggregator, self.root_update, content, self.uplink_specs(),
                                   self.current, self.trainable(self.current))
        self.centre, self._previous = centre_reference(self.settings.aggregator, self.current, self._previous)
        return content

    def reply_screen(self, provisional: bool = True) -> ReplyScreen:
        """This round's :class:`.ReplyScreen` (``provisional=False``: no fold while measuring; native DP aggregates)."""
        assert self.current is not None
        policy = ScreenPolicy.from_settings(self.settings, self.weighting)
        return ReplyScreen(self.current, self.uplink_specs(), self.trainable(self.current), policy, self.method,
                           self.needs_client_half, root=self.root, centre=self.centre, seed=self.settings.seed,
                           provisional=provisional, sent=self.sent)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """One straight round: check (:class:`.ReplyBinder`) → screen (:attr:`.ReplyScreen.STAGES`) → aggregate
        (plain, or native DP's) → the method's update and the commit (:meth:`_update`)."""
        round_log = self.rounds.pop_open_log(server_round)
        replies = self.sampler.receive(server_round, replies)  # in node order, less the never-answered
        round_log.bytes_up = sum(R.arrays_nbytes(m.content) for m in replies if not m.has_error())
        privacy = PrivacyPolicy.from_settings(self.settings)  # once a round
        screen = self.reply_screen(provisional=not privacy.enabled)
        bound = self.binder.check(server_round, replies, screen.current, screen.specs, screen.trainable,
                                  self.settings.max_reply_bytes)
        screened = screen.run(server_round, bound.passed)
        if privacy.enabled and screened.kept:  # native DP: clipped, noised aggregates
            aggregates, dp_metrics = privacy.privatize(
                self.method, screen.specs, [reply.records for reply in screened.kept], screen.current,
                round_log.sampled, max(self.sampler.population, round_log.sampled), released_rounds(self.history))
        else:
            aggregates, dp_metrics = screen.aggregate(screened), {}
        self.binder.remember(bound, [reply.msg for reply in screened.kept])
        reply_metrics, clipped = screened.reply_metrics()
        metrics_out = round_log.add_replies(bound.rejections + screened.rejections, reply_metrics, clipped,
                                            screened.updates_clipped)
        warn_divergence(server_round, loss_alarm(reply_metrics, metrics_out, self.rounds.lowest_train_loss()),
                        [r for r in round_log.rejections if r.kind is Kind.NONFINITE], self.client_lr_at(server_round),
                        getattr(self.hparams, "server_lr", None), self.method)
        new_arrays: ArrayRecord | None = None
        if round_log.replies_used < self.settings.min_replies:
            log(WARNING, "Round %d: %d valid replies < min-replies %d; keeping the previous model",
                server_round, round_log.replies_used, self.settings.min_replies)
        else:
            new_arrays, round_metrics = self._update(server_round, aggregates, reply_metrics)
            round_log.round_metrics = {**round_metrics, **(dp_metrics if new_arrays is not None else {})}
            metrics_out.update(round_log.round_metrics)
            round_log.updated = new_arrays is not None
        self.rounds.close(round_log, metrics_out)
        if not self._stall_warned:  # once per run
            self._stall_warned = warn_stall(server_round, stall_alarm(self.history), self.client_lr_at(server_round),
                                            getattr(self.hparams, "server_lr", None), self.method)
        return new_arrays, MetricRecord(metrics_out)

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


# A setting's name on a strategy is an AttributeError pointing to .settings; ``weighting`` is a real property (the
# method's default resolved).
point_to_settings(FedAdaptStrategy, SETTINGS - {"weighting"})
