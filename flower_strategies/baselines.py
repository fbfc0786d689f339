"""FedOpt-family baselines: FedAvg, FedAvgM, FedAdagrad, FedAdam, FedYogi and FedProx.

* FedAvg — McMahan et al., *Communication-Efficient Learning of Deep Networks from Decentralized Data*, 2017.
* FedAvgM — Hsu et al., *Measuring the Effects of Non-Identical Data Distribution*, 2019 (server heavy-ball momentum).
* FedAdagrad / FedAdam / FedYogi — Reddi et al., *Adaptive Federated Optimization*, ICLR 2021.
* FedProx — Li et al., *Federated Optimization in Heterogeneous Networks*, MLSys 2020.

Clients run local SGD (:class:`~flower_strategies.local.SGDOptimizer`) and upload their model; the server
forms the descent-positive pseudo-gradient ``D̄ = x_t − mean_i x_i`` over the trainable floating-point keys
and applies a :class:`~flower_strategies.server_opt.ServerOptimizer` (ALGORITHMS.md §6).  Non-trainable
floating arrays take the clients' mean; integer arrays keep the server's value.

Conventions and deviations
--------------------------
* Sign: ``D̄`` is descent-positive (``x ← x − lr·m/(√v+τ)``); Reddi et al. and Flower write the ascent
  sign ``Δ = mean x_i − x`` with ``x ← x + …`` – the same update.
* ``initial-v`` (``v₀``): ``-1`` (default) means ``τ²``; Flower's built-ins correspond to ``0``.
* ``bias-correction``: ``none`` (Reddi et al., default), ``adam`` (Keras: lr·√(1−β2^s)/(1−β1^s), s = server
  steps), ``flower`` (exponent = server round + 1, Flower 1.42's FedAdam).
* FedAdagrad keeps the momentum ``β1`` (Reddi et al.'s Algorithm 2); ``beta1 = 0`` is classic AdaGrad and
  Flower's FedAdagrad.
* Weighting: example-weighted mean by default (``weighting="uniform"`` for papers 002/004).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from .hparams import HParams, param
from .ops import NamedArrays
from .server_opt import BIAS_CORRECTIONS, ServerOptimizer, ServerState
from .local import SGDOptimizer
from .registry import register
from .strategy import FedAdaptStrategy


# ------------------------------------------------------------------------------------------ hparams
@dataclass(frozen=True)
class FedAvgHParams(HParams):
    """FedAvg: ``x ← x − server_lr·D̄`` (server_lr = 1 is model averaging)."""

    server_lr: float = param(1.0, lo=0.0, help="server learning rate η_g")
    weight_decay: float = param(0.0, lo=0.0, help="coupled L2 weight decay in the local SGD steps")


@dataclass(frozen=True)
class FedAvgMHParams(HParams):
    """FedAvgM: heavy-ball server momentum ``u ← β·u + D̄ ; x ← x − server_lr·u``."""

    server_lr: float = param(1.0, lo=0.0, help="server learning rate η_g")
    server_momentum: float = param(0.9, lo=0.0, hi=1.0, help="server momentum β")
    weight_decay: float = param(0.0, lo=0.0, help="coupled L2 weight decay in the local SGD steps")


@dataclass(frozen=True)
class FedAdaptiveHParams(HParams):
    """Shared fields of FedAdagrad / FedAdam / FedYogi (Reddi et al. 2021)."""

    server_lr: float = param(0.01, lo=0.0, help="server learning rate η")
    beta1: float = param(0.9, lo=0.0, hi=1.0, help="server momentum β1 (m₀ = 0)")
    beta2: float = param(0.99, lo=0.0, hi=1.0, help="second-moment decay β2 (unused by AdaGrad)")
    tau: float = param(1e-3, lo=0.0, help="adaptivity τ (added to √v)")
    initial_v: float = param(-1.0, help="v₀; negative = τ² (Reddi et al.); 0 = Flower's built-ins")
    bias_correction: str = param("none", choices=BIAS_CORRECTIONS, help="none | adam (Keras) | flower (Flower 1.42 FedAdam)")
    weight_decay: float = param(0.0, lo=0.0, help="coupled L2 weight decay in the local SGD steps")


@dataclass(frozen=True)
class FedAdagradHParams(FedAdaptiveHParams):
    server_lr: float = param(0.03, lo=0.0, help="server learning rate η")


@dataclass(frozen=True)
class FedAdamHParams(FedAdaptiveHParams):
    pass


@dataclass(frozen=True)
class FedYogiHParams(FedAdaptiveHParams):
    pass


@dataclass(frozen=True)
class FedProxHParams(HParams):
    """FedProx: local objective ``F_i(w) + (mu/2)·‖w − x_t‖²``, FedAvg server."""

    mu: float = param(0.01, lo=0.0, help="proximal coefficient μ")
    server_lr: float = param(1.0, lo=0.0, help="server learning rate η_g")
    weight_decay: float = param(0.0, lo=0.0, help="coupled L2 weight decay in the local SGD steps")


# ------------------------------------------------------------------------------------------ strategies
class FedOpt(FedAdaptStrategy):
    """Clients upload their local model; the server applies a FedOpt server optimizer to ``D̄``."""

    method: ClassVar[str] = ""

    def server_optimizer(self) -> ServerOptimizer:
        raise NotImplementedError

    def round_config(self, server_round: int) -> dict:
        cfg = super().round_config(server_round)
        cfg["weight-decay"] = float(getattr(self.hparams, "weight_decay", 0.0))
        return cfg

    def init_state(self, arrays: NamedArrays) -> None:
        self.opt = self.server_optimizer()
        self.opt_state: ServerState = self.opt.init({k: arrays[k] for k in self.trainable(arrays)})

    def server_update(self, server_round: int, current: NamedArrays, aggregates: Mapping[str, NamedArrays]) -> NamedArrays:
        mean = aggregates["arrays"]
        keys = self.trainable(current)
        params = {k: current[k] for k in keys}
        pseudo_grad = {k: current[k].astype("float64") - mean[k].astype("float64") for k in keys}
        new_params, self.opt_state = self.opt.step(
            params, pseudo_grad, self.opt_state, step=self.num_updates, server_round=server_round
        )
        return self.merge_buffers(new_params, current, mean)


class FedAvg(FedOpt):
    """FedAvg (McMahan et al. 2017) with an optional server learning rate."""

    method: ClassVar[str] = "fedavg"
    hparams_class = FedAvgHParams

    def server_optimizer(self) -> ServerOptimizer:
        return ServerOptimizer("sgd", lr=self.hparams.server_lr)


class FedAvgM(FedOpt):
    """FedAvgM (Hsu et al. 2019): heavy-ball server momentum, ``u₀ = 0``."""

    method: ClassVar[str] = "fedavgm"
    hparams_class = FedAvgMHParams

    def server_optimizer(self) -> ServerOptimizer:
        return ServerOptimizer("sgdm", lr=self.hparams.server_lr, beta1=self.hparams.server_momentum)


class _FedAdaptive(FedOpt):
    kind: ClassVar[str] = ""

    def server_optimizer(self) -> ServerOptimizer:
        hp = self.hparams
        return ServerOptimizer(
            self.kind,
            lr=hp.server_lr,
            beta1=hp.beta1,
            beta2=hp.beta2,
            tau=hp.tau,
            initial_v=None if hp.initial_v < 0 else hp.initial_v,
            bias_correction=hp.bias_correction,
        )


class FedAdagrad(_FedAdaptive):
    """FedAdagrad (Reddi et al. 2021): ``v ← v + D̄²``."""

    method: ClassVar[str] = "fedadagrad"
    hparams_class = FedAdagradHParams
    kind = "adagrad"


class FedAdam(_FedAdaptive):
    """FedAdam (Reddi et al. 2021): ``v ← β2·v + (1−β2)·D̄²``."""

    method: ClassVar[str] = "fedadam"
    hparams_class = FedAdamHParams
    kind = "adam"


class FedYogi(_FedAdaptive):
    """FedYogi (Reddi et al. 2021): ``v ← v − (1−β2)·D̄²·sign(v − D̄²)``."""

    method: ClassVar[str] = "fedyogi"
    hparams_class = FedYogiHParams
    kind = "yogi"


class FedProx(FedAvg):
    """FedProx (Li et al. 2020): FedAvg server; clients add ``mu·(w − x_t)`` to every local gradient."""

    method: ClassVar[str] = "fedprox"
    hparams_class = FedProxHParams

    def round_config(self, server_round: int) -> dict:
        cfg = super().round_config(server_round)
        cfg["prox-mu"] = float(self.hparams.mu)
        return cfg


_REDDI = "Reddi et al., Adaptive Federated Optimization, ICLR 2021"
register(FedAvg, SGDOptimizer, paper="McMahan et al., AISTATS 2017", summary="local SGD + (weighted) model averaging")
register(FedAvgM, SGDOptimizer, paper="Hsu et al., 2019", summary="FedAvg + server heavy-ball momentum")
register(FedAdagrad, SGDOptimizer, paper=_REDDI, summary="local SGD + server AdaGrad")
register(FedAdam, SGDOptimizer, paper=_REDDI, summary="local SGD + server Adam")
register(FedYogi, SGDOptimizer, paper=_REDDI, summary="local SGD + server Yogi")
register(FedProx, SGDOptimizer, paper="Li et al., MLSys 2020", summary="local SGD with proximal term + FedAvg")
