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

import csv
import json
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from client_app.task import build_model, evaluate, load_test_data
from flower_strategies.core import checkpoint as ckpt
from flower_strategies.core import records as R
from client_app.config import AppConfig
from client_app.config import parse as app_config
from flower_strategies.core.registry import build_strategy, run_config_defaults
from flower_strategies.core.strategy import FedAdaptStrategy

from . import plots, presets
from .loop import run_rounds
from .metrics import COLUMNS, MetricsWriter, progress_line

from logging import INFO, WARNING

app = ServerApp()


def run_dir(fed: AppConfig) -> Path:
    name = fed.run_name or f"{fed.method}-{fed.task}-seed{fed.seed}"
    return Path(fed.output_dir).expanduser().resolve() / name


def discover_partitions(grid: Grid, strategy: FedAdaptStrategy, timeout: float) -> None:
    """Ask connected nodes for their partition id; order sampling by it (fallback: node id)."""
    nodes = strategy.sample(grid, 1.0, strategy.min_available_nodes)
    msgs = [Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=n) for n in nodes]
    order: dict[int, Any] = {}
    for reply in grid.send_and_receive(msgs, timeout=timeout):
        if not reply.has_error() and R.METRICS in reply.content.metric_records:
            metrics = reply.content.metric_records[R.METRICS]
            if "partition-id" in metrics:  # nodes with their own data may have none
                order[reply.metadata.src_node_id] = int(metrics["partition-id"])
    if len(order) < len(nodes):
        log(WARNING, "Only %d of %d nodes reported a partition id; the others are ordered by node id", len(order), len(nodes))
    strategy.order_nodes(order)


class Checkpointer:
    """Writes ``checkpoint.pkl`` every ``every`` rounds and after the last one; keeps the latest round's
    checkpoint in memory so that SIGINT/SIGTERM can write it before the process exits."""

    def __init__(self, path: Path, every: int, num_rounds: int) -> None:
        self.path, self.every, self.num_rounds = path, every, num_rounds
        self.latest: bytes | None = None
        self.latest_round = -1
        self.written_round = -1

    def round_end(self, server_round: int, payload: dict[str, Any]) -> None:
        self.latest, self.latest_round = ckpt.dumps(payload), server_round
        if server_round % self.every == 0 or server_round == self.num_rounds:
            self.write()

    def write(self) -> None:
        if self.latest is not None and self.written_round != self.latest_round:
            ckpt.write_atomic(self.path, self.latest)
            self.written_round = self.latest_round
            log(INFO, "fedadapt: checkpoint of round %d written to %s", self.latest_round, self.path)

    def install_signal_handlers(self) -> dict[int, Any]:
        """SIGINT/SIGTERM: write the last completed round's checkpoint, then hand over to the previous handler
        (Flower's graceful exit in a deployed ServerApp) or exit (KeyboardInterrupt / SystemExit(128+signum)).
        Only possible in the main thread; returns the previous handlers (restored when the run ends)."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        previous: dict[int, Any] = {}

        def handler(signum: int, frame: Any) -> None:
            log(WARNING, "fedadapt: received signal %d; writing the checkpoint of round %d", signum, self.latest_round)
            self.write()
            prev = previous.get(signum)
            if callable(prev):  # e.g. Flower's own graceful-exit handler in a deployed ServerApp
                prev(signum, frame)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.getsignal(sig)
            signal.signal(sig, handler)
        return previous


def _restore_rows(writer: MetricsWriter, rows: list[dict[str, Any]]) -> None:
    """Put the checkpointed metrics rows back into a fresh writer (rewrites metrics.jsonl and metrics.csv)."""
    writer.rows = [dict(r) for r in rows]
    writer.jsonl.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in writer.rows))
    cols = COLUMNS + sorted({k for r in writer.rows for k in r} - set(COLUMNS))
    with writer.csv.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows(writer.rows)


def run(grid: Grid, run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Everything ``main`` does, callable with any Grid (the in-process engine uses it too)."""
    run_config = presets.apply(run_config)  # the task's per-method presets on keys left at their defaults
    # Validate before anything is sent.
    probe_fed = app_config(run_config)
    model = build_model(probe_fed.task, probe_fed.seed, probe_fed.synthetic_dim, probe_fed.precision)
    trainable = [name for name, _ in model.named_parameters()]
    strategy, fed = build_strategy(run_config, trainable_keys=trainable, settings=AppConfig)
    payload: dict[str, Any] | None = None
    if fed.resume:
        payload = ckpt.load(fed.resume)
        ckpt.check_compatible(payload, run_config, run_config_defaults(AppConfig))
    x_test, y_test = load_test_data(
        fed.task, seed=fed.seed, num_clients=fed.synthetic_clients, synthetic_dim=fed.synthetic_dim,
        synthetic_heterogeneity=fed.synthetic_heterogeneity, precision=fed.precision, data_dir=fed.data_dir,
        max_examples=fed.test_max_examples,
    )
    out = run_dir(fed)
    writer = MetricsWriter(out)
    log(INFO, "fedadapt: method=%s task=%s rounds=%d → %s", fed.method, fed.task, fed.num_server_rounds, out)
    if fed.fraction_train < 1.0 or fed.fraction_evaluate not in (0.0, 1.0):
        discover_partitions(grid, strategy, fed.round_timeout)

    start_round = 1
    initial = ArrayRecord(model.state_dict())
    if payload is not None:
        # After discover_partitions (which draws from the sampling RNG in a fresh run too): the restored RNG
        # state is exactly the one the uninterrupted run had after round ``payload['round']``.
        ckpt.restore_strategy(strategy, payload)
        initial = R.to_record(payload["arrays"])
        _restore_rows(writer, payload["metrics_rows"])
        start_round = int(payload["round"]) + 1
        log(INFO, "fedadapt: resuming from %s after round %d", fed.resume, payload["round"])

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
                "replies-missing": max(0, h.sampled - h.replies_used - h.replies_rejected),
                "bytes-down": h.bytes_down, "bytes-up": h.bytes_up, "updated": h.updated,
            })
            row.update(h.round_metrics)  # the method's own per-round values (e.g. decayed learning rates)
            if h.rejections:
                row["rejections"] = "; ".join(h.rejections)
        row = writer.add(row)
        print(progress_line(row, fed.num_server_rounds), flush=True)
        return MetricRecord({k: v for k, v in m.items()})

    checkpointer: Checkpointer | None = None
    on_round_end = None
    previous_handlers: dict[int, Any] = {}
    if fed.checkpoint_every > 0:
        checkpointer = Checkpointer(out / "checkpoint.pkl", fed.checkpoint_every, fed.num_server_rounds)

        def on_round_end(server_round: int, arrays: ArrayRecord) -> None:
            assert checkpointer is not None
            checkpointer.round_end(server_round, ckpt.make_payload(
                server_round=server_round, num_rounds=fed.num_server_rounds, arrays=R.to_numpy(arrays),
                strategy=strategy, metrics_rows=writer.rows, run_config=run_config,
            ))

        previous_handlers = checkpointer.install_signal_handlers()

    t0 = time.monotonic()
    try:
        result = run_rounds(
            strategy, grid, initial, fed.num_server_rounds, fed.round_timeout, evaluate_fn,
            start_round=start_round, on_round_end=on_round_end,
        )
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
    # Flower's Result keeps an empty ArrayRecord when no round ever updated the model.
    final_arrays = result.arrays if len(result.arrays) else initial
    model.load_state_dict(final_arrays.to_torch_state_dict())
    torch.save(model.state_dict(), out / "model.pt")
    final = writer.rows[-1] if writer.rows else {}
    summary = {
        "status": "completed", "method": fed.method, "task": fed.task, "rounds": fed.num_server_rounds,
        "final": final, "seconds": round(time.monotonic() - t0, 3), "run_config": dict(run_config),
        "rounds_without_update": [h.server_round for h in strategy.history if not h.updated],
        "resumed_after_round": None if payload is None else int(payload["round"]),
    }
    if checkpointer is not None:
        summary["checkpoint"] = str(checkpointer.path)
    plots.write_learning_curve(writer.rows, out, f"{fed.method} on {fed.task}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
    log(INFO, "fedadapt: finished; metrics in %s", out)
    return summary


@app.main()
def main(grid: Grid, context: Context) -> None:
    run(grid, dict(context.run_config))
