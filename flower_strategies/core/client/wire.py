"""The client half's wire: the round's ConfigRecord read and checked, ArrayRecord ⇄ torch, the downlink records,
and the client state saved in a node's ``Context.state``.

What a client must know about the method comes in the round's ConfigRecord, decided by the server
(:meth:`~flower_strategies.core.strategy.FedAdaptStrategy.round_config`; docs/plugin.md lists the keys):
``method``, ``client-lr``, the plan, the method's client hyper-parameters ``<method>.<key>``, and

* ``client-half`` — whether the method's local optimizer must train (else the app's own optimizer may);
* ``local-optimizer`` — the name of that optimizer (:data:`~flower_strategies.core.local.LOCAL_OPTIMIZERS`);
* ``loss-before`` — whether the server reads ``train-loss-before``;
* ``full-gradient`` — whether the optimizer needs the full local gradient at the received model.

So the client side imports no server-side module (the strategy, the registry).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import Tensor

from .. import records as R

#: The ConfigRecord keys a fedadapt client half reads besides the plan and the method's hyper-parameters.
CLIENT_KEYS = (R.METHOD, R.CLIENT_LR, R.CLIENT_HALF, R.LOCAL_OPTIMIZER, R.LOSS_BEFORE, R.FULL_GRADIENT)


def read_round_config(content: RecordDict) -> dict[str, Any]:
    """The train message's ConfigRecord as a dict, checked to carry :data:`CLIENT_KEYS`: a message without them was
    not sent by a fedadapt strategy, or by one older than this client (no ``client-half`` &c.)."""
    config = content.get(R.CONFIG)
    if not isinstance(config, ConfigRecord) or R.METHOD not in config:
        raise ValueError(
            f"the train message has no '{R.CONFIG}' ConfigRecord naming the method: it was not sent by a "
            "fedadapt strategy"
        )
    missing = [key for key in CLIENT_KEYS if key not in config]
    if missing:
        raise ValueError(
            f"the train message's '{R.CONFIG}' lacks {missing}: it was sent by a fedadapt server older than this "
            f"client (or by a configure_train that rebuilt the ConfigRecord); run the same fedadapt version on the "
            "server, whose strategies send these keys every round"
        )
    return dict(config)


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
