"""The client half of :mod:`flower_strategies.methods.scaffold`: its hyper-parameters, local optimizer and record
names.  A device imports this module (through :mod:`flower_strategies.optimizers`), never the strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..core.params import HParams, client_lr_decay_param, param
from ..core.local import LocalOptimizer

SERVER_CONTROL = "server-control"
CONTROL_DELTA = "control-delta"
CLIENT_CONTROL = "client-control"


@dataclass(frozen=True)
class ScaffoldHParams(HParams):
    """SCAFFOLD option II."""

    weight_decay: float = param(
        1e-3, lo=0.0, client=True, help="coupled L2 weight decay λ added to g (paper 002: 1e-3)",
    )
    server_lr: float = param(1.0, lo=0.0, help="server learning rate η_g (1 = model averaging)")
    num_clients: int | None = param(
        None, lo=1, help="N_total in c ← c + ΣΔc_i/N_total; empty = the most nodes seen connected",
    )
    client_lr_decay: float = client_lr_decay_param(1.0, "paper 002 setup: 0.998")


class ScaffoldOptimizer(LocalOptimizer):
    """Client of SCAFFOLD option II: corrected SGD steps and the c_i⁺ update (persistent c_i)."""

    hparams_class = ScaffoldHParams

    def downlink_records(self) -> tuple[str, ...]:
        return (SERVER_CONTROL,)

    def init_state(self, name: str, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["c"] = self.received(SERVER_CONTROL, name, p)
        if state["c"] is None:
            raise ValueError(
                f"ScaffoldOptimizer: downlink record '{SERVER_CONTROL}' has no entry for parameter '{name}'"
            )
        ci = self.saved(CLIENT_CONTROL, name, p)
        state["ci"] = torch.zeros_like(p) if ci is None else ci      # c_i = 0 before the first participation

    def update_param(self, name: str, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        d = grad.sub(state["ci"]).add_(state["c"])                   # g − c_i + c
        if group["weight_decay"]:
            d.add_(p, alpha=group["weight_decay"])                   # + λ·y
        p.add_(d, alpha=-group["lr"])                                # y ← y − η_l·d

    def _updated_control(self) -> dict[str, Tensor]:
        """``c_i⁺ = c_i − c + (x_t − y)/(K·η_l)`` with K = the steps taken (``c_i`` when ``K·η_l = 0``)."""
        out: dict[str, Tensor] = {}
        for name, p, group in self.named_params():
            st = self.state[p]
            scale = self.steps_taken * group["lr"]
            out[name] = st["ci"] - st["c"] + (st["round_start"] - p.detach()) / scale if scale > 0 else st["ci"].clone()
        return out

    def uplink_arrays(self) -> dict[str, dict[str, Tensor]]:
        c_plus = self._updated_control()
        return {CONTROL_DELTA: {name: c_plus[name] - self.state[p]["ci"] for name, p, _ in self.named_params()}}

    def persistent_arrays(self) -> dict[str, dict[str, Tensor]]:
        return {CLIENT_CONTROL: self._updated_control()}
