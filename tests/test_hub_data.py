"""Hub loaders (``client_app/hub_data.py``) on tiny local ``datasets`` with the hub datasets' schemas (offline)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value

from client_app import hub_data as H


def images(n: int, size: int, channels: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (size, size) if channels == 1 else (size, size, channels)
    return [rng.integers(0, 256, size=shape, dtype=np.uint8) for _ in range(n)]


def local_copy(name: str, n_train: int = 60, n_test: int = 20) -> DatasetDict:
    """A DatasetDict with the same column names and feature types as the hub dataset ``name``."""
    s = H.spec(name)
    feats = {s.image: Image(), s.label: ClassLabel(num_classes=s.num_classes)}
    if name == "cifar100":
        feats["coarse_label"] = ClassLabel(num_classes=20)
    if name == "femnist":
        feats["writer_id"] = Value("string")
        feats["hsf_id"] = Value("int64")

    def split(n: int, seed: int) -> Dataset:
        cols = {s.image: images(n, s.size, s.channels, seed), s.label: [i % min(10, s.num_classes) for i in range(n)]}
        if name == "cifar100":
            cols["coarse_label"] = [i % 20 for i in range(n)]
        if name == "femnist":
            cols["writer_id"] = [f"f{i % 4:04d}_00" for i in range(n)]
            cols["hsf_id"] = [0] * n
        return Dataset.from_dict(cols, features=Features(feats))

    out = {"train": split(n_train, 0)}
    if s.test_split:
        out[s.test_split] = split(n_test, 1)
    return DatasetDict(out)


@pytest.mark.parametrize("name", ["cifar10", "cifar100", "mnist", "fashion-mnist"])
@pytest.mark.parametrize("kind", ["iid", "dirichlet", "classes"])
def test_partitions_cover_the_training_split_with_normalised_tensors(name, kind):
    s = H.spec(name)
    src = local_copy(name)
    data = H.HubData(name, 3, partitioner=kind, seed=0, alpha=0.5, classes_per_client=4, source=src)
    parts = [data.partition(i) for i in range(3)]
    used = set().union(*(set(y.tolist()) for _, y in parts))
    # a partition of the training split (k-classes: of the rows whose class some client drew)
    expected = 60 if kind != "classes" else sum(lab in used for lab in src["train"][s.label])
    assert sum(len(y) for _, y in parts) == expected
    for x, y in parts:
        assert x.dtype == torch.float32 and y.dtype == torch.long
        assert x.shape[1:] == (s.channels, s.size, s.size)
    # the tensor of one example is (pixel/255 − mean)/std of exactly that image
    raw = src["train"][0]
    x_all, y_all = H.to_tensors(src["train"], s)
    px = np.asarray(raw[s.image], dtype=np.float32) / 255.0
    px = px[None] if px.ndim == 2 else px.transpose(2, 0, 1)
    mean, std = np.asarray(s.mean, dtype=np.float32), np.asarray(s.std, dtype=np.float32)
    expect = (px - mean[:, None, None]) / std[:, None, None]
    np.testing.assert_allclose(x_all[0].numpy(), expect, rtol=1e-6, atol=1e-6)
    assert int(y_all[0]) == raw[s.label]
    if kind == "classes":
        for _, y in parts:
            assert len(set(y.tolist())) <= 4
    xt, yt = data.test()
    assert len(xt) == 20 and xt.shape[1:] == (s.channels, s.size, s.size)
    assert len(data.test(max_examples=7)[0]) == 7
    with pytest.raises(ValueError, match="outside"):
        data.partition(3)


def test_femnist_natural_writer_partitions_and_per_client_split():
    src = local_copy("femnist", n_train=80)
    data = H.HubData("femnist", 0, partitioner="natural", seed=0, source=src)
    assert data.num_partitions == 4  # one per writer_id
    for pid in range(4):
        writer = data.partitioner.partition_id_to_natural_id[pid]
        rows = [i for i, w in enumerate(src["train"]["writer_id"]) if w == writer]
        tr, te = data.partition(pid, "train"), data.partition(pid, "test")
        assert len(tr[1]) + len(te[1]) == len(rows) == 20 and len(te[1]) == 2
        assert tr[0].shape[1:] == (1, 28, 28)
    assert len(data.test(num_clients=4)[1]) == 8
    with pytest.raises(ValueError, match="no natural client id"):
        H.HubData("cifar10", 2, partitioner="natural", source=local_copy("cifar10"))


def test_resnet18_groupnorm_and_femnist_cnn():
    m = H.build_hub_model("cifar100", seed=0)
    assert not any(isinstance(mod, torch.nn.BatchNorm2d) for mod in m.modules())
    gns = [mod for mod in m.modules() if isinstance(mod, torch.nn.GroupNorm)]
    assert gns and all(g.num_groups == 2 for g in gns)
    convs = [mod for mod in m.modules() if isinstance(mod, torch.nn.Conv2d)]
    assert len(convs) == 1 + 16 + 3  # stem + 8 blocks × 2 + 3 projection shortcuts = ResNet-18
    n_params = sum(p.numel() for p in m.parameters())
    assert 11_000_000 < n_params < 11_400_000
    x = torch.randn(2, 3, 32, 32)
    assert m(x).shape == (2, 100)
    m2 = H.build_hub_model("cifar100", seed=0)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    assert H.build_hub_model("mnist")(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert H.build_hub_model("femnist", arch="femnist-cnn")(torch.randn(2, 1, 28, 28)).shape == (2, 62)


@pytest.mark.parametrize("task", ["cifar10-resnet18", "mnist-cnn", "femnist-cnn"])
def test_hub_tasks_run_through_the_real_apps(task, tmp_path, monkeypatch):
    """The hub tasks are ordinary run-config tasks: with a same-schema local DatasetDict standing in for the hub,
    the real ServerApp + ClientApp train them (in-process) and evaluate centrally."""
    from client_app import task as task_mod
    from simulations.engine import run_inprocess

    name = task_mod.HUB_TASKS[task][0]
    monkeypatch.setitem(task_mod._HUB_SOURCES, name, local_copy(name, n_train=40, n_test=10))
    task_mod.hub_data.cache_clear()
    summary = run_inprocess({"task": task, "num-server-rounds": 1, "local-steps": 1, "batch-size": 8,
                             "partitioner": "iid", "output-dir": str(tmp_path), "run-name": task}, 2)
    task_mod.hub_data.cache_clear()
    assert summary["status"] == "completed"
    assert summary["final"]["replies-used"] == 2 and 0.0 <= summary["final"]["test-accuracy"] <= 1.0
