"""FedDA: momentum-decoupled adaptive federated optimization (+SGDM / +Adam / +AdaGrad).

Paper: Jiayin Jin, Jiaxiang Ren, Yang Zhou, Lingjuan Lyu, Ji Liu, Dejing Dou, *Accelerated Federated Learning
with Decoupled Adaptive Optimization*, ICML 2022 (seed file ``001_7e69cb14711dc6c0.txt``; §4, Algorithms 1–2 in
appendix A.2, Table 12).

Client (identical for the three variants; :class:`FedDAOptimizer`), starting from ``W = W_r``, ``m = m_r``
(the broadcast global momentum, *inherited*), ``P = 0``, for each of the ``T`` local steps::

    g ← ∇f_i(W; batch) [+ μ·(W − W_r)]          (full batch in the stabilization phase; μ = FedDA+Prox)
    W ← W − η·g                                  (plain SGD: the momentum never touches the local model)
    m ← β1·m + (1−β1)·g                          (global-momentum recursion on the local gradient)
    P ← P + m

Uplink: ``P_i`` (record ``"momentum-sum"``) and the final ``m_i`` (record ``"momentum"``); the local model is
not sent.  Server (:func:`fedda_server_step`), with ``P̄ = mean_i P_i``, ``m_{r+1} = mean_i m_i`` and ``s`` the
1-based count of server updates::

    SGDM     W ← W − η·α·P̄
    Adam     G = (P̄ − β1·m_r)/(1−β1) ;  m̂ = (β1·m_r + (1−β1)·G)/(1−β1^s)
             V ← β2·V + (1−β2)·G² ;    V̂ = V/(1−β2^s) ;   W ← W − η·α·m̂/(√V̂ + ε)
    AdaGrad  G = (P̄ − β1·m_r)/(1−β1) ;  V ← V + G² ;        W ← W − η·α·G/(√V + ε)

Symbol ↔ variable: ``W`` model, ``m`` record ``"momentum"`` (server state ``"m_t"``, client
``state[p]["momentum"]``), ``P`` record ``"momentum-sum"`` (client ``state[p]["momentum_sum"]``), ``V`` server
state ``"v_t"``, ``η`` ``client-lr``, ``α`` ``server-lr``, ``β1`` ``beta1``, ``β2`` ``beta2``, ``ε`` ``eps``,
``μ`` ``prox-mu``, ``T`` the local steps taken (``steps_taken``; the run's ``local-steps``).  Every key is
``<method>.<key>`` (method ∈ ``fedda``, ``fedda-sgdm``, ``fedda-adam``, ``fedda-adagrad``).

Conventions and deviations (each ambiguity of the paper is a flag; default = our reading)
------------------------------------------------------------------------------------------------------
* A1 η placement: ``eta-in-server`` (True: Algorithm 1, ``W ← W − η·α·P̄``; False: ``W ← W − α·P̄``) and
  ``eta-in-momentum`` (False; True = Eq. 25, ``m ← β1·m + (1−β1)·η·g``).
* A3 bias-correction exponent: ``bias-correction`` = ``updates`` (s = server updates so far, 1-based; default),
  ``round`` (s = Flower server round), ``none``.
* A4 V̂: ``v-hat`` = ``new`` (``V_{r+1}``, Algorithm 2; default) or ``stale`` (``V_r``, Eq. 35).
* A5 AdaGrad follows Algorithm 2 (``V_{r+1}``, ``η·α``); Eq. (39)'s form is ``server-lr = 1``.
* A6 aggregation weights: the run's ``weighting`` (examples = ``n_i``, the paper's choice, default).
* A7 ``T`` is the run's ``local-steps`` (0 = epochs, the framework's default).
* A8 full-batch stabilization: ``full-batch-last`` (fraction of the final rounds, default 0.05 ⇒ the last
  ``ceil(0.05·R)`` rounds, R = the strategy's ``num_rounds``) or ``full-batch-from`` (first full-batch round,
  overrides; empty = unset); in that phase the round config carries ``"full-batch": True``
  (:meth:`FedDA.client_config`) and each client takes exactly one full-batch step.
* A9 FedDA+Prox: ``prox-mu`` μ, the same prox-augmented gradient in the local step and the momentum.
* A10 ``m_0 = 0``, ``V_0 = initial-v`` (default 0).
* A11 ``server-lr``: Table 12 (EMNIST) per variant: ``fedda-sgdm`` 1, ``fedda-adam``/``fedda-adagrad`` 0.1;
  ``fedda``'s empty default takes the value of its ``variant``.
* A12 ``G`` is used as written (no rescaling for ``T > 1``).
* A parameter without a gradient counts as ``g = 0`` (its momentum track keeps running: the recursion stays linear).
* Only trainable floating-point arrays are updated; other arrays keep the server's value (our models have
  no buffers).

Registry: ``fedda`` (variant chosen by ``fedda.variant``) and ``fedda-sgdm``, ``fedda-adam``,
``fedda-adagrad`` (the same class with that ``variant`` and its Table 12 server lr as defaults).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from ..core import records as R
from ..core.hparams import ConfigError
from ..core.ops import NamedArrays, dtype_of, state_like
from ..core.strategy import FedAdaptStrategy, RecordSpec, RoundInputs, ServerState
from ..optimizers.fedda import (
    FEDDA_BIAS_CORRECTIONS, FedDAClientHParams, FedDAHParams, FedDAOptimizer, MOMENTUM, MOMENTUM_SUM,
    TABLE12_SERVER_LR, VARIANTS, V_HATS,
)

#: This module's names and its client half's (:mod:`flower_strategies.optimizers.fedda`, re-exported).
__all__ = [
    "FEDDA_BIAS_CORRECTIONS", "FedDA", "FedDAAdagrad", "FedDAAdam", "FedDAClientHParams", "FedDAHParams",
    "FedDAOptimizer", "FedDASGDM", "MOMENTUM", "MOMENTUM_SUM", "TABLE12_SERVER_LR", "VARIANTS", "V_HATS",
    "fedda_server_step",
]


# ------------------------------------------------------------------------------------------ pure server math
def fedda_server_step(
    variant: str,
    params: Mapping[str, np.ndarray],
    p_bar: Mapping[str, np.ndarray],
    m_prev: Mapping[str, np.ndarray],
    v: Mapping[str, np.ndarray],
    *,
    client_lr: float,
    server_lr: float,
    beta1: float = 0.9,
    beta2: float = 0.99,
    eps: float = 0.1,
    eta_in_server: bool = True,
    bias_step: int | None = 1,
    v_hat: str = "new",
) -> tuple[NamedArrays, NamedArrays]:
    """One FedDA server update (Algorithms 1–2); returns ``(new_params, new_V)`` in new arrays (inputs untouched).

    ``params`` – ``W_r``; ``p_bar`` – aggregated ``P``; ``m_prev`` – the momentum ``m_r`` broadcast this round;
    ``v`` – ``V_r`` (ignored by SGDM); ``bias_step`` – Adam's bias-correction exponent ``s`` (``None`` = no
    correction).  The step size is ``server_lr·client_lr`` if ``eta_in_server`` else ``server_lr``.
    The math runs in each parameter's dtype (float64 runs: the float64 expressions of the algorithm box, bit for bit).
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown FedDA variant {variant!r}; valid: {', '.join(VARIANTS)}")
    if v_hat not in V_HATS:
        raise ValueError(f"unknown v_hat {v_hat!r}; valid: {', '.join(V_HATS)}")
    lr = server_lr * client_lr if eta_in_server else server_lr
    c1 = 1.0 - beta1**bias_step if bias_step is not None else 1.0
    c2 = 1.0 - beta2**bias_step if bias_step is not None else 1.0
    new_params: NamedArrays = {}
    new_v: NamedArrays = {}
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for k, w in params.items():
            dt = dtype_of(w)
            p = np.asarray(p_bar[k], dt)
            if variant == "sgdm":
                new_params[k] = np.asarray(w) - p * lr
                continue
            m, v_old = np.asarray(m_prev[k], dt), np.asarray(v[k], dt)
            g = (p - m * beta1) / (1.0 - beta1)
            if variant == "adam":
                m_hat = (m * beta1 + g * (1.0 - beta1)) / c1
                new_v[k] = v_old * beta2 + g * (1.0 - beta2) * g  # V = β2·V + (1−β2)·G·G
                den = (new_v[k] if v_hat == "new" else v_old) / c2
                upd = m_hat / (np.sqrt(den) + eps)
            else:  # adagrad: V = V + G·G; G / (√V + ε)
                new_v[k] = v_old + g * g
                upd = g / (np.sqrt(new_v[k]) + eps)
            new_params[k] = np.asarray(w) - upd * lr
    return new_params, new_v


# ------------------------------------------------------------------------------------------ server
class FedDA(FedAdaptStrategy):
    """FedDA strategy (Jin et al., ICML 2022); the server half of Algorithms 1–2.

    Server state (the model's dtype, trainable keys): ``"m_t"`` (global momentum ``m``, broadcast as record
    ``"momentum"`` in the model dtype) and ``"v_t"`` (second moment ``V``; empty for ``sgdm``).  The round
    config carries ``"full-batch"`` (A8).  See the module docstring for the update rules, flags and conventions.
    """

    method: ClassVar[str] = "fedda"
    hparams_class = FedDAHParams
    hparams: FedDAHParams
    local_optimizer = FedDAOptimizer
    default_weighting: ClassVar[str] = "examples"

    def __init__(self, hparams: FedDAHParams | None = None, **kwargs: Any) -> None:
        super().__init__(hparams, **kwargs)
        fixed = self.hparam_defaults.get("variant")  # FedDASGDM, FedDAAdam, FedDAAdagrad fix the server optimizer
        if fixed is not None and self.hparams.variant != fixed:
            raise ConfigError(
                f"{type(self).__name__} is FedDA with variant {fixed!r}, but its hparams say {self.hparams.variant!r}; "
                f"build them with {type(self).__name__}.make_hparams(...) or use FedDA"
            )

    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        return (RecordSpec(MOMENTUM_SUM, "mean", "params"), RecordSpec(MOMENTUM, "mean", "params"))

    def init_server_state(self, arrays: NamedArrays) -> ServerState:
        keys = self.trainable(arrays)
        v0 = self.hparams.initial_v
        return {
            "m_t": state_like(arrays, keys),
            "v_t": {} if self.hparams.variant == "sgdm" else state_like(arrays, keys, v0),
        }

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        return {MOMENTUM: (self.server_state or {})["m_t"]}

    def client_config(self, server_round: int) -> dict[str, Any]:
        return {R.FULL_BATCH: self.full_batch(server_round)}

    def full_batch(self, server_round: int) -> bool:
        """Whether ``server_round`` is in the full-batch stabilization phase (A8) of this run."""
        return self.hparams.full_batch(server_round, self.num_rounds)

    def server_update(
        self, inputs: RoundInputs, state: ServerState
    ) -> tuple[NamedArrays, ServerState, dict[str, float]]:
        hp = self.hparams
        new_params, new_v = fedda_server_step(
            hp.variant,
            {k: inputs.current[k] for k in inputs.trainable},
            inputs.aggregates[MOMENTUM_SUM],
            state["m_t"],
            state["v_t"],
            client_lr=self.client_lr_at(inputs.server_round),
            server_lr=hp.alpha,
            beta1=hp.beta1,
            beta2=hp.beta2,
            eps=hp.eps,
            eta_in_server=hp.eta_in_server,
            bias_step=hp.bias_step(inputs.num_updates, inputs.server_round),
            v_hat=hp.v_hat,
        )
        m_next = {k: inputs.aggregates[MOMENTUM][k] for k in inputs.trainable}  # m_{r+1}: the round's aggregate
        return self.merge_buffers(new_params, inputs.current, None), {"m_t": m_next, "v_t": new_v}, {}


class FedDASGDM(FedDA):
    """FedDA+SGDM (Algorithm 1): ``W ← W − η·α·P̄``."""

    method: ClassVar[str] = "fedda-sgdm"
    hparam_defaults = {"variant": "sgdm", "server_lr": TABLE12_SERVER_LR["sgdm"]}


class FedDAAdam(FedDA):
    """FedDA+Adam (Algorithm 2, Adam branch)."""

    method: ClassVar[str] = "fedda-adam"
    hparam_defaults = {"variant": "adam", "server_lr": TABLE12_SERVER_LR["adam"]}


class FedDAAdagrad(FedDA):
    """FedDA+AdaGrad (Algorithm 2, AdaGrad branch)."""

    method: ClassVar[str] = "fedda-adagrad"
    hparam_defaults = {"variant": "adagrad", "server_lr": TABLE12_SERVER_LR["adagrad"]}
