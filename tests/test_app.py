"""The real ServerApp logic + real ClientApp, in-process: metrics files, determinism, fault injection, direct calls."""

from __future__ import annotations

import csv
import json
import time

import numpy as np
import pytest

from server_app.app import RunFailed
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, Metadata, RecordDict

from client_app.app import app as client_app
from flower_strategies.core import records as R
from app_common.task import build_model
from simulations.engine.inprocess import run_inprocess
from tests.helpers import client_keys

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

    cfg = {**BASE, "output-dir": str(tmp_path), "run-name": "k", "min-replies": 2, "max-idle-rounds": 0,
           "max-rejected-rounds": 0}  # the end-of-run rule alone (2 of 3 rejected each round would trip the other)
    with pytest.raises(RunFailed, match=r"no round of the run updated the model \(3 rounds\)"):
        run_inprocess(cfg, 3, intercept=fail_all_but_one)
    rows = read_rows(tmp_path / "k" / "metrics.jsonl")
    assert all(not r["updated"] for r in rows[1:])
    assert len({r["test-loss"] for r in rows}) == 1  # model never changed
    summary = json.loads((tmp_path / "k" / "summary.json").read_text())
    assert summary["rounds_without_update"] == [1, 2, 3] and summary["status"] == "failed"
    assert "missing ArrayRecord 'arrays'" in summary["failure"]


def test_a_run_that_stops_training_fails_after_max_idle_rounds(tmp_path):
    def break_from_round_2(request, reply, partition_id):
        if int(request.content["config"]["server-round"]) >= 2:
            del reply.content["arrays"]
        return reply

    cfg = {**BASE, "output-dir": str(tmp_path), "run-name": "idle", "num-server-rounds": 10, "max-idle-rounds": 2}
    with pytest.raises(RunFailed, match="the last 2 rounds updated nothing"):
        run_inprocess(cfg, 3, intercept=break_from_round_2)
    rows = read_rows(tmp_path / "idle" / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2, 3]  # stopped at once, not after 10 rounds
    assert json.loads((tmp_path / "idle" / "summary.json").read_text())["status"] == "failed"


@pytest.mark.slow  # an end-to-end run: the full suite runs it
def test_every_client_failing_stops_the_run_with_their_error(tmp_path):
    # 10 of 2,000 nodes sampled: more partitions than the 1,437 training examples, which no partitioner (nor its
    # fallbacks) can split, so every sampled client fails the same way
    cfg = {**BASE, "output-dir": str(tmp_path), "run-name": "p", "task": "digits-mlp", "partitioner": "dirichlet",
           "num-server-rounds": 3, "fraction-train": 0.005}
    with pytest.raises(RunFailed,
                       match="cannot split 1437 training examples into 2000 'dirichlet' partitions.*dirichlet-alpha"):
        run_inprocess(cfg, 2000)


def test_client_side_evaluation_when_requested(tmp_path):
    from server_app.app import run
    from simulations.engine.inprocess import LoopbackGrid

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
         "batch-size": 8, "prox-mu": 0.1, **client_keys("fedprox")})})
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
        {"server-round": 1, "method": "fedavg", "client-lr": 0.1, "local-steps": 1, **client_keys("fedavg")})})
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    # (the Flower runtime turns this exception into an error reply, which the strategy rejects and logs)
    with pytest.raises(ValueError, match=r"partition-id.*--node-config"):
        client_app(_train_message(content), ctx)


def _loss_before_reply(extra_config, partition=1, server_round=2):
    from app_common.task import load_client_data

    model = build_model("digits-mlp", 0)
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": ConfigRecord(
        {"server-round": server_round, "method": "fedavg", "client-lr": 0.1, "local-steps": 1, "local-epochs": 1,
         "batch-size": 8, **client_keys("fedavg"), **extra_config})})
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": partition, "num-partitions": 4}, state=RecordDict(),
                  run_config={})
    reply = client_app(_train_message(content), ctx)
    assert not reply.has_error()
    x, y = load_client_data("digits-mlp", partition, 4, partitioner="dirichlet", seed=0, alpha=0.3,
                            classes_per_client=2)
    return model, x, y, reply.content["metrics"]


def test_loss_before_is_over_all_examples_by_default_and_over_a_seeded_sample_when_capped():
    from flower_strategies.core.client import TensorPartition, loss_before_sample, mean_loss

    loss_fn = torch.nn.functional.cross_entropy
    model, x, y, m = _loss_before_reply({})
    assert m["train-loss-before"] == pytest.approx(mean_loss(model, TensorPartition(x, y), loss_fn), rel=1e-6)
    # capped: exactly the loss on the documented sample (10 distinct examples), not on all of them
    _, _, _, capped = _loss_before_reply({"loss-before-max-examples": 10})
    cfg = {"loss-before-max-examples": 10, "server-round": 2}
    idx = loss_before_sample(len(x), cfg, seed=0, client_key=1)
    assert len(idx) == 10 == len(set(idx.tolist())) and list(idx) == sorted(idx)
    sub = torch.from_numpy(idx)
    want = mean_loss(model, TensorPartition(x[sub], y[sub]), loss_fn)
    assert capped["train-loss-before"] == pytest.approx(want, rel=1e-6)
    assert capped["train-loss-before"] != pytest.approx(m["train-loss-before"], rel=1e-6)
    # the sample changes with the round, and a cap ≥ n means all examples
    assert not np.array_equal(idx, loss_before_sample(len(x), {**cfg, "server-round": 3}, 0, 1))
    assert loss_before_sample(len(x), {**cfg, "loss-before-max-examples": len(x)}, 0, 1) is None


def test_loss_before_cap_and_test_sample_through_the_run_config(tmp_path):
    cfg = {**BASE, "method": "fedavg", "output-dir": str(tmp_path), "loss-before-max-examples": 5,
           "test-max-examples": 50}
    run_inprocess({**cfg, "run-name": "capped"}, 4)
    run_inprocess({**BASE, "method": "fedavg", "output-dir": str(tmp_path), "run-name": "full"}, 4)
    capped, full = read_rows(tmp_path / "capped" / "metrics.jsonl"), read_rows(tmp_path / "full" / "metrics.jsonl")
    # training is untouched by the cap (same model → same train loss during the local steps) ...
    assert [r["train-loss"] for r in capped[1:]] == [r["train-loss"] for r in full[1:]]
    # ... only the estimate of the loss before training and the (sampled, 50-example) test metrics differ
    assert capped[1]["train-loss-before"] != full[1]["train-loss-before"]
    assert all(abs(r["test-accuracy"] * 50 - round(r["test-accuracy"] * 50)) < 1e-4 for r in capped)  # k/50 in float32
    assert capped[-1]["test-loss"] != full[-1]["test-loss"]


def test_negative_caps_are_rejected_before_round_one(tmp_path):
    from flower_strategies.core.hparams import ConfigError

    for key in ("loss-before-max-examples", "test-max-examples"):
        with pytest.raises(ConfigError, match=key):
            run_inprocess({**BASE, "output-dir": str(tmp_path), key: -1}, 2)


def test_metrics_row_carries_the_round_log_and_the_methods_round_metrics():
    """A round's row = test metrics + its RoundLog, including the method's own ``round_metrics`` (e.g. decayed lrs)."""
    from flower_strategies.core.rejections import Kind, Rejection
    from flower_strategies.core.strategy import RoundLog
    from server_app.app import round_row

    log = RoundLog(2, sampled=4, replies_used=2, replies_rejected=1, rejections=[Rejection(3, Kind.NONFINITE, "NaN")],
                   bytes_down=40, bytes_up=20, updated=True,
                   train_metrics={"train-loss": 0.5, "train-loss-before": 0.7},
                   round_metrics={"client-lr": 0.05, "server-lr": 0.5})
    row = round_row(2, {"loss": 0.4, "accuracy": 0.9}, log)
    assert row == {"round": 2, "test-loss": 0.4, "test-accuracy": 0.9, "train-loss": 0.5, "train-loss-before": 0.7,
                   "replies-used": 2, "replies-rejected": 1, "replies-missing": 1, "bytes-down": 40, "bytes-up": 20,
                   "updated": True, "client-lr": 0.05, "server-lr": 0.5, "rejections": "node 3: NaN"}
    assert round_row(0, {"loss": 1.0}, None) == {"round": 0, "test-loss": 1.0}  # round 0: evaluation only
    assert round_row(3, {"loss": 1.0}, None) == {"round": 3, "test-loss": 1.0}  # no train round closed


@pytest.mark.learning_curve
def test_lean_settings_skip_only_loss_before_and_the_plot(tmp_path):
    """``train-loss-before = false`` and ``learning-curve = false`` (what bench_simulation's engine column uses) change
    nothing but the skipped metric and the png: the same model and every other metric, bit for bit."""
    cfg = {**BASE, "method": "fedavg", "output-dir": str(tmp_path), "seed": 2}
    run_inprocess({**cfg, "run-name": "full"}, 4)
    run_inprocess({**cfg, "run-name": "lean", "train-loss-before": False, "learning-curve": False}, 4)
    full, lean = read_rows(tmp_path / "full" / "metrics.jsonl"), read_rows(tmp_path / "lean" / "metrics.jsonl")
    assert all(r["train-loss-before"] is not None for r in full[1:])
    assert all(r.get("train-loss-before") is None for r in lean)
    drop = {"seconds", "train-loss-before"}
    assert [{k: v for k, v in r.items() if k not in drop} for r in lean] == \
           [{k: v for k, v in r.items() if k not in drop} for r in full]
    a, b = torch.load(tmp_path / "full" / "model.pt"), torch.load(tmp_path / "lean" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "full" / "learning_curve.png").is_file()
    assert not (tmp_path / "lean" / "learning_curve.png").exists()


def test_skipping_loss_before_is_refused_for_the_method_that_needs_it(tmp_path):
    from flower_strategies.core.hparams import ConfigError

    with pytest.raises(ConfigError, match="train-loss-before"):
        run_inprocess({**BASE, "method": "localupdatedecay", "output-dir": str(tmp_path), "train-loss-before": False},
                      2)


def test_metrics_csv_appended_per_round_equals_a_full_rewrite(tmp_path):
    """Rows are appended; a row with a new column rewrites the file: the result is what rewriting every round gave."""
    from server_app.metrics import MetricsWriter

    w = MetricsWriter(tmp_path)
    for row in ({"round": 0, "test-loss": 1.0}, {"round": 1, "test-loss": 0.5, "extra": 2},
                {"round": 2, "test-loss": 0.25}, {"round": 3, "test-loss": 0.125, "z": 1}, {"round": 4, "extra": 3}):
        w.add(row)
        appended = (tmp_path / "metrics.csv").read_text()
        w._write_csv()
        assert (tmp_path / "metrics.csv").read_text() == appended


def test_exchange_polls_at_its_own_interval_and_returns_every_reply():
    """flower_strategies.core.loop.exchange: Grid.push_messages + Grid.pull_messages every ``interval`` s (Flower's
    deployment grid
    sleeps 3 s between polls); replies arriving over several polls are all returned, a timeout ends the wait."""
    import time as _time
    from types import SimpleNamespace

    from flwr.app import Message, RecordDict

    from flower_strategies.core.loop import exchange

    class SlowGrid:
        def __init__(self, ready_after: int) -> None:
            self.polls, self.ready_after, self.ids = 0, ready_after, []

        def push_messages(self, messages):
            self.msgs = list(messages)
            return [f"id{i}" for i in range(len(self.msgs))]

        def pull_messages(self, ids):
            self.polls += 1
            if self.polls < self.ready_after:
                return []
            return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i)) for i in sorted(ids)]

        def send_and_receive(self, messages, *, timeout=None):  # noqa: ARG002
            raise AssertionError("exchange must poll itself")

    msgs = [Message(RecordDict(), dst_node_id=n, message_type="train") for n in (1, 2)]
    grid = SlowGrid(ready_after=4)
    t0 = _time.perf_counter()
    got = exchange(grid, msgs, timeout=10.0, interval=0.01)
    assert len(got) == 2 and grid.polls == 4 and _time.perf_counter() - t0 < 1.0
    grid = SlowGrid(ready_after=10**9)
    assert exchange(grid, msgs, timeout=0.05, interval=0.01) == [] and grid.polls >= 2


def test_a_run_keeps_its_start_up_objects_out_of_the_collector_and_gives_them_back(tmp_path, monkeypatch):
    """server_app.app.frozen_heap: while a run's rounds go, the objects alive at its start are in gc's permanent
    generation (a full collection does not walk them); after the run, and after a failed run, they are back.  A
    process that froze objects itself keeps exactly its own permanent generation."""
    import gc

    import server_app.app as server

    seen = []
    inner = server._run

    def spy(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return inner(*args, **kwargs)

    monkeypatch.setattr(server, "_run", spy)
    assert gc.get_freeze_count() == 0
    run_inprocess({**BASE, "method": "fedavg", "num-server-rounds": 1, "output-dir": str(tmp_path), "run-name": "a"}, 3)
    assert seen[-1] > 1000 and gc.get_freeze_count() == 0
    with pytest.raises(ZeroDivisionError), server.frozen_heap():
        assert gc.get_freeze_count() > 1000
        raise ZeroDivisionError
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        own = gc.get_freeze_count()
        with server.frozen_heap():
            junk = [[] for _ in range(10)]
            assert gc.get_freeze_count() == own
        assert gc.get_freeze_count() == own and junk
    finally:
        gc.unfreeze()
