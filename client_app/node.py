"""What a node's ``Context`` gives the ClientApp: the run's settings (parsed once per run), the client's key and its
data — the partition named by the node config (``partition-id``, ``num-partitions``) or the node-local file it
names (:mod:`client_app.node_data`).  Shared by the Message-API ClientApp (:mod:`client_app.app`) and the legacy
NumPyClient one (:mod:`client_app.legacy`)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from flwr.app import Context

from app_common.config import ROUND_PARTITIONERS, AppConfig
from app_common.config import parse as app_config
from app_common.task import HUB_TASKS, TASK_SPECS, load_client_data, load_round_data
from app_common.wire import ROUND_PARTITIONS
from flower_strategies.core import records as R

from .node_data import NODE_DATA_KEY, load_node_data


def node_partition(context: Context) -> tuple[int, int]:
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError as err:
        raise ValueError(
            f"node config lacks {err}; start the SuperNode with "
            '--node-config "partition-id=<i> num-partitions=<n>"'
        ) from None


def client_key(context: Context) -> int:
    """Seeds this client's mini-batch order: the partition id, else (node-local data without one) the node id."""
    if "partition-id" in context.node_config:
        return int(context.node_config["partition-id"])
    return int(context.node_id)


#: ``run id -> (run-config, its AppConfig)`` of the runs this process served last (a few: runs are few per process).
_runs: dict[int, tuple[Mapping[str, Any], AppConfig]] = {}
_runs_lock = threading.Lock()
_MAX_RUNS = 8


def run_settings(context: Context) -> AppConfig:
    """The run's :class:`~app_common.config.AppConfig`, parsed once per run and process (it is frozen): later
    messages of the run find it by run id.  A copy of the run-config it was parsed from is kept and compared (a
    dict comparison, no parse), so that an in-process engine reusing a run id with another run-config gets that
    config's settings."""
    run_config = context.run_config
    hit = _runs.get(context.run_id)
    if hit is not None and hit[0] == run_config:
        return hit[1]
    fed = app_config(run_config)
    with _runs_lock:
        _runs.pop(context.run_id, None)
        if len(_runs) >= _MAX_RUNS:
            _runs.pop(next(iter(_runs)))
        _runs[context.run_id] = (dict(run_config), fed)
    return fed


@lru_cache(maxsize=256)
def _partition(task: str, pid: int, n: int, **settings: Any):
    return load_client_data(task, pid, n, **settings)


def client_data(context: Context, config: Mapping[str, Any] | None = None):
    """``(settings, client key, x, y)``.  Offline partitions (digits, MNIST, synthetic, Shakespeare) are loaded once
    per process and reused for every later message of the same node (the tensors are only read); hub data sets and
    node-local files are read per message.

    Under a per-round partitioner (``round-iid`` / ``round-class``) a train message's ``config`` (its ConfigRecord)
    lists the round's sampled partition ids (:data:`~app_common.wire.ROUND_PARTITIONS`, in sampling order): this
    client's slot is the position of its own partition id there, and its data the slot's share of the round's
    allocation (:func:`~app_common.task.load_round_data`).  Without that list (evaluate messages, the legacy client)
    the node's data is its fixed ``iid`` partition."""
    fed = run_settings(context)
    path = context.node_config.get(NODE_DATA_KEY)
    per_round = fed.partitioner in ROUND_PARTITIONERS
    if path:  # the node brings its own data
        if per_round:
            raise ValueError(f"partitioner = {fed.partitioner!r} divides the task's bundled training split among each "
                             f"round's nodes; this node brings its own data ({NODE_DATA_KEY}): use partitioner = "
                             "'iid', 'dirichlet' or 'classes', or drop the node config's data-path")
        x, y = load_node_data(str(path), classification=TASK_SPECS[fed.task].classification, precision=fed.precision)
        return fed, client_key(context), x, y
    pid, n = node_partition(context)
    active = None if config is None else config.get(ROUND_PARTITIONS)
    if per_round and config is not None and active is not None:
        ids = [int(i) for i in active]
        if pid not in ids:
            raise ValueError(f"partition {pid} is not among the round's sampled partitions {ids}")
        x, y = load_round_data(fed.task, int(config.get(R.SERVER_ROUND, 0)), ids.index(pid), len(ids),
                               partitioner=fed.partitioner, seed=fed.seed, precision=fed.precision,
                               data_dir=fed.data_dir, dataset_path=fed.dataset_path, mnist_source=fed.mnist_source)
        return fed, pid, x, y
    load = load_client_data if fed.task in HUB_TASKS else _partition
    x, y = load(fed.task, pid, n, partitioner="iid" if per_round else fed.partitioner, seed=fed.seed,
                alpha=fed.dirichlet_alpha, classes_per_client=fed.classes_per_client, synthetic_dim=fed.synthetic_dim,
                synthetic_heterogeneity=fed.synthetic_heterogeneity, precision=fed.precision, data_dir=fed.data_dir,
                dataset_path=fed.dataset_path, synthetic_alpha=fed.synthetic_alpha, synthetic_beta=fed.synthetic_beta,
                mnist_source=fed.mnist_source)
    return fed, pid, x, y
