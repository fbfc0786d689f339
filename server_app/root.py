"""FLTrust's trusted root set (``aggregator = fltrust``, the ``defence = "robust"`` profile): the server's own small
training split and its local procedure on it.

The root set is ``root-set-size`` examples of the task's *training* split (never the test split the run is
evaluated on), drawn iid: a server that has collected a small clean sample of the clients' distribution, as Cao et
al. (NDSS 2021) assume.  It is not any client's partition (its examples are spread over all of them, as every
example of the training split is).  Digits: a sample of the 1,437 training images; other tasks: a sample of
``root-set-size`` examples of iid partition 0 of 10.

**The trust reference is secret.**  The sample and the server's batch order on it come from the run's *root
secret* (:func:`root_secret`): 63 bits the server draws with :mod:`secrets` at a fresh run's start, kept only in
its checkpoint (``app["root-secret"]``, so a resumed run continues exactly) and never logged nor sent.  Everything
a client has — the run-config (its ``seed`` too), the round's train content, its own data, this code — gives it
no more than an honest client's view of the root update (``tests/test_root_secret.py``).  ``root-seed`` ≥ 0
replaces the secret by that seed for experiments; the run-config reaches every ClientApp, so such a run's gate is
void (any client computes the root update exactly).

:func:`root_update` is the server's :attr:`~flower_strategies.FedAdaptStrategy.root_update`: each round it runs
the method's own client half (:func:`flower_strategies.core.client.train_reply`, the clients' code) on the round's
train content over the root set, with the server's own client state, and returns the trained model.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from app_common.config import AppConfig
from app_common.task import TASK_SPECS, build_model, digits_split, load_client_data
from flower_strategies.core import records as R
from flower_strategies.core.client import train_reply
from flower_strategies.core.ops import NamedArrays
from flower_strategies.core.rootset import ROOT_KEY

#: Where a checkpoint keeps the root secret (its ``app`` object).
ROOT_SECRET = "root-secret"


def root_secret(fed: AppConfig, payload: Mapping[str, Any] | None = None) -> int:
    """The run's root secret: the resumed checkpoint's (``payload``), else ``root-seed`` when ≥ 0 (experiments: a
    published seed voids the gate), else 63 fresh bits from :mod:`secrets`."""
    if payload is not None and ROOT_SECRET in payload.get("app", {}):
        return int(payload["app"][ROOT_SECRET])
    return fed.root_seed if fed.root_seed >= 0 else secrets.randbits(63)


def load_root_set(fed: AppConfig, secret: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``root-set-size`` examples of the task's training split, drawn with ``secret`` (see the module docstring)."""
    size = fed.root_set_size
    rng = np.random.default_rng([secret, 36])
    if fed.task.startswith("digits"):
        x_tr, y_tr, _, _ = digits_split(fed.seed)
        pick = np.sort(rng.choice(len(x_tr), min(size, len(x_tr)), replace=False))
        x, y = torch.from_numpy(x_tr[pick]), torch.from_numpy(y_tr[pick])
        return (x.double(), y) if fed.precision == "float64" else (x, y)
    x, y = load_client_data(fed.task, 0, 10, partitioner="iid", seed=fed.seed, alpha=fed.dirichlet_alpha,
                            classes_per_client=fed.classes_per_client, synthetic_dim=fed.synthetic_dim,
                            synthetic_heterogeneity=fed.synthetic_heterogeneity, precision=fed.precision,
                            data_dir=fed.data_dir, dataset_path=fed.dataset_path)
    rows = torch.from_numpy(np.sort(rng.choice(len(y), min(size, len(y)), replace=False)))
    return x[rows], y[rows]


def root_update(fed: AppConfig, secret: int) -> Callable[[RecordDict], dict[str, NamedArrays]]:
    """The server's local procedure on its root set: ``content`` (a round's train content) → its reply's array
    records (``{"arrays": the trained model, …}``: what a client of the method sends).  ``secret``
    (:func:`root_secret`) draws the root set and seeds its batch order; the set is loaded on the first call."""
    model = build_model(fed.task, fed.seed, fed.synthetic_dim, fed.precision)
    state = RecordDict()  # the server's own client state (stateful methods), kept across rounds
    loss_fn = TASK_SPECS[fed.task].loss_fn()
    data: list[torch.Tensor] = []

    def update(content: RecordDict) -> dict[str, NamedArrays]:
        if not data:
            data.extend(load_root_set(fed, secret))
        reply: Any = train_reply(model, content, *data, loss_fn, state=state, seed=secret, client_key=ROOT_KEY,
                                 loss_before=False)
        return {name: {k: np.asarray(v.numpy()) for k, v in record.items()}
                for name, record in R.of_type(reply, ArrayRecord)}
    return update
