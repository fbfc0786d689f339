"""FedDA: momentum-decoupled adaptive federated optimization (+SGDM / +Adam / +AdaGrad).

Paper: Jiayin Jin, Jiaxiang Ren, Yang Zhou, Lingjuan Lyu, Ji Liu, Dejing Dou, *Accelerated Federated Learning
with Decoupled Adaptive Optimization*, ICML 2022 (seed file ``001_7e69cb14711dc6c0.txt``; §4, Algorithms 1–2 in
appendix A.2, Table 12).  Spec: ALGORITHMS.md §2.

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

Symbol ↔ variable: ``W`` model, ``m`` ``momentum`` (server ``self.m_t``), ``P`` ``momentum-sum``, ``V``
``self.v_t``, ``η`` ``client-lr``, ``α`` ``server-lr``, ``β1`` ``beta1``, ``β2`` ``beta2``, ``ε`` ``eps``, ``μ``
``prox-mu``, ``T`` ``local-steps``.

Conventions and deviations (each ALGORITHMS.md §2.6 ambiguity is a flag; default = the spec's reading)
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
  ``ceil(0.05·R)`` rounds) or ``full-batch-from`` (first full-batch round, overrides); in that phase the round
  config carries ``"full-batch": True`` and each client takes exactly one full-batch step.
* A9 FedDA+Prox: ``prox-mu`` μ, the same prox-augmented gradient in the local step and the momentum.
* A10 ``m_0 = 0``, ``V_0 = initial-v`` (default 0).
* A12 ``G`` is used as written (no rescaling for ``T > 1``).
* Only trainable floating-point arrays are updated; other arrays keep the server's value (our models have
  no buffers).

Registry: ``fedda`` (variant chosen by ``fedda.variant``) and the fixed-variant ``fedda-sgdm``,
``fedda-adam``, ``fedda-adagrad``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..core.hparams import HParams, param
from ..core.local import LocalOptimizer, Named
from ..core.ops import NamedArrays
from ..core.registry import register
from ..core.strategy import FedAdaptStrategy, RecordSpec

#: Record names (downlink: MOMENTUM; uplink: MOMENTUM_SUM and MOMENTUM).
MOMENTUM = "momentum"
MOMENTUM_SUM = "momentum-sum"

#: Round-config keys read by :class:`FedDAOptimizer`.
CFG_BETA1 = "fedda-beta1"
CFG_ETA_IN_MOMENTUM = "fedda-eta-in-momentum"
CFG_PROX_MU = "prox-mu"
CFG_FULL_BATCH = "full-batch"

VARIANTS = ("sgdm", "adam", "adagrad")
BIAS_CORRECTIONS = ("updates", "round", "none")
V_HATS = ("new", "stale")
#: Table 12 server learning rates α on EMNIST (used by ``fedda`` when ``server-lr = 0``).
TABLE12_SERVER_LR = {"sgdm": 1.0, "adam": 0.1, "adagrad": 0.1}


# ------------------------------------------------------------------------------------------ pure server math
def recover_gradient(p_bar: np.ndarray, m_prev: np.ndarray, beta1: float) -> np.ndarray:
    """``G = (P̄ − β1·m_r)/(1−β1)`` (Algorithm 2, line 11): treat ``P̄`` as one momentum step fed with ``G``."""
    return (np.asarray(p_bar, np.float64) - beta1 * np.asarray(m_prev, np.float64)) / (1.0 - beta1)


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
    """One FedDA server update (Algorithms 1–2); returns ``(new_params, new_V)``.

    ``params`` – ``W_r``; ``p_bar`` – aggregated ``P``; ``m_prev`` – the momentum ``m_r`` broadcast this round;
    ``v`` – ``V_r`` (ignored by SGDM); ``bias_step`` – Adam's bias-correction exponent ``s`` (``None`` = no
    correction).  The step size is ``server_lr·client_lr`` if ``eta_in_server`` else ``server_lr``.
    Inputs are not modified; state is float64, parameters keep their dtype.
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
    for k, w in params.items():
        w64 = np.asarray(w, np.float64)
        p = np.asarray(p_bar[k], np.float64)
        if variant == "sgdm":
            upd = p
        else:
            m = np.asarray(m_prev[k], np.float64)
            g = recover_gradient(p, m, beta1)
            v_old = np.asarray(v[k], np.float64)
            if variant == "adam":
                m_hat = (beta1 * m + (1.0 - beta1) * g) / c1
                v_new = beta2 * v_old + (1.0 - beta2) * g * g
                v_hat_k = (v_new if v_hat == "new" else v_old) / c2
                upd = m_hat / (np.sqrt(v_hat_k) + eps)
            else:  # adagrad
                v_new = v_old + g * g
                upd = g / (np.sqrt(v_new) + eps)
            new_v[k] = v_new
        new_params[k] = (w64 - lr * upd).astype(np.asarray(w).dtype, copy=False)
    return new_params, new_v


# ------------------------------------------------------------------------------------------ hyper-parameters
@dataclass(frozen=True)
class FedDASGDMHParams(HParams):
    """FedDA+SGDM (Algorithm 1); defaults: Table 12, EMNIST."""

    server_lr: float = param(1.0, lo=0.0, lo_open=True, help="server learning rate α (Table 12 EMNIST: 1)")
    beta1: float = param(0.9, lo=0.0, hi=0.999, help="momentum β1 (Table 12: 0.9)")
    prox_mu: float = param(0.0, lo=0.0, help="FedDA+Prox μ (local step and momentum); 0 = off")
    full_batch_last: float = param(0.05, lo=0.0, hi=1.0, help="fraction of final rounds with one full-batch step (A8)")
    full_batch_from: int = param(0, lo=0, help="first full-batch round; > 0 overrides full-batch-last")
    eta_in_server: bool = param(True, help="A1: server step η·α (Algorithm 1) vs α only")
    eta_in_momentum: bool = param(False, help="A1: momentum fed with η·g (Eq. 25) vs g (Algorithm 1)")


@dataclass(frozen=True)
class FedDAAdaptiveHParams(FedDASGDMHParams):
    """Fields shared by FedDA+Adam / FedDA+AdaGrad (Algorithm 2)."""

    server_lr: float = param(0.1, lo=0.0, lo_open=True, help="server learning rate α (Table 12 EMNIST: 0.1)")
    beta2: float = param(0.99, lo=0.0, hi=1.0, help="second-moment decay β2 (Table 12: 0.99; Adam only)")
    eps: float = param(0.1, lo=0.0, help="fuzz factor ε outside the square root (Table 12 EMNIST: 0.1)")
    initial_v: float = param(0.0, lo=0.0, help="V_0 (A10: 0)")
    bias_correction: str = param("updates", choices=BIAS_CORRECTIONS, help="A3 (Adam): s = server updates | round | none")
    v_hat: str = param("new", choices=V_HATS, help="A4 (Adam): V̂ from V_{r+1} (Algorithm 2) or stale V_r (Eq. 35)")


@dataclass(frozen=True)
class FedDAAdamHParams(FedDAAdaptiveHParams):
    pass


@dataclass(frozen=True)
class FedDAAdagradHParams(FedDAAdaptiveHParams):
    pass


@dataclass(frozen=True)
class FedDAHParams(FedDAAdaptiveHParams):
    """``fedda``: the variant is a hyper-parameter; ``server-lr = 0`` takes the variant's Table 12 value."""

    variant: str = param("sgdm", choices=VARIANTS, help="server optimizer: sgdm | adam | adagrad")
    server_lr: float = param(0.0, lo=0.0, help="server learning rate α; 0 = Table 12 EMNIST value of the variant (1 / 0.1 / 0.1)")


# ------------------------------------------------------------------------------------------ client
class FedDAOptimizer(LocalOptimizer):
    """FedDA's client: plain SGD on the model + the global-momentum track ``m`` and its running sum ``P``.

    ``begin_round`` reads the broadcast momentum (record ``"momentum"``; zeros when absent); ``end_round``
    uploads ``{"momentum-sum": P, "momentum": m}``.  A parameter without a gradient counts as ``g = 0``.
    """

    config_keys: ClassVar[dict[str, str]] = {
        "client-lr": "lr", CFG_BETA1: "beta1", CFG_PROX_MU: "mu", CFG_ETA_IN_MOMENTUM: "eta_in_momentum",
    }
    sends_model: ClassVar[bool] = False

    def __init__(
        self,
        params: Iterable[tuple[str, Tensor]],
        lr: float = 0.1,
        beta1: float = 0.9,
        mu: float = 0.0,
        eta_in_momentum: bool = False,
    ) -> None:
        if lr < 0 or mu < 0 or not 0.0 <= beta1 < 1.0:
            raise ValueError(f"need lr >= 0, mu >= 0, 0 <= beta1 < 1 (got {lr}, {mu}, {beta1})")
        super().__init__(params, {"lr": lr, "beta1": beta1, "mu": mu, "eta_in_momentum": bool(eta_in_momentum)})
        self.momentum: Named = {}
        self.momentum_sum: Named = {}

    def begin_round(self, downlink=None, persistent=None) -> None:  # type: ignore[override]
        super().begin_round(downlink, persistent)
        down = (downlink or {}).get(MOMENTUM, {})
        for name, p, _ in self.named_params():
            m = down.get(name)
            self.momentum[name] = (
                m.detach().to(dtype=p.dtype, device=p.device).clone() if m is not None else torch.zeros_like(p)
            )
            self.momentum_sum[name] = torch.zeros_like(p)

    @torch.no_grad()
    def apply_step(self) -> None:
        for name, p, group in self.named_params():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if group["mu"]:
                g = g.add(p - self.round_start[name], alpha=group["mu"])
            p.add_(g, alpha=-group["lr"])
            feed = g.mul(group["lr"]) if group["eta_in_momentum"] else g
            m = self.momentum[name]
            m.mul_(group["beta1"]).add_(feed, alpha=1.0 - group["beta1"])
            self.momentum_sum[name].add_(m)

    def end_round(self) -> dict[str, Named]:
        return {MOMENTUM_SUM: dict(self.momentum_sum), MOMENTUM: dict(self.momentum)}


# ------------------------------------------------------------------------------------------ server
class FedDA(FedAdaptStrategy):
    """FedDA strategy (Jin et al., ICML 2022); the server half of Algorithms 1–2.

    State: ``m_t`` (global momentum, broadcast as ``"momentum"``), ``v_t`` (second moment, Adam/AdaGrad),
    float64.  See the module docstring for the update rules, flags and conventions.
    """

    method: ClassVar[str] = "fedda"
    hparams_class = FedDAHParams
    default_weighting: ClassVar[str] = "examples"
    #: Fixed variant of the subclasses; "" = ``hparams.variant``.
    fixed_variant: ClassVar[str] = ""

    def __init__(self, hparams: HParams | None = None, **kwargs: Any) -> None:
        super().__init__(hparams, **kwargs)
        #: Total rounds (set by :meth:`start`; needed by ``full-batch-last``).
        self.num_rounds: int | None = None
        self.m_t: NamedArrays = {}
        self.v_t: NamedArrays = {}
        self._param_dtypes: dict[str, np.dtype] = {}

    # -------------------------------------------------------------- settings
    @property
    def variant(self) -> str:
        return self.fixed_variant or str(getattr(self.hparams, "variant", "sgdm"))

    @property
    def server_lr(self) -> float:
        lr = float(self.hparams.server_lr)
        return lr if lr > 0 else TABLE12_SERVER_LR[self.variant]

    def log_settings(self) -> list[str]:
        return [f"variant = {self.variant}", f"effective server_lr = {self.server_lr}", *super().log_settings()]

    def start(self, grid, initial_arrays, num_rounds: int = 3, *args: Any, **kwargs: Any):  # type: ignore[override]
        self.num_rounds = int(num_rounds)
        return super().start(grid, initial_arrays, num_rounds, *args, **kwargs)

    def full_batch(self, server_round: int) -> bool:
        """Whether ``server_round`` is in the full-batch stabilization phase (A8)."""
        hp = self.hparams
        if hp.full_batch_from > 0:
            return server_round >= hp.full_batch_from
        if hp.full_batch_last > 0 and self.num_rounds:
            last = math.ceil(hp.full_batch_last * self.num_rounds - 1e-9)
            return server_round > self.num_rounds - last
        return False

    # -------------------------------------------------------------- hooks
    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        return (RecordSpec(MOMENTUM_SUM, "mean", "params"), RecordSpec(MOMENTUM, "mean", "params"))

    def init_state(self, arrays: NamedArrays) -> None:
        keys = self.trainable(arrays)
        self._param_dtypes = {k: np.asarray(arrays[k]).dtype for k in keys}
        self.m_t = {k: np.zeros(np.shape(arrays[k]), np.float64) for k in keys}
        v0 = float(getattr(self.hparams, "initial_v", 0.0))
        self.v_t = {k: np.full(np.shape(arrays[k]), v0, np.float64) for k in keys} if self.variant != "sgdm" else {}

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        return {MOMENTUM: {k: m.astype(self._param_dtypes[k]) for k, m in self.m_t.items()}}

    def round_config(self, server_round: int) -> dict[str, Any]:
        cfg = super().round_config(server_round)
        hp = self.hparams
        cfg[CFG_BETA1] = float(hp.beta1)
        cfg[CFG_PROX_MU] = float(hp.prox_mu)
        cfg[CFG_ETA_IN_MOMENTUM] = bool(hp.eta_in_momentum)
        cfg[CFG_FULL_BATCH] = self.full_batch(server_round)
        return cfg

    def bias_step(self, server_round: int) -> int | None:
        mode = getattr(self.hparams, "bias_correction", "none")
        if mode == "none":
            return None
        return self.num_updates if mode == "updates" else server_round

    def server_update(self, server_round: int, current: NamedArrays, aggregates: Mapping[str, NamedArrays]) -> NamedArrays:
        hp = self.hparams
        keys = self.trainable(current)
        new_params, new_v = fedda_server_step(
            self.variant,
            {k: current[k] for k in keys},
            aggregates[MOMENTUM_SUM],
            self.m_t,
            self.v_t,
            client_lr=self.client_lr_at(server_round),
            server_lr=self.server_lr,
            beta1=hp.beta1,
            beta2=getattr(hp, "beta2", 0.99),
            eps=getattr(hp, "eps", 0.0),
            eta_in_server=hp.eta_in_server,
            bias_step=self.bias_step(server_round),
            v_hat=getattr(hp, "v_hat", "new"),
        )
        self.v_t = new_v
        self.m_t = {k: np.asarray(aggregates[MOMENTUM][k], np.float64).copy() for k in keys}
        return self.merge_buffers(new_params, current, None)


class FedDASGDM(FedDA):
    """FedDA+SGDM (Algorithm 1): ``W ← W − η·α·P̄``."""

    method: ClassVar[str] = "fedda-sgdm"
    hparams_class = FedDASGDMHParams
    fixed_variant: ClassVar[str] = "sgdm"


class FedDAAdam(FedDA):
    """FedDA+Adam (Algorithm 2, Adam branch)."""

    method: ClassVar[str] = "fedda-adam"
    hparams_class = FedDAAdamHParams
    fixed_variant: ClassVar[str] = "adam"


class FedDAAdagrad(FedDA):
    """FedDA+AdaGrad (Algorithm 2, AdaGrad branch)."""

    method: ClassVar[str] = "fedda-adagrad"
    hparams_class = FedDAAdagradHParams
    fixed_variant: ClassVar[str] = "adagrad"


_PAPER = "Jin et al., Accelerated Federated Learning with Decoupled Adaptive Optimization, ICML 2022"
register(FedDA, FedDAOptimizer, paper=_PAPER, summary="local SGD + decoupled global momentum; server SGDM/Adam/AdaGrad (fedda.variant)")
register(FedDASGDM, FedDAOptimizer, paper=_PAPER, summary="FedDA with server SGDM (Algorithm 1)")
register(FedDAAdam, FedDAOptimizer, paper=_PAPER, summary="FedDA with server Adam on the recovered gradient (Algorithm 2)")
register(FedDAAdagrad, FedDAOptimizer, paper=_PAPER, summary="FedDA with server AdaGrad on the recovered gradient (Algorithm 2)")
