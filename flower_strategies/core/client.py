"""The client half of every method, usable from any ``@app.train()`` function.

    from flower_strategies import train_reply

    @app.train()
    def train(msg, context):
        model = MyNet()
        content = train_reply(model, msg.content, x_train, y_train, torch.nn.functional.cross_entropy,
                              state=context.state, seed=0, client_key=context.node_id)
        return Message(content=content, reply_to=msg)

The round's ConfigRecord names the method; the matching local optimizer comes from the registry and is
built from the server-owned hyper-parameters in the same ConfigRecord.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import Tensor, nn

from . import records as R

LossFn = Callable[[Tensor, Tensor], Tensor]


def num_local_steps(n: int, config: Mapping[str, Any]) -> int:
    """K_i: ``local-steps`` if > 0, else ``local-epochs · ceil(n / batch-size)``; 1 in the full-batch phase."""
    if bool(config.get(R.FULL_BATCH, False)):
        return 1
    k = int(config.get(R.LOCAL_STEPS, 0) or 0)
    if k > 0:
        return k
    return int(config.get(R.LOCAL_EPOCHS, 1)) * math.ceil(n / int(config.get(R.BATCH_SIZE, 32)))


def batch_indices(n: int, batch_size: int, steps: int, seed: int, server_round: int, client_key: int) -> list[np.ndarray]:
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


@torch.no_grad()
def mean_loss(model: nn.Module, x: Tensor, y: Tensor, loss_fn: LossFn, batch_size: int = 1024) -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    for s in range(0, len(x), batch_size):
        total += float(loss_fn(model(x[s : s + batch_size]), y[s : s + batch_size])) * len(x[s : s + batch_size])
    model.train(was_training)
    return total / max(len(x), 1)


def loss_before_sample(n: int, config: Mapping[str, Any], seed: int, client_key: int) -> np.ndarray | None:
    """Indices of the examples ``train-loss-before`` is computed on: ``None`` = all ``n`` (the default), else a
    sorted sample of ``loss-before-max-examples`` drawn without replacement, seeded by ``(seed, round, client_key)``."""
    k = int(config.get(R.LOSS_BEFORE_MAX, 0) or 0)
    if k <= 0 or k >= n:
        return None
    rng = np.random.default_rng([seed, int(config.get(R.SERVER_ROUND, 0)), client_key, 1])
    return np.sort(rng.choice(n, size=k, replace=False))


def full_gradient(model: nn.Module, x: Tensor, y: Tensor, loss_fn: LossFn) -> dict[str, Tensor]:
    """Gradient of the mean loss over all of ``(x, y)`` at the model's current parameters."""
    model.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def local_train(
    model: nn.Module,
    optimizer,
    x: Tensor,
    y: Tensor,
    loss_fn: LossFn,
    config: Mapping[str, Any],
    *,
    seed: int = 0,
    client_key: int = 0,
) -> dict[str, float]:
    """Run the round's local steps with ``optimizer``; return metrics (steps counted by the optimizer)."""
    n = len(x)
    steps = num_local_steps(n, config)
    full = bool(config.get(R.FULL_BATCH, False))
    bs = n if full else int(config.get(R.BATCH_SIZE, 32))
    server_round = int(config.get(R.SERVER_ROUND, 0))
    model.train()
    total = 0.0
    for idx in batch_indices(n, bs, steps, seed, server_round, client_key):
        idx_t = torch.from_numpy(idx)
        optimizer.zero_grad(set_to_none=False)
        loss = loss_fn(model(x[idx_t]), y[idx_t])
        loss.backward()
        optimizer.step()
        total += float(loss.detach())
    taken = optimizer.steps_taken
    return {R.NUM_STEPS: float(taken), R.TRAIN_LOSS: total / max(steps, 1)}


def downlink_records(content: RecordDict) -> dict[str, dict[str, Tensor]]:
    """The named extra records of a train message (everything but the model), as torch tensors."""
    return {name: rec.to_torch_state_dict() for name, rec in content.array_records.items() if name != R.MODEL}


def load_client_state(state: RecordDict | None) -> dict[str, dict[str, Tensor]]:
    """The method's saved client state from a node's ``Context.state`` (records ``fedadapt.<name>``)."""
    if state is None:
        return {}
    return {
        name[len(R.STATE_PREFIX):]: rec.to_torch_state_dict()
        for name, rec in state.array_records.items()
        if name.startswith(R.STATE_PREFIX)
    }


def save_client_state(state: RecordDict, arrays: Mapping[str, Mapping[str, Tensor]]) -> None:
    for name, named in arrays.items():
        state[R.STATE_PREFIX + name] = ArrayRecord({k: v.detach().cpu() for k, v in named.items()})


def train_reply(
    model: nn.Module,
    content: RecordDict,
    x: Tensor,
    y: Tensor,
    loss_fn: LossFn,
    *,
    state: RecordDict | None = None,
    seed: int = 0,
    client_key: int = 0,
) -> RecordDict:
    """Do one fedadapt training round on ``(x, y)`` and return the reply ``RecordDict``.

    ``state`` is the node's ``Context.state``: the method's persistent client state is read from and written
    back to it (records named ``fedadapt.<name>``).  ``client_key`` (e.g. the partition id) and ``seed``
    determine the mini-batch order.
    """
    from .registry import get_method  # local import: the registry imports the strategy base

    config = dict(content.config_records[R.CONFIG])
    spec = get_method(str(config[R.METHOD]))
    model.load_state_dict(content.array_records[R.MODEL].to_torch_state_dict(), strict=True)

    sample = loss_before_sample(len(x), config, seed, client_key)
    if sample is None:
        loss_before = mean_loss(model, x, y, loss_fn)
    else:
        idx = torch.from_numpy(sample)
        loss_before = mean_loss(model, x[idx], y[idx], loss_fn)
    opt_cls = spec.local_optimizer
    optimizer = opt_cls(
        model.named_parameters(),
        lr=float(config[R.CLIENT_LR]),
        downlink=downlink_records(content),
        client_state=load_client_state(state),
        full_gradient=full_gradient(model, x, y, loss_fn) if opt_cls.needs_full_gradient else None,
        planned_steps=num_local_steps(len(x), config) if opt_cls.needs_planned_steps else None,
        **spec.hparams.client_kwargs_from_wire(config, spec.name),
    )
    metrics = local_train(model, optimizer, x, y, loss_fn, config, seed=seed, client_key=client_key)
    uplink = optimizer.uplink()
    if state is not None:
        save_client_state(state, optimizer.client_state())

    reply = RecordDict()
    if optimizer.sends_model:
        reply[R.MODEL] = ArrayRecord(model.state_dict())
    for name, arrays in uplink.items():
        reply[name] = ArrayRecord({k: v.detach().cpu().contiguous() for k, v in arrays.items()})
    reply[R.METRICS] = MetricRecord(
        {**metrics, R.NUM_EXAMPLES: int(len(x)), R.TRAIN_LOSS_BEFORE: loss_before}
    )
    return reply
