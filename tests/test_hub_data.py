"""Hub loaders (``app_common/hub_data.py``) on tiny local ``datasets`` with the hub datasets' schemas (offline):
in memory, and saved with ``save_to_disk`` for the run-config ``dataset-path``; the unreachable hub's error."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value

from app_common import hub_data as H


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


def saved_copy(tmp_path, name: str, **kw) -> str:
    """``local_copy(name)`` written with ``save_to_disk`` (what the documented conversion command writes)."""
    path = tmp_path / name
    local_copy(name, **kw).save_to_disk(str(path))
    return str(path)


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
    mean, std = (np.asarray(v, dtype=np.float32)[:, None, None] for v in (s.mean, s.std))
    expect = (px - mean) / std
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


def test_femnist_natural_writer_partitions_and_per_client_split(tmp_path):
    """From a saved FEMNIST-shaped copy (``dataset-path``): one partition per writer, counted before anything else
    is asked (the hub path asked the partitioner before the data set was loaded: AttributeError)."""
    path = saved_copy(tmp_path, "femnist", n_train=80)
    train = local_copy("femnist", n_train=80)["train"]
    data = H.HubData("femnist", 0, partitioner="natural", seed=0, dataset_path=path)
    assert data.num_partitions == 4  # one per writer_id
    for pid in range(4):
        writer = data.partitioner.partition_id_to_natural_id[pid]
        rows = [i for i, w in enumerate(train["writer_id"]) if w == writer]
        tr, te = data.partition(pid, "train"), data.partition(pid, "test")
        assert len(tr[1]) + len(te[1]) == len(rows) == 20 and len(te[1]) == 2
        assert tr[0].shape[1:] == (1, 28, 28)
    assert len(data.test(num_clients=4)[1]) == 8
    assert not list((tmp_path / "femnist").rglob("cache-*"))  # nothing written into the user's copy
    with pytest.raises(ValueError, match="no natural client id"):
        H.HubData("cifar10", 2, partitioner="natural", source=local_copy("cifar10"))


def test_femnist_from_the_hub_counts_writers_before_any_partition_is_loaded(monkeypatch):
    """The hub path (``dataset-path`` empty) loads the DatasetDict first, so the natural-id partitioner can count."""
    monkeypatch.setattr(H, "load_hub", lambda name: local_copy(name, n_train=40))
    data = H.HubData("femnist", 0, partitioner="natural", seed=1)
    assert data.num_partitions == 4
    assert sum(len(data.partition(i)[1]) + len(data.partition(i, "test")[1]) for i in range(4)) == 40


def test_task_loaders_read_dataset_path_for_clients_and_the_test_split(tmp_path):
    """``load_client_data`` / ``load_test_data`` (what the ClientApp and the ServerApp call) read ``dataset_path``;
    FEMNIST through its writers, CIFAR-10 through the run-config partitioner and its own test split."""
    from app_common import task as T

    fem, cif = saved_copy(tmp_path, "femnist", n_train=80), saved_copy(tmp_path, "cifar10", n_train=30, n_test=12)
    T.hub_data.cache_clear()
    try:
        sizes = [len(T.load_client_data("femnist-cnn", i, 99, partitioner="dirichlet", seed=0, alpha=0.3,
                                        classes_per_client=2, dataset_path=fem)[1]) for i in range(4)]
        assert sizes == [18] * 4  # 20 rows per writer, 90 % for training
        with pytest.raises(ValueError, match=r"partition-id 4 is outside \[0, 4\)"):
            T.load_client_data("femnist-cnn", 4, 99, partitioner="iid", seed=0, alpha=0.3, classes_per_client=2,
                               dataset_path=fem)
        x, y = T.load_test_data("femnist-cnn", seed=0, num_clients=3, dataset_path=fem)
        assert x.shape == (6, 1, 28, 28) and y.dtype == torch.long
        parts = [T.load_client_data("cifar10-resnet18", i, 3, partitioner="iid", seed=0, alpha=0.3,
                                    classes_per_client=2, dataset_path=cif)[1] for i in range(3)]
        assert [len(p) for p in parts] == [10, 10, 10]
        assert T.load_test_data("cifar10-resnet18", seed=0, dataset_path=cif)[0].shape == (12, 3, 32, 32)
    finally:
        T.hub_data.cache_clear()


def test_dataset_path_errors_name_the_conversion(tmp_path):
    with pytest.raises(H.DatasetUnavailable, match="does not exist.*load_dataset\\('uoft-cs/cifar10'\\)"):
        H.HubData("cifar10", 2, dataset_path=str(tmp_path / "nowhere"))
    wrong = saved_copy(tmp_path, "mnist")  # image/label, no 'img'
    with pytest.raises(H.DatasetUnavailable, match=r"lacks the column\(s\) \['img'\]"):
        H.HubData("cifar10", 2, dataset_path=wrong)
    no_test = tmp_path / "no-test"
    DatasetDict({"train": local_copy("cifar10")["train"]}).save_to_disk(str(no_test))
    with pytest.raises(H.DatasetUnavailable, match="needs \\['train', 'test'\\]"):
        H.HubData("cifar10", 2, dataset_path=str(no_test))


@pytest.fixture
def unknown_hub_name(monkeypatch):
    """cifar10 pointed at a hub name that does not exist: nothing real is ever downloaded, even with network."""
    fake = dataclasses.replace(H.spec("cifar10"), hub_name="fedadapt-tests/no-such-dataset")
    monkeypatch.setitem(H.HUB_DATASETS, "cifar10", fake)


def test_unreachable_hub_fails_the_run_fast_naming_dataset_path(unknown_hub_name, monkeypatch, tmp_path):
    """Hub unreachable, no ``dataset-path``: the ServerApp fails before round 1 within seconds, and the error names
    ``dataset-path`` and the conversion command (no hub traceback chained to it)."""
    from app_common import task as T
    from simulations.engine.inprocess import run_inprocess

    monkeypatch.setattr(H, "hub_offline", lambda: False)
    monkeypatch.setattr(H, "hub_unreachable", lambda: "https://huggingface.co is unreachable (ConnectError: test)")
    T.hub_data.cache_clear()
    t0 = time.monotonic()
    with pytest.raises(H.DatasetUnavailable) as err:
        run_inprocess({"task": "cifar10-resnet18", "num-server-rounds": 1, "output-dir": str(tmp_path)}, 2)
    assert time.monotonic() - t0 < 5.0
    msg = str(err.value)
    assert "dataset-path" in msg and "unreachable" in msg
    assert "load_dataset('fedadapt-tests/no-such-dataset').save_to_disk('cifar10')" in msg
    assert err.value.__cause__ is None and (err.value.__context__ is None or err.value.__suppress_context__)
    (summary_file,) = tmp_path.glob("*/summary.json")  # a failed run leaves its summary too
    summary = json.loads(summary_file.read_text())
    assert summary["status"] == "failed" and "dataset-path" in summary["failure"]


def test_hub_offline_without_a_cached_copy_names_dataset_path(unknown_hub_name, monkeypatch):
    """``HF_HUB_OFFLINE=1`` (the user's choice, honoured) and the data set not in the cache: the hub client's own
    ConnectionError becomes the same clear error, quickly."""
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(H, "hub_unreachable", lambda: pytest.fail("offline: the hub is not probed"))
    t0 = time.monotonic()
    with pytest.raises(H.DatasetUnavailable, match="HF_HUB_OFFLINE is set.*dataset-path"):
        H.HubData("cifar10", 2)
    assert time.monotonic() - t0 < 5.0


@pytest.mark.slow  # a child interpreter importing the apps (~3.5 CPU-s)
def test_fedadapt_never_sets_the_hub_offline_variables():
    """Importing the apps leaves ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` alone; the launcher passes the user's
    environment through (its fixed variables name none of them)."""
    from simulations.launch.processes import BASE_ENV

    assert not any(k.startswith("HF_") for k in BASE_ENV)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    code = ("import os, app_common.task, app_common.hub_data, simulations.launch.processes; "
            "print([k for k in ('HF_HUB_OFFLINE', 'HF_DATASETS_OFFLINE') if k in os.environ])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


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
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True))
    assert H.build_hub_model("mnist")(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert H.build_hub_model("femnist", arch="femnist-cnn")(torch.randn(2, 1, 28, 28)).shape == (2, 62)


class SmallGN(torch.nn.Module):
    """Stands in for ResNet-18 (same constructor) where its CPU training step would make the test slow."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(in_channels, 8, 3, 2, 1)
        self.gn = torch.nn.GroupNorm(2, 8)
        self.fc = torch.nn.Linear(8, num_classes)

    def forward(self, x):
        h = torch.relu(self.gn(self.conv(x)))
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(h, 1), 1))


@pytest.mark.parametrize("task", ["cifar10-resnet18", "fashion-mnist-cnn", "femnist-cnn"])
def test_hub_tasks_run_through_the_real_apps(task, tmp_path, monkeypatch):
    """The hub tasks are ordinary run-config tasks: with ``dataset-path`` naming a same-schema copy written by
    ``save_to_disk``, the real ServerApp + ClientApp train them (in-process) and evaluate centrally on its test
    split (FEMNIST: its writers' held-out parts); the hub is never asked.  cifar10-resnet18 trains a small GroupNorm
    CNN in ResNet-18's place (one ResNet-18 step takes seconds on a shared CPU; the model has its own test above)."""
    from client_app import app as client_mod
    from app_common import task as task_mod
    from simulations.engine.inprocess import run_inprocess

    name = task_mod.HUB_TASKS[task][0]
    path = saved_copy(tmp_path, name, n_train=16, n_test=4)
    reads: list[str] = []
    load_local = H.load_local
    monkeypatch.setattr(H, "load_local", lambda n, p: reads.append(p) or load_local(n, p))
    monkeypatch.setattr(H, "load_hub", lambda n: pytest.fail("the hub was asked despite dataset-path"))
    if task == "cifar10-resnet18":
        monkeypatch.setattr(H, "ResNet18GN", SmallGN)
        monkeypatch.setattr(client_mod._models, "cache", {}, raising=False)  # no model cached by another test
    task_mod.hub_data.cache_clear()
    try:
        summary = run_inprocess({"task": task, "num-server-rounds": 1, "local-steps": 1, "batch-size": 4,
                                 "partitioner": "iid", "output-dir": str(tmp_path), "run-name": task,
                                 "dataset-path": path}, 2)
    finally:
        task_mod.hub_data.cache_clear()
    assert summary["status"] == "completed"
    assert summary["final"]["replies-used"] == 2 and 0.0 <= summary["final"]["test-accuracy"] <= 1.0
    assert reads == [path, path]  # the server's test split and the clients' partitions
