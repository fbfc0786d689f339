"""Method-agnostic ServerApp.

1. Validates the whole run-config (unknown method/key, wrong type, out-of-range value → one clear error,
   raised before round 1) and builds the strategy from the registry.
2. Asks every connected node for its partition id (a QUERY message) when clients are sub-sampled, so that
   sampling with the run's seed picks the same partitions whatever node ids the runtime assigned.
3. Runs the strategy, evaluating the global model centrally on the held-out test split after every round;
   writes ``<output-dir>/<run-name>/metrics.jsonl`` + ``metrics.csv``, prints one progress line per round
   and saves ``model.pt`` and ``summary.json`` at the end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from client_app.task import build_model, evaluate, load_test_data
from flower_strategies import records as R
from flower_strategies.hparams import FederationConfig
from flower_strategies.registry import build_strategy
from flower_strategies.strategy import FedAdaptStrategy

from .metrics import MetricsWriter, progress_line

from logging import INFO, WARNING

app = ServerApp()


def run_dir(fed: FederationConfig) -> Path:
    name = fed.run_name or f"{fed.method}-{fed.task}-seed{fed.seed}"
    return Path(fed.output_dir).expanduser().resolve() / name


def discover_partitions(grid: Grid, strategy: FedAdaptStrategy, timeout: float) -> None:
    """Ask connected nodes for their partition id; order sampling by it (fallback: node id)."""
    nodes = strategy.sample(grid, 1.0, strategy.min_available_nodes)
    msgs = [Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=n) for n in nodes]
    order: dict[int, Any] = {}
    for reply in grid.send_and_receive(msgs, timeout=timeout):
        if not reply.has_error() and R.METRICS in reply.content.metric_records:
            order[reply.metadata.src_node_id] = int(reply.content.metric_records[R.METRICS]["partition-id"])
    if len(order) < len(nodes):
        log(WARNING, "Only %d of %d nodes reported a partition id; the others are ordered by node id", len(order), len(nodes))
    strategy.node_order = order


def run(grid: Grid, run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Everything ``main`` does, callable with any Grid (the in-process engine uses it too)."""
    # Validate before anything is sent.
    probe_fed = FederationConfig.from_run_config({k: v for k, v in run_config.items() if k in FederationConfig.keys(None)}, None)
    model = build_model(probe_fed.task, probe_fed.seed, probe_fed.synthetic_dim, probe_fed.precision)
    trainable = [name for name, _ in model.named_parameters()]
    strategy, fed = build_strategy(run_config, trainable_keys=trainable)
    x_test, y_test = load_test_data(
        fed.task, seed=fed.seed, num_clients=fed.synthetic_clients, synthetic_dim=fed.synthetic_dim,
        synthetic_heterogeneity=fed.synthetic_heterogeneity, precision=fed.precision,
    )
    out = run_dir(fed)
    writer = MetricsWriter(out)
    log(INFO, "fedadapt: method=%s task=%s rounds=%d → %s", fed.method, fed.task, fed.num_server_rounds, out)
    if fed.fraction_train < 1.0 or fed.fraction_evaluate not in (0.0, 1.0):
        discover_partitions(grid, strategy, fed.round_timeout)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        m = evaluate(model, x_test, y_test, fed.task)
        row: dict[str, Any] = {"round": server_round, "test-loss": m["loss"]}
        if "accuracy" in m:
            row["test-accuracy"] = m["accuracy"]
        if server_round > 0 and strategy.history and strategy.history[-1].server_round == server_round:
            h = strategy.history[-1]
            tm = h.train_metrics or {}
            row.update({
                "train-loss": tm.get(R.TRAIN_LOSS), "train-loss-before": tm.get(R.TRAIN_LOSS_BEFORE),
                "replies-used": h.replies_used, "replies-rejected": h.replies_rejected,
                "bytes-down": h.bytes_down, "bytes-up": h.bytes_up, "updated": h.updated,
            })
            for key in getattr(strategy, "logged_metrics", ()):  # method-specific per-round state (e.g. decayed lrs)
                row[key] = tm.get(key)
            if h.rejections:
                row["rejections"] = "; ".join(h.rejections)
        row = writer.add(row)
        print(progress_line(row, fed.num_server_rounds), flush=True)
        return MetricRecord({k: v for k, v in m.items()})

    t0 = time.monotonic()
    initial = ArrayRecord(model.state_dict())
    result = strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=fed.num_server_rounds,
        timeout=fed.round_timeout,
        evaluate_fn=evaluate_fn,
    )
    # Flower's Result keeps an empty ArrayRecord when no round ever updated the model.
    final_arrays = result.arrays if len(result.arrays) else initial
    model.load_state_dict(final_arrays.to_torch_state_dict())
    torch.save(model.state_dict(), out / "model.pt")
    final = writer.rows[-1] if writer.rows else {}
    summary = {
        "status": "completed", "method": fed.method, "task": fed.task, "rounds": fed.num_server_rounds,
        "final": final, "seconds": round(time.monotonic() - t0, 3), "run_config": dict(run_config),
        "rounds_without_update": [h.server_round for h in strategy.history if not h.updated],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
    log(INFO, "fedadapt: finished; metrics in %s", out)
    return summary


@app.main()
def main(grid: Grid, context: Context) -> None:
    run(grid, dict(context.run_config))
