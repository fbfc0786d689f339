"""The shared Message-API strategy every fedadapt method subclasses.

A method writes only its math, through five hooks (none of them touches Flower messages):

* :meth:`~FedAdaptStrategy.uplink_specs` — the records every train reply must carry and their aggregation rule;
* :meth:`~FedAdaptStrategy.init_server_state` — the server state before round 1 (``{name: arrays or scalar}``);
* :meth:`~FedAdaptStrategy.downlink` — named extra arrays sent with the model (read from the server state);
* :meth:`~FedAdaptStrategy.client_config` — per-round client values beyond the declared client hyper-parameters;
* :meth:`~FedAdaptStrategy.server_update` — ``(RoundInputs, state) → (arrays, state, round metrics)``.

The base samples nodes with its own seeded RNG, sends the model + extras + the round's ConfigRecord (the
method's ``client=True`` hyper-parameters under their run-config keys), validates replies
(:mod:`.validation`) and, in one chunk-major pass, measures their update norms and folds them into the aggregates
(:func:`.ops.fold`), calls :meth:`server_update` and commits the new arrays and state only when every value is
finite.  Memory: one accumulator per uplink record, in the model's dtype, whatever the number of replies; a method
may write its results into those accumulators (they belong to the round) and update its state arrays in place
through :func:`.ops.apply_update`, which writes nothing unless every new value is finite.  Everything a resumed run needs is in
:meth:`state_dict` (data only: arrays, numbers, strings).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.common.constant import HEARTBEAT_INTERVAL_INF, HEARTBEAT_PATIENCE, ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from . import records as R
from .hparams import HParams
from .local import LocalOptimizer, SGDOptimizer
from .ops import ROBUST_RULES, NamedArrays, all_finite, check_trim, decayed_lr, fold, is_float, nbytes, robust_aggregate
from .validation import RecordSpec, check_update_norms, layout, nonfinite_reason, parse_reply

#: A reply metric above this multiple of max(1, the round's lower-median magnitude) is left out of its mean.
METRIC_OUTLIER_RATIO = 1e3

#: Reply metrics that are identifiers or weights, not quantities to average.
NOT_AVERAGED = frozenset({R.NUM_EXAMPLES, "partition-id", "num-partitions", "node-id"})

#: Error replies the SuperLink makes up for a node that never answered (offline node, expired message or reply):
#: counted as missing replies, not as rejected client replies.
NO_REPLY_CODES = frozenset({ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE, ErrorCode.NODE_UNAVAILABLE})

#: Server state: named arrays (``{key: ndarray}``) or JSON-able scalars/lists, by name.
ServerState = dict[str, Any]


@dataclass
class RoundLog:
    """What happened in one training round (read by the ServerApp's metrics writer)."""

    server_round: int
    sampled: int = 0
    replies_used: int = 0
    replies_rejected: int = 0
    rejections: list[str] = field(default_factory=list)
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


CLIENT_HALF_REASON = "reply was not produced by the client half of fedadapt method"


class ClientHalfMissing(RuntimeError):
    """Every reply of a round came from a client without the method's client half: the run cannot train."""


def weighted_mean(values: Sequence[tuple[float, float]], weighting: str) -> float:
    """Mean of ``(value, num_examples)`` pairs, example-weighted or uniform; NaN when empty."""
    if not values:
        return float("nan")
    if weighting == "uniform":
        return float(sum(v for v, _ in values) / len(values))
    total = sum(n for _, n in values)
    return float(sum(v * n for v, n in values) / total)


def cast_like(arrays: Mapping[str, np.ndarray], like: Mapping[str, np.ndarray]) -> NamedArrays:
    """``arrays`` cast to the dtypes of the same keys in ``like``."""
    return {k: np.asarray(v).astype(np.asarray(like[k]).dtype, copy=False) for k, v in arrays.items()}


def _finite_state(state: Mapping[str, Any]) -> str | None:
    for name, value in state.items():
        if isinstance(value, Mapping):
            bad = all_finite(value)
            if bad is not None:
                return f"{name}/{bad}"
        elif isinstance(value, float) and not np.isfinite(value):
            return name
    return None


class FedAdaptStrategy(Strategy):
    """Base class of all fedadapt strategies (Message API, ``flwr.serverapp.strategy``).

    Parameters
    ----------
    hparams
        The method's frozen hyper-parameter dataclass (paper defaults when omitted).
    client_lr, local_epochs, local_steps, batch_size
        Client training plan sent in every round's ConfigRecord (the server owns them).
    fraction_train, min_train_nodes, min_available_nodes
        Sampling: ``max(int(fraction·available), min_train_nodes)`` nodes per round.
    min_replies
        Minimum number of valid replies to update the model; otherwise the round keeps the old one.
    fraction_evaluate, min_evaluate_nodes
        Client-side evaluation (0 = off; the fedadapt ServerApp evaluates centrally).
    weighting
        ``"examples"`` (weight n_i) or ``"uniform"``; ``None`` = the method's paper default.
    seed
        Seed of the sampling RNG.
    trainable_keys
        Keys of the global arrays that are trainable parameters.  Server optimizers act only on these
        (and only if floating point); other floating arrays (e.g. BatchNorm statistics) are averaged and
        integer arrays keep the server's value.  ``None`` = every floating-point array.
    wait_for_nodes_s
        How long sampling waits for ``min_available_nodes`` live nodes before failing (run-config
        ``wait-for-nodes``).  Live = listed by the grid (Flower's SuperLink lists only nodes whose heartbeat has not
        expired) and not silent: a sampled node that sent no reply is left out of sampling until the grid reports a
        heartbeat from it after that round (see :meth:`live_nodes`).
    loss_before_max_examples
        > 0: clients estimate ``train-loss-before`` on a seeded sample of at most this many examples.
    max_update_norm
        Reject replies whose update norm exceeds this (0 = off); see :func:`.validation.check_update_norms`.
    update_norm_ratio
        Reject replies whose update norm (per record) exceeds this multiple of the round's (lower) median norm
        (0 = off).  The default 100 is never reached by honest training and stops magnitude attacks (one finite
        reply of 1e38 would otherwise become the model).
    max_weight_ratio
        Clip every reply's ``num-examples`` weight at this multiple of the round's median reported count (0 = off):
        one client cannot take over an example-weighted mean by reporting 1e12 examples.  The default 1.5 bounds a
        liar to the weight of 1.5 median clients (3 let a 1-of-5 hijacker on Dirichlet digits cost up to 0.13
        accuracy; 1.5 ≤ 0.04, see docs/robustness.md).  Needs ≥ 3 replies to bind: with 2, the liar moves the median.
    aggregator, trim_fraction
        ``"mean"`` (the method's rule), or a robust coordinate-wise ``"median"`` / ``"trimmed-mean"`` (dropping the
        ``floor(trim_fraction·N)`` largest and smallest values) for every ``"mean"``-rule record; O(N·model) memory.
    num_rounds
        Total rounds of the run (round-dependent schedules); :meth:`start` sets it from its argument.
    method
        Registry name sent to clients (default: the class's); aliases pass their own name.
    """

    #: Registry name; sent to clients so that the generic ClientApp picks the matching local optimizer.
    method: ClassVar[str] = ""
    hparams_class: ClassVar[type[HParams]] = HParams
    #: The client half: the local optimizer the ClientApp builds for this method.
    local_optimizer: ClassVar[type[LocalOptimizer]] = SGDOptimizer
    default_weighting: ClassVar[str] = "examples"
    #: Whether the method needs each reply's ``train-loss-before`` metric (the ServerApp refuses to switch it off).
    needs_train_loss_before: ClassVar[bool] = False

    @classmethod
    def make_hparams(cls, **changes: Any) -> HParams:
        """This class's hyper-parameters: the defaults of its registry name :attr:`method` (the declaration's,
        with the field defaults given to :func:`.registry.register`), then ``changes``."""
        from .registry import class_overrides

        return cls.hparams_class(**{**class_overrides(cls), **changes})

    def __init__(
        self,
        hparams: HParams | None = None,
        *,
        client_lr: float = 0.1,
        local_epochs: int = 1,
        local_steps: int = 0,
        batch_size: int = 32,
        fraction_train: float = 1.0,
        min_train_nodes: int = 2,
        min_available_nodes: int = 2,
        min_replies: int = 1,
        fraction_evaluate: float = 0.0,
        min_evaluate_nodes: int = 1,
        weighting: str | None = None,
        seed: int = 0,
        trainable_keys: Iterable[str] | None = None,
        wait_for_nodes_s: float = 600.0,
        loss_before_max_examples: int = 0,
        max_update_norm: float = 0.0,
        update_norm_ratio: float = 100.0,
        max_weight_ratio: float = 1.5,
        aggregator: str = "mean",
        trim_fraction: float = 0.1,
        num_rounds: int | None = None,
        method: str | None = None,
    ) -> None:
        self.hparams = hparams if hparams is not None else self.make_hparams()
        if not isinstance(self.hparams, self.hparams_class):
            raise TypeError(f"{type(self).__name__} needs {self.hparams_class.__name__}, got {type(self.hparams).__name__}")
        if method is not None:
            self.method = method  # type: ignore[misc]  (an alias's registry name)
        self.client_lr = float(client_lr)
        self.local_epochs = int(local_epochs)
        self.local_steps = int(local_steps)
        self.batch_size = int(batch_size)
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
        self.fraction_train = fraction_train
        self.min_train_nodes = min_train_nodes
        self.min_available_nodes = min_available_nodes
        self.min_replies = min_replies
        self.fraction_evaluate = fraction_evaluate
        self.min_evaluate_nodes = min_evaluate_nodes
        w = weighting or self.default_weighting
        if w not in ("examples", "uniform"):
            raise ValueError(f"weighting must be 'examples' or 'uniform', got {weighting!r}")
        self.weighting = w
        self.seed = seed
        self.rng = random.Random(seed)
        self.trainable_keys = None if trainable_keys is None else list(trainable_keys)
        self.wait_for_nodes_s = float(wait_for_nodes_s)
        if int(loss_before_max_examples) < 0:
            raise ValueError(f"loss_before_max_examples must be >= 0, got {loss_before_max_examples}")
        self.loss_before_max_examples = int(loss_before_max_examples)
        if not max_update_norm >= 0:
            raise ValueError(f"max_update_norm must be >= 0, got {max_update_norm}")
        self.max_update_norm = float(max_update_norm)
        if not update_norm_ratio >= 0 or not max_weight_ratio >= 0:
            raise ValueError(f"update_norm_ratio and max_weight_ratio must be >= 0, got {update_norm_ratio}, {max_weight_ratio}")
        self.update_norm_ratio = float(update_norm_ratio)
        self.max_weight_ratio = float(max_weight_ratio)
        if aggregator not in ("mean", *ROBUST_RULES):
            raise ValueError(f"aggregator must be one of mean, {', '.join(ROBUST_RULES)}; got {aggregator!r}")
        check_trim(trim_fraction)
        self.aggregator = aggregator
        self.trim_fraction = float(trim_fraction)
        self.num_rounds = num_rounds
        #: ``{node_id: sort_key}`` ordering nodes before sampling (see :meth:`order_nodes`).
        self.node_order: dict[int, Any] = {}
        self.current: NamedArrays | None = None
        self.server_state: ServerState | None = None
        self.num_updates = 0
        self.nodes_seen = 0
        self.history: list[RoundLog] = []
        self._round: RoundLog | None = None
        #: ``{node_id: wall time}`` of sampled nodes that sent no reply (see :meth:`live_nodes`); runtime only.
        self.silent_since: dict[int, float] = {}
        self._awaiting: list[int] = []
        self._t0 = 0.0

    # ------------------------------------------------------------------ hooks for subclasses
    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        """Records every train reply must carry (besides ``metrics``)."""
        return (RecordSpec(R.MODEL, "mean", "model"),)

    def init_server_state(self, arrays: NamedArrays) -> ServerState:
        """The server state before round 1 (default: none)."""
        return {}

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        """Named extra arrays sent with the model this round (default: none)."""
        return {}

    def client_config(self, server_round: int) -> dict[str, Any]:
        """Per-round client values beyond the declared client hyper-parameters (default: none)."""
        return {}

    def client_lr_at(self, server_round: int) -> float:
        """Client learning rate of ``server_round``: ``client_lr``, times ``client_lr_decay`` after every round when
        the method's hyper-parameters declare that field (:func:`.hparams.client_lr_decay_param`)."""
        decay = getattr(self.hparams, "client_lr_decay", None)
        return self.client_lr if decay is None else decayed_lr(self.client_lr, decay, server_round)

    def server_update(self, inputs: RoundInputs, state: ServerState) -> tuple[NamedArrays, ServerState, dict[str, float]]:
        """The server math: ``(new global arrays, new server state, round metrics)``.  It may write into
        ``inputs.aggregates`` (the round's own buffers) and update state arrays in place only through
        :func:`.ops.apply_update`; the base commits the result only when every value is finite."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers for subclasses
    def trainable(self, arrays: Mapping[str, np.ndarray]) -> list[str]:
        """Trainable floating-point keys of ``arrays`` (what server optimizers act on)."""
        keys = self.trainable_keys if self.trainable_keys is not None else list(arrays)
        return [k for k in keys if k in arrays and is_float(np.asarray(arrays[k]))]

    @staticmethod
    def merge_buffers(new_params: NamedArrays, current: NamedArrays, averaged: NamedArrays | None) -> NamedArrays:
        """Complete ``new_params`` (trainable keys) with the non-trainable arrays.

        Floating buffers take the clients' average when available; integer arrays keep the server's value.
        """
        out: NamedArrays = {}
        for k, x in current.items():
            if k in new_params:
                out[k] = new_params[k]
            elif averaged is not None and k in averaged and is_float(np.asarray(x)):
                out[k] = averaged[k]
            else:
                out[k] = x
        return out

    def round_config(self, server_round: int) -> dict[str, Any]:
        """The round's ConfigRecord entries: plan + declared client hyper-parameters + :meth:`client_config`."""
        cfg: dict[str, Any] = {
            R.METHOD: self.method,
            R.CLIENT_LR: self.client_lr_at(server_round),
            R.LOCAL_EPOCHS: self.local_epochs,
            R.LOCAL_STEPS: self.local_steps,
            R.BATCH_SIZE: self.batch_size,
        }
        if self.loss_before_max_examples > 0:
            cfg[R.LOSS_BEFORE_MAX] = self.loss_before_max_examples
        cfg.update(self.hparams.to_wire(self.method))
        cfg.update(self.client_config(server_round))
        return cfg

    def log_settings(self) -> list[str]:
        return [f"{k} = {v}" for k, v in vars(self.hparams).items()]

    def order_nodes(self, order: Mapping[int, Any]) -> None:
        """Order nodes by ``order[node_id]`` (e.g. their partition id) before sampling (fallback: node id)."""
        self.node_order = dict(order)

    # ------------------------------------------------------------------ Strategy API
    def summary(self) -> None:
        log(INFO, "\t├──> %s (%s) settings:", type(self).__name__, self.method)
        for line in self.log_settings():
            log(INFO, "\t│\t├── %s", line)
        log(
            INFO,
            "\t│\t└── client-lr %s | local-steps %s | local-epochs %s | batch-size %s | weighting %s | seed %s",
            self.client_lr, self.local_steps, self.local_epochs, self.batch_size, self.weighting, self.seed,
        )

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, *args: Any, **kwargs: Any) -> Result:  # type: ignore[override]
        """Flower's ``Strategy.start``; records ``num_rounds`` for round-dependent schedules."""
        self.num_rounds = int(num_rounds)
        return super().start(grid, initial_arrays, num_rounds, *args, **kwargs)

    def live_nodes(self, grid: Grid) -> list[int]:
        """Nodes the grid lists, less the silent ones: a node that sent no reply in a round it was sampled for is
        left out until the grid reports a heartbeat from it after that round (Flower's ``NodeInfo.online_until`` =
        last heartbeat + ``HEARTBEAT_PATIENCE`` × ``heartbeat_interval``).  A dead node is thus never sampled again
        (the SuperLink drops it from the list once its heartbeat expires), a live straggler is back after its next
        heartbeat, and a node that restarts is sampled again.  Grids without heartbeat information (in-process
        engine; Ray simulation, whose virtual nodes have an infinite heartbeat interval) list every node."""
        get_nodes = getattr(grid, "get_nodes", None)  # a Grid without node information (test doubles, custom grids)
        if get_nodes is None:
            return list(grid.get_node_ids())
        live = []
        for info in get_nodes():
            since = self.silent_since.get(info.node_id)
            if since is not None and 0 < info.heartbeat_interval < HEARTBEAT_INTERVAL_INF:  # simulation: INF
                if info.online_until - HEARTBEAT_PATIENCE * info.heartbeat_interval <= since:
                    continue  # no heartbeat since it missed its reply: presumed lost
                log(INFO, "Node %s is alive again (heartbeat after its missing reply)", info.node_id)
            self.silent_since.pop(info.node_id, None)
            live.append(info.node_id)
        return live

    def sample(self, grid: Grid, fraction: float, minimum: int) -> list[int]:
        """Wait (at most ``wait_for_nodes_s``) until enough live nodes are connected, then :meth:`pick` from them."""
        deadline = time.monotonic() + self.wait_for_nodes_s
        need = max(self.min_available_nodes, minimum)
        while len(nodes := self.live_nodes(grid)) < need:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(nodes)} live nodes connected after waiting {self.wait_for_nodes_s:g}s "
                                   f"(wait-for-nodes); need {need} (min-available-nodes / min-train-nodes)")
            log(INFO, "Waiting for nodes: %d live (need %d)", len(nodes), need)
            time.sleep(1.0)
        return self.pick(nodes, fraction, minimum)

    def pick(self, nodes: Iterable[int], fraction: float, minimum: int) -> list[int]:
        """``max(int(fraction·len), minimum)`` nodes drawn with the strategy's own RNG, in :attr:`node_order`."""
        order = self.node_order
        nodes = sorted(nodes, key=lambda n: (order.get(n, float("inf")), n))
        self.nodes_seen = max(self.nodes_seen, len(nodes))
        k = min(len(nodes), max(int(len(nodes) * fraction), minimum))
        picked = self.rng.sample(nodes, k)
        return sorted(picked, key=nodes.index)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        node_ids = self.sample(grid, self.fraction_train, self.min_train_nodes)
        content = self.prepare_round(server_round, arrays, config, len(node_ids))
        self._awaiting = list(node_ids)
        log(INFO, "configure_train: sampled %d of %d nodes", len(node_ids), len(list(grid.get_node_ids())))
        return [Message(content=content, message_type=MessageType.TRAIN, dst_node_id=n) for n in node_ids]

    def prepare_round(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, num_sampled: int) -> RecordDict:
        """The train content of this round: model + downlink extras + round ConfigRecord (transport-agnostic;
        the legacy adapter uses it too)."""
        self._t0 = time.monotonic()
        self.current = R.views(arrays)  # read-only, zero-copy: the server math never writes into x_t
        if self.server_state is None:
            self.server_state = self.init_server_state(self.current)
        cfg = ConfigRecord(dict(config))
        cfg[R.SERVER_ROUND] = server_round
        for key, value in self.round_config(server_round).items():
            cfg[key] = value
        extras = self.downlink(server_round)
        clash = set(extras) & {R.MODEL, R.CONFIG}
        if clash:
            raise ValueError(f"downlink record names clash with reserved names: {sorted(clash)}")
        content = RecordDict({R.MODEL: arrays, **{k: R.to_record(v) for k, v in extras.items()}, R.CONFIG: cfg})
        per_msg = nbytes(self.current) + sum(nbytes(v) for v in extras.values())
        self._round = RoundLog(server_round, sampled=num_sampled, bytes_down=per_msg * num_sampled)
        return content

    def expected_layouts(self) -> dict[str, dict[str, tuple[tuple[int, ...], np.dtype]]]:
        """``{record: {key: (shape, dtype)}}`` every reply must match this round."""
        assert self.current is not None
        trainable = self.trainable(self.current)
        return {s.name: layout(self.current, trainable if s.keys == "params" else None) for s in self.uplink_specs()}

    @property
    def needs_client_half(self) -> bool:
        """Whether replies must come from this method's client half (anything beyond plain local SGD)."""
        return self.local_optimizer is not SGDOptimizer or any(bool(v) for v in self.hparams.client_values().values())

    def _check_client_half(self, msg: Message) -> str | None:
        """A reply naming another method is rejected; a reply naming none is rejected when nothing else shows the
        method's client half ran (its declared uplink is only the model)."""
        if msg.has_error():
            return None
        info = R.get(msg.content, R.REPLY_INFO, ConfigRecord)
        produced_by = None if info is None else info.get(R.METHOD)
        if produced_by is None:
            model_only = all(s.name == R.MODEL for s in self.uplink_specs())
            if not (self.needs_client_half and model_only):
                return None
        elif produced_by == self.method:
            return None
        return f"{CLIENT_HALF_REASON} '{self.method}' (its '{R.REPLY_INFO}' ConfigRecord names {produced_by!r})"

    def _rule(self, spec: RecordSpec) -> str:
        if spec.rule == "mean":
            if self.aggregator != "mean":
                return self.aggregator
            return "wmean" if self.weighting == "examples" else "umean"
        return spec.rule

    def _reject(self, rlog: RoundLog, msg: Message, reason: str) -> None:
        rlog.replies_rejected += 1
        rlog.rejections.append(f"node {msg.metadata.src_node_id}: {reason}")
        log(WARNING, "Round %d: rejected reply from node %s: %s", rlog.server_round, msg.metadata.src_node_id, reason)

    def _screen_and_fold(
        self, replies: list[Message], rlog: RoundLog
    ) -> tuple[list[tuple[Message, dict[str, NamedArrays]]], list[float], dict[str, NamedArrays]]:
        """Validate the replies, screen their update norms and aggregate the usable ones: ``(usable replies with their
        parsed records, their weights, {record: aggregate})``.

        The records are zero-copy views of the payloads the messages hold.  One chunk-major pass
        (:func:`.ops.fold`) both measures every reply's norms and folds the replies into the aggregates; a finite
        norm proves the record finite.  Only when the norms reject a reply (NaN/Inf, ``max-update-norm``, more than
        ``update-norm-ratio`` × the round's median) are the survivors folded again — the same operations in the
        same order as if the rejected replies had never arrived."""
        expected = self.expected_layouts()
        specs = self.uplink_specs()
        kept: list[tuple[Message, dict[str, NamedArrays]]] = []
        missing_half = 0
        for msg in replies:
            reason = self._check_client_half(msg)
            parsed: dict[str, NamedArrays] = {}
            if reason is None:
                reason, parsed = parse_reply(msg, expected)
            if reason is not None:
                missing_half += reason.startswith(CLIENT_HALF_REASON) or (
                    self.needs_client_half and reason.startswith("missing ArrayRecord"))
                self._reject(rlog, msg, reason)
                continue
            kept.append((msg, parsed))
        if replies and missing_half == len(replies):
            raise ClientHalfMissing(
                f"every reply of round {rlog.server_round} lacks the client half of method '{self.method}' "
                f"(e.g. the ClientApp trains with its own optimizer). Fix: build the reply with "
                f"flower_strategies.train_reply(...) or flower_strategies.ClientRound(...) in @app.train() "
                f"(legacy apps: FedAdaptNumPyClient); see the README section 'Use a method in your own Flower app'."
            )
        weights, aggregates, norms = self._fold(kept, measure=True)
        survivors = [j for j in range(len(kept)) if self._norm_reason(rlog, kept[j], [n[j] for n in norms]) is None]
        if self.update_norm_ratio > 0 and len(survivors) > 2:
            for i, spec in enumerate(specs):
                median = float(np.quantile([norms[i][j] for j in survivors], 0.5, method="lower"))
                bound = self.update_norm_ratio * median
                for j in [j for j in survivors if not norms[i][j] <= bound]:
                    survivors.remove(j)
                    self._reject(rlog, kept[j][0], f"record '{spec.name}' norm {norms[i][j]:.4g} exceeds "
                                 f"update-norm-ratio {self.update_norm_ratio:g} × the round's median {median:.4g}")
        if len(survivors) < len(kept):
            kept = [kept[j] for j in survivors]
            weights, aggregates, _ = self._fold(kept, measure=False)
        for spec in specs:
            rule = self._rule(spec)
            if rule in ROBUST_RULES and kept:
                aggregates[spec.name] = robust_aggregate([p[spec.name] for _, p in kept], rule, self.trim_fraction)
        return kept, weights, aggregates

    def _fold(
        self, kept: Sequence[tuple[Message, dict[str, NamedArrays]]], measure: bool
    ) -> tuple[list[float], dict[str, NamedArrays], list[list[float]]]:
        """``(weights, {record: aggregate}, norms[spec][reply])`` of the streaming-rule records (robust rules: norms
        only, the aggregate comes after screening)."""
        reported = [float(R.get(msg.content, R.METRICS, MetricRecord)[R.NUM_EXAMPLES]) for msg, _ in kept]
        weights = self.client_weights(reported)
        aggregates: dict[str, NamedArrays] = {}
        norms: list[list[float]] = []
        for spec in self.uplink_specs():
            rule = self._rule(spec)
            rule = None if rule in ROBUST_RULES or not kept else rule
            if rule is None and not measure:
                continue
            items = [parsed[spec.name] for _, parsed in kept]
            agg, n = fold(items, weights, rule, self.current if spec.keys == "model" else None, norms=measure)
            if rule is not None:
                aggregates[spec.name] = agg
            norms.append(n)
        return weights, aggregates, norms

    def _norm_reason(self, rlog: RoundLog, item: tuple[Message, dict[str, NamedArrays]], norms: list[float]) -> str | None:
        """Reject (and say why) a reply whose records hold NaN/Inf or exceed ``max-update-norm``."""
        msg, parsed = item
        specs = self.uplink_specs()
        reason = nonfinite_reason(parsed, norms, [s.name for s in specs])
        if reason is None and self.max_update_norm > 0:
            assert self.current is not None
            reason = check_update_norms(parsed, specs, self.current, self.max_update_norm, norms)
        if reason is not None:
            self._reject(rlog, msg, reason)
        return reason

    def _drop_no_replies(self, server_round: int, replies: list[Message]) -> list[Message]:
        """Leave out the SuperLink's stand-in replies of nodes that never answered (they count as missing) and mark
        the sampled nodes without a real reply as silent (:meth:`live_nodes`)."""
        real = [m for m in replies if not (m.has_error() and m.error.code in NO_REPLY_CODES)]
        answered = {m.metadata.src_node_id for m in real}
        now = time.time()
        for node in self._awaiting:
            if node not in answered:
                self.silent_since[node] = now
                log(WARNING, "Round %d: no reply from node %s (lost or too slow for round-timeout); it is not sampled "
                    "again until it sends a heartbeat", server_round, node)
        self._awaiting = []
        return real

    def client_weights(self, reported: Sequence[float]) -> list[float]:
        """The replies' weights: reported ``num-examples`` clipped at ``max_weight_ratio`` × their median."""
        if self.max_weight_ratio <= 0 or not reported:
            return list(reported)
        cap = self.max_weight_ratio * float(np.median(reported))
        return [min(n, cap) for n in reported]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        rlog = self._round or RoundLog(server_round)
        self._round = None
        # Deterministic fold order, in the sampling order (partition ids when known): float32 sums depend on the order,
        # and a run must not depend on the node ids a runtime assigns.
        order = self.node_order
        replies = sorted(replies, key=lambda m: (order.get(m.metadata.src_node_id, float("inf")), m.metadata.src_node_id))
        replies = self._drop_no_replies(server_round, replies)
        rlog.bytes_up = sum(R.record_nbytes(r) for m in replies if not m.has_error() for _, r in R.of_type(m.content, ArrayRecord))
        usable, weights, aggregates = self._screen_and_fold(replies, rlog)
        reply_metrics: list[dict[str, Any]] = []
        clipped = 0
        for (msg, _), weight in zip(usable, weights):
            metrics = dict(R.get(msg.content, R.METRICS, MetricRecord))
            clipped += weight < float(metrics[R.NUM_EXAMPLES])
            reply_metrics.append({**metrics, R.NUM_EXAMPLES: weight, "node-id": msg.metadata.src_node_id})
        rlog.replies_used = len(reply_metrics)
        metrics_out = self.mean_reply_metrics(reply_metrics)
        metrics_out["replies-used"] = rlog.replies_used
        metrics_out["replies-rejected"] = rlog.replies_rejected
        metrics_out["weights-clipped"] = clipped
        new_arrays: ArrayRecord | None = None
        if rlog.replies_used < self.min_replies:
            log(WARNING, "Round %d: %d valid replies < min-replies %d; keeping the previous model",
                server_round, rlog.replies_used, self.min_replies)
        else:
            new_arrays, round_metrics = self._update(server_round, aggregates, reply_metrics)
            metrics_out.update(round_metrics)
            rlog.round_metrics = round_metrics
            rlog.updated = new_arrays is not None
        rlog.train_metrics = metrics_out
        rlog.seconds = time.monotonic() - self._t0
        self.history.append(rlog)
        return new_arrays, MetricRecord(metrics_out)

    @staticmethod
    def mean_reply_metrics(reply_metrics: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Example-weighted means of the replies' numeric metrics, plus the total ``num-examples``.

        One reply cannot poison a metric: NaN/Inf values are left out, and with 3 or more values so is any value
        above ``METRIC_OUTLIER_RATIO`` × max(1, the lower median of the values' magnitudes) (e.g. a train-loss of
        1e300)."""
        values: dict[str, list[tuple[float, float]]] = {}
        for m in reply_metrics:
            n = float(m[R.NUM_EXAMPLES])
            for key, value in m.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in NOT_AVERAGED \
                        and np.isfinite(value):
                    values.setdefault(key, []).append((float(value), n))
        out: dict[str, float] = {}
        for key, pairs in values.items():
            if len(pairs) >= 3:
                scale = max(1.0, float(np.quantile([abs(v) for v, _ in pairs], 0.5, method="lower")))
                pairs = [(v, n) for v, n in pairs if abs(v) <= METRIC_OUTLIER_RATIO * scale]
            total = sum(n for _, n in pairs)
            if total > 0:
                out[key] = sum(v * n for v, n in pairs) / total
        out[R.NUM_EXAMPLES] = float(sum(float(m[R.NUM_EXAMPLES]) for m in reply_metrics))
        return out

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
        del inputs
        aggregates.clear()  # the round's buffers live on only where the update kept them (e.g. as the new model)
        bad = all_finite(new) or _finite_state(state)
        if bad is not None:  # never publish a corrupted model or keep a corrupted state
            log(WARNING, "Round %d: server update produced NaN/Inf in '%s'; keeping the previous model and state",
                server_round, bad)
            return None, {}
        self.server_state = state
        self.num_updates += 1
        return R.to_record(new, consume=True), {k: float(v) for k, v in round_metrics.items()}

    # ------------------------------------------------------------------ checkpoint state (data only)
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit-exactly, as data: the server state (arrays and
        scalars), the sampling RNG, the update counter, the nodes seen and the per-round history."""
        version, internal, gauss = self.rng.getstate()
        return {
            "server_state": self.server_state,
            "rng": [version, list(internal), gauss],
            "num_updates": self.num_updates,
            "nodes_seen": self.nodes_seen,
            "history": [dataclasses.asdict(h) for h in self.history],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict` on a freshly built strategy of the same class and settings."""
        version, internal, gauss = state["rng"]
        self.rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
        self.server_state = None if state["server_state"] is None else dict(state["server_state"])
        self.num_updates = int(state["num_updates"])
        self.nodes_seen = int(state["nodes_seen"])
        self.history = [RoundLog(**h) for h in state["history"]]

    # ------------------------------------------------------------------ client-side evaluation
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.fraction_evaluate <= 0.0:
            return []
        node_ids = self.sample(grid, self.fraction_evaluate, self.min_evaluate_nodes)
        cfg = ConfigRecord(dict(config))
        cfg[R.SERVER_ROUND] = server_round
        content = RecordDict({R.MODEL: arrays, R.CONFIG: cfg})
        return [Message(content=content, message_type=MessageType.EVALUATE, dst_node_id=n) for n in node_ids]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        found = (R.get(m.content, R.METRICS, MetricRecord) for m in replies if not m.has_error())
        usable = [dict(rec) for rec in found if rec is not None]
        usable = [m for m in usable if isinstance(m.get(R.NUM_EXAMPLES), (int, float)) and m[R.NUM_EXAMPLES] > 0]
        return MetricRecord(self.mean_reply_metrics(usable)) if usable else None
