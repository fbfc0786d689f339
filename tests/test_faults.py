"""Fault matrix: per-round injected client faults, for every registered method.

The real ServerApp logic drives the real ClientApp in-process through :class:`FaultGrid` (a LoopbackGrid that
also turns ClientApp exceptions into error replies as a SuperNode does, drops replies of stragglers/timed-out
nodes and takes nodes offline).  Checked: the run always completes, the global model is always finite, every
rejection is counted with its reason, missing replies are counted, rounds with fewer than ``min-replies`` valid
replies keep the previous model, and huge updates are refused when ``max-update-norm`` is set.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Error, Message
from flwr.common.constant import ErrorCode

import flower_strategies  # noqa: F401 - registers the methods
from client_app.app import app as client_app
from flower_strategies.methods.baselines import FedAvg
from server_app.app import run
from simulations.engine.inprocess import LoopbackGrid
from tests.helpers import NodesGrid, config, every_method, reply

NODES = 6
BASE = {
    "task": "synthetic-linear", "synthetic-dim": 4, "precision": "float64", "local-steps": 3, "batch-size": 8,
    "seed": 0, "num-server-rounds": 5, "client-lr": 0.05, "min-replies": 2, "max-update-norm": 1.0e4,
}
#: Faults the strategy must reject (counted in replies-rejected) and the reason it must log for each.
REJECTED = {
    "raise": "client error", "nan": "NaN/Inf", "inf": "NaN/Inf", "key": "wrong keys", "shape": "has shape",
    "dtype": "has dtype", "norm": "exceeds max-update-norm",
}
#: Per round: {partition id: fault}.  "drop" = the reply never arrives (straggler / timeout);
#: "offline" = the node has left the federation before the round (not sampled at all).
SCHEDULE: dict[int, dict[int, str]] = {
    1: {0: "raise", 1: "nan", 2: "drop"},
    2: {0: "key", 1: "shape", 2: "dtype", 3: "inf"},
    3: {0: "norm", 1: "norm", 2: "raise", 3: "drop", 4: "nan"},  # only 1 valid reply < min-replies 2
    4: {5: "offline", 0: "drop", 1: "dtype"},
    5: {5: "offline"},
}


def round_of(msg) -> int:
    cfg = msg.content.config_records.get("config") if not msg.has_error() else None
    return int(cfg["server-round"]) if cfg is not None else 0


class FaultGrid(LoopbackGrid):
    """LoopbackGrid with a SuperNode's error replies, dropped replies and nodes that go offline."""

    def __init__(self, client_app, num_nodes, run_config, schedule):
        super().__init__(client_app, num_nodes, run_config)
        self.schedule = schedule
        self.server_round = 0

    def _fault(self, node_id: int, server_round: int) -> str | None:
        pid = int(self.contexts[node_id].node_config["partition-id"])
        return self.schedule.get(server_round, {}).get(pid)

    def get_node_ids(self):
        """Nodes connected for the upcoming round (the strategy samples before it pushes that round)."""
        return [n for n in self.contexts if self._fault(n, self.server_round + 1) != "offline"]

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            self.server_round = max(self.server_round, round_of(msg))
            node = msg.metadata.dst_node_id
            fault = self._fault(node, self.server_round) if round_of(msg) else None
            if fault in ("drop", "offline"):
                ids.append(f"lost-{node}")  # pushed, but no reply will ever be pulled
                continue
            try:
                if fault == "raise":
                    raise RuntimeError("injected client crash")
                out = self._app(msg, self.contexts[node])
            except Exception as ex:  # what a SuperNode does with a ClientApp exception
                out = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(ex)}:<'{ex}'>"),
                              reply_to=msg)
            if fault is not None:
                out = corrupt(out, fault)
            mid = f"m{len(self._inbox)}-{node}-{self.server_round}"
            self._inbox[mid] = out
            ids.append(mid)
        return ids


def _map_records(reply: Message, fn) -> Message:
    for name in list(reply.content.array_records):
        arrays = {k: v.numpy() for k, v in reply.content.array_records[name].items()}
        reply.content[name] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in fn(arrays).items()})
    return reply


def corrupt(reply: Message, fault: str) -> Message:
    if reply.has_error():
        return reply
    floats = lambda a: a.dtype.kind == "f"  # noqa: E731
    if fault == "nan":
        return _map_records(reply, lambda d: {k: np.full_like(v, np.nan) if floats(v) else v for k, v in d.items()})
    if fault == "inf":
        return _map_records(reply, lambda d: {k: np.where(np.arange(v.size).reshape(v.shape) == 0, np.inf, v)
                                              if floats(v) else v for k, v in d.items()})
    if fault == "key":
        return _map_records(reply, lambda d: {k + ".renamed": v for k, v in d.items()})
    if fault == "shape":
        return _map_records(reply, lambda d: {k: np.concatenate([v.ravel(), v.ravel()[:1]]) for k, v in d.items()})
    if fault == "dtype":
        return _map_records(reply, lambda d: {k: v.astype(np.float32 if v.dtype == np.float64 else np.float64)
                                              for k, v in d.items()})
    if fault == "norm":
        return _map_records(reply, lambda d: {k: v + 1.0e6 if floats(v) else v for k, v in d.items()})
    raise ValueError(fault)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", every_method())
def test_fault_matrix(tmp_path, method):
    cfg = {**BASE, "method": method, "output-dir": str(tmp_path), "run-name": "f"}
    summary = run(FaultGrid(client_app, NODES, cfg, SCHEDULE), cfg)
    assert summary["status"] == "completed"
    got = rows(tmp_path / "f")
    assert [r["round"] for r in got] == list(range(BASE["num-server-rounds"] + 1))
    for r in got:
        assert np.isfinite(r["test-loss"]), r
    for rnd in range(1, BASE["num-server-rounds"] + 1):
        faults = SCHEDULE.get(rnd, {})
        online = NODES - sum(f == "offline" for f in faults.values())
        rejected = [f for f in faults.values() if f in REJECTED]
        missing = sum(f == "drop" for f in faults.values())
        used = online - len(rejected) - missing
        row = got[rnd]
        got_counts = (row["replies-used"], row["replies-rejected"], row["replies-missing"])
        assert got_counts == (used, len(rejected), missing), row
        assert row["bytes-down"] * NODES == got[1]["bytes-down"] * online  # only the online nodes were sampled
        for f in rejected:
            assert REJECTED[f] in row["rejections"], (f, row["rejections"])
        assert row.get("rejections", "").count("node ") == len(rejected)
        assert row["updated"] == (used >= BASE["min-replies"])
        if not row["updated"]:  # the previous model was kept
            assert row["test-loss"] == got[rnd - 1]["test-loss"]
    assert summary["rounds_without_update"] == [3]
    final = torch.load(tmp_path / "f" / "model.pt")
    assert all(torch.isfinite(v).all() for v in final.values())


def test_fault_free_run_rejects_nothing_with_the_norm_limit_on(tmp_path):
    """max-update-norm does not reject ordinary updates (so the matrix above counts only injected faults)."""
    cfg = {**BASE, "method": "fedadam", "output-dir": str(tmp_path), "run-name": "ok", "num-server-rounds": 3}
    run(FaultGrid(client_app, NODES, cfg, {}), cfg)
    assert all(r["replies-used"] == NODES and r["replies-rejected"] == 0 and r["replies-missing"] == 0
               for r in rows(tmp_path / "ok")[1:])


def test_a_huge_update_is_rejected_by_default_and_wrecks_the_model_only_with_every_bound_off(tmp_path):
    """Finite but absurd updates: the default median-relative bound rejects them, so does an absolute bound; with both
    off (the old default) the model is wrecked — why the default is on."""
    sched = {1: {0: "norm"}}
    for extra, name in (({"update-norm-ratio": 0.0, "max-update-norm": 0.0}, "off"),
                        ({"max-update-norm": 0.0}, "default"),
                        ({"update-norm-ratio": 0.0, "max-update-norm": 1.0e4}, "absolute")):
        cfg = {**BASE, "method": "fedavg", "output-dir": str(tmp_path), "run-name": name, "num-server-rounds": 1,
               **extra}
        run(FaultGrid(client_app, NODES, cfg, sched), cfg)
    off, default, absolute = (rows(tmp_path / n)[1] for n in ("off", "default", "absolute"))
    assert off["replies-rejected"] == 0 and default["replies-rejected"] == 1 and absolute["replies-rejected"] == 1
    assert "update-norm-ratio 100" in default["rejections"]
    assert off["test-loss"] > 1e6 * default["test-loss"]
    assert default["test-loss"] == pytest.approx(absolute["test-loss"], rel=1e-6)


def test_update_norm_is_measured_against_the_global_model_for_model_records():
    strategy = FedAvg(min_available_nodes=1, min_train_nodes=1, max_update_norm=5.0)
    w = np.full((1, 4), 100.0)  # a large model: its own norm (200) is far above the limit
    list(strategy.configure_train(1, ArrayRecord({"w": Array(w)}), config(), NodesGrid([1, 2, 3])))
    ok = reply(1, {"arrays": {"w": w + 2.0}})            # ‖Δ‖ = 4  ≤ 5
    far = reply(2, {"arrays": {"w": w + 3.0}})           # ‖Δ‖ = 6  > 5
    new, metrics = strategy.aggregate_train(1, [ok, far])
    assert metrics["replies-used"] == 1 and metrics["replies-rejected"] == 1
    reason = str(strategy.history[-1].rejections[0])
    assert reason.startswith("node 2:") and "update norm 6 exceeds max-update-norm 5" in reason
    assert np.array_equal(new["w"].numpy(), w + 2.0)


def test_update_norm_of_other_records_is_their_own_norm():
    from flower_strategies.core.validation import RecordSpec, check_update_norms, update_norm

    zero, three = {"w": np.zeros((2, 2))}, {"w": np.full((2, 2), 3.0)}
    params = RecordSpec("momentum", "mean", "params")
    model = RecordSpec("arrays", "mean", "model")
    assert update_norm(three, None) == pytest.approx(6.0)  # a non-model record: its own norm
    assert update_norm(three, three) == 0.0  # a model record: the update against the current model
    assert update_norm({"i": np.array([10**6])}, None) == 0.0  # integer buffers are not measured
    # check_update_norms picks the reference by the record's spec
    assert str(check_update_norms({"momentum": three}, [params], three, 5.0)) == (
        "record 'momentum' norm 6 exceeds max-update-norm 5")
    assert check_update_norms({"arrays": three}, [model], three, 5.0) is None
    assert "update norm 6" in str(check_update_norms({"arrays": three}, [model], zero, 5.0))
