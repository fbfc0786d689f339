"""The client half of :mod:`flower_strategies.methods.fedcm`: its hyper-parameters, local optimizer and record
names.  A device imports this module (through :mod:`flower_strategies.optimizers`), never the strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..core.params import HParams, client_lr_decay_param, param
from ..core.local import LocalOptimizer

#: Downlink record (and server state) of the broadcast global update Δ_t.
GLOBAL_UPDATE = "global-update"


@dataclass(frozen=True)
class FedCMHParams(HParams):
    """FedCM (client-level momentum), defaults as in paper 002's setup."""

    amend_weight: float = param(
        0.1, lo=0.0, hi=1.0, client=True, help="α: weight of the local gradient in d = α·g + (1−α)·Δ_t (1 = FedAvg)",
    )
    weight_decay: float = param(
        1e-3, lo=0.0, client=True, help="coupled L2 weight decay λ added to g (paper 002: 1e-3)",
    )
    server_lr: float = param(1.0, lo=0.0, help="server learning rate η_g (1 = model averaging)")
    client_lr_decay: float = client_lr_decay_param(0.998, "paper 002: 0.998")


class FedCMOptimizer(LocalOptimizer):
    """Client of FedCM: ``x ← x − η_l·(α·(g + λx) + (1−α)·Δ_t)`` with ``Δ_t`` from the downlink."""

    hparams_class = FedCMHParams

    def downlink_records(self) -> tuple[str, ...]:
        return (GLOBAL_UPDATE,) if any(g["amend_weight"] < 1.0 for g in self.param_groups) else ()

    def init_state(self, name: str, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        if group["amend_weight"] < 1.0:  # α = 1: Δ_t has weight 0 and is not sent
            state["global_update"] = self.received(GLOBAL_UPDATE, name, p)
            if state["global_update"] is None:
                raise ValueError(
                    f"FedCMOptimizer: downlink record '{GLOBAL_UPDATE}' has no entry for parameter '{name}'"
                )

    def update_param(self, name: str, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        a, lam = group["amend_weight"], group["weight_decay"]
        g = grad.add(p, alpha=lam) if lam else grad                 # g + λx
        d = g.mul(a)                                                # d = α·g + (1−α)·Δ_t
        if a < 1.0:
            d.add_(state["global_update"], alpha=1.0 - a)
        p.add_(d, alpha=-group["lr"])                               # x ← x − η_l·d
