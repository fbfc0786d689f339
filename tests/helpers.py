"""Test helpers: mocked Flower messages and a node-only grid (no runtime needed)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity


def set_task_identity() -> None:
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0


def metadata(src: int, dst: int = 0, message_type: str = MessageType.TRAIN) -> Metadata:
    return Metadata(
        run_id=1, message_id=uuid.uuid4().hex, src_node_id=src, dst_node_id=dst, reply_to_message_id="",
        group_id="", created_at=time.time(), ttl=3600.0, message_type=message_type,
    )


def record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v, order="C")) for k, v in arrays.items()})


def reply(src: int, records: Mapping[str, Mapping[str, np.ndarray]], num_examples: float | None = 10,
          method: str | None = None, **metrics: float) -> Message:
    """A mocked train reply; ``method`` adds the marker a fedadapt client half puts in its reply."""
    content = RecordDict({name: record(a) for name, a in records.items()})
    if method is not None:
        content["fedadapt"] = ConfigRecord({"method": method})
    m = dict(metrics)
    if num_examples is not None:
        m["num-examples"] = num_examples
    content["metrics"] = MetricRecord(m)
    return Message(content=content, metadata=metadata(src))


def error_reply(src: int, reason: str = "boom") -> Message:
    return Message(error=Error(code=1, reason=reason), metadata=metadata(src))


def train_message(content: RecordDict, dst: int = 1) -> Message:
    return Message(content=content, metadata=metadata(0, dst))


class NodesGrid(Grid):
    """A grid that only knows node ids (for configure_* calls with mocked replies)."""

    def __init__(self, node_ids) -> None:
        set_task_identity()
        self.ids = list(node_ids)

    def set_run(self, run) -> None: ...

    @property
    def run(self):  # type: ignore[override]
        return None

    def create_message(self, *a, **k):  # type: ignore[override]
        raise NotImplementedError

    def get_node_ids(self):
        return list(self.ids)

    def push_messages(self, messages):
        raise NotImplementedError

    def pull_messages(self, message_ids):
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):
        raise NotImplementedError


def config(**kv) -> ConfigRecord:
    return ConfigRecord(kv)


# ------------------------------------------------------------------ paper-002 harness (FedLADA / FedCM / SCAFFOLD tests)
SYNTH_DIM = 5
SYNTH_NODES = 10
SYNTH_RC = {"task": "synthetic-linear", "seed": 0, "precision": "float64", "synthetic-dim": SYNTH_DIM}
SYNTH_X0 = np.array([[0.3, -0.2, 0.1, 0.5, -0.4]])


def synthetic_initial_arrays() -> ArrayRecord:
    """The synthetic-linear model (float64) started at :data:`SYNTH_X0`."""
    import torch

    from client_app.task import build_model

    model = build_model("synthetic-linear", 0, SYNTH_DIM, "float64")
    with torch.no_grad():
        model.w.weight.copy_(torch.from_numpy(SYNTH_X0))
    return ArrayRecord(model.state_dict())


def recorded_run(cls, hp, rounds, capture, *, fraction=0.5, client_lr=0.05, local_steps=5, local_epochs=1, batch_size=8,
                 weighting=None, **kwargs):
    """Run strategy class ``cls`` (real strategy + real ClientApp, in-process) on the synthetic federation.

    Returns ``(weights per round, sampled partition ids per round, [capture(strategy) after each server update],
    strategy, grid)``.
    """
    from simulations.engine import simulate

    schedule: list[list[int]] = []
    captured: list = []

    class Recording(cls):
        def configure_train(self, server_round, arrays, config, grid):
            msgs = list(super().configure_train(server_round, arrays, config, grid))
            schedule.append([m.metadata.dst_node_id - 1 for m in msgs])
            return msgs

        def server_update(self, server_round, current, aggregates):
            out = super().server_update(server_round, current, aggregates)
            captured.append(capture(self))
            return out

    strat = Recording(hp, client_lr=client_lr, local_steps=local_steps, local_epochs=local_epochs, batch_size=batch_size,
                      fraction_train=fraction, weighting=weighting, seed=0, **kwargs)
    snaps, grid = simulate(strat, synthetic_initial_arrays(), rounds, SYNTH_NODES, SYNTH_RC)
    return [s["w.weight"] for s in snaps], schedule, captured, strat, grid
