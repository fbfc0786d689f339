"""The papers' own image data: from the Hugging Face hub, or from a local copy saved by ``datasets``.

| name | hub dataset | image column | label column | classes | test split | clients |
|---|---|---|---|---|---|---|
| ``cifar10`` | ``uoft-cs/cifar10`` | ``img`` 32×32 RGB | ``label`` | 10 | ``test`` | partitioner |
| ``cifar100`` | ``uoft-cs/cifar100`` | ``img`` 32×32 RGB | ``fine_label`` | 100 | ``test`` | partitioner |
| ``mnist`` | ``ylecun/mnist`` | ``image`` 28×28 L | ``label`` | 10 | ``test`` | partitioner |
| ``fashion-mnist`` | ``zalando-datasets/fashion_mnist`` | ``image`` 28×28 L | ``label`` | 10 | ``test`` | partitioner |
| ``femnist`` | ``flwrlabs/femnist`` | ``image`` 28×28 L | ``character`` | 62 | per-writer 90/10 | ``writer_id`` |

Partitioners (flwr-datasets): ``iid``, ``dirichlet`` (label skew α, as the digits task), ``classes`` (k labels per
client) and ``natural`` (``NaturalIdPartitioner`` on the dataset's natural id; FEMNIST's writers).

Where the data comes from (:func:`load_source`): ``dataset_path=""`` downloads the hub dataset with
``datasets.load_dataset`` (or reads the Hugging Face cache when ``HF_HUB_OFFLINE=1``); ``dataset_path=<dir>`` reads a
directory written by ``DatasetDict.save_to_disk`` (:func:`convert_command` prints the one-line conversion).  Either way
the ``DatasetDict`` is shuffled with the seed and goes through the very same partitioners and tensor conversion.
When the hub cannot be reached, :class:`DatasetUnavailable` says so within seconds and names ``dataset-path``.

Models: :class:`ResNet18GN` — ResNet-18 (CIFAR stem: 3×3 conv, no max-pool; 4 stages × 2 basic blocks, 64–512 channels)
with every BatchNorm replaced by GroupNorm (2 groups, as FedOpt/FedDA use for CIFAR-100), and :class:`FemnistCNN`
(paper 003's FEMNIST model: conv5×5-32, pool, conv5×5-64, pool, dense-512, 62 outputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class HubSpec:
    hub_name: str
    image: str
    label: str
    num_classes: int
    channels: int
    size: int
    test_split: str | None
    natural_id: str | None = None
    mean: tuple[float, ...] = (0.5,)
    std: tuple[float, ...] = (0.5,)


HUB_DATASETS: dict[str, HubSpec] = {
    "cifar10": HubSpec("uoft-cs/cifar10", "img", "label", 10, 3, 32, "test",
                       mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616)),
    "cifar100": HubSpec("uoft-cs/cifar100", "img", "fine_label", 100, 3, 32, "test",
                        mean=(0.5071, 0.4865, 0.4409), std=(0.2673, 0.2564, 0.2762)),
    "mnist": HubSpec("ylecun/mnist", "image", "label", 10, 1, 28, "test", mean=(0.1307,), std=(0.3081,)),
    "fashion-mnist": HubSpec("zalando-datasets/fashion_mnist", "image", "label", 10, 1, 28, "test",
                             mean=(0.2860,), std=(0.3530,)),
    "femnist": HubSpec("flwrlabs/femnist", "image", "character", 62, 1, 28, None, natural_id="writer_id"),
}
PARTITIONERS = ("iid", "dirichlet", "classes", "natural")


def spec(name: str) -> HubSpec:
    try:
        return HUB_DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown hub dataset {name!r}; valid: {', '.join(HUB_DATASETS)}") from None


#: Smallest hub partition the Dirichlet partitioner aims for (then 1, then IID: :mod:`app_common.partitions`).
HUB_MIN_PARTITION = 2


def make_partitioner(s: HubSpec, kind: str, num_partitions: int, seed: int, alpha: float = 0.3,
                     classes_per_client: int = 2, min_size: int = HUB_MIN_PARTITION):
    from flwr_datasets.partitioner import (DirichletPartitioner, IidPartitioner, NaturalIdPartitioner,
                                           PathologicalPartitioner)

    if kind == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if kind == "dirichlet":
        return DirichletPartitioner(num_partitions=num_partitions, partition_by=s.label, alpha=alpha,
                                    min_partition_size=min_size, self_balancing=True, seed=seed)
    if kind == "classes":
        return PathologicalPartitioner(num_partitions=num_partitions, partition_by=s.label,
                                       num_classes_per_partition=classes_per_client,
                                       class_assignment_mode="first-deterministic", seed=seed)
    if kind == "natural":
        if s.natural_id is None:
            raise ValueError(f"{s.hub_name} has no natural client id; use iid, dirichlet or classes")
        return NaturalIdPartitioner(partition_by=s.natural_id)
    raise ValueError(f"unknown partitioner {kind!r}; valid: {', '.join(PARTITIONERS)}")


class DatasetUnavailable(RuntimeError):
    """A hub dataset could be read neither from the hub nor from ``dataset-path`` (the message says what to do)."""


#: Seconds to wait for the hub's endpoint before concluding it is unreachable (the hub client itself retries
#: for about half a minute).
HUB_PROBE_TIMEOUT = 3.0


def convert_command(name: str, target: str | None = None) -> str:
    """The one-line command that saves hub dataset ``name`` where ``dataset-path`` can read it (needs network)."""
    s = spec(name)
    return (f"python -c \"from datasets import load_dataset; load_dataset('{s.hub_name}')"
            f".save_to_disk('{target or name}')\"")


def _unavailable(name: str, reason: str) -> DatasetUnavailable:
    s = spec(name)
    return DatasetUnavailable(
        f"cannot load {name} ('{s.hub_name}') from the Hugging Face hub: {reason}. Without network, set the run-config "
        f"key dataset-path to a local copy (a directory written by datasets' save_to_disk), made once where the hub is "
        f"reachable with: {convert_command(name)}; then pass --run-config \"dataset-path='/abs/path/{name}'\" "
        f"(or, with the dataset in the Hugging Face cache, set HF_HUB_OFFLINE=1)")


def hub_offline() -> bool:
    """Whether the user switched the hub off (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``; read, never set)."""
    import datasets.config

    return bool(datasets.config.HF_HUB_OFFLINE)


def hub_unreachable() -> str | None:
    """Why the hub's endpoint cannot be reached within :data:`HUB_PROBE_TIMEOUT` seconds, or None if it answers."""
    import httpx
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT)
    except httpx.TransportError as err:
        return f"{constants.ENDPOINT} is unreachable ({type(err).__name__}: {err})"
    return None


def load_hub(name: str) -> Any:
    """The hub's ``DatasetDict`` of ``name``; :class:`DatasetUnavailable` (quickly) when the hub is out of reach."""
    import httpx
    from datasets import load_dataset

    s = spec(name)
    if not hub_offline():
        reason = hub_unreachable()
        if reason is not None:
            raise _unavailable(name, reason)
    try:
        return load_dataset(s.hub_name)
    except (ConnectionError, httpx.TransportError) as err:
        offline = " (HF_HUB_OFFLINE is set and the dataset is not in the Hugging Face cache)" if hub_offline() else ""
        raise _unavailable(name, f"{err}{offline}") from None


def load_local(name: str, dataset_path: str) -> Any:
    """The ``DatasetDict`` that ``save_to_disk`` wrote to ``dataset_path`` (checked: splits and columns of ``name``)."""
    from datasets import DatasetDict, load_from_disk

    s = spec(name)
    path = Path(dataset_path).expanduser()
    how = f"write it with: {convert_command(name, str(path))}"
    if not (path / "dataset_dict.json").is_file():
        what = "does not exist" if not path.exists() else "is not a DatasetDict saved by datasets' save_to_disk"
        raise DatasetUnavailable(f"dataset-path = '{dataset_path}' ({path.resolve()}) {what}; {how}")
    dd = load_from_disk(str(path))
    assert isinstance(dd, DatasetDict)
    splits = ["train"] + ([s.test_split] if s.test_split else [])
    missing = [sp for sp in splits if sp not in dd]
    if missing:
        raise DatasetUnavailable(f"dataset-path = '{dataset_path}' has the splits {sorted(dd)}, {name} needs {splits}; "
                                 f"{how}")
    columns = [c for c in (s.image, s.label, s.natural_id) if c]
    for sp in splits:
        lacking = [c for c in columns if c not in dd[sp].column_names]
        if lacking:
            raise DatasetUnavailable(f"dataset-path = '{dataset_path}': split {sp!r} lacks the column(s) {lacking} of "
                                     f"{name} (has {dd[sp].column_names}); is it a copy of '{s.hub_name}'? {how}")
    return dd


def load_source(name: str, dataset_path: str = "") -> Any:
    """``name``'s ``DatasetDict``: from ``dataset_path`` (a ``save_to_disk`` directory) if given, else the hub."""
    return load_local(name, dataset_path) if dataset_path else load_hub(name)


class HubData:
    """Partitions + central test set of one dataset: from ``source`` (a ``DatasetDict``) if given, else from
    ``dataset_path`` / the hub (:func:`load_source`).  The training split is shuffled with ``seed`` (as
    ``flwr_datasets.FederatedDataset`` does) before it is partitioned."""

    def __init__(self, name: str, num_partitions: int, *, partitioner: str = "dirichlet", seed: int = 0,
                 alpha: float = 0.3, classes_per_client: int = 2, source: Any = None, dataset_path: str = "",
                 test_fraction: float = 0.1) -> None:
        self.spec = spec(name)
        self.kind, self.seed, self.test_fraction, self.alpha = partitioner, seed, test_fraction, alpha
        self.partitioner = make_partitioner(self.spec, partitioner, num_partitions, seed, alpha, classes_per_client)
        self._remake = lambda m: make_partitioner(self.spec, partitioner, num_partitions, seed, alpha,
                                                  classes_per_client, m)
        self._fitted = False
        # DirichletPartitioner.num_partitions makes its assignment: the fallback (app_common.partitions) must come first
        self._num_partitions = None if partitioner == "natural" else num_partitions
        if source is None:
            source = load_source(name, dataset_path)
        # loaded before anything asks the partitioner (NaturalIdPartitioner counts its partitions on the data);
        # the shuffled order stays in memory: nothing is written next to the data (dataset-path may be read-only)
        self.partitioner.dataset = source["train"].shuffle(seed=seed, keep_in_memory=True)
        self._test = source[self.spec.test_split] if self.spec.test_split else None

    @property
    def num_partitions(self) -> int:
        return self.partitioner.num_partitions if self._num_partitions is None else self._num_partitions

    def partition(self, pid: int, split: str = "train") -> tuple[Tensor, Tensor]:
        """Client ``pid``'s examples.  Without a test split on the hub (FEMNIST) a seeded per-client 90/10 split."""
        if not 0 <= pid < self.num_partitions:
            raise ValueError(f"partition-id {pid} is outside [0, {self.num_partitions})")
        if not self._fitted:  # the assignment is made on first use (the server may only need the test split)
            from app_common.partitions import fit_partitioner

            self.partitioner = fit_partitioner(self.kind, self._remake, self.partitioner.dataset,
                                               self.num_partitions, self.alpha, HUB_MIN_PARTITION)
            self._fitted = True
        ds = self.partitioner.load_partition(pid)
        if self.spec.test_split is None:
            # the rows ``ds.train_test_split(test_size, seed=seed + pid)`` picks, selected in memory (it would write
            # index files next to the data)
            order = np.random.default_rng(self.seed + pid).permutation(len(ds))
            n_test = math.ceil(self.test_fraction * len(ds))
            ds = ds.select(order[:n_test] if split == "test" else order[n_test:])
        elif split != "train":
            raise ValueError("per-client test data only exists for datasets without a test split")
        return to_tensors(ds, self.spec)

    def test(self, max_examples: int | None = None, num_clients: int = 10) -> tuple[Tensor, Tensor]:
        """Central test set: the hub's test split, or (FEMNIST) the test parts of the first ``num_clients`` clients."""
        if self._test is None:
            parts = [self.partition(i, "test") for i in range(min(num_clients, self.num_partitions))]
            xs, ys = zip(*parts, strict=True)
            x, y = torch.cat(xs), torch.cat(ys)
        else:
            x, y = to_tensors(self._test, self.spec)
        if max_examples is not None and len(x) > max_examples:
            rng = np.random.default_rng([self.seed, 11])
            idx = torch.from_numpy(np.sort(rng.choice(len(x), max_examples, replace=False)))
            x, y = x[idx], y[idx]
        return x, y


def to_tensors(ds: Any, s: HubSpec) -> tuple[Tensor, Tensor]:
    """Images → float32 ``(N, C, H, W)`` normalised per channel with the dataset's mean/std; labels → int64."""
    imgs = [np.asarray(im, dtype=np.float32) / 255.0 for im in ds[s.image]]
    if not imgs:
        return torch.zeros((0, s.channels, s.size, s.size)), torch.zeros((0,), dtype=torch.long)
    x = np.stack(imgs)
    x = x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)
    if x.shape[1] != s.channels:
        raise ValueError(f"{s.hub_name}: expected {s.channels} channel(s), got images of shape {x.shape[1:]}")
    mean = np.asarray(s.mean, dtype=np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(s.std, dtype=np.float32).reshape(1, -1, 1, 1)
    y = np.asarray(ds[s.label], dtype=np.int64)
    return torch.from_numpy((x - mean) / std), torch.from_numpy(y)


# ------------------------------------------------------------------------------------------ models
class BasicBlockGN(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(groups, cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(groups, cout))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.gn1(self.conv1(x)))
        return torch.relu(self.gn2(self.conv2(h)) + self.shortcut(x))


class ResNet18GN(nn.Module):
    """ResNet-18 with GroupNorm (``groups`` per norm layer, default 2) and a CIFAR stem."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, groups: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False), nn.GroupNorm(groups, 64), nn.ReLU())
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlockGN(cin, cout, stride, groups), BasicBlockGN(cout, cout, 1, groups)]
            cin = cout
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))


class FemnistCNN(nn.Module):
    def __init__(self, num_classes: int = 62) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = nn.Linear(64 * 7 * 7, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        h = torch.max_pool2d(torch.relu(self.conv2(h)), 2)
        return self.fc2(torch.relu(self.fc1(h.flatten(1))))


def build_hub_model(name: str, seed: int = 0, arch: str = "resnet18-gn") -> nn.Module:
    """``resnet18-gn`` (any dataset) or ``femnist-cnn``; initialised deterministically from ``seed``."""
    s = spec(name)
    state = torch.random.get_rng_state()
    torch.default_generator.manual_seed(seed)  # the CPU generator only, restored below (as app_common.task.build_model)
    try:
        if arch == "resnet18-gn":
            return ResNet18GN(s.num_classes, s.channels)
        if arch == "femnist-cnn":
            return FemnistCNN(s.num_classes)
        raise ValueError(f"unknown arch {arch!r}; valid: resnet18-gn, femnist-cnn")
    finally:
        torch.random.set_rng_state(state)
