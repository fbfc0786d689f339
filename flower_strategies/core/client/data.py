"""A client's data as the round sees it: the planned steps, the seeded mini-batches, the batch format, and the
library's own passes over the data (the mean loss, the full local gradient).

Nothing here reads a message: the round's plan arrives as the ConfigRecord's entries (``local-steps``,
``local-epochs``, ``batch-size``, ``full-batch``, ``loss-before-max-examples``, ``server-round``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .. import records as R

LossFn = Callable[[Tensor, Tensor], Tensor]
Batch = tuple[Tensor, Tensor]


def num_local_steps(n: int, config: Mapping[str, Any]) -> int:
    """K_i: ``local-steps`` if > 0, else ``local-epochs · ceil(n / batch-size)``; 1 in the full-batch phase."""
    if bool(config.get(R.FULL_BATCH, False)):
        return 1
    k = int(config.get(R.LOCAL_STEPS, 0) or 0)
    if k > 0:
        return k
    return int(config.get(R.LOCAL_EPOCHS, 1)) * math.ceil(n / int(config.get(R.BATCH_SIZE, 32)))


def batch_indices(n: int, batch_size: int, steps: int, seed: int, server_round: int,
                  client_key: int) -> list[np.ndarray]:
    """Mini-batch index arrays for ``steps`` local steps: a fresh permutation per epoch, seeded by
    ``(seed, server_round, client_key)``; the last batch of an epoch may be smaller."""
    rng = np.random.default_rng([seed, server_round, client_key])
    out: list[np.ndarray] = []
    while len(out) < steps:
        perm = rng.permutation(n)
        for start in range(0, n, batch_size):
            out.append(perm[start : start + batch_size])
            if len(out) == steps:
                break
    return out


def loss_before_sample(n: int, config: Mapping[str, Any], seed: int, client_key: int) -> np.ndarray | None:
    """Positions of the examples ``train-loss-before`` is computed on: ``None`` = all ``n`` (the default), else a
    sorted sample of ``loss-before-max-examples`` drawn without replacement, seeded by ``(seed, round, client_key)``
    (positions in the order one pass over the data yields its examples)."""
    k = int(config.get(R.LOSS_BEFORE_MAX, 0) or 0)
    if k <= 0 or k >= n:
        return None
    rng = np.random.default_rng([seed, int(config.get(R.SERVER_ROUND, 0)), client_key, 1])
    return np.sort(rng.choice(n, size=k, replace=False))


class TensorPartition:
    """A client's whole partition as two tensors, used as data by :func:`train_reply` and :meth:`ClientRound.batches`.

    Iterating it yields the whole partition as one ``(x, y)`` batch (the evaluation passes: ``train-loss-before``,
    the full gradient); :meth:`ClientRound.batches` draws the round's training mini-batches from it by index, with a
    permutation per epoch seeded by ``(seed, round, client_key)`` (:func:`batch_indices`)."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        if len(x) != len(y):
            raise ValueError(f"x and y differ in length ({len(x)} != {len(y)})")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __iter__(self) -> Iterator[Batch]:
        yield self.x, self.y

    def take(self, idx: np.ndarray) -> Batch:
        """The examples at positions ``idx``."""
        idx_t = torch.from_numpy(idx).to(self.x.device)
        return self.x[idx_t], self.y[idx_t]


#: Keys :func:`as_xy` reads the inputs and the targets of a mapping batch from (exactly one of each must be present).
INPUT_KEYS = ("x", "input", "inputs", "img", "image", "pixel_values", "input_ids")
TARGET_KEYS = ("y", "label", "labels", "target", "targets")


def as_xy(item: Any) -> Batch:
    """The default ``unpack``: ``(inputs, targets)`` of a batch — the first two entries of a sequence (a
    DataLoader over a ``TensorDataset`` yields ``[x, y]``), or of a mapping the value of its one key in
    :data:`INPUT_KEYS` and its one key in :data:`TARGET_KEYS`."""
    if isinstance(item, Mapping):
        found = [[k for k in keys if k in item] for keys in (INPUT_KEYS, TARGET_KEYS)]
        if all(len(keys) == 1 for keys in found):
            return item[found[0][0]], item[found[1][0]]
        raise TypeError(
            f"a batch with keys {sorted(item)[:8]} has no single input key of {INPUT_KEYS} and target key of "
            f"{TARGET_KEYS}: pass ClientRound(..., unpack=lambda b: (b['<input>'], b['<label>']))"
        )
    if isinstance(item, (tuple, list)) and len(item) >= 2:
        return item[0], item[1]
    raise TypeError(
        f"a batch of type {type(item).__name__} is not an (inputs, targets) pair: pass ClientRound(..., "
        "unpack=lambda b: (<inputs>, <targets>))"
    )


def concat_batches(items: list[Any], method: str = "the method") -> Any:
    """One batch of every example: ``items`` (batches of the same structure — tensors, sequences, mappings of them)
    concatenated along the first dimension, keeping their structure."""
    if not items:
        raise ValueError("the loader yielded no batch")
    first = items[0]
    if isinstance(first, Tensor):
        return torch.cat(items)
    if isinstance(first, Mapping):
        return type(first)({k: concat_batches([b[k] for b in items], method) for k in first})  # type: ignore[call-arg]
    if isinstance(first, (tuple, list)):
        parts = [concat_batches(list(col), method) for col in zip(*items, strict=True)]
        return type(first)(parts) if not hasattr(first, "_fields") else type(first)(*parts)
    raise TypeError(
        f"{method}'s full-batch round needs one batch of every example, and the loader's batches of type "
        f"{type(first).__name__} cannot be concatenated: map them to tensors with "
        "ClientRound.batches(trainloader, batch_fn=lambda b: (<inputs>, <targets>))"
    )


def num_examples_of(data: Iterable[Any]) -> int:
    """The number of examples of a :class:`TensorPartition` or of a loader with a ``.dataset``."""
    if isinstance(data, TensorPartition):
        return len(data)
    dataset = getattr(data, "dataset", None)
    if dataset is None:
        raise ValueError("pass num_examples= (the loader has no .dataset to count)")
    return len(dataset)


def _on_device(data: Iterable[Any], batch_fn: Callable[[Any], Batch] | None, device: torch.device) -> Iterator[Batch]:
    """The ``(inputs, targets)`` of each batch of one pass over ``data`` (``batch_fn``, default :func:`as_xy`),
    tensors moved to ``device``."""
    to_xy = as_xy if isinstance(data, TensorPartition) else batch_fn or as_xy
    for item in data:
        x, y = to_xy(item)
        yield (x.to(device) if isinstance(x, Tensor) else x), (y.to(device) if isinstance(y, Tensor) else y)


#: Examples per forward pass of :func:`mean_loss` (bounds its memory; larger batches are split).
EVAL_CHUNK = 1024


@torch.no_grad()
def mean_loss(model: nn.Module, data: Iterable[Any], loss_fn: LossFn, batch_fn: Callable[[Any], Batch] | None = None,
              *, sample: np.ndarray | None = None) -> float:
    """The mean loss of ``model`` over one pass of ``data`` (a :class:`TensorPartition` or any iterable of batches;
    batch losses weighted by batch size, ``loss_fn`` must average over its batch), in eval mode, forward passes of
    at most :data:`EVAL_CHUNK` examples.  ``sample``: sorted positions (in the pass's order) to average over
    instead of all examples."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count, offset = 0.0, 0, 0
    for x, y in _on_device(data, batch_fn, device):
        size = len(x)
        if sample is not None:
            lo, hi = np.searchsorted(sample, [offset, offset + size])
            offset += size
            if lo == hi:
                if lo == len(sample):
                    break
                continue
            idx_t = torch.from_numpy(sample[lo:hi] - (offset - size)).to(device)
            x, y = x[idx_t], y[idx_t]
        for s in range(0, len(x), EVAL_CHUNK):
            xs, ys = x[s : s + EVAL_CHUNK], y[s : s + EVAL_CHUNK]
            total += float(loss_fn(model(xs), ys)) * len(xs)
            count += len(xs)
        if sample is not None and offset > sample[-1]:
            break
    model.train(was_training)
    return total / max(count, 1)


def full_gradient_from(model: nn.Module, loader: Iterable[Any], loss_fn: LossFn,
                       batch_fn: Callable[[Any], Batch] | None = None) -> dict[str, Tensor]:
    """Gradient of the mean loss over every example of ``loader`` (a :class:`TensorPartition` or any iterable of
    batches) at the model's current parameters: batch gradients weighted by batch size (``loss_fn`` must average
    over its batch); a single batch's gradient as it is."""
    device = next(model.parameters()).device
    batches = _on_device(loader, batch_fn, device)
    first = next(batches, None)
    if first is None:
        raise ValueError("the loader yielded no batch")
    second = next(batches, None)
    model.zero_grad(set_to_none=True)
    if second is None:
        loss_fn(model(first[0]), first[1]).backward()
        grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                 for n, p in model.named_parameters()}
    else:
        total = 0
        for x, y in itertools.chain((first, second), batches):
            (loss_fn(model(x), y) * len(x)).backward()
            total += len(x)
        grads = {n: (p.grad.detach() / total if p.grad is not None else torch.zeros_like(p))
                 for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads
