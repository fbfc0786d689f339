"""fedadapt's own training loop: :func:`train_reply`, one call for a whole round.

It runs on any iterable of ``(x, y)`` batches or on whole-partition tensors (a :class:`.data.TensorPartition`:
seeded mini-batches — what the fedadapt ClientApp and the exactness tests use), through the same
:class:`.round.ClientRound` a user's own loop drives (:meth:`~.round.ClientRound.batches`,
:meth:`~.round.ClientRound.loss_before`, :func:`.data.full_gradient_from`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import RecordDict
from torch import Tensor, nn

from .data import Batch, TensorPartition, as_xy, full_gradient_from, num_examples_of
from .round import ClientRound


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
    device = next(model.parameters()).device
    if isinstance(data, Tensor):
        x, (y, loss_fn) = data, args
        data = TensorPartition(x.to(device), y.to(device))
    else:
        (loss_fn,) = args
    rnd = ClientRound(content, state, data, loss_fn, seed=seed, client_key=client_key, unpack=batch_fn)
    rnd.load_model(model)
    n = num_examples_of(data)
    before = rnd.loss_before_value = rnd.loss_before(model) if loss_before else None
    grad = full_gradient_from(model, data, loss_fn, batch_fn) if rnd.needs_full_gradient else None
    optimizer = rnd.optimizer(model, num_examples=n, full_gradient=grad)
    to_xy = as_xy if isinstance(data, TensorPartition) else batch_fn or as_xy
    model.train()
    total, steps = 0.0, 0
    for item in rnd.batches(data, n):
        x, y = to_xy(item)
        optimizer.zero_grad(set_to_none=False)
        loss = loss_fn(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        total, steps = total + float(loss.detach()), steps + 1
    return rnd.reply(model, optimizer, num_examples=n, train_loss=total / max(steps, 1), train_loss_before=before)
