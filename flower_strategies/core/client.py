"""The client half of every method, inside any training loop.

Your own loop (your DataLoader, device, augmentation) with :class:`ClientRound`::

    from flower_strategies import ClientRound

    @app.train()
    def train(msg, context):
        model = Net().to(device)
        rnd = ClientRound(msg.content, state=context.state)   # method, lr, plan and downlink of this round
        rnd.load_model(model)                                  # the global model x_t
        opt = rnd.optimizer(model, num_examples=len(trainloader.dataset))
        for x, y in rnd.batches(trainloader):                  # exactly the round's planned local steps
            opt.zero_grad()
            loss_fn(model(x.to(device)), y.to(device)).backward()
            opt.step()
        return Message(rnd.reply(model, opt, num_examples=len(trainloader.dataset)), reply_to=msg)

or the one-call convenience :func:`train_reply` on any iterable of ``(x, y)`` batches or on whole-partition tensors
(a :class:`TensorPartition`: seeded mini-batches — what the fedadapt ClientApp and the exactness tests use); both
go through the same loop (:meth:`ClientRound.batches`, :meth:`ClientRound.loss_before`, :func:`full_gradient_from`).
The round's ConfigRecord names the method; the matching local optimizer comes from the registry and is built from
the server-owned hyper-parameters in the same ConfigRecord.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import Tensor, nn

from . import records as R
from .local import LocalOptimizer
from .privacy import refuse_flower_dp_mods

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


# ------------------------------------------------------------------ ArrayRecord ⇄ torch without np.load/np.save
def record_tensors(record: ArrayRecord, *, copy: bool = True) -> dict[str, Tensor]:
    """The arrays of ``record`` as CPU tensors: the same values and dtypes as ``record.to_torch_state_dict()``
    without its per-array ``np.load`` (header parse).  ``copy=False``: tensors sharing the message's bytes
    (zero-copy; never write to them — only for reading, e.g. ``load_state_dict``, which copies)."""
    if copy:
        return {k: torch.from_numpy(np.array(v)) for k, v in R.views(record).items()}
    with warnings.catch_warnings():  # torch warns (once per process) that the buffer is not writable
        warnings.simplefilter("ignore", UserWarning)
        return {k: torch.from_numpy(v) for k, v in R.views(record).items()}


def tensor_record(tensors: Mapping[str, Tensor]) -> ArrayRecord:
    """``ArrayRecord(tensors)`` (a state dict / named tensors), byte-identical, serialised without ``np.save``'s
    per-call overhead (:func:`.records.to_record`)."""
    return R.to_record({k: t.detach().cpu().numpy() for k, t in tensors.items()})


def downlink_records(content: RecordDict) -> dict[str, dict[str, Tensor]]:
    """The named extra records of a train message (everything but the model), as torch tensors."""
    return {name: record_tensors(rec) for name, rec in R.of_type(content, ArrayRecord) if name != R.MODEL}


def load_client_state(state: RecordDict | None) -> dict[str, dict[str, Tensor]]:
    """The method's saved client state from a node's ``Context.state`` (records ``fedadapt.<name>``)."""
    if state is None:
        return {}
    return {
        name[len(R.STATE_PREFIX):]: record_tensors(rec)
        for name, rec in R.of_type(state, ArrayRecord)
        if name.startswith(R.STATE_PREFIX)
    }


def save_client_state(state: RecordDict, arrays: Mapping[str, Mapping[str, Tensor]]) -> None:
    for name, named in arrays.items():
        state[R.STATE_PREFIX + name] = tensor_record(named)


class ClientRound:
    """One round of a method's client half, read from the train message; your loop drives it.

    Parameters
    ----------
    content
        The train message's ``RecordDict`` (``msg.content``).
    state
        The node's ``Context.state`` (persistent client state of methods such as SCAFFOLD and Fed-LAMB is read from
        it and written back by :meth:`reply`); ``None`` for methods without one.
    seed, client_key
        Seed the mini-batch order of a :class:`TensorPartition` and the ``loss-before-max-examples`` sample
        (with the round number).
    """

    def __init__(self, content: RecordDict, state: RecordDict | None = None, *, seed: int = 0,
                 client_key: int = 0) -> None:
        from .registry import get_method  # local import: the registry imports the strategy base

        config = content.get(R.CONFIG)
        if not isinstance(config, ConfigRecord) or R.METHOD not in config:
            raise ValueError(
                f"the train message has no '{R.CONFIG}' ConfigRecord naming the method: it was not sent by a "
                "fedadapt strategy"
            )
        self.content = content
        self.state = state
        self.config: dict[str, Any] = dict(config)
        self.spec = get_method(str(self.config[R.METHOD]))
        self.seed, self.client_key = int(seed), int(client_key)

    # ----------------------------------------------------------------- the round's plan
    @property
    def method(self) -> str:
        return self.spec.name

    @property
    def lr(self) -> float:
        """The client learning rate η_l of this round (the server may schedule it)."""
        return float(self.config[R.CLIENT_LR])

    @property
    def server_round(self) -> int:
        return int(self.config.get(R.SERVER_ROUND, 0))

    @property
    def full_batch(self) -> bool:
        """FedDA's stabilization phase: one full-batch step this round (:meth:`batches` yields one batch)."""
        return bool(self.config.get(R.FULL_BATCH, False))

    def num_steps(self, num_examples: int) -> int:
        """The planned local steps K for ``num_examples`` examples (``local-steps``, else epochs·⌈n/B⌉)."""
        return num_local_steps(num_examples, self.config)

    def batches(self, loader: Iterable[Any], num_examples: int | None = None,
                batch_fn: Callable[[Any], Batch] | None = None) -> Iterator[Batch]:
        """Yield exactly the round's planned number of ``(x, y)`` batches from ``loader``, re-iterating it (epochs)
        as needed; in the full-batch phase yield one batch holding every example.

        A :class:`TensorPartition` yields seeded mini-batches (a permutation per epoch, :func:`batch_indices`).
        ``num_examples`` defaults to ``len(loader.dataset)``; ``batch_fn`` maps a loader item to ``(x, y)``
        (e.g. ``lambda b: (b["img"], b["label"])`` for a Hugging Face/flwr-datasets loader)."""
        if isinstance(loader, TensorPartition):
            n = len(loader)
            size = n if self.full_batch else int(self.config.get(R.BATCH_SIZE, 32))
            for idx in batch_indices(n, size, self.num_steps(n), self.seed, self.server_round, self.client_key):
                yield loader.take(idx)
            return
        to_xy = batch_fn or _as_xy
        if self.full_batch:
            xs, ys = zip(*(to_xy(b) for b in loader))
            yield torch.cat(xs), torch.cat(ys)
            return
        n = num_examples if num_examples is not None else num_examples_of(loader)
        remaining = self.num_steps(n)
        while remaining > 0:
            produced = 0
            for item in loader:
                yield to_xy(item)
                produced += 1
                remaining -= 1
                if remaining == 0:
                    return
            if produced == 0:
                raise ValueError("the loader yielded no batch")

    def loss_before(self, model: nn.Module, loader: Iterable[Any], loss_fn: LossFn, num_examples: int | None = None,
                    batch_fn: Callable[[Any], Batch] | None = None) -> float:
        """``train-loss-before``: the mean loss of ``model`` (call it before training: the received model) over one
        pass of ``loader`` — or, when the round's config sets ``loss-before-max-examples = m > 0`` (and m < n), over
        a sample of m of the pass's example positions seeded by ``(seed, round, client_key)``
        (:func:`loss_before_sample`); the pass then stops after the last sampled position."""
        n = num_examples if num_examples is not None else num_examples_of(loader)
        sample = loss_before_sample(n, self.config, self.seed, self.client_key)
        return mean_loss(model, loader, loss_fn, batch_fn, sample=sample)

    # ----------------------------------------------------------------- model, optimizer, reply
    def load_model(self, model: nn.Module) -> None:
        """Load the global model x_t into ``model`` (on whatever device it lives)."""
        received = R.get(self.content, R.MODEL, ArrayRecord)
        if received is None:
            raise ValueError(f"the train message has no '{R.MODEL}' ArrayRecord (the global model x_t)")
        model.load_state_dict(record_tensors(received, copy=False), strict=True)

    def optimizer(
        self, model: nn.Module, *, num_examples: int | None = None, full_gradient: Mapping[str, Tensor] | None = None
    ) -> LocalOptimizer:
        """The method's local optimizer for ``model`` with this round's lr, downlink records, saved client state and
        client hyper-parameters.  ``num_examples`` is needed by methods that plan their steps (LocalUpdate,
        FedLADA's ``K-1``); ``full_gradient`` by MimeLite (see :func:`full_gradient_from`)."""
        cls = self.spec.local_optimizer
        planned = None if num_examples is None else self.num_steps(num_examples)
        return cls(
            model.named_parameters(),
            lr=self.lr,
            downlink=downlink_records(self.content),
            client_state=load_client_state(self.state),
            full_gradient=full_gradient,
            planned_steps=planned,
            **self.spec.hparams.client_kwargs_from_wire(self.config, self.method),
        )

    @property
    def needs_full_gradient(self) -> bool:
        return self.spec.local_optimizer.needs_full_gradient

    def reply(
        self,
        model: nn.Module,
        optimizer: LocalOptimizer,
        *,
        num_examples: int,
        train_loss: float | None = None,
        train_loss_before: float | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> RecordDict:
        """The reply content: model (if the method sends it), the optimizer's uplink records, ``metrics``
        (``num-examples``, ``num-steps`` = steps actually taken, losses) and the method marker; saves the
        client state into ``state``."""
        if not isinstance(num_examples, int) or isinstance(num_examples, bool) or num_examples <= 0:
            raise ValueError(f"num_examples must be a positive int, got {num_examples!r}")
        check_bound(optimizer, model)
        uplink = optimizer.uplink()
        if self.state is not None:
            save_client_state(self.state, optimizer.client_state())
        reply = RecordDict()
        if optimizer.sends_model:
            reply[R.MODEL] = tensor_record(model.state_dict())
        for name, arrays in uplink.items():
            reply[name] = tensor_record({k: v.detach().cpu().contiguous() for k, v in arrays.items()})
        out: dict[str, Any] = dict(metrics or {})
        out[R.NUM_EXAMPLES] = int(num_examples)
        out[R.NUM_STEPS] = float(optimizer.steps_taken)
        if train_loss is not None:
            out[R.TRAIN_LOSS] = float(train_loss)
        if train_loss_before is not None:
            out[R.TRAIN_LOSS_BEFORE] = float(train_loss_before)
        refuse_flower_dp_mods(self.method, list(reply.array_records))  # core/privacy.py
        reply[R.METRICS] = MetricRecord(out)
        reply[R.REPLY_INFO] = ConfigRecord({R.METHOD: self.method})
        return reply


def check_bound(optimizer: LocalOptimizer, model: nn.Module) -> None:
    """Refuse an optimizer whose parameters are not ``model``'s own tensors (identity, not equal values): its steps
    and uplink records would describe another model instance than the one sent back."""
    own = dict(model.named_parameters())
    foreign = [name for name, p, _ in optimizer.named_params() if own.get(name) is not p]
    if foreign:
        raise ValueError(
            f"{type(optimizer).__name__} is bound to parameters that are not this {type(model).__name__}'s own "
            f"({', '.join(foreign[:3])}{', …' if len(foreign) > 3 else ''}): it was built for another model instance "
            "(a copy, or a model rebuilt after the optimizer). Fix: build it with ClientRound.optimizer(model) on the "
            "model you train, and reply with that same model"
        )


def _as_xy(item: Any) -> Batch:
    if isinstance(item, Mapping):
        raise TypeError("the loader yields mappings: pass batch_fn=lambda b: (b['<input>'], b['<label>'])")
    x, y = item[0], item[1]
    return x, y


def num_examples_of(data: Iterable[Any]) -> int:
    """The number of examples of a :class:`TensorPartition` or of a loader with a ``.dataset``."""
    if isinstance(data, TensorPartition):
        return len(data)
    dataset = getattr(data, "dataset", None)
    if dataset is None:
        raise ValueError("pass num_examples= (the loader has no .dataset to count)")
    return len(dataset)


def _on_device(data: Iterable[Any], batch_fn: Callable[[Any], Batch] | None, device: torch.device) -> Iterator[Batch]:
    """The ``(x, y)`` batches of one pass over ``data``, on ``device``."""
    to_xy = _as_xy if isinstance(data, TensorPartition) else batch_fn or _as_xy
    for item in data:
        x, y = to_xy(item)
        yield x.to(device), y.to(device)


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


def train_reply(
    model: nn.Module,
    content: RecordDict,
    data: Tensor | Iterable[Any],
    *args: Any,
    state: RecordDict | None = None,
    seed: int = 0,
    client_key: int = 0,
    batch_fn: Callable[[Any], Batch] | None = None,
    loss_before: bool = True,
) -> RecordDict:
    """Do one fedadapt training round and return the reply ``RecordDict``.

    ``train_reply(model, content, x, y, loss_fn)``: whole-partition tensors (a :class:`TensorPartition`);
    mini-batches are drawn with a permutation seeded by ``(seed, round, client_key)`` (bit-reproducible; what the
    exactness tests use).  ``train_reply(model, content, loader, loss_fn)``: any iterable of ``(x, y)`` batches
    (e.g. a DataLoader with your transforms), re-iterated for the round's planned steps; ``batch_fn`` maps a loader
    item to ``(x, y)``.  Both run the same loop (:meth:`ClientRound.batches`, :meth:`ClientRound.loss_before`,
    :func:`full_gradient_from`); batches are moved to the model's device.  ``state`` is the node's
    ``Context.state`` (persistent client state, records ``fedadapt.<name>``).  ``loss_before=False`` skips
    ``train-loss-before`` (the received model's mean loss over the local data, or over a seeded sample of at most
    ``loss-before-max-examples`` of them: one forward pass) — for methods whose server does not read it.
    """
    rnd = ClientRound(content, state, seed=seed, client_key=client_key)
    rnd.load_model(model)
    device = next(model.parameters()).device
    if isinstance(data, Tensor):
        x, (y, loss_fn) = data, args
        data = TensorPartition(x.to(device), y.to(device))
    else:
        (loss_fn,) = args
    n = num_examples_of(data)
    before = rnd.loss_before(model, data, loss_fn, n, batch_fn) if loss_before else None
    grad = full_gradient_from(model, data, loss_fn, batch_fn) if rnd.needs_full_gradient else None
    optimizer = rnd.optimizer(model, num_examples=n, full_gradient=grad)
    model.train()
    total, steps = 0.0, 0
    for x, y in rnd.batches(data, n, batch_fn):
        optimizer.zero_grad(set_to_none=False)
        loss = loss_fn(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        total, steps = total + float(loss.detach()), steps + 1
    return rnd.reply(model, optimizer, num_examples=n, train_loss=total / max(steps, 1), train_loss_before=before)
