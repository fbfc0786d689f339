"""FedOpt-family baselines: FedAvg, FedAvgM, FedAdagrad, FedAdam, FedYogi and FedProx.

* FedAvg — McMahan et al., *Communication-Efficient Learning of Deep Networks from Decentralized Data*, 2017.
* FedAvgM — Hsu et al., *Measuring the Effects of Non-Identical Data Distribution*, 2019 (server heavy-ball momentum).
* FedAdagrad / FedAdam / FedYogi — Reddi et al., *Adaptive Federated Optimization*, ICLR 2021.
* FedProx — Li et al., *Federated Optimization in Heterogeneous Networks*, MLSys 2020.

Clients run local SGD (:class:`~flower_strategies.core.local.SGDOptimizer`) and upload their model; the server
forms the descent-positive pseudo-gradient ``D̄ = x_t − mean_i x_i`` over the trainable floating-point keys
and applies a :class:`~flower_strategies.core.server_opt.ServerOptimizer`.  Non-trainable
floating arrays take the clients' mean; integer arrays keep the server's value.

Conventions and deviations
--------------------------
* Sign: ``D̄`` is descent-positive (``x ← x − lr·m/(√v+τ)``); Reddi et al. and Flower write the ascent
  sign ``Δ = mean x_i − x`` with ``x ← x + …`` – the same update.
* ``initial-v`` (``v₀``): empty/None (default) means ``τ²``; Flower's built-ins correspond to ``0``.
* ``bias-correction``: ``none`` (Reddi et al., default), ``adam`` (Keras: lr·√(1−β2^s)/(1−β1^s), s = server
  steps), ``flower`` (exponent = server round + 1, Flower 1.42's FedAdam).
* FedAdagrad keeps the momentum ``β1`` (Reddi et al.'s Algorithm 2); ``beta1 = 0`` is classic AdaGrad and
  Flower's FedAdagrad.
* Weighting: example-weighted mean by default (``weighting="uniform"`` for papers 002/004).

One strategy class, :class:`FedOpt`; the six baselines are registry names with other defaults of its
declaration (:class:`FedOptHParams`), given to :func:`~flower_strategies.core.registry.register`: ``server_opt``
picks the server optimizer, ``mu > 0`` is FedProx.  The classes ``FedAvg``, ``FedAdam``, … exist for
``from flower_strategies import FedAdam``: each only names its registry name, whose defaults it takes.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..core.local import SGDOptimizer
from ..core.ops import NamedArrays, all_finite, pseudo_gradient
from ..core.server_opt import ServerOptimizer
from ..core.strategy import FedAdaptStrategy, RoundInputs, ServerState
from ..optimizers.baselines import (
    FedOptHParams,
)

#: This module's names and its client half's (:mod:`flower_strategies.optimizers.baselines`, re-exported).
__all__ = [
    "FedAdagrad", "FedAdam", "FedAvg", "FedAvgM", "FedOpt", "FedOptHParams", "FedProx", "FedYogi",
    "fedopt_server_optimizer",
]


def fedopt_server_optimizer(h: FedOptHParams) -> ServerOptimizer:
    """The server optimizer the hyper-parameters ``h`` configure (the strategy's ``opt``)."""
    return ServerOptimizer(
        h.server_opt, lr=h.server_lr, beta1=h.beta1, beta2=h.beta2, tau=h.tau,
        initial_v=h.initial_v, bias_correction=h.bias_correction,
    )


class FedOpt(FedAdaptStrategy):
    """Clients upload their local model; the server applies a FedOpt server optimizer to ``D̄ = x_t − mean_i x_i``."""

    method: ClassVar[str] = "fedavg"
    hparams_class = FedOptHParams
    hparams: FedOptHParams
    local_optimizer = SGDOptimizer

    def __init__(self, hparams: FedOptHParams | None = None, **kwargs: Any) -> None:
        super().__init__(hparams, **kwargs)
        self.opt = fedopt_server_optimizer(self.hparams)

    @property
    def averages_models(self) -> bool:
        """Whether the new model is the mean of the replies (server-opt sgd, server-lr 1): Flower's DP wrappers
        compose with such a strategy (:func:`flower_strategies.core.privacy.composes_with_flower_dp`)."""
        return self.hparams.server_opt == "sgd" and self.hparams.server_lr == 1.0

    def init_server_state(self, arrays: NamedArrays) -> ServerState:
        return dict(self.opt.init({k: arrays[k] for k in self.trainable(arrays)}))

    def server_update(
        self, inputs: RoundInputs, state: ServerState
    ) -> tuple[NamedArrays, ServerState, dict[str, float]]:
        current, mean = inputs.current, inputs.aggregates["arrays"]
        params = {k: current[k] for k in inputs.trainable}
        # D̄, then x_{t+1}, in the round's own mean buffers, and the state updated in place when every new value is
        # finite (ServerOptimizer.step): the round needs no model copy beyond its aggregate
        pseudo_grad = pseudo_gradient(current, mean, inputs.trainable, in_place=True)  # (model dtype)
        buffers_finite = all_finite({k: v for k, v in mean.items() if k not in pseudo_grad}) is None
        new_params, new_state = self.opt.step(
            params, pseudo_grad, state, step=inputs.num_updates + 1, server_round=inputs.server_round,
            in_place=buffers_finite,
        )
        return self.merge_buffers(new_params, current, mean), dict(new_state), {}


class FedAvg(FedOpt):
    """FedAvg (McMahan et al. 2017) with an optional server learning rate."""

    method: ClassVar[str] = "fedavg"


class FedAvgM(FedOpt):
    """FedAvgM (Hsu et al. 2019): heavy-ball server momentum ``u ← β1·u + D̄``, ``u₀ = 0``."""

    method: ClassVar[str] = "fedavgm"
    hparam_defaults = {"server_opt": "sgdm"}


class FedAdagrad(FedOpt):
    """FedAdagrad (Reddi et al. 2021): ``v ← v + D̄²``."""

    method: ClassVar[str] = "fedadagrad"
    hparam_defaults = {"server_opt": "adagrad", "server_lr": 0.03}


class FedAdam(FedOpt):
    """FedAdam (Reddi et al. 2021): ``v ← β2·v + (1−β2)·D̄²``."""

    method: ClassVar[str] = "fedadam"
    hparam_defaults = {"server_opt": "adam", "server_lr": 0.01}


class FedYogi(FedOpt):
    """FedYogi (Reddi et al. 2021): ``v ← v − (1−β2)·D̄²·sign(v − D̄²)``."""

    method: ClassVar[str] = "fedyogi"
    hparam_defaults = {"server_opt": "yogi", "server_lr": 0.01}


class FedProx(FedOpt):
    """FedProx (Li et al. 2020): FedAvg server; clients add ``mu·(w − x_t)`` to every local gradient."""

    method: ClassVar[str] = "fedprox"
    hparam_defaults = {"mu": 0.01}
