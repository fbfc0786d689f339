"""Legacy Flower API (``NumPyClient`` + ``flwr.server.strategy.Strategy``) for every fedadapt method.

No update rule is implemented twice: :class:`LegacyStrategy` wraps a Message-API :class:`FedAdaptStrategy` and calls
its ``prepare_round`` / ``aggregate_train`` (sampling with its :class:`~flower_strategies.core.sampler.NodeSampler`);
:class:`FedAdaptNumPyClient` calls the same :func:`train_reply` as our ClientApp.

Wire layout
-----------
The legacy protocol carries one flat list of NumPy arrays per direction.  Every fedadapt message therefore also carries
a self-describing layout under the key ``"fedadapt.layout"`` (in ``FitIns.config`` down, ``FitRes.metrics`` up): a JSON
list with one ``[record, key]`` pair per array, in list order, e.g.
``[["arrays", "fc1.weight"], ["arrays", "fc1.bias"], ["momentum", "fc1.weight"], …]``.  The receiver rebuilds the named
records from it (and checks the count); nothing is inferred from position alone.  All other config entries are the
method's round config (``method``, ``client-lr``, …), exactly as in the Message API.
"""

from __future__ import annotations

import json
import numbers
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from logging import ERROR, INFO, WARNING
from typing import Any, cast

import numpy as np
import torch
from flwr.app import ConfigRecord, Error, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.client import NumPyClient
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    log,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy as LegacyBase
from torch import Tensor, nn

from ..core import records as R
from ..core.client import ClientRound, TensorPartition, mean_loss, num_examples_of, train_reply
from ..core.ops import NamedArrays
from ..core.loop import own_loop_config
from ..core.policy import RunFailed, check_strategy
from ..core.rounds import mean_reply_metrics
from ..core.strategy import FedAdaptStrategy

LAYOUT = "fedadapt.layout"
#: Your training function for :class:`FedAdaptNumPyClient`: ``train(model, loader, lr, optimizer) -> result``, the
#: result read by :func:`train_result` (``None``, the train loss, or a dict of the loss and other metrics).
TrainFn = Callable[[nn.Module, Iterable[Any], float, "torch.optim.Optimizer | None"], Any]
#: Keys of a ``train`` result dict read as the train loss, in this order (the first present one).
LOSS_KEYS = ("train_loss", "train-loss", "loss")
TRAIN_CONTRACT = (
    "FedAdaptNumPyClient(train=...) must return None, the train loss (a number), or a dict of numbers whose "
    f"'{LOSS_KEYS[0]}' (else '{LOSS_KEYS[1]}', else '{LOSS_KEYS[2]}') entry is the train loss and whose other entries "
    "are reply metrics"
)
#: ``FitRes.metrics`` key naming the method whose client half produced the reply (the Message API's marker).
METHOD_KEY = "fedadapt.method"


# ------------------------------------------------------------------------------------------ packing
def pack(records: dict[str, NamedArrays]) -> tuple[list[np.ndarray], str]:
    """Flatten named records into (array list, JSON layout)."""
    arrays: list[np.ndarray] = []
    layout: list[list[str]] = []
    for name, named in records.items():
        for key, arr in named.items():
            arrays.append(np.asarray(arr))
            layout.append([name, key])
    return arrays, json.dumps(layout)


def unpack(arrays: list[np.ndarray], layout: str) -> dict[str, NamedArrays]:
    """Inverse of :func:`pack`; raises ValueError if the layout does not describe the arrays."""
    entries = json.loads(layout)
    if len(entries) != len(arrays):
        raise ValueError(f"layout lists {len(entries)} arrays but {len(arrays)} were received")
    out: dict[str, NamedArrays] = {}
    for (name, key), arr in zip(entries, arrays, strict=True):
        out.setdefault(name, {})[key] = arr
    return out


def _scalars(record: ConfigRecord | MetricRecord) -> dict[str, Scalar]:
    return {k: v for k, v in record.items() if isinstance(v, (bool, int, float, str, bytes))}


# ------------------------------------------------------------------------------------------ client
def _real_number(value: Any) -> float | None:
    """``value`` as a float when it is a real number (not a bool) or a one-element tensor/array, else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
        return float(value.item())
    if isinstance(value, np.ndarray) and value.size == 1 and np.isrealobj(value) and value.dtype != np.bool_:
        return float(value.item())
    return None


def train_result(result: Any) -> tuple[float | None, dict[str, float]]:
    """``(train loss, other metrics)`` of what your ``train`` returned (:data:`TRAIN_CONTRACT`): ``None`` → no loss;
    a number → the loss; a dict → its ``train_loss`` (else ``train-loss``, else ``loss``) entry is the loss and every
    other entry a reply metric (numbers only, e.g. Flower quickstart's ``{"train_loss": 0.41}``); anything else raises
    a ``TypeError`` naming the contract."""
    if result is None:
        return None, {}
    loss = _real_number(result)
    if loss is not None:
        return loss, {}
    if isinstance(result, Mapping):
        for k, v in result.items():
            if not isinstance(k, str) or _real_number(v) is None:
                raise TypeError(f"{TRAIN_CONTRACT}; got a dict whose {k!r} entry is a {type(v).__name__}")
        values = {k: float(_real_number(v)) for k, v in result.items()}  # type: ignore[arg-type]
        key = next((k for k in LOSS_KEYS if k in values), None)
        return (None if key is None else values.pop(key)), values
    raise TypeError(f"{TRAIN_CONTRACT}; got {type(result).__name__}")


class FedAdaptNumPyClient(NumPyClient):
    """A ``NumPyClient`` that runs whatever fedadapt method the server's config names.

    ``FedAdaptNumPyClient(model, trainloader, loss_fn, train=...)``: your DataLoader and your training function
    ``train(model, loader, lr, optimizer)`` run the round, exactly as :class:`ClientRound` does in a Message-API app
    (``loader`` is :attr:`ClientRound.loader`: the round's planned batches, ``len(loader)`` of them; ``optimizer`` is
    the method's local optimizer, or ``None`` for a method without a client half — then train with your own, e.g.
    SGD with momentum, at ``lr``).  ``train`` returns ``None``, the train loss (a number), or a dict of numbers
    whose ``"train_loss"`` (else ``"train-loss"``, else ``"loss"``) entry is the train loss and whose other entries
    go into the reply's metrics (Flower quickstart's ``{"train_loss": ...}`` works as it is); anything else is a
    ``TypeError`` naming this contract (:func:`train_result`).  Without ``train``, fedadapt's own loop runs on the
    loader (:func:`train_reply`).
    ``FedAdaptNumPyClient(model, x, y, loss_fn)``: whole-partition tensors (seeded mini-batches, :func:`train_reply`).

    ``state`` should be the node's ``context.state`` (pass it from your ``client_fn``) so that methods with persistent
    client state (control variates, carried moments) keep it between rounds.  ``evaluate_fn(model) -> (loss,
    num_examples, metrics)`` is the client-side evaluation (default: the mean loss over the training data).
    """

    def __init__(self, model: nn.Module, data: Tensor | Iterable[Any], *args: Any, state: RecordDict | None = None,
                 seed: int = 0, client_key: int = 0, train: TrainFn | None = None,
                 evaluate_fn: Callable[[nn.Module], tuple[float, int, dict[str, Scalar]]] | None = None) -> None:
        if isinstance(data, Tensor):
            y, loss_fn = args
            data = TensorPartition(data, y)
        else:
            (loss_fn,) = args
        self.model, self.data, self.loss_fn, self.train = model, data, loss_fn, train
        self.state, self.seed, self.client_key = state, seed, client_key
        self.evaluate_fn = evaluate_fn

    def get_parameters(self, config: dict[str, Scalar]) -> list[np.ndarray]:
        return [v.detach().cpu().numpy() for v in self.model.state_dict().values()]

    def fit(self, parameters: list[np.ndarray], config: dict[str, Scalar],
            ) -> tuple[list[np.ndarray], int, dict[str, Scalar]]:
        if LAYOUT not in config:
            raise ValueError(f"FitIns.config lacks '{LAYOUT}': the server is not a fedadapt LegacyStrategy")
        records = unpack(parameters, str(config[LAYOUT]))
        cfg = ConfigRecord({k: v for k, v in config.items() if k != LAYOUT})
        content = RecordDict({name: R.to_record(a) for name, a in records.items()})
        content[R.CONFIG] = cfg
        if self.train is None:
            reply = train_reply(self.model, content, self.data, self.loss_fn, state=self.state, seed=self.seed,
                                client_key=self.client_key)
        else:
            rnd = ClientRound(content, self.state, self.data, self.loss_fn, seed=self.seed, client_key=self.client_key)
            rnd.load_model(self.model)
            opt = rnd.optimizer(self.model) if rnd.needs_client_half else None
            loss, extra = train_result(self.train(self.model, rnd.loader, rnd.lr, opt))
            reply = rnd.reply(self.model, opt, train_loss=loss, metrics=extra)
        arrays, layout = pack({name: R.to_numpy(rec) for name, rec in reply.array_records.items()})
        metrics = _scalars(reply.metric_records[R.METRICS])
        metrics[LAYOUT] = layout
        metrics[METHOD_KEY] = str(reply.config_records[R.REPLY_INFO][R.METHOD])
        return arrays, int(metrics[R.NUM_EXAMPLES]), metrics

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        keys = list(self.model.state_dict())
        self.model.load_state_dict({k: torch.from_numpy(np.asarray(a)) for k, a in zip(keys, parameters, strict=True)})
        if self.evaluate_fn is None:
            return mean_loss(self.model, self.data, self.loss_fn), num_examples_of(self.data), {}
        return self.evaluate_fn(self.model)


# ------------------------------------------------------------------------------------------ server
#: Flower's legacy metrics aggregation: ``fn([(num_examples, metrics), …]) -> metrics``.
MetricsAggregationFn = Callable[[list[tuple[int, dict[str, Scalar]]]], dict[str, Scalar]]
#: Central evaluation ``(server_round, {key: ndarray}) -> (loss, metrics)`` or ``None``.
EvaluateFn = Callable[[int, dict[str, np.ndarray]], tuple[float, dict[str, Scalar]] | None]


class LegacyStrategy(LegacyBase):
    """Run a fedadapt Message-API strategy under the legacy ``ServerApp(server_fn=…)`` / ``start_grid`` API.

    Parameters
    ----------
    strategy
        Any :class:`FedAdaptStrategy` (its sampling settings, seed and hyper-parameters apply unchanged).
    initial_arrays
        The initial global model as ``{state_dict key: ndarray or tensor}``, e.g. ``net.state_dict()`` (its key
        order is the parameter order).
    evaluate_fn
        Optional central evaluation ``(server_round, {key: ndarray}) -> (loss, metrics)``.
    evaluate_metrics_aggregation_fn
        Optional, as in Flower's legacy ``FedAvg``: ``fn([(num_examples, metrics), …]) -> metrics`` aggregates the
        clients' evaluation metrics (default: example-weighted means of the numeric ones, non-finite values left
        out).  The loss is always the example-weighted mean.
    num_rounds
        The run's number of rounds (the legacy API keeps it in ``ServerConfig``, out of the strategy's sight); pass it
        for methods with round-dependent schedules (e.g. FedDA's full-batch phase in the last rounds), and for the
        end-of-run check of the failure policy.

    The run-failure policy of the Message API (:mod:`flower_strategies.core.policy`) applies after every round
    (:meth:`evaluate`): ``RunFailed`` when every client failed (e.g. stock ``NumPyClient`` clients, whose replies
    lack the ``fedadapt.layout``), when ``max_idle_rounds`` rounds updated nothing, or (``num_rounds`` given) when
    no round of the run updated the model.
    """

    def __init__(self, strategy: FedAdaptStrategy, initial_arrays: Mapping[str, Any],
                 evaluate_fn: EvaluateFn | None = None,
                 num_rounds: int | None = None,
                 evaluate_metrics_aggregation_fn: MetricsAggregationFn | None = None) -> None:
        self.inner = strategy
        if num_rounds is not None:
            strategy.num_rounds = int(num_rounds)
        self.keys = list(initial_arrays)
        self.initial = {k: v.detach().cpu().numpy() if isinstance(v, Tensor) else np.asarray(v)
                        for k, v in initial_arrays.items()}
        self.evaluate_fn = evaluate_fn
        self.evaluate_metrics_aggregation_fn = evaluate_metrics_aggregation_fn

    def __repr__(self) -> str:
        return f"LegacyStrategy({type(self.inner).__name__})"

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters([self.initial[k] for k in self.keys])

    def _arrays(self, parameters: Parameters) -> dict[str, np.ndarray]:
        nds = parameters_to_ndarrays(parameters)
        if len(nds) != len(self.keys):
            raise ValueError(f"expected {len(self.keys)} global arrays, got {len(nds)}")
        return dict(zip(self.keys, nds, strict=True))

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager,
                      ) -> list[tuple[ClientProxy, FitIns]]:
        s = self.inner
        cfg = s.settings
        need = max(cfg.min_available_nodes, cfg.min_train_nodes)
        # num_available() first, as Flower's own strategies do: under start_grid it refreshes the node list (the
        # wrapped method), so wait_for() returns at once instead of idling until the 5 s background refresh.
        if client_manager.num_available() < need:
            client_manager.wait_for(need, timeout=int(cfg.wait_for_nodes))
        proxies = client_manager.all()
        by_node = {_node_id(p): p for p in proxies.values()}
        picked = s.sampler.pick(list(by_node), cfg.fraction_train, cfg.min_train_nodes)
        content = s.prepare_round(server_round, R.to_record(self._arrays(parameters)), own_loop_config(),
                                  len(picked))
        arrays, layout = pack({name: R.to_numpy(rec) for name, rec in content.array_records.items()})
        config: dict[str, Scalar] = _scalars(content.config_records[R.CONFIG])
        config[LAYOUT] = layout
        fit_ins = FitIns(ndarrays_to_parameters(arrays), config)
        log(INFO, "configure_fit: sampled %d of %d clients", len(picked), len(by_node))
        return [(by_node[n], fit_ins) for n in picked]

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[tuple[ClientProxy, FitRes] | BaseException],
                      ) -> tuple[Parameters | None, dict[str, Scalar]]:
        messages = [_fitres_to_message(proxy, res) for proxy, res in results]
        for i, fail in enumerate(failures):
            if isinstance(fail, BaseException):  # Flower's workflow wraps an error reply as Exception(its Error)
                code = fail.args[0].code if fail.args and isinstance(fail.args[0], Error) else 0
                messages.append(_reply(-(i + 1), error=Error(code=code, reason=repr(fail))))
            else:
                messages.append(_fitres_to_message(*fail))
        arrays, metrics = self.inner.aggregate_train(server_round, messages)
        out = None if arrays is None else ndarrays_to_parameters([arrays[k].numpy() for k in self.keys])
        return out, dict(cast(Any, metrics)) if metrics is not None else {}

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager,
                           ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Client-side evaluation with the wrapped strategy's ``fraction_evaluate`` / ``min_evaluate_nodes`` and RNG."""
        s = self.inner
        if s.settings.fraction_evaluate <= 0.0:
            return []
        by_node = {_node_id(p): p for p in client_manager.all().values()}
        picked = s.sampler.pick(list(by_node), s.settings.fraction_evaluate, s.min_evaluate_nodes)
        ins = EvaluateIns(parameters, {R.SERVER_ROUND: server_round})
        return [(by_node[n], ins) for n in picked]

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures: list[Any]) -> tuple[float | None, dict[str, Scalar]]:
        """Example-weighted mean loss and metrics of the clients' evaluations (non-finite values left out), or
        ``evaluate_metrics_aggregation_fn([(num_examples, metrics), …])`` for the metrics when given.  Flower's
        legacy server logs the count of results and failures; this logs the failures' reasons (grouped) and warns
        when no client evaluation came back with ``num_examples`` > 0."""
        reasons: dict[str, int] = {}
        for fail in failures:
            reason = repr(fail) if isinstance(fail, BaseException) else str(getattr(fail[1], "status", fail[1]))
            reasons[reason[:300]] = reasons.get(reason[:300], 0) + 1
        for reason, count in reasons.items():
            log(INFO, "\t> %d evaluate failure%s: %s", count, "s" if count > 1 else "", reason)
        usable = [(proxy, res) for proxy, res in results if res.num_examples > 0]
        if not usable:
            if results or failures:
                why = (f"all {len(failures)} client evaluations failed" if not results else
                       f"{len(results)} client evaluation(s) reported num_examples = 0: evaluate_fn must return "
                       "(loss, num_examples > 0, metrics)")
                log(WARNING, "Round %d: no client-side evaluate metrics: %s", server_round, why)
            return None, {}
        rows = [{**{k: v for k, v in (res.metrics or {}).items() if isinstance(v, (int, float))},
                 "loss": float(res.loss), R.NUM_EXAMPLES: float(res.num_examples)} for _, res in usable]
        mean: dict[str, Any] = mean_reply_metrics(rows)
        loss = mean.pop("loss", None)
        if self.evaluate_metrics_aggregation_fn is not None:
            return loss, dict(self.evaluate_metrics_aggregation_fn([(res.num_examples, res.metrics)
                                                                    for _, res in usable]))
        return loss, mean

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """Central evaluation (``evaluate_fn``), then the run-failure policy (:mod:`flower_strategies.core.policy`),
        as the Message API's ``start`` applies it: Flower's legacy server calls this after every round."""
        res = None if self.evaluate_fn is None else self.evaluate_fn(server_round, self._arrays(parameters))
        if server_round > 0:
            last = self.inner.num_rounds is not None and server_round >= self.inner.num_rounds
            try:
                check_strategy(self.inner, final=last)
            except RunFailed as err:
                log(ERROR, "fedadapt: run FAILED: %s", err)
                raise
        return res


def _node_id(proxy: ClientProxy) -> int:
    node_id = getattr(proxy, "node_id", None)
    return int(node_id) if node_id is not None else int(proxy.cid)


def _md(src: int) -> Metadata:
    return Metadata(run_id=0, message_id=uuid.uuid4().hex, src_node_id=src, dst_node_id=0, reply_to_message_id="",
                    group_id="", created_at=time.time(), ttl=0.0, message_type=MessageType.TRAIN)


def _reply(src: int, *, content: RecordDict | None = None, error: Error | None = None) -> Message:
    """A reply from node ``src`` (Flower's runtime-side constructor, with metadata; its typed overloads lack it)."""
    if error is not None:
        return Message(error=error, metadata=_md(src))  # type: ignore[call-overload]
    return Message(content=content, metadata=_md(src))  # type: ignore[call-overload]


def _fitres_to_message(proxy: ClientProxy, res: FitRes) -> Message:
    """A FitRes as the reply Message the Message-API strategy validates and aggregates."""
    src = _node_id(proxy)
    metrics = dict(res.metrics or {})
    layout = metrics.pop(LAYOUT, None)
    if layout is None:
        log(WARNING, "FitRes from client %s has no '%s'; rejecting it", proxy.cid, LAYOUT)
        reason = f"reply without '{LAYOUT}' (not a fedadapt client?)"
        return _reply(src, error=Error(code=0, reason=reason))
    try:
        records = unpack(parameters_to_ndarrays(res.parameters), str(layout))
    except (ValueError, TypeError) as err:
        return _reply(src, error=Error(code=0, reason=f"bad layout: {err}"))
    content = RecordDict({name: R.to_record(a) for name, a in records.items()})
    method = metrics.pop(METHOD_KEY, None)
    if method is not None:
        content[R.REPLY_INFO] = ConfigRecord({R.METHOD: str(method)})
    numeric: dict[str, Any] = {
        k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    numeric.setdefault(R.NUM_EXAMPLES, res.num_examples)
    content[R.METRICS] = MetricRecord(numeric)
    return _reply(src, content=content)
