"""The shared Message-API strategy every fedadapt method subclasses.

What the base does (so that a method only writes its math):

* **Downlink**: the global model under ``"arrays"`` plus any named extras from :meth:`downlink`, and a
  ConfigRecord with the server-owned per-round client hyper-parameters (:meth:`round_config`).
* **Sampling**: its own ``random.Random(seed)``; nodes are ordered by :attr:`node_order` (e.g. the
  partition id each node reported) or by node id, so a run with the same seed samples the same clients.
* **Uplink validation**: a reply is rejected – with a logged reason, counted in the round metrics – when it
  carries an error, misses a declared record or the ``num-examples`` metric, has wrong keys, shapes or
  dtypes, or holds NaN/Inf.  Fewer than ``min_replies`` valid replies ⇒ the round keeps the old model.
* **Aggregation**: each declared uplink record is folded reply by reply with its rule
  (``wmean``/``umean``/``max``/``sum``) into float64 accumulators (O(model) memory), then
  :meth:`server_update` – a method's pure server math – produces the new global arrays.

Subclasses override :meth:`uplink_specs`, :meth:`downlink`, :meth:`round_config` and
:meth:`server_update`; none of them touches Flower messages.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from . import records as R
from .hparams import HParams
from .ops import NamedArrays, StreamingAggregator, all_finite, is_float, nbytes


#: Reply metrics that are identifiers or weights, not quantities to average.
_NOT_AVERAGED = frozenset({R.NUM_EXAMPLES, "partition-id", "num-partitions", "node-id"})


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


@dataclass
class RoundLog:
    """What happened in one training round (read by the ServerApp's metrics writer)."""

    server_round: int
    sampled: int = 0
    replies_used: int = 0
    replies_rejected: int = 0
    rejections: list[str] | None = None
    bytes_down: int = 0
    bytes_up: int = 0
    updated: bool = False
    seconds: float = 0.0
    train_metrics: dict[str, float] | None = None


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
        Client-side evaluation (0 = off; the ServerApp evaluates centrally).
    weighting
        ``"examples"`` (weight n_i) or ``"uniform"``; ``None`` = the method's paper default.
    seed
        Seed of the sampling RNG.
    trainable_keys
        Keys of the global arrays that are trainable parameters.  Server optimizers act only on these
        (and only if floating point); other floating arrays (e.g. BatchNorm statistics) are averaged and
        integer arrays keep the server's value.  ``None`` = every floating-point array.
    """

    #: Registry name; sent to clients so that the generic ClientApp picks the matching local optimizer.
    method: ClassVar[str] = ""
    hparams_class: ClassVar[type[HParams]] = HParams
    default_weighting: ClassVar[str] = "examples"
    #: Reject replies whose update norm exceeds this (0 = off); see :meth:`update_norm`.  Set on the
    #: instance (the ServerApp sets it from the run-config key ``max-update-norm``).
    max_update_norm: float = 0.0
    #: Instance attributes that :meth:`checkpoint_state` leaves out (runtime-specific, re-created on resume).
    checkpoint_exclude: ClassVar[frozenset[str]] = frozenset({"node_order", "wait_for_nodes_s", "_round", "_t0"})

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
    ) -> None:
        self.hparams = hparams if hparams is not None else self.hparams_class()
        if not isinstance(self.hparams, self.hparams_class):
            raise TypeError(f"{type(self).__name__} needs {self.hparams_class.__name__}, got {type(self.hparams).__name__}")
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
        self.wait_for_nodes_s = wait_for_nodes_s
        if int(loss_before_max_examples) < 0:
            raise ValueError(f"loss_before_max_examples must be >= 0, got {loss_before_max_examples}")
        #: > 0: clients estimate ``train-loss-before`` on a seeded sample of at most this many examples.
        self.loss_before_max_examples = int(loss_before_max_examples)
        #: Optional ``{node_id: sort_key}`` used to order nodes before sampling (e.g. partition ids).
        self.node_order: dict[int, Any] | None = None
        self.current: NamedArrays | None = None
        self.num_updates = 0
        self.history: list[RoundLog] = []
        self._round: RoundLog | None = None
        self._t0 = 0.0
        self._initialized = False
        #: Most nodes ever available when sampling (e.g. SCAFFOLD's N_total); updated by :meth:`pick`.
        self.nodes_seen = 0
        #: Total rounds of the run (set by :meth:`start`, or by the legacy adapter); for round-dependent schedules.
        self.num_rounds: int | None = None

    # ------------------------------------------------------------------ hooks for subclasses
    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        """Records every train reply must carry (besides ``metrics``)."""
        return (RecordSpec(R.MODEL, "mean", "model"),)

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        """Named extra arrays sent with the model this round (default: none)."""
        return {}

    def round_config(self, server_round: int) -> dict[str, Any]:
        """Server-owned client hyper-parameters for this round (override and extend with ``super()``)."""
        cfg: dict[str, Any] = {
            R.METHOD: self.method,
            R.CLIENT_LR: self.client_lr_at(server_round),
            R.LOCAL_EPOCHS: self.local_epochs,
            R.LOCAL_STEPS: self.local_steps,
            R.BATCH_SIZE: self.batch_size,
        }
        if self.loss_before_max_examples > 0:  # only when set: the default round config stays as it was
            cfg[R.LOSS_BEFORE_MAX] = self.loss_before_max_examples
        return cfg

    def client_lr_at(self, server_round: int) -> float:
        """Client learning rate of ``server_round`` (constant unless a method schedules it)."""
        return self.client_lr

    def init_state(self, arrays: NamedArrays) -> None:
        """Called once with the initial global arrays, before the first round."""

    def server_update(
        self, server_round: int, current: NamedArrays, aggregates: Mapping[str, NamedArrays]
    ) -> NamedArrays:
        """Pure server math: current global arrays + aggregated uplink records → new global arrays."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers for subclasses
    def trainable(self, arrays: Mapping[str, np.ndarray]) -> list[str]:
        """Trainable floating-point keys of ``arrays`` (what server optimizers act on)."""
        keys = self.trainable_keys if self.trainable_keys is not None else list(arrays)
        return [k for k in keys if k in arrays and is_float(np.asarray(arrays[k]))]

    def merge_buffers(self, new_params: NamedArrays, current: NamedArrays, averaged: NamedArrays | None) -> NamedArrays:
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

    def log_settings(self) -> list[str]:
        return [f"{k} = {v}" for k, v in vars(self.hparams).items()]

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

    def sample(self, grid: Grid, fraction: float, minimum: int) -> list[int]:
        """Wait until enough nodes are connected, then :meth:`pick` from them."""
        deadline = time.monotonic() + self.wait_for_nodes_s
        need = max(self.min_available_nodes, minimum)
        while len(nodes := list(grid.get_node_ids())) < need:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(nodes)} nodes connected after {self.wait_for_nodes_s}s; need {need}")
            log(INFO, "Waiting for nodes: %d connected (need %d)", len(nodes), need)
            time.sleep(1.0)
        return self.pick(nodes, fraction, minimum)

    def pick(self, nodes: Iterable[int], fraction: float, minimum: int) -> list[int]:
        """``max(int(fraction·len), minimum)`` nodes drawn with the strategy's own RNG, in :attr:`node_order`."""
        order = self.node_order or {}
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
        log(INFO, "configure_train: sampled %d of %d nodes", len(node_ids), len(list(grid.get_node_ids())))
        return [Message(content=content, message_type=MessageType.TRAIN, dst_node_id=n) for n in node_ids]

    def prepare_round(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, num_sampled: int) -> RecordDict:
        """The train content of this round: model + downlink extras + round ConfigRecord (transport-agnostic;
        the legacy adapter uses it too)."""
        self._t0 = time.monotonic()
        self.current = R.to_numpy(arrays)
        if not self._initialized:
            self.init_state(self.current)
            self._initialized = True
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
        self._round = RoundLog(server_round, sampled=num_sampled, bytes_down=per_msg * num_sampled, rejections=[])
        return content

    def _expected(self, spec: RecordSpec) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        assert self.current is not None
        keys = self.trainable(self.current) if spec.keys == "params" else list(self.current)
        return {k: (np.shape(self.current[k]), np.asarray(self.current[k]).dtype) for k in keys}

    def validate_reply(self, msg: Message) -> str | None:
        """Return why ``msg`` must be rejected, or None if it is usable."""
        return self._parse_reply(msg)[0]

    def _parse_reply(self, msg: Message) -> tuple[str | None, dict[str, NamedArrays]]:
        """``(reason, {})`` for a bad reply, else ``(None, uplink records as NumPy)`` (deserialised once)."""
        parsed: dict[str, NamedArrays] = {}
        reason = self._check_reply(msg, parsed)
        if reason is None and self.max_update_norm > 0:
            reason = self._check_update_norm(parsed)
        return reason, ({} if reason else parsed)

    def update_norm(self, spec: RecordSpec, arrays: NamedArrays) -> float:
        """L2 norm (over all floating arrays of the record) checked against :attr:`max_update_norm`.

        A ``keys="model"`` record is a local model: its norm is that of the update ``record − global``.
        Any other record (momenta, gradients, control variates, …) is checked by its own norm.
        """
        total = 0.0
        for key, value in arrays.items():
            a = np.asarray(value)
            if not is_float(a):
                continue
            d = a.astype(np.float64)
            if spec.keys == "model" and self.current is not None and key in self.current:
                d = d - np.asarray(self.current[key], dtype=np.float64)
            total += float(np.vdot(d, d))
        return float(np.sqrt(total))

    def _check_update_norm(self, parsed: Mapping[str, NamedArrays]) -> str | None:
        for spec in self.uplink_specs():
            if spec.name not in parsed:
                continue
            norm = self.update_norm(spec, parsed[spec.name])
            if not np.isfinite(norm) or norm > self.max_update_norm:
                what = "update norm" if spec.keys == "model" else "norm"
                return f"record '{spec.name}' {what} {norm:.4g} exceeds max-update-norm {self.max_update_norm:g}"
        return None

    def _check_reply(self, msg: Message, parsed: dict[str, NamedArrays]) -> str | None:
        if msg.has_error():
            return f"client error: {msg.error.reason}"
        content = msg.content
        metrics = content.metric_records.get(R.METRICS)
        if metrics is None:
            return f"missing MetricRecord '{R.METRICS}'"
        n = metrics.get(R.NUM_EXAMPLES)
        if not isinstance(n, (int, float)) or isinstance(n, bool) or not np.isfinite(n) or n <= 0:
            return f"metric '{R.NUM_EXAMPLES}' missing or not positive: {n!r}"
        for spec in self.uplink_specs():
            rec = content.array_records.get(spec.name)
            if rec is None:
                return f"missing ArrayRecord '{spec.name}'"
            expected = self._expected(spec)
            if set(rec.keys()) != set(expected):
                missing = sorted(set(expected) - set(rec.keys()))[:3]
                extra = sorted(set(rec.keys()) - set(expected))[:3]
                return f"record '{spec.name}' has wrong keys (missing {missing}, unexpected {extra})"
            for key, (shape, dtype) in expected.items():
                arr = rec[key]
                if tuple(arr.shape) != tuple(shape):
                    return f"record '{spec.name}' key '{key}' has shape {tuple(arr.shape)}, expected {tuple(shape)}"
                if np.dtype(arr.dtype) != dtype:
                    return f"record '{spec.name}' key '{key}' has dtype {arr.dtype}, expected {dtype}"
            arrays = R.to_numpy(rec)
            bad = all_finite(arrays)
            if bad is not None:
                return f"record '{spec.name}' key '{bad}' holds NaN/Inf"
            parsed[spec.name] = arrays
        return None

    def _rule(self, spec: RecordSpec) -> str:
        if spec.rule == "mean":
            return "wmean" if self.weighting == "examples" else "umean"
        return spec.rule

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        rlog = self._round or RoundLog(server_round, rejections=[])
        self._round = None
        assert rlog.rejections is not None
        specs = self.uplink_specs()
        aggs = {s.name: StreamingAggregator(self._rule(s)) for s in specs}
        metric_sums: dict[str, float] = {}
        total_n = 0.0
        #: Metrics of each valid reply this round (``num-examples``, ``train-loss-before``, …), readable by
        #: :meth:`server_update` (e.g. LocalUpdateDecay's plateau controller).
        self.reply_metrics: list[dict[str, Any]] = []
        # Deterministic fold order, whatever order replies arrived in.
        for msg in sorted(replies, key=lambda m: m.metadata.src_node_id):
            if not msg.has_error():
                rlog.bytes_up += sum(R.record_nbytes(r) for r in msg.content.array_records.values())
            reason, parsed = self._parse_reply(msg)
            if reason is not None:
                rlog.replies_rejected += 1
                rlog.rejections.append(f"node {msg.metadata.src_node_id}: {reason}")
                log(WARNING, "Round %d: rejected reply from node %s: %s", server_round, msg.metadata.src_node_id, reason)
                continue
            metrics = msg.content.metric_records[R.METRICS]
            n = float(metrics[R.NUM_EXAMPLES])
            for spec in specs:
                aggs[spec.name].add(parsed[spec.name], n)
            del parsed  # O(model): only one reply's arrays are deserialised at a time
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in _NOT_AVERAGED:
                    metric_sums[key] = metric_sums.get(key, 0.0) + n * float(value)
            total_n += n
            rlog.replies_used += 1
            self.reply_metrics.append({**dict(metrics), "node-id": msg.metadata.src_node_id})

        metrics_out: dict[str, float] = {k: v / total_n for k, v in metric_sums.items()} if total_n else {}
        metrics_out[R.NUM_EXAMPLES] = total_n
        metrics_out["replies-used"] = rlog.replies_used
        metrics_out["replies-rejected"] = rlog.replies_rejected

        rlog.train_metrics = metrics_out
        new_arrays: ArrayRecord | None = None
        if rlog.replies_used < self.min_replies:
            log(
                WARNING,
                "Round %d: %d valid replies < min-replies %d; keeping the previous model",
                server_round, rlog.replies_used, self.min_replies,
            )
        else:
            assert self.current is not None
            aggregates = {name: agg.result() for name, agg in aggs.items()}
            self.num_updates += 1
            new = self.server_update(server_round, self.current, aggregates)
            bad = all_finite(new)
            if bad is not None:  # never publish a corrupted model
                self.num_updates -= 1
                log(WARNING, "Round %d: server update produced NaN/Inf in '%s'; keeping the previous model", server_round, bad)
            else:
                new_arrays = R.to_record(new)
                rlog.updated = True
        rlog.seconds = time.monotonic() - self._t0
        self.history.append(rlog)
        return new_arrays, MetricRecord(metrics_out)

    # ------------------------------------------------------------------ run loop with resume + checkpoint state
    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        *,
        start_round: int = 1,
        on_round_end: Callable[[int, ArrayRecord], None] | None = None,
    ) -> Result:
        """Flower's ``Strategy.start`` plus two keyword-only extras (Flower's call stays valid).

        ``start_round``: first round to run (``> 1`` continues a checkpointed run: ``initial_arrays`` are then
        the global arrays after round ``start_round − 1``, the strategy state must have been restored with
        :meth:`restore_state`, and the round-0 evaluation is skipped).  ``on_round_end(round, arrays)`` is called
        after each round, once its evaluation is done (the ServerApp writes checkpoints there).  With the
        defaults, Flower's own loop runs unchanged.
        """
        self.num_rounds = int(num_rounds)
        if start_round == 1 and on_round_end is None:
            return super().start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config, evaluate_fn)
        if start_round < 1:
            raise ValueError(f"start_round must be >= 1, got {start_round}")
        log(INFO, "Starting %s strategy at round %d of %d", type(self).__name__, start_round, num_rounds)
        self.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result()
        t_start = time.time()
        if evaluate_fn and start_round == 1:
            res = evaluate_fn(0, initial_arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        arrays = initial_arrays
        for current_round in range(start_round, num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", current_round, num_rounds)
            replies = grid.send_and_receive(
                messages=self.configure_train(current_round, arrays, train_config, grid), timeout=timeout
            )
            agg_arrays, agg_metrics = self.aggregate_train(current_round, replies)
            if agg_arrays is not None:
                result.arrays = agg_arrays
                arrays = agg_arrays
            if agg_metrics is not None:
                log(INFO, "\t└──> Aggregated MetricRecord: %s", agg_metrics)
                result.train_metrics_clientapp[current_round] = agg_metrics
            eval_replies = grid.send_and_receive(
                messages=self.configure_evaluate(current_round, arrays, evaluate_config, grid), timeout=timeout
            )
            agg_eval = self.aggregate_evaluate(current_round, eval_replies)
            if agg_eval is not None:
                result.evaluate_metrics_clientapp[current_round] = agg_eval
            if evaluate_fn:
                res = evaluate_fn(current_round, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[current_round] = res
            if on_round_end is not None:
                on_round_end(current_round, arrays)
        log(INFO, "Strategy execution finished in %.2fs", time.time() - t_start)
        return result

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit-exactly: the instance's attributes (server optimizer
        moments, controllers, sampling RNG, history, …) except :attr:`checkpoint_exclude`.  Pickled by the
        ServerApp – checkpoints are therefore trusted files."""
        return {k: v for k, v in vars(self).items() if k not in self.checkpoint_exclude}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`checkpoint_state` on a freshly built strategy of the same class and settings."""
        for key, value in state.items():
            if key not in self.checkpoint_exclude:
                setattr(self, key, value)

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
        sums: dict[str, float] = {}
        total = 0.0
        for msg in replies:
            if msg.has_error() or R.METRICS not in msg.content.metric_records:
                continue
            m = msg.content.metric_records[R.METRICS]
            n = float(m.get(R.NUM_EXAMPLES, 0) or 0)
            if n <= 0:
                continue
            for k, v in m.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _NOT_AVERAGED:
                    sums[k] = sums.get(k, 0.0) + n * float(v)
            total += n
        if not total:
            return None
        return MetricRecord({**{k: v / total for k, v in sums.items()}, R.NUM_EXAMPLES: total})
