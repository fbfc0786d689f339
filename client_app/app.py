"""Method-agnostic ClientApp: trains with whatever local optimizer the round's config names.

The same code serves simulation and deployment: the node's data partition comes from the node config
(``partition-id``, ``num-partitions``) – or, when the node config names a node-local file
(``data-path``, see :mod:`client_app.node_data`), from that file – the task settings from the run-config, and
every method hyper-parameter from the server's ConfigRecord.  Persistent client state lives in ``context.state``
and, in runs that write checkpoints, also in a node-local directory (:mod:`client_app.client_state`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from app_common.config import AppConfig
from app_common.task import TASK_SPECS, build_model, dropout_rng, evaluate
from app_common.wire import CLIENT_STATE_BASE, CLIENT_STATE_KEEP, CLIENT_STATE_KEY, STATUS
from flower_strategies.core import records as R
from flower_strategies.core.client import record_tensors, train_reply

from .client_state import store_for
from .node import client_data, node_partition
from .node_data import NODE_DATA_KEY

#: The record of Flower's SecAgg+ protocol messages (``flwr.common.secure_aggregation.secaggplus_constants.
#: RECORD_KEY_CONFIGS``; ``flower_strategies.compat.secagg.SECAGG_CONFIGS``).
SECAGG_CONFIGS = "secaggplus_configs"


def secure_aggregation(msg: Message, context: Context, call_next: Any) -> Message:
    """Client mod: a message of a ``secure-aggregation = secaggplus`` run goes through fedadapt's SecAgg+ client mod
    (:func:`flower_strategies.compat.secagg.secagg_mod`: Flower's ``secaggplus_mod``; the train step, a legacy
    FitIns, is answered by :mod:`client_app.legacy`), imported then only: a device of an ordinary run loads no
    server-side adapter.  Every other message passes unchanged."""
    if SECAGG_CONFIGS not in msg.content.config_records:
        return call_next(msg, context)
    from flower_strategies.compat.secagg import secagg_mod

    return secagg_mod(msg, context, call_next)


app = ClientApp(mods=[secure_aggregation])


def legacy_message(msg: Message) -> bool:
    """Whether ``msg`` carries a legacy FitIns/EvaluateIns (Flower's ``DefaultWorkflow``, e.g. a SecAgg+ run)."""
    return any(name in msg.content.config_records for name in ("fitins.config", "evaluateins.config"))


def answer_legacy(msg: Message, context: Context) -> Message:
    """The legacy ClientApp's answer (:mod:`client_app.legacy`: the same client half through a NumPyClient)."""
    from .legacy import app as legacy_app

    return legacy_app(msg, context)


def device_of(context: Context, setting: str) -> torch.device:
    """The training device: the node config's ``device`` if set, else the run-config's; ``auto`` = CUDA if present."""
    choice = str(context.node_config.get("device", setting))
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device = 'cuda' but this node has no CUDA device (use device = 'auto' or 'cpu')")
    return torch.device(choice)


_models = threading.local()


def model_for(fed, device: torch.device) -> Any:
    """The task's model, built once per process and thread and reused by every message (each round loads the
    complete received state into it first; gradients are cleared so that nothing carries over; training and
    evaluation set the module mode themselves)."""
    cache = _models.__dict__.setdefault("cache", {})
    key = (fed.task, fed.seed, fed.synthetic_dim, fed.precision, str(device))
    model = cache.get(key)
    if model is None:
        model = cache[key] = build_model(fed.task, fed.seed, fed.synthetic_dim, fed.precision).to(device)
    for p in model.parameters():
        p.grad = None
    return model


def _holds_state(context: Context) -> bool:
    """Whether the node's ``Context.state`` holds saved client state (ArrayRecords ``fedadapt.<name>``)."""
    return any(n.startswith(R.STATE_PREFIX) and isinstance(r, ArrayRecord) for n, r in context.state.items())


@dataclass
class TrainJob:
    """What :func:`train` knows about one train message before the round's training (shared with the vectorized
    engine, :mod:`simulations.engine.vectorized`, which trains many of them at once and finishes each with
    :func:`finish_train`)."""

    fed: AppConfig
    pid: int
    x: torch.Tensor
    y: torch.Tensor
    config: Mapping[str, Any]
    store: Any
    status: str


def begin_train(msg: Message, context: Context) -> TrainJob:
    """Read the node's data and settings and load its saved client state (from disk in runs that checkpoint)."""
    config: Mapping[str, Any] = R.get(msg.content, R.CONFIG, ConfigRecord) or {}
    fed, pid, x, y = client_data(context, config)
    server_round = int(config.get(R.SERVER_ROUND, 0))
    store = store_for(config, context, pid)
    held = _holds_state(context)
    base = int(config.get(CLIENT_STATE_BASE, 0))
    status = store.load(context.state, server_round, context.run_id, base) if store else ("memory" if held else "fresh")
    return TrainJob(fed, pid, x, y, config, store, status)


def finish_train(job: TrainJob, content: RecordDict, msg: Message, context: Context) -> Message:
    """The reply of a trained round: partition id in the metrics, the client state saved to disk when asked."""
    metrics, info = R.get(content, R.METRICS, MetricRecord), R.get(content, R.REPLY_INFO, ConfigRecord)
    assert metrics is not None and info is not None  # train_reply writes both
    metrics["partition-id"] = job.pid
    config = job.config
    if config.get(CLIENT_STATE_KEY) and _holds_state(context):  # stateful
        if job.store is not None:
            server_round = int(config.get(R.SERVER_ROUND, 0))
            job.store.save(context.state, server_round, int(config.get(CLIENT_STATE_KEEP, 0)), context.run_id,
                           int(config.get(CLIENT_STATE_BASE, 0)))
        info[STATUS] = job.status
    return Message(content=content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train one round.  In runs that write checkpoints the method's client state is also kept on the node's disk
    (:mod:`client_app.client_state`), so that a resumed run continues it exactly.  A legacy FitIns (a SecAgg+ run)
    is answered by the legacy client (:func:`answer_legacy`)."""
    if legacy_message(msg):
        return answer_legacy(msg, context)
    job = begin_train(msg, context)
    fed = job.fed
    model = model_for(fed, device_of(context, fed.device))
    with dropout_rng(model, fed.seed, int(job.config.get(R.SERVER_ROUND, 0)), job.pid):
        content = train_reply(
            model, msg.content, job.x, job.y, TASK_SPECS[fed.task].loss_fn(),
            state=context.state, seed=fed.seed, client_key=job.pid, loss_before=fed.train_loss_before,
        )
    return finish_train(job, content, msg, context)


@app.evaluate()
def evaluate_local(msg: Message, context: Context) -> Message:
    """Evaluate the received global model on this node's own data (a legacy EvaluateIns: :func:`answer_legacy`)."""
    if legacy_message(msg):
        return answer_legacy(msg, context)
    fed, _, x, y = client_data(context)
    device = device_of(context, fed.device)
    model = model_for(fed, device)
    received = R.get(msg.content, R.MODEL, ArrayRecord)
    if received is None:
        raise ValueError(f"the evaluate message has no '{R.MODEL}' ArrayRecord (the global model)")
    model.load_state_dict(record_tensors(received, copy=False))
    metrics: dict[str, Any] = {**evaluate(model, x.to(device), y.to(device), fed.task), R.NUM_EXAMPLES: len(x)}
    return Message(content=RecordDict({R.METRICS: MetricRecord(metrics)}), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Report this node's partition id (the server orders nodes by it for reproducible sampling).

    A node with node-local data and no ``partition-id`` reports none (the server then orders it by node id)."""
    if context.node_config.get(NODE_DATA_KEY):  # own data: partition-id optional, num-partitions unused
        has_pid = "partition-id" in context.node_config
        own: dict[str, Any] = {"partition-id": int(context.node_config["partition-id"])} if has_pid else {}
        return Message(content=RecordDict({R.METRICS: MetricRecord(own)}), reply_to=msg)
    pid, n = node_partition(context)
    ids: dict[str, Any] = {"partition-id": pid, "num-partitions": n}
    return Message(content=RecordDict({R.METRICS: MetricRecord(ids)}), reply_to=msg)
