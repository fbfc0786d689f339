"""FedLADA — local AMSGrad with an amended (global-offset) direction, and LocalAdam (its α = 1 case).

Yan Sun, Li Shen, Hao Sun, Liang Ding, Dacheng Tao, *Efficient Federated Learning via Local Adaptive Amended Optimizer with Linear
Speedup*, 2023 (IEEE journal version; seed ``002_be4d0f1e88a9ebd5.txt``; Algorithm 3, §3.3, §4).  Spec: ALGORITHMS.md §3.

Round ``t`` (all ops elementwise; ``v_srv`` = server average of last round's ``v̂``; ``g_a`` = global offset)::

    client i:  x ← x_t ; m ← 0 ; v̂ ← v_srv ; v ← 0
               K_i times:  g ← ∇f(x; batch) + λ·x                       (coupled L2, paper §4)
                           m ← β1·m + (1−β1)·g ;  v ← β2·v + (1−β2)·g²
                           v̂ ← max(v̂, v) ;        ϑ ← 1/√v̂             (no ε by default)
                           x ← x − η_l·(α·m⊙ϑ + (1−α)·g_a)
               upload x_{i,K} (model) and v̂_i
    server:    Δ̄ = mean_i(x_t − x_{i,K}) ;  x_{t+1} = x_t − η_g·Δ̄ ;  v_srv = mean_i v̂_i
               g_a = Δ̄ / (η_l^{(t)}·K̄)  (= (x_t − x_{t+1})/(η_g·η_l·K), Algorithm 3 line 18)
               η_l^{(t+1)} = client_lr_decay · η_l^{(t)}

Initial state: ``x_0`` shared, ``v_srv = initial_vhat`` (ε_v² = 1e-16), ``g_a = 0``.  Means are uniform by
default (Algorithm 3; ``weighting="examples"`` is the common flag).  ``K̄`` is the mean of the clients' step
counts with the same weights as ``Δ̄`` (= K when all clients take K steps; see docs/methods/fedlada.md).

**LocalAdam** (paper 002's Table 3 "SGD global + Adam local") is the same method with α = 1: local AMSGrad
with restarted momentum, ``v̂`` seeded from the averaged ``v̂``, model averaging.  It does not broadcast
``g_a`` (2× communication instead of FedLADA's 3× download).

Flags for ALGORITHMS.md §3.6 (defaults = the spec): ``local_updates`` (A1: K or the printed K−1),
``v_init`` (A4), ``initial_vhat`` (A5), ``eps_placement``/``eps`` (A5: none), ``decoupled_wd`` (A6),
``offset_lr`` (A2: lr of the producing round), ``client_lr_decay`` (A11), ``precondition_offset`` (A12),
``second_moment`` (AMSGrad / Adam without the max / SGD base = the FedCM client, §3.7 case 5).

Records: downlink ``"v-hat"`` (v_srv) and ``"global-offset"`` (g_a; FedLADA only); uplink ``"arrays"`` (the
local model) and ``"v-hat"`` (v̂_i), plus ``"direction-sum"`` (Σ_τ m⊙ϑ) in debug mode.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..core import records as R
from .fedcm import averaging_step, cast_like, global_offset, mean_local_steps
from ..core.hparams import ConfigError, HParams, param
from ..core.local import LocalOptimizer
from ..core.ops import NamedArrays, all_finite
from ..core.registry import register
from ..core.strategy import FedAdaptStrategy, RecordSpec

#: Record names (downlink and uplink share "v-hat").
VHAT = "v-hat"
GLOBAL_OFFSET = "global-offset"
DIRECTION_SUM = "direction-sum"

SECOND_MOMENTS = ("amsgrad", "adam", "sgd")
EPS_PLACEMENTS = ("none", "outside", "inside")
V_INITS = ("zero", "server")
LOCAL_UPDATES = ("K", "K-1")
OFFSET_LRS = ("producing", "consuming", "initial")


# ------------------------------------------------------------------------------------------ hparams
@dataclass(frozen=True)
class LocalAdaptiveHParams(HParams):
    """Fields shared by FedLADA and LocalAdam (paper 002 §4 defaults)."""

    server_lr: float = param(1.0, lo=0.0, help="server learning rate η_g (1 = model averaging)")
    beta1: float = param(0.9, lo=0.0, hi=1.0, help="first-moment decay β1 (m restarted at 0 every round)")
    beta2: float = param(0.99, lo=0.0, hi=1.0, help="second-moment decay β2")
    weight_decay: float = param(0.01, lo=0.0, help="L2 weight decay λ (paper: 1e-2; 0 = Algorithm 3 exactly)")
    decoupled_wd: bool = param(False, help="A6: AdamW-style x ← x − η_l·λ·x instead of g ← g + λ·x")
    client_lr_decay: float = param(0.998, lo=0.0, lo_open=True, hi=1.0, help="A11: client lr × this after every round (1 = Algorithm 3)")
    initial_vhat: float = param(1e-16, lo=0.0, help="A5: server v̂ before round 1 (ε_v² = 1e-16; the text's '1e-8' is the alternative)")
    v_init: str = param("zero", choices=V_INITS, help="A4: client v at round start: zero | server (= the received v̂)")
    second_moment: str = param("amsgrad", choices=SECOND_MOMENTS, help="amsgrad (ϑ=1/√max) | adam (ϑ=1/√v, no max) | sgd (ϑ=1: FedCM-style base)")
    eps_placement: str = param("none", choices=EPS_PLACEMENTS, help="A5: none (ϑ=1/√v̂) | outside 1/(√v̂+ε) | inside 1/√(v̂+ε)")
    eps: float = param(1e-8, lo=0.0, help="ε used when eps-placement is not 'none'")
    local_updates: str = param("K", choices=LOCAL_UPDATES, help="A1: K updates, or the printed K−1 (last batch unused; g_a still ÷K)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eps_placement == "none" and self.second_moment != "sgd":
            if self.initial_vhat == 0.0 and self.second_moment == "amsgrad":
                raise ConfigError("initial-vhat = 0 with eps-placement = none divides by zero; set initial-vhat > 0 or an eps")
            if self.second_moment == "adam" and (self.v_init == "zero" or self.initial_vhat == 0.0):
                raise ConfigError("second-moment = adam with eps-placement = none needs v-init = server and initial-vhat > 0")


@dataclass(frozen=True)
class FedLADAHParams(LocalAdaptiveHParams):
    """FedLADA: α (amended weight) 0.1 (CIFAR-10; 0.05 for CIFAR-100/TinyImageNet)."""

    amend_weight: float = param(0.1, lo=0.0, hi=1.0, help="α: weight of the local adaptive direction (1 = LocalAdam)")
    offset_lr: str = param("producing", choices=OFFSET_LRS, help="A2: η_l dividing g_a: producing round | consuming round | initial")
    precondition_offset: bool = param(False, help="A12: step (α·m + (1−α)·g_a)⊙ϑ (appendix) instead of α·m⊙ϑ + (1−α)·g_a")


@dataclass(frozen=True)
class LocalAdamHParams(LocalAdaptiveHParams):
    """LocalAdam (paper 002): FedLADA with α = 1 — no global offset, same other hyper-parameters."""


# ------------------------------------------------------------------------------------------ client
class FedLADAOptimizer(LocalOptimizer):
    """Local amended AMSGrad (Algorithm 3, lines 4–13) with the §3.6 flags; see the module docstring."""

    config_keys: ClassVar[dict[str, str]] = {
        R.CLIENT_LR: "lr",
        "amend-weight": "amend_weight",
        "beta1": "beta1",
        "beta2": "beta2",
        "weight-decay": "weight_decay",
        "decoupled-wd": "decoupled_wd",
        "initial-vhat": "initial_vhat",
        "v-init": "v_init",
        "second-moment": "second_moment",
        "eps-placement": "eps_placement",
        "eps": "eps",
        "local-updates": "local_updates",
        "precondition-offset": "precondition_offset",
        "debug-direction-sum": "debug_direction_sum",
    }

    def __init__(
        self,
        params: Iterable[tuple[str, Tensor]],
        lr: float = 0.001,
        amend_weight: float = 0.1,
        beta1: float = 0.9,
        beta2: float = 0.99,
        weight_decay: float = 0.0,
        decoupled_wd: bool = False,
        initial_vhat: float = 1e-16,
        v_init: str = "zero",
        second_moment: str = "amsgrad",
        eps_placement: str = "none",
        eps: float = 1e-8,
        local_updates: str = "K",
        precondition_offset: bool = False,
        debug_direction_sum: bool = False,
    ) -> None:
        if lr < 0 or weight_decay < 0 or eps < 0 or initial_vhat < 0:
            raise ValueError("lr, weight_decay, eps and initial_vhat must be >= 0")
        if not 0.0 <= amend_weight <= 1.0 or not 0.0 <= beta1 <= 1.0 or not 0.0 <= beta2 <= 1.0:
            raise ValueError(f"amend_weight, beta1, beta2 must lie in [0, 1] (got {amend_weight}, {beta1}, {beta2})")
        for value, valid, what in (
            (v_init, V_INITS, "v_init"), (second_moment, SECOND_MOMENTS, "second_moment"),
            (eps_placement, EPS_PLACEMENTS, "eps_placement"), (local_updates, LOCAL_UPDATES, "local_updates"),
        ):
            if value not in valid:
                raise ValueError(f"{what} = {value!r}; valid: {', '.join(valid)}")
        super().__init__(params, {
            "lr": lr, "amend_weight": amend_weight, "beta1": beta1, "beta2": beta2, "weight_decay": weight_decay,
            "decoupled_wd": bool(decoupled_wd), "eps": eps,
        })
        self.initial_vhat = float(initial_vhat)
        self.v_init = v_init
        self.second_moment = second_moment
        self.eps_placement = eps_placement
        self.local_updates = local_updates
        self.precondition_offset = bool(precondition_offset)
        self.debug_direction_sum = bool(debug_direction_sum)
        self.updates_done = 0

    def begin_round(self, downlink=None, persistent=None) -> None:
        super().begin_round(downlink, persistent)
        downlink = downlink or {}
        vrec, orec = downlink.get(VHAT), downlink.get(GLOBAL_OFFSET)
        self.updates_done = 0
        for name, p, group in self.named_params():
            st = self.state[p]
            if vrec is not None and name in vrec:
                seed = vrec[name].to(device=p.device, dtype=p.dtype).clone()
            else:  # no server average yet: Algorithm 3's v̂⁰
                seed = torch.full_like(p, self.initial_vhat)
            if orec is not None and name in orec:
                st["offset"] = orec[name].to(device=p.device, dtype=p.dtype).clone()
            elif group["amend_weight"] < 1.0:
                raise ValueError(f"FedLADA needs the downlink record '{GLOBAL_OFFSET}' (key '{name}' missing)")
            else:  # α = 1 (LocalAdam): the offset has weight 0
                st["offset"] = torch.zeros_like(p)
            st["m"] = torch.zeros_like(p)  # momentum restarted every round
            st["v"] = seed.clone() if self.v_init == "server" else torch.zeros_like(p)
            st["vhat"] = seed
            if self.debug_direction_sum:
                st["direction_sum"] = torch.zeros_like(p)

    def _theta(self, den: Tensor, eps: float) -> Tensor:
        if self.eps_placement == "outside":
            return 1.0 / (den.sqrt() + eps)
        if self.eps_placement == "inside":
            return 1.0 / (den + eps).sqrt()
        return den.rsqrt()

    @torch.no_grad()
    def apply_step(self) -> None:
        if self.local_updates == "K-1" and self.updates_done >= self.num_steps - 1:
            return  # Algorithm 3 as printed: τ = 1..K−1
        self.updates_done += 1
        for name, p, group in self.named_params():
            if p.grad is None:
                continue
            st = self.state[p]
            lr, a, wd = group["lr"], group["amend_weight"], group["weight_decay"]
            g = p.grad
            if wd and not group["decoupled_wd"]:
                g = g.add(p, alpha=wd)
            m, v, vhat = st["m"], st["v"], st["vhat"]
            m.mul_(group["beta1"]).add_(g, alpha=1.0 - group["beta1"])
            if self.second_moment == "sgd":
                theta = None
            else:
                v.mul_(group["beta2"]).addcmul_(g, g, value=1.0 - group["beta2"])
                if self.second_moment == "amsgrad":
                    torch.maximum(vhat, v, out=vhat)
                    theta = self._theta(vhat, group["eps"])
                else:
                    theta = self._theta(v, group["eps"])
            if self.precondition_offset:
                d = m.mul(a).add_(st["offset"], alpha=1.0 - a)
                if theta is not None:
                    d.mul_(theta)
            else:
                d = m.mul(a) if theta is None else m.mul(theta).mul_(a)
                d.add_(st["offset"], alpha=1.0 - a)
            if self.debug_direction_sum:
                st["direction_sum"].add_(m if theta is None else m * theta)
            if wd and group["decoupled_wd"]:
                d.add_(p, alpha=wd)
            p.add_(d, alpha=-lr)

    def end_round(self) -> dict[str, dict[str, Tensor]]:
        key = "v" if self.second_moment == "adam" else "vhat"
        out = {VHAT: {name: self.state[p][key] for name, p, _ in self.named_params()}}
        if self.debug_direction_sum:
            out[DIRECTION_SUM] = {name: self.state[p]["direction_sum"] for name, p, _ in self.named_params()}
        return out


# ------------------------------------------------------------------------------------------ server math
def fedlada_server_step(
    current: Mapping[str, np.ndarray],
    mean_model: Mapping[str, np.ndarray],
    mean_vhat: Mapping[str, np.ndarray],
    keys: Iterable[str],
    *,
    server_lr: float,
    offset_client_lr: float,
    mean_steps: float,
) -> tuple[NamedArrays, NamedArrays, NamedArrays]:
    """Algorithm 3 lines 16–18 → ``(x_{t+1}, v_srv, g_a)`` over ``keys`` (float64).

    ``offset_client_lr`` is the η_l dividing ``g_a`` (the producing round's by default).
    """
    keys = list(keys)
    delta, new = averaging_step(current, mean_model, keys, server_lr)
    vsrv = {k: np.asarray(mean_vhat[k], np.float64).copy() for k in keys}
    return new, vsrv, global_offset(delta, offset_client_lr, mean_steps)


# ------------------------------------------------------------------------------------------ strategies
class FedLADA(FedAdaptStrategy):
    """FedLADA server (Algorithm 3 lines 16–18 + the paper's per-round client-lr decay).

    ``debug_direction_sum=True`` makes clients also upload ``Σ_τ m⊙ϑ`` (for the Eq. (4) identity); the
    averaged value of the last round is kept in :attr:`last_direction_sum`.
    """

    method: ClassVar[str] = "fedlada"
    hparams_class = FedLADAHParams
    default_weighting: ClassVar[str] = "uniform"
    #: Whether g_a is broadcast (False for LocalAdam, whose α is 1).
    sends_offset: ClassVar[bool] = True

    def __init__(self, hparams: HParams | None = None, *, debug_direction_sum: bool = False, **kwargs: Any) -> None:
        super().__init__(hparams, **kwargs)
        self.debug_direction_sum = bool(debug_direction_sum)
        self.last_direction_sum: NamedArrays | None = None

    @property
    def amend_weight(self) -> float:
        return float(getattr(self.hparams, "amend_weight", 1.0))

    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        specs = (RecordSpec(R.MODEL, "mean", "model"), RecordSpec(VHAT, "mean", "params"))
        if self.debug_direction_sum:
            specs += (RecordSpec(DIRECTION_SUM, "mean", "params"),)
        return specs

    def client_lr_at(self, server_round: int) -> float:
        return self.client_lr * self.hparams.client_lr_decay ** max(server_round - 1, 0)

    def offset_lr(self, server_round: int) -> float:
        """η_l dividing the g_a produced in ``server_round`` (flag ``offset_lr``, A2)."""
        mode = getattr(self.hparams, "offset_lr", "producing")
        if mode == "consuming":
            return self.client_lr_at(server_round + 1)
        if mode == "initial":
            return self.client_lr
        return self.client_lr_at(server_round)

    def round_config(self, server_round: int) -> dict[str, Any]:
        hp = self.hparams
        cfg = super().round_config(server_round)
        cfg.update({
            "amend-weight": self.amend_weight,
            "beta1": float(hp.beta1),
            "beta2": float(hp.beta2),
            "weight-decay": float(hp.weight_decay),
            "decoupled-wd": bool(hp.decoupled_wd),
            "initial-vhat": float(hp.initial_vhat),
            "v-init": hp.v_init,
            "second-moment": hp.second_moment,
            "eps-placement": hp.eps_placement,
            "eps": float(hp.eps),
            "local-updates": hp.local_updates,
            "precondition-offset": bool(getattr(hp, "precondition_offset", False)),
        })
        if self.debug_direction_sum:
            cfg["debug-direction-sum"] = True
        return cfg

    def init_state(self, arrays: NamedArrays) -> None:
        keys = self.trainable(arrays)
        self.vhat: NamedArrays = {k: np.full(np.shape(arrays[k]), self.hparams.initial_vhat, np.float64) for k in keys}
        self.offset: NamedArrays = {k: np.zeros(np.shape(arrays[k]), np.float64) for k in keys}

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        assert self.current is not None
        out = {VHAT: cast_like(self.vhat, self.current)}
        if self.sends_offset:
            out[GLOBAL_OFFSET] = cast_like(self.offset, self.current)
        return out

    def server_update(self, server_round: int, current: NamedArrays, aggregates: Mapping[str, NamedArrays]) -> NamedArrays:
        mean = aggregates[R.MODEL]
        new, vsrv, offset = fedlada_server_step(
            current, mean, aggregates[VHAT], self.trainable(current),
            server_lr=self.hparams.server_lr,
            offset_client_lr=self.offset_lr(server_round),
            mean_steps=mean_local_steps(self.reply_metrics, self.weighting),
        )
        new_params = cast_like(new, current)
        if all(all_finite(a) is None for a in (new_params, vsrv, offset)):  # commit state only for a usable round
            self.vhat, self.offset = vsrv, offset
            if self.debug_direction_sum:
                self.last_direction_sum = {k: np.asarray(v, np.float64) for k, v in aggregates[DIRECTION_SUM].items()}
        return self.merge_buffers(new_params, current, mean)


class LocalAdam(FedLADA):
    """LocalAdam in paper 002's sense: FedLADA with α = 1 (no global offset is sent)."""

    method: ClassVar[str] = "localadam"
    hparams_class = LocalAdamHParams
    sends_offset: ClassVar[bool] = False


_PAPER = "Sun et al., Efficient Federated Learning via Local Adaptive Amended Optimizer with Linear Speedup, 2023"
register(FedLADA, FedLADAOptimizer, paper=_PAPER, summary="local AMSGrad amended by the global offset g_a + averaged v̂")
register(LocalAdam, FedLADAOptimizer, paper=_PAPER, summary="FedLADA with α = 1: local AMSGrad + model/v̂ averaging")
