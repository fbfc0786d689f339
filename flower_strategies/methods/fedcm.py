"""FedCM — federated learning with client-level momentum (baseline of paper 002).

Xu, Wang, Wang, Wang, Wang, *FedCM: Federated Learning with Client-level Momentum*, 2021; used as the main
SGD baseline of Sun et al., *Efficient Federated Learning via Local Adaptive Amended Optimizer with Linear
Speedup* (FedLADA), 2023 (seed ``002_be4d0f1e88a9ebd5.txt``).  Spec: ALGORITHMS.md §6 ("FedCM").

Round ``t`` (``Δ_i = x_t − x_{i,K}``, descent-positive)::

    client i:  x ← x_t;  K_i times:  d = α·(g + λ·x) + (1−α)·Δ_t ;  x ← x − η_l·d
    server:    Δ̄ = mean_i Δ_i ;  x_{t+1} = x_t − η_g·Δ̄ ;  Δ_{t+1} = Δ̄ / (η_l^{(t)}·K̄)

``Δ_0 = 0``; ``η_l^{(t)}`` is the client learning rate *used in round t* (the server decays it by
``client-lr-decay`` per round and undoes exactly that decay); ``K̄`` is the mean of the clients' local step
counts with the same weights as ``Δ̄`` (= K when all clients take K steps).

Records: downlink ``"global-update"`` (Δ_t, trainable keys) besides the model; uplink the local model
(``"arrays"``).  Communication per round: 2× FedAvg's download, 1× its upload.

Deviation from Xu et al.: their server writes ``x_{t+1} = x_t − η_g·Δ_{t+1}`` (η_g multiplying the lr-normalised
update); we follow ALGORITHMS.md §6 / paper 002 (``η_g = 1`` ⇒ model averaging), i.e. their ``η_g`` equals
ours times ``η_l·K``.

The pure helpers :func:`mean_local_steps` and :func:`global_offset` are shared with FedLADA.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..core import records as R
from ..core.hparams import HParams, param
from ..core.local import LocalOptimizer
from ..core.ops import NamedArrays, all_finite
from ..core.registry import register
from ..core.strategy import FedAdaptStrategy, RecordSpec

#: Downlink record name of the broadcast global update Δ_t.
GLOBAL_UPDATE = "global-update"


# ------------------------------------------------------------------------------------------ pure math
def mean_local_steps(reply_metrics: Iterable[Mapping[str, Any]], weighting: str) -> float:
    """``K̄``: mean of the replies' ``num-steps`` with the weights of the model mean (n_i or uniform)."""
    num = den = 0.0
    for m in reply_metrics:
        w = float(m[R.NUM_EXAMPLES]) if weighting == "examples" else 1.0
        num += w * float(m[R.NUM_STEPS])
        den += w
    if den <= 0:
        raise ValueError("no replies to average the local step counts over")
    return num / den


def global_offset(mean_delta: Mapping[str, np.ndarray], client_lr: float, mean_steps: float) -> NamedArrays:
    """``Δ̄ / (η_l·K̄)`` = ``(x_t − x_{t+1}) / (η_g·η_l·K̄)``: the average per-step global direction.

    Zero when ``η_l·K̄ = 0`` (no local progress is possible, so there is no direction to estimate).
    """
    scale = client_lr * mean_steps
    if scale == 0:
        return {k: np.zeros_like(np.asarray(v, dtype=np.float64)) for k, v in mean_delta.items()}
    return {k: np.asarray(v, dtype=np.float64) / scale for k, v in mean_delta.items()}


def averaging_step(
    current: Mapping[str, np.ndarray], mean_model: Mapping[str, np.ndarray], keys: Iterable[str], server_lr: float
) -> tuple[NamedArrays, NamedArrays]:
    """``Δ̄ = x_t − mean_i x_i`` and ``x_{t+1} = x_t − η_g·Δ̄`` (float64) over ``keys``."""
    delta = {k: np.asarray(current[k], np.float64) - np.asarray(mean_model[k], np.float64) for k in keys}
    new = {k: np.asarray(current[k], np.float64) - server_lr * delta[k] for k in keys}
    return delta, new


def cast_like(arrays: Mapping[str, np.ndarray], like: Mapping[str, np.ndarray]) -> NamedArrays:
    return {k: np.asarray(v).astype(np.asarray(like[k]).dtype) for k, v in arrays.items()}


# ------------------------------------------------------------------------------------------ hparams
@dataclass(frozen=True)
class FedCMHParams(HParams):
    """FedCM (client-level momentum), defaults as in paper 002's setup."""

    amend_weight: float = param(0.1, lo=0.0, hi=1.0, help="α: weight of the local gradient in d = α·g + (1−α)·Δ_t (1 = FedAvg)")
    server_lr: float = param(1.0, lo=0.0, help="server learning rate η_g (1 = model averaging)")
    weight_decay: float = param(1e-3, lo=0.0, help="coupled L2 weight decay λ added to g (paper 002: 1e-3)")
    client_lr_decay: float = param(0.998, lo=0.0, lo_open=True, hi=1.0, help="client lr × this after every round (paper 002: 0.998)")


# ------------------------------------------------------------------------------------------ client
class FedCMOptimizer(LocalOptimizer):
    """Client of FedCM: ``x ← x − lr·(α·(g + λx) + (1−α)·Δ_t)`` with Δ_t from the downlink."""

    config_keys: ClassVar[dict[str, str]] = {
        R.CLIENT_LR: "lr", "amend-weight": "amend_weight", "weight-decay": "weight_decay",
    }

    def __init__(
        self, params: Iterable[tuple[str, Tensor]], lr: float = 0.1, amend_weight: float = 0.1, weight_decay: float = 0.0
    ) -> None:
        if lr < 0 or weight_decay < 0 or not 0.0 <= amend_weight <= 1.0:
            raise ValueError(f"need lr >= 0, weight_decay >= 0, 0 <= amend_weight <= 1 (got {lr}, {weight_decay}, {amend_weight})")
        super().__init__(params, {"lr": lr, "amend_weight": amend_weight, "weight_decay": weight_decay})
        self.global_update: dict[str, Tensor] = {}

    def begin_round(self, downlink=None, persistent=None) -> None:
        super().begin_round(downlink, persistent)
        rec = (downlink or {}).get(GLOBAL_UPDATE)
        for name, p, group in self.named_params():
            if rec is not None and name in rec:
                self.global_update[name] = rec[name].to(device=p.device, dtype=p.dtype)
            elif group["amend_weight"] < 1.0:
                raise ValueError(f"FedCM needs the downlink record '{GLOBAL_UPDATE}' (key '{name}' missing)")
            else:
                self.global_update[name] = torch.zeros_like(p)

    def update_param(self, name: str, p: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
        g = grad
        if group["weight_decay"]:
            g = g.add(p, alpha=group["weight_decay"])
        a = group["amend_weight"]
        d = g.mul(a).add_(self.global_update[name], alpha=1.0 - a)
        p.add_(d, alpha=-group["lr"])


# ------------------------------------------------------------------------------------------ server
class FedCM(FedAdaptStrategy):
    """FedCM server: model averaging (server lr η_g) and broadcast of ``Δ_t = Δ̄/(η_l·K̄)``."""

    method: ClassVar[str] = "fedcm"
    hparams_class = FedCMHParams
    default_weighting: ClassVar[str] = "uniform"

    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        return (RecordSpec(R.MODEL, "mean", "model"),)

    def client_lr_at(self, server_round: int) -> float:
        return self.client_lr * self.hparams.client_lr_decay ** max(server_round - 1, 0)

    def round_config(self, server_round: int) -> dict[str, Any]:
        cfg = super().round_config(server_round)
        cfg["amend-weight"] = float(self.hparams.amend_weight)
        cfg["weight-decay"] = float(self.hparams.weight_decay)
        return cfg

    def init_state(self, arrays: NamedArrays) -> None:
        self.global_update: NamedArrays = {k: np.zeros(np.shape(arrays[k]), np.float64) for k in self.trainable(arrays)}

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        assert self.current is not None
        return {GLOBAL_UPDATE: cast_like(self.global_update, self.current)}

    def server_update(self, server_round: int, current: NamedArrays, aggregates: Mapping[str, NamedArrays]) -> NamedArrays:
        mean = aggregates[R.MODEL]
        keys = self.trainable(current)
        delta, new = averaging_step(current, mean, keys, self.hparams.server_lr)
        k_bar = mean_local_steps(self.reply_metrics, self.weighting)
        update = global_offset(delta, self.client_lr_at(server_round), k_bar)
        new_params = cast_like(new, current)
        if all_finite(new_params) is None and all_finite(update) is None:  # commit state only for a usable round
            self.global_update = update
        return self.merge_buffers(new_params, current, mean)


register(
    FedCM, FedCMOptimizer,
    paper="Xu et al., FedCM: Federated Learning with Client-level Momentum, 2021 (baseline of paper 002)",
    summary="local SGD on α·g + (1−α)·Δ_t (broadcast global update) + model averaging",
)
