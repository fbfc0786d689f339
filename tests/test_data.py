"""Offline data and models: digits split, flwr-datasets partitioners, synthetic task, determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app_common import task


def test_digits_split_is_stratified_and_fixed():
    x_tr, y_tr, x_te, y_te = task.digits_split(0)
    assert x_tr.shape == (1437, 64) and x_te.shape == (360, 64)
    assert x_tr.dtype == np.float32 and x_tr.min() >= 0.0 and x_tr.max() <= 1.0
    assert set(np.unique(y_te)) == set(range(10))
    again = task.digits_split(0)
    assert np.array_equal(again[1], y_tr)


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "classes"])
def test_partitions_are_disjoint_cover_and_deterministic(kind):
    n = 8
    parts = [task.digits_partition(i, n, partitioner=kind, seed=0, alpha=0.3) for i in range(n)]
    sizes = [len(p[0]) for p in parts]
    assert all(s > 0 for s in sizes)
    x_tr, _, _, _ = task.digits_split(0)
    if kind != "classes":  # the pathological partitioner may leave some classes unused
        assert sum(sizes) == len(x_tr)
    rows = np.concatenate([p[0].numpy() for p in parts])
    # disjoint: the clients' rows together are a sub-multiset of the training rows (every row at most as often as
    # in the split; a cover when the sizes add up, checked above)
    train_rows, train_counts = np.unique(x_tr, axis=0, return_counts=True)
    used_rows, used_counts = np.unique(rows, axis=0, return_counts=True)
    where = {r.tobytes(): c for r, c in zip(train_rows, train_counts, strict=True)}
    assert all(where.get(r.tobytes(), 0) >= c for r, c in zip(used_rows, used_counts, strict=True))
    task._digits_partitions.cache_clear()
    again = task.digits_partition(3, n, partitioner=kind, seed=0, alpha=0.3)
    assert torch.equal(again[1], parts[3][1])


def test_label_skew_differs_by_partitioner():
    n = 10
    iid = [task.digits_partition(i, n, partitioner="iid", seed=0)[1] for i in range(n)]
    cls = [task.digits_partition(i, n, partitioner="classes", seed=0, classes_per_client=2)[1] for i in range(n)]
    dir_ = [task.digits_partition(i, n, partitioner="dirichlet", seed=0, alpha=0.1)[1] for i in range(n)]
    assert all(len(torch.unique(y)) >= 8 for y in iid)
    assert all(len(torch.unique(y)) <= 2 for y in cls)
    dominant = np.mean([torch.bincount(y, minlength=10).max().item() / len(y) for y in dir_])
    assert dominant > 0.4  # strong label skew at alpha = 0.1


def test_dirichlet_seed_changes_partition():
    a = task.digits_partition(0, 5, partitioner="dirichlet", seed=0)[1]
    b = task.digits_partition(0, 5, partitioner="dirichlet", seed=1)[1]
    assert len(a) != len(b) or not torch.equal(a, b)


def test_bad_partition_id_is_explained():
    with pytest.raises(ValueError, match=r"partition-id 5 is outside \[0, 5\)"):
        task.digits_partition(5, 5)


def test_synthetic_clients_are_deterministic_and_heterogeneous():
    a = task.synthetic_client(2, 4, 1.0, 0)
    b = task.synthetic_client(2, 4, 1.0, 0)
    assert all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))
    w = [np.linalg.lstsq(task.synthetic_client(i, 4, 1.0, 0)[0], task.synthetic_client(i, 4, 1.0, 0)[1], rcond=None)[0]
         for i in range(3)]
    assert np.linalg.norm(w[0] - w[1]) > 0.5  # clients have different optima
    w0 = [np.linalg.lstsq(task.synthetic_client(i, 4, 0.0, 0)[0], task.synthetic_client(i, 4, 0.0, 0)[1], rcond=None)[0]
          for i in range(2)]
    assert np.linalg.norm(w0[0] - w0[1]) < 0.05  # heterogeneity 0 → shared optimum


@pytest.mark.parametrize("name", ["digits-mlp", "digits-cnn", "synthetic-linear"])
def test_models_are_seeded_and_shaped(name):
    a, b = task.build_model(name, 5, 4), task.build_model(name, 5, 4)
    for (k, v), (_, u) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(v, u), k
    x = torch.zeros(3, 64 if name.startswith("digits") else 4)
    assert a(x).shape == ((3, 10) if name.startswith("digits") else (3, 1))
    assert next(task.build_model(name, 5, 4, "float64").parameters()).dtype == torch.float64


def test_model_seed_does_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    task.build_model("digits-mlp", 9)
    assert torch.equal(torch.rand(1), expected)
