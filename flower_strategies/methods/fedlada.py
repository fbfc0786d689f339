"""FedLADA — local AMSGrad with an amended (global-offset) direction, and LocalAdam (its α = 1 case).

Yan Sun, Li Shen, Hao Sun, Liang Ding, Dacheng Tao, *Efficient Federated Learning via Local Adaptive Amended
Optimizer with Linear Speedup*, 2023 (IEEE journal version; seed ``002_be4d0f1e88a9ebd5.txt``; Algorithm 3, §3.3,
§4).

Round ``t`` (all ops elementwise; ``v_srv`` = server average of last round's ``v̂``; ``g_a`` = global offset)::

    client i:  x ← x_t ; m ← 0 ; v̂ ← v_srv ; v ← 0
               K_i times:  g ← ∇f(x; batch) + λ·x                       (coupled L2, paper §4)
                           m ← β1·m + (1−β1)·g ;  v ← β2·v + (1−β2)·g²
                           v̂ ← max(v̂, v) ;        ϑ ← 1/√v̂             (no ε by default)
                           x ← x − η_l·(α·m⊙ϑ + (1−α)·g_a)
               upload x_{i,K} (model) and v̂_i
    server:    Δ̄ = mean_i(x_t − x_{i,K}) ;  x_{t+1} = x_t − η_g·Δ̄ ;  v_srv = mean_i v̂_i
               g_a = Δ̄ / (η_l^{(t)}·K̄)  (= (x_t − x_{t+1})/(η_g·η_l·K), Algorithm 3 line 18; offset_steps = "mean")
               g_a = mean_i Δ_i/(η_l^{(t)}·K_i)  (offset_steps = "per-client"; the same when every K_i = K)
               η_l^{(t+1)} = client_lr_decay · η_l^{(t)}

Symbols ↔ code: α ``amend_weight``, β1/β2 ``beta1``/``beta2``, λ ``weight_decay`` (client fields, read from
``group[...]``); m, v, v̂, g_a optimizer state ``m``, ``v``, ``vhat``, ``offset``;
ϑ :meth:`FedLADAOptimizer.preconditioner`;
v_srv / g_a server state and records ``"v-hat"`` / ``"global-offset"``; η_l ``client_lr_at(t)``
(the base applies ``client_lr_decay``); η_g ``server_lr``; K̄ ``RoundInputs.mean_steps``; K_i the
optimizer's ``steps_taken``.

Initial state: ``x_0`` shared, ``v_srv = initial_vhat`` (ε_v² = 1e-16), ``g_a = 0``.  Means are uniform by
default (Algorithm 3; ``weighting="examples"`` is the common flag).

**LocalAdam** (paper 002's Table 3 "SGD global + Adam local") is the registry name ``localadam``: this class
with ``amend_weight = 1`` by default — local AMSGrad with restarted momentum, ``v̂`` seeded from the averaged
``v̂``, model averaging.  With α = 1 the offset has weight 0, so ``g_a`` is not broadcast (2× communication
instead of FedLADA's 3× download).

Flags for the paper's ambiguities (defaults = our reading): ``local_updates`` (A1: K or the printed K−1),
``v_init`` (A4), ``initial_vhat`` (A5), ``eps_placement``/``eps`` (A5: none), ``decoupled_wd`` (A6),
``offset_lr`` (A2: lr of the producing round), ``client_lr_decay`` (A11), ``precondition_offset`` (A12),
``second_moment`` (AMSGrad / Adam without the max / SGD base = the FedCM client, §3.7 case 5).

Records: downlink ``"v-hat"`` (v_srv) and ``"global-offset"`` (g_a; only when α < 1); uplink ``"arrays"`` (the
local model), ``"v-hat"`` (v̂_i; the final ``v`` with ``second-moment = adam``) and, with
``offset_steps = "per-client"``, ``"delta-per-step"`` (``Δ_i/K_i``).

Conventions and deviations
--------------------------
* Unequal K_i (A2), flag ``offset_steps``: ``"mean"`` (default) ``g_a = Δ̄/(η_l·K̄)`` with K̄ the mean of the
  replies' ``num-steps`` (the steps each client really took) with the weights of Δ̄; ``"per-client"``
  ``g_a = mean_i Δ_i/(η_l·K_i)``: each client uploads ``Δ_i/K_i`` (record ``"delta-per-step"``) and the server
  divides that record's mean by η_l (the folded model mean cannot give a per-client quotient).  Both are exact for
  the paper's equal-K setting.
* ``local_updates = "K-1"`` (the printed loop) skips the last planned step entirely (no moment update), so
  the client needs the planned K (``planned_steps``); ``num-steps`` is still K, so ``g_a`` is still ÷K.
* Momentum restart: a fresh optimizer is built per round; nothing is persisted on the client.
* The client requires the ``"v-hat"`` record (round 1: the server sends ``initial_vhat``); ``initial_vhat``
  is a server field.
* The learning-rate decay is owned by the server (the base's ``client_lr_at``); ``server_lr`` is not decayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..core import records as R
from ..core.hparams import ConfigError, HParams, client_lr_decay_param, param
from ..core.local import EPS_PLACEMENTS, LocalOptimizer, inverse_sqrt
from ..core.ops import NamedArrays, averaging_step, owned, state_like
from ..core.registry import register
from ..core.strategy import FedAdaptStrategy, RecordSpec, RoundInputs, ServerState

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


class FedLADA(FedAdaptStrategy):
    """FedLADA server (Algorithm 3 lines 16–18 + the paper's per-round client-lr decay)."""

    method: ClassVar[str] = "fedlada"
    hparams_class = FedLADAHParams
    hparams: FedLADAHParams
    local_optimizer = FedLADAOptimizer
    default_weighting: ClassVar[str] = "uniform"

    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        # v̂ is a second moment (>= 0) and, under AMSGrad, the running max from the v̂ the server sent
        running_max = VHAT if self.hparams.second_moment == "amsgrad" else None
        specs = (RecordSpec(R.MODEL, "mean", "model"), RecordSpec(VHAT, "mean", "params", floor=0.0,
                                                                   at_least=running_max))
        if self.hparams.offset_steps == "per-client":
            return (*specs, RecordSpec(DELTA_PER_STEP, "mean", "params"))
        return specs

    def offset_lr(self, server_round: int) -> float:
        """η_l dividing the g_a produced in ``server_round`` (flag ``offset_lr``, A2)."""
        mode = self.hparams.offset_lr
        if mode == "consuming":
            return self.client_lr_at(server_round + 1)
        if mode == "initial":
            return self.settings.client_lr
        return self.client_lr_at(server_round)

    def init_server_state(self, arrays: NamedArrays) -> ServerState:
        keys = self.trainable(arrays)
        return {
            VHAT: state_like(arrays, keys, self.hparams.initial_vhat),  # v̂⁰ = ε_v²
            GLOBAL_OFFSET: state_like(arrays, keys),                    # g_a⁰ = 0
        }

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        state = self.server_state or {}
        return {name: state[name] for name in ((VHAT, GLOBAL_OFFSET) if self.hparams.amend_weight < 1.0 else (VHAT,))}

    def server_update(
        self, inputs: RoundInputs, state: ServerState
    ) -> tuple[NamedArrays, ServerState, dict[str, float]]:
        current, mean, lr = inputs.current, inputs.aggregates[R.MODEL], self.offset_lr(inputs.server_round)
        if self.hparams.offset_steps == "per-client":
            # line 17: x_{t+1} = x_t − η_g·Δ̄ ; line 18 per client: g_a = mean_i Δ_i/(η_l·K_i), into the record's buffers
            new, _ = averaging_step(current, mean, inputs.trainable, self.hparams.server_lr)
            per_step = inputs.aggregates[DELTA_PER_STEP]  # mean_i Δ_i/K_i
            offset = {k: np.divide(per_step[k], lr, out=per_step[k] if owned(per_step[k], current[k]) else None)
                      for k in inputs.trainable}
        else:
            # lines 17–18: x_{t+1} = x_t − η_g·Δ̄ (into the mean's buffers), g_a = Δ̄/(η_l·K̄) (in place)
            new, offset = averaging_step(current, mean, inputs.trainable, self.hparams.server_lr, state[GLOBAL_OFFSET],
                                         lr, inputs.mean_steps)
        vhat = inputs.aggregates[VHAT]  # line 16: v_srv = the round's aggregate itself
        new_state = {VHAT: {k: vhat[k] for k in inputs.trainable}, GLOBAL_OFFSET: offset}
        return self.merge_buffers(new, current, mean), new_state, {}


_PAPER = "Sun et al., Efficient Federated Learning via Local Adaptive Amended Optimizer with Linear Speedup, 2023"
register(FedLADA, paper=_PAPER, summary="local AMSGrad amended by the global offset g_a + averaged v̂")
register(FedLADA, name="localadam", amend_weight=1.0, paper=_PAPER,
         summary="FedLADA with α = 1: local AMSGrad + model/v̂ averaging")
