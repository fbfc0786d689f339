"""The client half of :mod:`flower_strategies.methods.mimelite`: its hyper-parameters, local optimizer and record
names.  A device imports this module (through :mod:`flower_strategies.optimizers`), never the strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..core.params import HParams, param
from ..core.local import LocalOptimizer, Named

MOMENTUM = "momentum"
SECOND_MOMENT = "second-moment"
FULL_GRADIENT = "full-gradient"

#: The server statistics ``s`` of each base optimizer (downlink records = server-state entries).
STATISTICS: dict[str, tuple[str, ...]] = {
    "sgdm": (MOMENTUM,), "adam": (MOMENTUM, SECOND_MOMENT), "adagrad": (SECOND_MOMENT,),
}
BASES = tuple(STATISTICS)


# ------------------------------------------------------------------------------------------ pure math
def mimelite_direction(base: str, g: Any, m: Any, v: Any, *, beta1: float, beta2: float, eps: float) -> Any:
    """Base-optimizer direction ``d(g)`` with frozen statistics (works on numpy arrays and torch tensors)."""
    if base == "sgdm":
        return (1.0 - beta1) * g + beta1 * m
    if base == "adam":
        sq = (1.0 - beta2) * g * g + beta2 * v
        return ((1.0 - beta1) * g + beta1 * m) / (sq**0.5 + eps)
    if base == "adagrad":
        return g / ((v + g * g) ** 0.5 + eps)
    raise ValueError(f"unknown MimeLite base optimizer {base!r}; valid: {', '.join(BASES)}")


# ------------------------------------------------------------------------------------------ hyper-parameters
@dataclass(frozen=True)
class MimeLiteHParams(HParams):
    """MimeLite (Karimireddy et al. 2021) with a SGDM / Adam / AdaGrad base optimizer."""

    base: str = param("sgdm", choices=BASES, client=True, help="base optimizer whose statistics the server keeps")
    beta1: float = param(0.9, lo=0.0, hi=0.999, client=True, help="momentum β1 (sgdm, adam)")
    beta2: float = param(0.99, lo=0.0, hi=1.0, client=True, help="second-moment decay β2 (adam)")
    eps: float = param(1e-3, lo=0.0, client=True, help="ε outside the square root (adam, adagrad)")
    server_lr: float = param(1.0, lo=0.0, lo_open=True, help="server learning rate η_g on the averaged model delta")


# ------------------------------------------------------------------------------------------ client
class MimeLiteOptimizer(LocalOptimizer):
    """Local steps with the broadcast (frozen) server statistics; uploads the full-batch gradient at ``x_t``."""

    hparams_class = MimeLiteHParams
    needs_full_gradient: ClassVar[bool] = True

    def downlink_records(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r for group in self.param_groups for r in STATISTICS[group["base"]]))

    def init_state(self, name: str, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        assert self.full_gradient is not None  # the base requires it (needs_full_gradient)
        if name not in self.full_gradient:
            raise ValueError(f"{type(self).__name__}: full_gradient has no entry for parameter {name!r}")
        for key, record in (("m", MOMENTUM), ("v", SECOND_MOMENT)):
            if record in STATISTICS[group["base"]]:
                s = self.received(record, name, p)
                state[key] = torch.zeros_like(p) if s is None else s

    def update_param(self, name: str, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        d = mimelite_direction(group["base"], grad, state.get("m"), state.get("v"),
                               beta1=group["beta1"], beta2=group["beta2"], eps=group["eps"])
        p.add_(d, alpha=-group["lr"])

    def uplink_arrays(self) -> dict[str, Named]:
        assert self.full_gradient is not None
        return {FULL_GRADIENT: {name: self.full_gradient[name] for name, _, _ in self.named_params()}}
