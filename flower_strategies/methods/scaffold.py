"""SCAFFOLD, option II (baseline of papers 001 and 002).

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, *SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning*, ICML 2020; compared against in Sun et al. (FedLADA, seed ``002_be4d0f1e88a9ebd5.txt``).
Spec: ALGORITHMS.md §6 ("SCAFFOLD, option II").

Round ``t`` (server state ``x, c``; client state ``c_i``, 0 until the client is first sampled)::

    client i:  y ← x_t ;  K_i times:  y ← y − η_l·(g(y) + λ·y − c_i + c)
               c_i⁺ = c_i − c + (x_t − y)/(K_i·η_l)            (option II)
               upload y (model) and Δc_i = c_i⁺ − c_i ;  keep c_i ← c_i⁺
    server:    x ← x − η_g·mean_i(x_t − y_i)                  (= x + η_g·mean_i Δy_i)
               c ← c + (1/N_total)·Σ_i Δc_i

``N_total`` is the number of all clients: ``num-clients`` if > 0, else the number of nodes the server saw
connected when it sampled the round.  With every ``c_i`` starting at 0 this keeps ``c = (1/N_total)·Σ_all c_i``.

Records: downlink ``"server-control"`` (c); uplink ``"arrays"`` (y_i) and ``"control-delta"`` (Δc_i, summed);
persistent client state ``"client-control"`` (c_i, in the node's ``Context.state`` as
``fedadapt.client-control``).  Communication: 2× FedAvg's in both directions.

Conventions: uploading ``y_i`` instead of ``Δy_i`` is equivalent for a mean and lets non-trainable buffers be
averaged.  Coupled L2 weight decay enters ``g`` (paper 002 uses 1e-3 for its SGD baselines); it therefore also
enters ``c_i⁺`` through ``x_t − y``.  ``K_i·η_l = 0`` leaves ``c_i`` unchanged (option II is undefined there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..core import records as R
from .fedcm import averaging_step, cast_like
from ..core.hparams import HParams, param
from ..core.local import LocalOptimizer
from ..core.ops import NamedArrays, all_finite
from ..core.registry import register
from ..core.strategy import FedAdaptStrategy, RecordSpec

SERVER_CONTROL = "server-control"
CONTROL_DELTA = "control-delta"
CLIENT_CONTROL = "client-control"


# ------------------------------------------------------------------------------------------ pure math
def scaffold_server_step(
    current: Mapping[str, np.ndarray],
    mean_model: Mapping[str, np.ndarray],
    control: Mapping[str, np.ndarray],
    control_delta_sum: Mapping[str, np.ndarray],
    keys: Iterable[str],
    *,
    server_lr: float,
    num_clients: int,
) -> tuple[NamedArrays, NamedArrays]:
    """``(x_{t+1}, c_{t+1})``: ``x − η_g·(x − mean y)`` and ``c + Σ Δc_i / N_total`` (float64)."""
    if num_clients <= 0:
        raise ValueError(f"num_clients must be positive, got {num_clients}")
    keys = list(keys)
    _, new = averaging_step(current, mean_model, keys, server_lr)
    c = {k: np.asarray(control[k], np.float64) + np.asarray(control_delta_sum[k], np.float64) / num_clients for k in keys}
    return new, c


# ------------------------------------------------------------------------------------------ hparams
@dataclass(frozen=True)
class ScaffoldHParams(HParams):
    """SCAFFOLD option II."""

    server_lr: float = param(1.0, lo=0.0, help="server learning rate η_g (1 = model averaging)")
    num_clients: int = param(0, lo=0, help="N_total in c ← c + ΣΔc_i/N_total; 0 = number of connected nodes")
    weight_decay: float = param(1e-3, lo=0.0, help="coupled L2 weight decay λ added to g (paper 002: 1e-3)")
    client_lr_decay: float = param(1.0, lo=0.0, lo_open=True, hi=1.0, help="client lr × this after every round (paper 002 setup: 0.998)")


# ------------------------------------------------------------------------------------------ client
class ScaffoldOptimizer(LocalOptimizer):
    """Client of SCAFFOLD option II: corrected SGD steps and the c_i⁺ update (persistent c_i)."""

    config_keys: ClassVar[dict[str, str]] = {R.CLIENT_LR: "lr", "weight-decay": "weight_decay"}

    def __init__(self, params: Iterable[tuple[str, Tensor]], lr: float = 0.1, weight_decay: float = 0.0) -> None:
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"lr and weight_decay must be >= 0 (got {lr}, {weight_decay})")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.updated_control: dict[str, Tensor] = {}

    def begin_round(self, downlink=None, persistent=None) -> None:
        super().begin_round(downlink, persistent)
        c_rec = (downlink or {}).get(SERVER_CONTROL)
        ci_rec = (persistent or {}).get(CLIENT_CONTROL, {})
        for name, p, _ in self.named_params():
            if c_rec is None or name not in c_rec:
                raise ValueError(f"SCAFFOLD needs the downlink record '{SERVER_CONTROL}' (key '{name}' missing)")
            st = self.state[p]
            st["c"] = c_rec[name].to(device=p.device, dtype=p.dtype).clone()
            st["ci"] = ci_rec[name].to(device=p.device, dtype=p.dtype).clone() if name in ci_rec else torch.zeros_like(p)
        self.updated_control = {}

    def update_param(self, name: str, p: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
        st = self.state[p]
        d = grad.sub(st["ci"]).add_(st["c"])
        if group["weight_decay"]:
            d.add_(p, alpha=group["weight_decay"])
        p.add_(d, alpha=-group["lr"])

    def end_round(self) -> dict[str, dict[str, Tensor]]:
        deltas: dict[str, Tensor] = {}
        for name, p, group in self.named_params():
            st = self.state[p]
            scale = self.num_steps * group["lr"]
            if scale > 0:
                c_plus = st["ci"] - st["c"] + (self.round_start[name] - p.detach()) / scale
            else:
                c_plus = st["ci"].clone()
            self.updated_control[name] = c_plus
            deltas[name] = c_plus - st["ci"]
        return {CONTROL_DELTA: deltas}

    def persistent_state(self) -> dict[str, dict[str, Tensor]]:
        return {CLIENT_CONTROL: dict(self.updated_control)} if self.updated_control else {}


# ------------------------------------------------------------------------------------------ server
class Scaffold(FedAdaptStrategy):
    """SCAFFOLD option II server; :attr:`control` is c (float64)."""

    method: ClassVar[str] = "scaffold"
    hparams_class = ScaffoldHParams
    default_weighting: ClassVar[str] = "uniform"

    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        return (RecordSpec(R.MODEL, "mean", "model"), RecordSpec(CONTROL_DELTA, "sum", "params"))

    def client_lr_at(self, server_round: int) -> float:
        return self.client_lr * self.hparams.client_lr_decay ** max(server_round - 1, 0)

    def round_config(self, server_round: int) -> dict[str, Any]:
        cfg = super().round_config(server_round)
        cfg["weight-decay"] = float(self.hparams.weight_decay)
        return cfg

    @property
    def num_clients_total(self) -> int:
        return int(self.hparams.num_clients) or self.nodes_seen

    def init_state(self, arrays: NamedArrays) -> None:
        self.control: NamedArrays = {k: np.zeros(np.shape(arrays[k]), np.float64) for k in self.trainable(arrays)}

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        assert self.current is not None
        return {SERVER_CONTROL: cast_like(self.control, self.current)}

    def server_update(self, server_round: int, current: NamedArrays, aggregates: Mapping[str, NamedArrays]) -> NamedArrays:
        mean = aggregates[R.MODEL]
        n_total = self.num_clients_total
        if n_total <= 0:  # server_update without configure_train (direct calls): count the replies
            n_total = len(self.reply_metrics)
        new, control = scaffold_server_step(
            current, mean, self.control, aggregates[CONTROL_DELTA], self.trainable(current),
            server_lr=self.hparams.server_lr, num_clients=n_total,
        )
        new_params = cast_like(new, current)
        if all_finite(new_params) is None and all_finite(control) is None:
            self.control = control
        return self.merge_buffers(new_params, current, mean)


register(
    Scaffold, ScaffoldOptimizer,
    paper="Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, ICML 2020",
    summary="SGD corrected by control variates (option II, persistent c_i) + model averaging",
)
