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

from app_common.config import AppConfig
from app_common.config import parse as app_config
from app_common.task import HUB_TASKS, TASK_SPECS, load_client_data

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


def client_data(context: Context):
    """``(settings, client key, x, y)``.  Offline partitions (digits, synthetic, Shakespeare: small) are loaded once
    per process and reused for every later message of the same node (the tensors are only read); hub data sets and
    node-local files are read per message."""
    fed = run_settings(context)
    path = context.node_config.get(NODE_DATA_KEY)
    if path:  # the node brings its own data
        x, y = load_node_data(str(path), classification=TASK_SPECS[fed.task].classification, precision=fed.precision)
        return fed, client_key(context), x, y
    pid, n = node_partition(context)
    load = load_client_data if fed.task in HUB_TASKS else _partition
    x, y = load(fed.task, pid, n, partitioner=fed.partitioner, seed=fed.seed, alpha=fed.dirichlet_alpha,
                classes_per_client=fed.classes_per_client, synthetic_dim=fed.synthetic_dim,
                synthetic_heterogeneity=fed.synthetic_heterogeneity, precision=fed.precision, data_dir=fed.data_dir,
                dataset_path=fed.dataset_path, synthetic_alpha=fed.synthetic_alpha, synthetic_beta=fed.synthetic_beta)
    return fed, pid, x, y
