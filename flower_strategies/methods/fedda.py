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

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..core import records as R
from ..core.hparams import ConfigError, HParams, param
from ..core.local import LocalOptimizer
from ..core.ops import NamedArrays, dtype_of, state_like
from ..core.registry import register
from ..core.strategy import FedAdaptStrategy, RecordSpec, RoundInputs, ServerState

#: Record names (downlink: MOMENTUM; uplink: MOMENTUM_SUM and MOMENTUM).
MOMENTUM = "momentum"
MOMENTUM_SUM = "momentum-sum"

VARIANTS = ("sgdm", "adam", "adagrad")
BIAS_CORRECTIONS = ("updates", "round", "none")
V_HATS = ("new", "stale")
#: Table 12 server learning rates α on EMNIST (used by ``fedda`` when ``server-lr`` is empty).
TABLE12_SERVER_LR = {"sgdm": 1.0, "adam": 0.1, "adagrad": 0.1}


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


# ------------------------------------------------------------------------------------------ hyper-parameters
@dataclass(frozen=True)
class FedDAClientHParams(HParams):
    """The client half of FedDA's declaration (:class:`FedDAOptimizer`'s hyper-parameters besides ``lr``)."""

    beta1: float = param(0.9, lo=0.0, hi=0.999, client=True, help="momentum β1 (Table 12: 0.9)")
    prox_mu: float = param(0.0, lo=0.0, client=True, help="FedDA+Prox μ (local step and momentum); 0 = off")
    eta_in_momentum: bool = param(False, client=True, help="A1: momentum fed with η·g (Eq. 25) vs g (Algorithm 1)")


@dataclass(frozen=True)
class FedDAHParams(FedDAClientHParams):
    """FedDA (Algorithms 1–2); the server optimizer is the ``variant`` field.  Defaults: Table 12, EMNIST."""

    variant: str = param(
        "sgdm", choices=VARIANTS, help="server optimizer: sgdm (Algorithm 1) | adam | adagrad (Algorithm 2)",
    )
    server_lr: float | None = param(
        None, lo=0.0, lo_open=True,
        help="server learning rate α; empty = the variant's Table 12 EMNIST value (sgdm 1, adam/adagrad 0.1)",
    )
    beta2: float = param(0.99, lo=0.0, hi=1.0, help="second-moment decay β2 (Table 12: 0.99; adam only)")
    eps: float = param(0.1, lo=0.0, help="fuzz factor ε outside the square root (Table 12 EMNIST: 0.1; adam, adagrad)")
    initial_v: float = param(0.0, lo=0.0, help="V_0 (A10: 0; adam, adagrad)")
    bias_correction: str = param(
        "updates", choices=BIAS_CORRECTIONS, help="A3 (adam): s = server updates | round | none",
    )
    v_hat: str = param("new", choices=V_HATS, help="A4 (adam): V̂ from V_{r+1} (Algorithm 2) or stale V_r (Eq. 35)")
    full_batch_last: float = param(
        0.05, lo=0.0, hi=1.0, help="A8: fraction of the final rounds with one full-batch step",
    )
    full_batch_from: int | None = param(
        None, lo=1, help="A8: first full-batch round; overrides full-batch-last (empty = unset)",
    )
    eta_in_server: bool = param(True, help="A1: server step η·α (Algorithm 1) vs α only")

    @property
    def alpha(self) -> float:
        """The server learning rate α in effect (``server_lr``, or the variant's Table 12 value)."""
        return TABLE12_SERVER_LR[self.variant] if self.server_lr is None else self.server_lr

    def full_batch(self, server_round: int, num_rounds: int | None) -> bool:
        """Whether ``server_round`` is in the full-batch stabilization phase (A8) of a ``num_rounds`` run."""
        if self.full_batch_from is not None:
            return server_round >= self.full_batch_from
        if self.full_batch_last == 0:
            return False
        if num_rounds is None:
            raise ConfigError(
                "FedDA's full-batch-last needs the run's number of rounds: pass num_rounds= to the strategy "
                "(Strategy.start sets it), or set full-batch-from, or full-batch-last = 0"
            )
        return server_round > num_rounds - math.ceil(self.full_batch_last * num_rounds - 1e-9)

    def bias_step(self, num_updates: int, server_round: int) -> int | None:
        """Adam's bias-correction exponent ``s`` (A3) for the update after ``num_updates`` updates; None = off."""
        if self.bias_correction == "none":
            return None
        return num_updates + 1 if self.bias_correction == "updates" else server_round


# ------------------------------------------------------------------------------------------ client
class FedDAOptimizer(LocalOptimizer):
    """FedDA's client: plain SGD on the model + the global-momentum track ``m`` and its running sum ``P``.

    Parameters
    ----------
    params, lr, downlink, hparams
        As :class:`~flower_strategies.core.local.LocalOptimizer`; ``downlink`` must hold ``"momentum"``
        (``m_r``, one tensor per parameter).
    beta1, prox_mu, eta_in_momentum
        The client fields of :class:`FedDAClientHParams` (β1, μ, A1).

    Per step, for each parameter (state ``round_start`` = ``W_r``, ``momentum`` = ``m``, ``momentum_sum`` = ``P``)::

        g ← grad + μ·(W − W_r)         (grad = 0 for a parameter without one)
        W ← W − η·g
        m ← β1·m + (1−β1)·g            (η·g with eta_in_momentum)
        P ← P + m

    :meth:`uplink` returns ``{"momentum-sum": P, "momentum": m}``; the reply carries no model.
    """

    hparams_class = FedDAClientHParams
    sends_model: ClassVar[bool] = False

    def downlink_records(self) -> tuple[str, ...]:
        return (MOMENTUM,)

    def init_state(self, name: str, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        m_r = self.received(MOMENTUM, name, p)
        if m_r is None:
            raise ValueError(f"{type(self).__name__}: the downlink record '{MOMENTUM}' has no tensor '{name}'")
        state["momentum"] = m_r
        state["momentum_sum"] = torch.zeros_like(p)

    def apply_step(self) -> None:
        for name, p, group in self.named_params():  # every parameter: the momentum track runs with g = 0 too
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            self.update_param(name, p, grad, self.param_state(name, p, group), group)

    def update_param(self, name: str, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        g = grad
        if group["prox_mu"]:
            g = g.add(p - state["round_start"], alpha=group["prox_mu"])
        p.add_(g, alpha=-group["lr"])
        feed = g.mul(group["lr"]) if group["eta_in_momentum"] else g
        state["momentum"].mul_(group["beta1"]).add_(feed, alpha=1.0 - group["beta1"])
        state["momentum_sum"].add_(state["momentum"])

    def uplink_arrays(self) -> dict[str, dict[str, Tensor]]:
        states = [(name, self.state[p]) for name, p, _ in self.named_params()]
        return {
            MOMENTUM_SUM: {name: st["momentum_sum"] for name, st in states},
            MOMENTUM: {name: st["momentum"] for name, st in states},
        }


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


_PAPER = "Jin et al., Accelerated Federated Learning with Decoupled Adaptive Optimization, ICML 2022"
register(FedDA, paper=_PAPER, summary="local SGD + decoupled global momentum; server SGDM/Adam/AdaGrad (fedda.variant)")
register(FedDASGDM, paper=_PAPER, summary="FedDA with server SGDM (Algorithm 1)")
register(FedDAAdam, paper=_PAPER, summary="FedDA with server Adam on the recovered gradient (Algorithm 2)")
register(FedDAAdagrad, paper=_PAPER, summary="FedDA with server AdaGrad on the recovered gradient (Algorithm 2)")
