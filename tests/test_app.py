"""The real ServerApp logic + real ClientApp, in-process: metrics files, determinism, fault injection, direct calls."""

from __future__ import annotations

import csv
import json
import time

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, Metadata, RecordDict

from client_app.app import app as client_app
from flower_strategies import records as R
from client_app.task import build_model
from simulations.engine import run_inprocess

BASE = {"num-server-rounds": 3, "local-steps": 4, "batch-size": 16}


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_writes_metrics_model_and_summary(tmp_path):
    cfg = {**BASE, "method": "fedavg", "output-dir": str(tmp_path), "run-name": "r"}
    summary = run_inprocess(cfg, 5)
    out = tmp_path / "r"
    rows = read_rows(out / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    for col in ("test-loss", "test-accuracy", "train-loss", "train-loss-before", "replies-used",
                "replies-rejected", "bytes-down", "bytes-up", "seconds"):
        assert col in rows[-1], col
    assert rows[-1]["replies-used"] == 5 and rows[-1]["replies-rejected"] == 0
    n_params = sum(p.numel() for p in build_model("digits-mlp", 0).parameters())
    assert rows[-1]["bytes-down"] == rows[-1]["bytes-up"] == 5 * n_params * 4
    assert rows[-1]["test-loss"] < rows[0]["test-loss"]
    with (out / "metrics.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == 4
    state = torch.load(out / "model.pt")
    assert set(state) == set(build_model("digits-mlp", 0).state_dict())
    assert summary["status"] == "completed" and json.loads((out / "summary.json").read_text())["final"]["round"] == 3


def _strip(rows):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


@pytest.mark.parametrize("extra", [{}, {"fraction-train": 0.5, "method": "fedadam"}])
def test_two_runs_with_the_same_seed_give_identical_metrics(tmp_path, extra):
    rows = []
    for name in ("a", "b"):
        run_inprocess({**BASE, "output-dir": str(tmp_path), "run-name": name, "seed": 3, **extra}, 6)
        rows.append(_strip(read_rows(tmp_path / name / "metrics.jsonl")))
    assert rows[0] == rows[1]
    run_inprocess({**BASE, "output-dir": str(tmp_path), "run-name": "c", "seed": 4, **extra}, 6)
    assert _strip(read_rows(tmp_path / "c" / "metrics.jsonl")) != rows[0]


def test_partial_participation_is_reproducible_under_other_node_ids(tmp_path):
    """Sampling follows the partition ids the nodes report (QUERY), not the runtime's random node ids."""
    cfg = {**BASE, "fraction-train": 0.5, "output-dir": str(tmp_path), "seed": 1}
    run_inprocess({**cfg, "run-name": "a"}, 6)
    run_inprocess({**cfg, "run-name": "b"}, 6, node_ids=[9001, 17, 4242, 5, 777, 31337])
    assert _strip(read_rows(tmp_path / "a" / "metrics.jsonl")) == _strip(read_rows(tmp_path / "b" / "metrics.jsonl"))


def test_injected_faults_are_rejected_and_the_run_goes_on(tmp_path):
    def corrupt(request, reply, partition_id):
        if partition_id == 1:  # NaN update
            arr = reply.content["arrays"]
            reply.content["arrays"] = R.to_record({k: _nan(v.numpy()) for k, v in arr.items()})
        if partition_id == 2:  # missing record
            del reply.content["arrays"]
        return reply

    cfg = {**BASE, "output-dir": str(tmp_path), "run-name": "f", "min-replies": 2}
    run_inprocess(cfg, 4, intercept=corrupt)
    rows = read_rows(tmp_path / "f" / "metrics.jsonl")
    assert all(r["replies-used"] == 2 and r["replies-rejected"] == 2 for r in rows[1:])
    assert "NaN" in rows[1]["rejections"] and "missing ArrayRecord 'arrays'" in rows[1]["rejections"]
    assert np.isfinite(rows[-1]["test-loss"]) and rows[-1]["test-loss"] < rows[0]["test-loss"]


def _nan(a):
    return np.full_like(a, np.nan) if a.dtype.kind == "f" else a


def test_round_keeps_old_model_when_too_few_valid_replies(tmp_path):
    def fail_all_but_one(request, reply, partition_id):
        if partition_id > 0:
            del reply.content["arrays"]
        return reply

    run_inprocess({**BASE, "output-dir": str(tmp_path), "run-name": "k", "min-replies": 2}, 3, intercept=fail_all_but_one)
    rows = read_rows(tmp_path / "k" / "metrics.jsonl")
    assert all(not r["updated"] for r in rows[1:])
    assert len({r["test-loss"] for r in rows}) == 1  # model never changed
    assert json.loads((tmp_path / "k" / "summary.json").read_text())["rounds_without_update"] == [1, 2, 3]


def test_client_side_evaluation_when_requested(tmp_path):
    from server_app.app import run
    from simulations.engine import LoopbackGrid

    grid = LoopbackGrid(client_app, 4, {})
    cfg = {**BASE, "num-server-rounds": 1, "fraction-evaluate": 1.0, "output-dir": str(tmp_path), "run-name": "e"}
    summary = run(grid, cfg)
    assert summary["status"] == "completed"


def _train_message(content):
    md = Metadata(run_id=1, message_id="m1", src_node_id=0, dst_node_id=1, reply_to_message_id="", group_id="",
                  created_at=time.time(), ttl=3600.0, message_type=MessageType.TRAIN)
    return Message(content=content, metadata=md)


def test_clientapp_called_directly_returns_model_and_metrics():
    model = build_model("digits-mlp", 0)
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": ConfigRecord(
        {"server-round": 1, "method": "fedprox", "client-lr": 0.1, "local-steps": 3, "local-epochs": 1,
         "batch-size": 8, "prox-mu": 0.1})})
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 1, "num-partitions": 4}, state=RecordDict(),
                  run_config={})
    reply = client_app(_train_message(content), ctx)
    assert not reply.has_error()
    m = reply.content["metrics"]
    assert m["num-steps"] == 3 and m["num-examples"] > 0 and m["partition-id"] == 1
    new = reply.content["arrays"].to_torch_state_dict()
    assert any(not torch.equal(new[k], v) for k, v in model.state_dict().items())


def test_clientapp_without_partition_in_node_config_explains_the_fix():
    model = build_model("digits-mlp", 0)
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": ConfigRecord(
        {"server-round": 1, "method": "fedavg", "client-lr": 0.1, "local-steps": 1})})
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    # (the Flower runtime turns this exception into an error reply, which the strategy rejects and logs)
    with pytest.raises(ValueError, match=r"partition-id.*--node-config"):
        client_app(_train_message(content), ctx)
