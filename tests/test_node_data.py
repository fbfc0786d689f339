"""Node-local data: SuperNodes that bring their own ``.npz`` files (node config ``data-path``).

The converter writes exactly the bundled partitions; a federation whose nodes read those files gives the same
run, bit for bit, as one reading the bundled partitions – and never touches the bundled loader.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import client_app.node as client_module
from client_app.app import app as client_app
from client_app.node_data import load_node_data
from app_common.task import load_client_data
from server_app.app import run
from simulations.tools.convert_data import convert
from simulations.engine.inprocess import LoopbackGrid
from simulations.launch import node_config, node_data_paths

ROOT = Path(__file__).resolve().parent.parent
NODES = 4


def rows(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "seconds"}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_converter_writes_exactly_the_bundled_partitions(tmp_path):
    files = convert(tmp_path, NODES, task="digits-mlp", partitioner="dirichlet", seed=3)
    assert [f.name for f in files] == [f"partition-{i}.npz" for i in range(NODES)]
    total = 0
    for i, f in enumerate(files):
        x, y = load_client_data("digits-mlp", i, NODES, partitioner="dirichlet", seed=3, alpha=0.3,
                                classes_per_client=2)
        with np.load(f) as z:
            assert sorted(z.files) == ["x", "y"]
            assert z["x"].dtype == np.float32 and z["y"].dtype == np.int64
            assert np.array_equal(z["x"], x.numpy()) and np.array_equal(z["y"], y.numpy())
        total += len(y)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["num-partitions"] == NODES and sum(manifest["examples"]) == total and manifest["seed"] == 3


@pytest.mark.slow  # real child processes / many end-to-end runs: the full suite runs it
def test_converter_command_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "simulations.tools.convert_data", "--out", str(tmp_path), "--num-partitions", "3",
         "--task", "synthetic-linear", "--synthetic-dim", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str((tmp_path / f"partition-{i}.npz").resolve()) for i in range(3)]
    with np.load(tmp_path / "partition-2.npz") as z:
        assert z["x"].shape[1] == 4 and z["y"].shape == (len(z["x"]), 1) and z["y"].dtype == np.float32


@pytest.mark.parametrize("task,extra", [
    ("digits-mlp", {"fraction-train": 0.5, "method": "fedadam"}),
    ("synthetic-linear", {"precision": "float64", "synthetic-dim": 4, "method": "fedlamb"}),
])
def test_nodes_with_their_own_files_reproduce_the_bundled_run(tmp_path, monkeypatch, task, extra):
    cfg = {"task": task, "num-server-rounds": 3, "local-steps": 3, "batch-size": 16, "seed": 1, **extra,
           "output-dir": str(tmp_path)}
    run(LoopbackGrid(client_app, NODES, cfg), {**cfg, "run-name": "bundled"})

    convert(tmp_path / "data", NODES, task=task, seed=1, synthetic_dim=4)
    grid = LoopbackGrid(client_app, NODES, cfg)
    for ctx in grid.contexts.values():  # what --node-config "partition-id=i data-path='…'" gives a SuperNode
        pid = int(ctx.node_config["partition-id"])
        ctx.node_config.pop("num-partitions")
        ctx.node_config["data-path"] = str(tmp_path / "data" / f"partition-{pid}.npz")

    def no_bundled_data(*a, **k):
        raise AssertionError("the bundled data set must not be read when the node brings its own data")

    monkeypatch.setattr(client_module, "load_client_data", no_bundled_data)
    run(grid, {**cfg, "run-name": "local"})
    assert rows(tmp_path / "bundled") == rows(tmp_path / "local")
    a, b = torch.load(tmp_path / "bundled" / "model.pt"), torch.load(tmp_path / "local" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_file_really_is_the_training_data(tmp_path):
    """Halving one node's file changes what it reports and the run's result."""
    cfg = {"task": "digits-mlp", "num-server-rounds": 1, "local-steps": 2, "seed": 0, "output-dir": str(tmp_path)}
    files = convert(tmp_path / "data", 2, task="digits-mlp")
    with np.load(files[1]) as z:
        n1 = len(z["y"])
        np.savez(tmp_path / "half.npz", x=z["x"][: n1 // 2], y=z["y"][: n1 // 2])
    for name, second in (("full", files[1]), ("half", tmp_path / "half.npz")):
        grid = LoopbackGrid(client_app, 2, cfg)
        grid.contexts[1].node_config["data-path"] = str(files[0])
        grid.contexts[2].node_config["data-path"] = str(second)
        run(grid, {**cfg, "run-name": name})
    assert rows(tmp_path / "half")[1]["test-loss"] != rows(tmp_path / "full")[1]["test-loss"]
    reply = client_app(_train(cfg), grid.contexts[2])
    assert reply.content["metrics"]["num-examples"] == n1 // 2


def _train(cfg):
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    from app_common.task import build_model
    from tests.helpers import client_keys, train_message

    model = build_model("digits-mlp", 0)
    return train_message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": ConfigRecord(
        {"server-round": 1, "method": "fedavg", "client-lr": 0.1, "local-steps": 1, "local-epochs": 1,
         "batch-size": 8, **client_keys("fedavg")})}))


def test_nodes_without_partition_id_use_their_node_id_and_sampling_still_works(tmp_path):
    cfg = {"task": "synthetic-linear", "synthetic-dim": 4, "num-server-rounds": 2, "local-steps": 2, "seed": 0,
           "fraction-train": 0.5, "output-dir": str(tmp_path), "run-name": "nopid"}
    files = convert(tmp_path / "data", NODES, task="synthetic-linear", synthetic_dim=4)
    grid = LoopbackGrid(client_app, NODES, cfg, node_ids=[11, 22, 33, 44])
    for ctx, f in zip(grid.contexts.values(), files, strict=True):
        ctx.node_config.clear()
        ctx.node_config["data-path"] = str(f)
    summary = run(grid, cfg)
    assert summary["status"] == "completed"
    got = rows(tmp_path / "nopid")
    assert all(r["replies-used"] == 2 and r["replies-rejected"] == 0 for r in got[1:])


@pytest.mark.parametrize("arrays,classification,match", [
    ({"x": np.zeros((3, 2), np.float32)}, True, r"lacks array\(s\) \['y'\]"),
    ({"x": np.zeros((3, 2), np.float32), "y": np.zeros(2, np.int64)}, True, "has 3 rows but 'y' has 2"),
    ({"x": np.zeros((3, 2), np.int64), "y": np.zeros(3, np.int64)}, True, "must be floating point"),
    ({"x": np.zeros((3, 2), np.float32), "y": np.zeros(3, np.float32)}, True, "integer class labels"),
    ({"x": np.zeros((3, 2), np.float32), "y": -np.ones(3, np.int64)}, True, "negative class labels"),
    ({"x": np.zeros((3, 2), np.float32), "y": np.zeros(3, np.int64)}, False, "floating regression targets"),
    ({"x": np.zeros((0, 2), np.float32), "y": np.zeros(0, np.int64)}, True, "n > 0"),
])
def test_bad_node_data_files_are_explained(tmp_path, arrays, classification, match):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=match):
        load_node_data(path, classification=classification)


def test_missing_or_corrupt_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_node_data(tmp_path / "nope.npz", classification=True)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable .npz"):
        load_node_data(tmp_path / "junk.npz", classification=True)
    np.save(tmp_path / "single.npy", np.zeros(3))
    with pytest.raises(ValueError, match="single .npy array"):
        load_node_data(tmp_path / "single.npy", classification=True)


def test_precision_and_target_shape(tmp_path):
    np.savez(tmp_path / "r.npz", x=np.ones((5, 3), np.float32), y=np.arange(5, dtype=np.float32))
    x, y = load_node_data(tmp_path / "r.npz", classification=False, precision="float64")
    assert x.dtype == y.dtype == torch.float64 and y.shape == (5, 1)


def test_launcher_node_data_arguments(tmp_path):
    files = convert(tmp_path, 2, task="synthetic-linear", synthetic_dim=3)
    assert node_data_paths([tmp_path], 2) == [f.resolve() for f in files]
    assert node_data_paths([str(f) for f in files], 2) == [f.resolve() for f in files]
    assert node_data_paths(None, 2) is None
    with pytest.raises(ValueError, match="3 paths for 2 nodes"):
        node_data_paths([files[0], files[1], files[0]], 2)
    with pytest.raises(FileNotFoundError):
        node_data_paths([tmp_path], 3)
    cfg = node_config(1, 2, node_data_paths([tmp_path], 2))
    from flwr.common.config import parse_config_args  # the parser flower-supernode uses for --node-config

    assert parse_config_args([cfg]) == {"partition-id": 1, "num-partitions": 2, "data-path": str(files[1].resolve())}


def test_launch_deploy_passes_data_paths_and_poll_interval_to_the_supernodes(tmp_path, monkeypatch):
    """launch_deploy's plumbing, with process start-up stubbed out (nothing is started)."""
    import simulations.launch.modes as launch

    started: list[tuple[str, list[str], dict]] = []

    class FakeProc:
        pid = 0

        def poll(self):
            return None

    def fake_start(self, name, argv, env=None, capture=False):
        started.append((name, list(argv), dict(env or {})))
        return FakeProc()

    monkeypatch.setattr(launch.Cluster, "start", fake_start)
    monkeypatch.setattr(launch.Cluster, "stop", lambda self: None)
    monkeypatch.setattr(launch, "wait_health", lambda *a, **k: None)
    monkeypatch.setattr(launch, "flwr_run", lambda *a, **k: (7, "finished:completed", ""))
    files = convert(tmp_path / "d", 2, task="synthetic-linear", synthetic_dim=3)
    rc = launch.launch_deploy(2, "num-server-rounds=1", tmp_path / "flwr", timeout=10, node_data=[tmp_path / "d"],
                              task_poll_interval=0.1)
    assert rc == 0
    nodes = [s for s in started if s[0].startswith("supernode")]
    assert len(nodes) == 2
    for i, (_, argv, env) in enumerate(nodes):
        cfg = argv[argv.index("--node-config") + 1]
        assert cfg == f"partition-id={i} num-partitions=2 data-path='{files[i].resolve()}'"
        assert env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "0.1"
    started.clear()
    launch.launch_deploy(2, None, tmp_path / "flwr", timeout=10)
    for _, argv, env in started[1:]:
        assert "data-path" not in argv[argv.index("--node-config") + 1]
        assert "FLWR_SUPEREXEC_TASK_POLL_INTERVAL" not in env
