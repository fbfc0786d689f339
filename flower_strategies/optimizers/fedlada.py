"""The client half of :mod:`flower_strategies.methods.fedlada`: its hyper-parameters, local optimizer and record
names.  A device imports this module (through :mod:`flower_strategies.optimizers`), never the strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..core.params import ConfigError, HParams, client_lr_decay_param, param
from ..core.local import EPS_PLACEMENTS, LocalOptimizer, inverse_sqrt

#: Record names (downlink and uplink share "v-hat").
VHAT = "v-hat"
GLOBAL_OFFSET = "global-offset"
#: Uplink record of ``offset-steps = per-client``: the client's ``Δ_i/K_i = (x_t − x_{i,K})/K_i``.
DELTA_PER_STEP = "delta-per-step"

SECOND_MOMENTS = ("amsgrad", "adam", "sgd")
V_INITS = ("zero", "server")
LOCAL_UPDATES = ("K", "K-1")
OFFSET_LRS = ("producing", "consuming", "initial")
OFFSET_STEPS = ("mean", "per-client")


@dataclass(frozen=True)
class FedLADAHParams(HParams):
    """FedLADA (paper 002 §4 defaults; α = 0.1 for CIFAR-10, 0.05 for CIFAR-100/TinyImageNet)."""

    amend_weight: float = param(
        0.1, lo=0.0, hi=1.0, client=True, help="α: weight of the local adaptive direction (1 = LocalAdam)",
    )
    beta1: float = param(0.9, lo=0.0, hi=1.0, client=True, help="first-moment decay β1 (m restarted at 0 every round)")
    beta2: float = param(0.99, lo=0.0, hi=1.0, client=True, help="second-moment decay β2")
    weight_decay: float = param(
        0.01, lo=0.0, client=True, help="L2 weight decay λ (paper: 1e-2; 0 = Algorithm 3 exactly)",
    )
    decoupled_wd: bool = param(False, client=True, help="A6: AdamW-style x ← x − η_l·λ·x instead of g ← g + λ·x")
    v_init: str = param(
        "zero", choices=V_INITS, client=True, help="A4: client v at round start: zero | server (= the received v̂)",
    )
    second_moment: str = param(
        "amsgrad", choices=SECOND_MOMENTS, client=True,
        help="amsgrad (ϑ=1/√max) | adam (ϑ=1/√v, no max) | sgd (ϑ=1: FedCM-style base)",
    )
    eps_placement: str = param(
        "none", choices=EPS_PLACEMENTS, client=True, help="A5: none (ϑ=1/√v̂) | outside 1/(√v̂+ε) | inside 1/√(v̂+ε)",
    )
    eps: float = param(1e-8, lo=0.0, client=True, help="ε used when eps-placement is not 'none'")
    local_updates: str = param(
        "K", choices=LOCAL_UPDATES, client=True,
        help="A1: K updates, or the printed K−1 (last batch unused; g_a still ÷K)",
    )
    precondition_offset: bool = param(
        False, client=True, help="A12: step (α·m + (1−α)·g_a)⊙ϑ (appendix) instead of α·m⊙ϑ + (1−α)·g_a",
    )
    server_lr: float = param(1.0, lo=0.0, help="server learning rate η_g (1 = model averaging)")
    client_lr_decay: float = client_lr_decay_param(0.998, "1 = Algorithm 3")
    initial_vhat: float = param(
        1e-16, lo=0.0, help="A5: server v̂ before round 1 (ε_v² = 1e-16; the text's '1e-8' is the alternative)",
    )
    offset_lr: str = param(
        "producing", choices=OFFSET_LRS, help="A2: η_l dividing g_a: producing round | consuming round | initial",
    )
    offset_steps: str = param(
        "mean", choices=OFFSET_STEPS, client=True,
        help="K dividing g_a when clients take unequal step counts K_i: mean (Δ̄/(η_l·K̄)) | per-client "
             "(mean_i Δ_i/(η_l·K_i); clients upload Δ_i/K_i, one more model-sized record)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eps_placement == "none" and self.second_moment != "sgd":
            if self.initial_vhat == 0.0 and self.second_moment == "amsgrad":
                raise ConfigError(
                    "initial-vhat = 0 with eps-placement = none divides by zero; set initial-vhat > 0 or an eps"
                )
            if self.second_moment == "adam" and (self.v_init == "zero" or self.initial_vhat == 0.0):
                raise ConfigError(
                    "second-moment = adam with eps-placement = none needs v-init = server and initial-vhat > 0"
                )


class FedLADAOptimizer(LocalOptimizer):
    """Local amended AMSGrad (Algorithm 3, lines 4–13) with the §3.6 flags; see the module docstring."""

    hparams_class = FedLADAHParams
    needs_planned_steps = True  # the driver always passes the planned K ...

    def requires_planned_steps(self) -> bool:
        """... which only ``local_updates = "K-1"`` needs (the one rule that needs K in advance)."""
        return any(g["local_updates"] == "K-1" for g in self.param_groups)

    def downlink_records(self) -> tuple[str, ...]:
        return (VHAT, GLOBAL_OFFSET) if any(g["amend_weight"] < 1.0 for g in self.param_groups) else (VHAT,)

    def _required(self, record: str, name: str, p: Tensor) -> Tensor:
        t = self.received(record, name, p)
        if t is None:
            raise ValueError(f"FedLADAOptimizer: downlink record '{record}' has no entry for parameter '{name}'")
        return t

    def init_state(self, name: str, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        v_srv = self._required(VHAT, name, p)
        state["m"] = torch.zeros_like(p)                                              # m ← 0 (restart)
        state["v"] = v_srv.clone() if group["v_init"] == "server" else torch.zeros_like(p)
        state["vhat"] = v_srv                                                         # v̂ ← v_srv
        if group["amend_weight"] < 1.0:                                               # α = 1: g_a has weight 0
            state["offset"] = self._required(GLOBAL_OFFSET, name, p)

    def preconditioner(self, state: dict[str, Any], group: dict[str, Any]) -> Tensor | None:
        """ϑ: ``1/√v̂`` (amsgrad) or ``1/√v`` (adam) with the ε placement; None for the SGD base (ϑ = 1)."""
        if group["second_moment"] == "sgd":
            return None
        den = state["vhat"] if group["second_moment"] == "amsgrad" else state["v"]
        return inverse_sqrt(den, group["eps"], group["eps_placement"])

    def apply_step(self) -> None:
        for name, p, group in self.named_params():
            planned = self.planned_steps  # always set when a group uses K-1 (needs_planned_steps)
            last_skipped = group["local_updates"] == "K-1" and planned is not None and self.steps_taken >= planned - 1
            if p.grad is not None and not last_skipped:                               # A1: τ = 1..K−1 as printed
                self.update_param(name, p, p.grad, self.param_state(name, p, group), group)

    def update_param(self, name: str, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        a, lam, b1, b2 = group["amend_weight"], group["weight_decay"], group["beta1"], group["beta2"]
        g = grad.add(p, alpha=lam) if lam and not group["decoupled_wd"] else grad    # g + λ·x
        m, v, vhat = state["m"], state["v"], state["vhat"]
        m.mul_(b1).add_(g, alpha=1.0 - b1)                                            # m ← β1·m + (1−β1)·g
        if group["second_moment"] != "sgd":
            v.mul_(b2).addcmul_(g, g, value=1.0 - b2)                                 # v ← β2·v + (1−β2)·g²
            if group["second_moment"] == "amsgrad":
                torch.maximum(vhat, v, out=vhat)                                      # v̂ ← max(v̂, v)
        theta = self.preconditioner(state, group)                                     # ϑ
        if group["precondition_offset"]:                                              # A12: (α·m + (1−α)·g_a)⊙ϑ
            d = m.mul(a)
            if a < 1.0:
                d.add_(state["offset"], alpha=1.0 - a)
            if theta is not None:
                d.mul_(theta)
        else:                                                                         # α·m⊙ϑ + (1−α)·g_a
            d = m.mul(a) if theta is None else m.mul(theta).mul_(a)
            if a < 1.0:
                d.add_(state["offset"], alpha=1.0 - a)
        if lam and group["decoupled_wd"]:
            d.add_(p, alpha=lam)                                                      # A6: + λ·x (AdamW-style)
        p.add_(d, alpha=-group["lr"])                                                 # x ← x − η_l·d

    def uplink_arrays(self) -> dict[str, dict[str, Tensor]]:
        out = {VHAT: {
            name: self.state[p]["v" if group["second_moment"] == "adam" else "vhat"]
            for name, p, group in self.named_params()
        }}
        if any(g["offset_steps"] == "per-client" for g in self.param_groups):
            k = self.steps_taken  # K_i: the steps this client took (= its num-steps)
            out[DELTA_PER_STEP] = {
                name: (self.state[p]["round_start"] - p.detach()).div_(k) if k else torch.zeros_like(p)
                for name, p, _ in self.named_params()
            }
        return out
