"""Paper 004's per-round allocation (partitioners ``round-iid`` / ``round-class``): the whole training split divided
anew every round among the round's active devices (``app_common.partitions.round_allocation``), and the real apps
using it (the ServerApp sends the round's sampled partition ids, each client takes its slot's share)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app_common.config import parse
from app_common.partitions import round_allocation
from flower_strategies.core.hparams import ConfigError

LABELS = np.repeat(np.arange(10), [23, 20, 21, 19, 25, 20, 22, 18, 24, 20])  # 212 rows, unequal classes


def test_round_iid_shards_are_disjoint_cover_everything_and_differ_by_at_most_one():
    shards = round_allocation(LABELS, "round-iid", 0, 3, 7)
    assert len(shards) == 7
    rows = np.concatenate(shards)
    assert np.array_equal(np.sort(rows), np.arange(len(LABELS)))  # each row exactly once
    assert sorted(len(s) for s in shards) == [30] * 5 + [31] * 2  # 212 = 7·30 + 2


def test_round_iid_is_reshuffled_between_rounds_and_deterministic():
    a, b = round_allocation(LABELS, "round-iid", 0, 1, 4), round_allocation(LABELS, "round-iid", 0, 2, 4)
    assert not np.array_equal(a[0], b[0])
    again = round_allocation(LABELS, "round-iid", 0, 1, 4)
    assert all(np.array_equal(x, y) for x, y in zip(a, again, strict=True))
    other_seed = round_allocation(LABELS, "round-iid", 1, 1, 4)
    assert not np.array_equal(a[0], other_seed[0])


@pytest.mark.parametrize("k", [25, 10, 4])
def test_round_class_gives_each_device_one_class_balanced_and_every_row_of_a_used_class_once(k):
    shards = round_allocation(LABELS, "round-class", 5, 2, k)
    perm_classes = [int(LABELS[s[0]]) for s in shards]
    for s in shards:
        assert len(s) > 0 and len(set(LABELS[s].tolist())) == 1  # one label per device
    # the rule: slot j gets perm[j mod 10]; with k = 25 the first 5 classes of perm have 3 devices, the others 2
    per_class = np.bincount(perm_classes, minlength=10)
    assert sorted(per_class.tolist(), reverse=True) == sorted([k // 10 + (1 if i < k % 10 else 0) for i in range(10)],
                                                              reverse=True)
    assert perm_classes[: min(k, 10)] == perm_classes[10:20] if k >= 20 else True
    used = sorted(set(perm_classes))
    rows = np.concatenate(shards)
    assert np.array_equal(np.sort(rows), np.flatnonzero(np.isin(LABELS, used)))  # every row of a used class once
    for c in used:  # a class's rows split evenly among its devices
        sizes = [len(s) for s, cls in zip(shards, perm_classes, strict=True) if cls == c]
        assert max(sizes) - min(sizes) <= 1
    assert len(used) == min(k, 10)


def test_round_class_changes_the_class_assignment_between_rounds():
    first = [int(LABELS[s[0]]) for s in round_allocation(LABELS, "round-class", 0, 1, 10)]
    second = [int(LABELS[s[0]]) for s in round_allocation(LABELS, "round-class", 0, 2, 10)]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second


def test_the_run_config_refuses_tasks_it_cannot_divide():
    assert parse({"task": "mnist-cnn", "partitioner": "round-class"}).partitioner == "round-class"
    with pytest.raises(ConfigError, match="digits and MNIST training splits only"):
        parse({"task": "cifar10-resnet18", "partitioner": "round-iid"})
    with pytest.raises(ConfigError, match="secure-aggregation"):
        parse({"task": "digits-mlp", "partitioner": "round-iid", "secure-aggregation": "secaggplus"})


def test_a_fixed_partition_is_refused_under_a_per_round_partitioner():
    from app_common.task import load_client_data

    with pytest.raises(ValueError, match="no fixed partition"):
        load_client_data("digits-mlp", 0, 4, partitioner="round-iid", seed=0, alpha=0.3, classes_per_client=2)


def _spy(monkeypatch):
    """Record every per-round load (round, slot, active, size) the clients make; the real loader answers."""
    from client_app import node

    calls: list[tuple[int, int, int, int]] = []
    real = node.load_round_data

    def load(task, server_round, slot, active, **kw):
        x, y = real(task, server_round, slot, active, **kw)
        calls.append((server_round, slot, active, len(y)))
        return x, y

    monkeypatch.setattr(node, "load_round_data", load)
    return calls


@pytest.mark.parametrize("partitioner", ["round-iid", "round-class"])
def test_an_inprocess_run_allocates_the_whole_training_split_to_each_rounds_active_clients(partitioner, tmp_path,
                                                                                            monkeypatch):
    from simulations.engine.inprocess import run_inprocess

    calls = _spy(monkeypatch)
    summary = run_inprocess({"task": "digits-mlp", "partitioner": partitioner, "num-server-rounds": 3,
                             "fraction-train": 0.5, "min-train-nodes": 2, "local-steps": 1, "batch-size": 16,
                             "fraction-evaluate": 0.5,  # client-side evaluation: each node's fixed iid partition
                             "output-dir": str(tmp_path), "run-name": partitioner}, 6)
    assert summary["status"] == "completed"
    for rnd in (1, 2, 3):
        mine = [c for c in calls if c[0] == rnd]
        assert sorted(c[1] for c in mine) == [0, 1, 2] and {c[2] for c in mine} == {3}
        total = sum(c[3] for c in mine)
        # iid: all 1,437 training images; one class per device: the 3 classes' rows
        assert total == 1437 if partitioner == "round-iid" else 100 < total < 600
    rows = [r for r in (tmp_path / partitioner / "metrics.csv").read_text().splitlines()[1:]]
    assert len(rows) == 4


@pytest.mark.parametrize("partitioner", ["round-iid", "round-class"])
def test_the_vectorized_engine_gives_the_sequential_run_under_a_per_round_partitioner(partitioner, tmp_path):
    """digits-mlp (no dropout), float64: the stacked clients get the same shares and the same model (round-class:
    shares of unequal sizes, so unequal step counts)."""
    from simulations.engine.inprocess import run_inprocess

    models = {}
    for engine in ("inprocess", "vectorized"):
        rc = {"task": "digits-mlp", "partitioner": partitioner, "num-server-rounds": 3, "fraction-train": 0.5,
              "min-train-nodes": 2, "local-epochs": 1, "local-steps": 0, "batch-size": 32, "precision": "float64",
              "output-dir": str(tmp_path), "run-name": engine, "method": "fedams", "client-lr": 0.01}
        assert run_inprocess(rc, 6, engine=engine)["status"] == "completed"
        models[engine] = torch.load(tmp_path / engine / "model.pt")
    for key, a in models["inprocess"].items():
        b = models["vectorized"][key]
        assert float((a - b).norm() / a.norm()) <= 1e-12, key
