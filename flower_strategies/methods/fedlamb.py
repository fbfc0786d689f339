"""Fed-LAMB and Fed-AMS: layer-wise and dimension-wise local AMSGrad (paper 004), plus Adp-Fed.

Paper: *FED-LAMB: Layer-wise and Dimension-wise Locally Adaptive Optimization* (Belhal Karimi, Xiaoyun Li,
Ping Li; Baidu Research, 2021), seed file ``004_0cb0825507252aef.txt`` — Algorithm 1, §3.2 and
appendix A (Adp-Fed).  Fed-AMS is local AMSGrad with moment averaging (Chen et al.,
*Toward Communication Efficient Adaptive Gradient Method*, 2020) as used in 004 = Fed-LAMB without the trust
ratio (``trust_ratio=False``); Adp-Fed is FedAdam (Reddi et al., ICLR 2021) as written in 004's appendix A.1.

Client round (all operations per coordinate, ``t = 1..T`` local steps, round ``r``)::

    θ ← θ̄ ;  m ← m_i (persisted, else 0) ;  v ← v̂ ;  v_max ← v̂            # v̂, s_v = server records
    g      = ∇f_i(θ; batch_t)                     # at the current iterate (A1; flag gradient_point)
    m      = β1·m + (1−β1)·g ;   v = β2·v + (1−β2)·g²                       # raw EMAs are the state (A3)
    m̂      = m / (1−β1^{s_m}) ;  v_c = v / (1−β2^{s_v+t})                  # bias correction (A4)
    v_max  = max(v_max, v_c)                                                # local AMSGrad max (A2)
    p      = m̂ / (√v_max + ε)                                               # ε outside the sqrt (A9)
    for each layer ℓ:   u = p_ℓ + λ·θ_ℓ
        Fed-LAMB:  θ_ℓ ← θ_ℓ − α_r · φ(‖θ_ℓ‖)/‖u‖ · u      (ratio 1 if ‖θ_ℓ‖ = 0 or ‖u‖ = 0, A6)
        Fed-AMS:   θ_ℓ ← θ_ℓ − α_r · u                     (trust_ratio = False)
    upload θ_i^T (record "arrays") and v_i = v (record "v", raw EMA) ; persist m_i and s_m

Server::

    θ̄ ← mean_i θ_i^T ;   v̂ ← max(v̂, mean_i v_i) ;   s_v ← s_v + K̄      (uniform mean by default)

The optimizer's kernel is written as the chain of optax's ``lamb`` (``scale_by_adam → add_decayed_weights →
scale_by_trust_ratio → scale_by_learning_rate``) with AMSGrad in place of Adam:
:meth:`FedLAMBOptimizer.amsgrad_direction` (p), ``+ λθ`` (u), :func:`trust_ratio`, ``θ ← θ − α_r·ratio·u``.

Symbol ↔ variable map
---------------------
``θ`` parameter ``p`` (or ``state["iterate"]`` under ``gradient_point="round_start"``); ``m`` ``state["exp_avg"]``;
``v`` ``state["exp_avg_sq"]``; ``v_max`` ``state["max_exp_avg_sq"]``; ``v̂`` server state ``"v_hat"`` / downlink
record ``"v_hat"``; ``s_v`` server state ``"v_steps"`` / downlink record ``"v_steps"`` (key ``"s_v"``);
``v_i`` uplink record ``"v"``; ``α_r`` ``client-lr`` (``client_lr_at``, optional ``lr_milestones``);
``β1, β2, ε, λ`` ``beta1, beta2, eps, weight_decay``; ``φ`` identity clipped to ``[phi_min, phi_max]``;
``s_m`` ``m_steps0 + t`` (``m_steps0`` from the persisted ``fedlamb_m_steps``); ``t`` ``steps_taken + 1``;
K̄ ``RoundInputs.mean_steps``.

Conventions and deviations (each is a field of :class:`FedLAMBHParams`; defaults = our reading of the paper)
---------------------------------------------------------------------------------------------------
* ``trust_ratio``: True (Fed-LAMB) | False (Fed-AMS; registry name ``fedams``, class :class:`FedAMS`).
* ``gradient_point`` (A1): ``current`` (default) | ``round_start`` (line 8 literally: every step uses the
  gradient of its own mini-batch at θ^0; the iterate is kept in ``state["iterate"]`` and written into the model
  by :meth:`~flower_strategies.core.local.LocalOptimizer.uplink`, which therefore ends the round).
* ``vhat_mode`` (A2): ``local_max`` (default) | ``server_fixed`` (denominator = the received v̂, unchanged during the
  round) | ``none`` (plain Adam denominator v_c).
* ``bias_correction`` (A4): ``global`` (default; ``s_v`` = local steps since v̂ was zero, sent by the server;
  ``s_m`` per ``m_step_count``) | ``as_written`` (local ``t`` for both, and the *corrected* v is uploaded) | ``none``.
  ``m_step_count``: ``client`` (default; steps this client's m has accumulated, persisted) | ``global`` (``s_v + t``).
* ``eps_placement`` (:func:`~flower_strategies.core.local.inverse_sqrt`): ``outside`` (default, paper) ``√v+ε`` |
  ``inside`` ``√(v+ε)`` | ``none`` ``√v``.
* ``stateless`` (A7): False (default; m carried across this client's participations via ``Context.state``,
  zeros for a client sampled for the first time) | True (m = 0 every round).
* Zero-norm layers (A6): trust ratio 1 (the published code skips such layers; we do not).
* ``layers``: each parameter tensor (``tensor``, default) or each module (``module``: the tensors of one param group
  sharing a module-name prefix, e.g. ``fc1.weight`` + ``fc1.bias``, share one ratio computed from the joint norms).
* ``phi_min``/``phi_max``: φ's clipping bounds (``phi_max`` empty/None = no upper bound).
* Server (A5, A8): one v̂ updated at the end of round r and broadcast in round r+1; one shared initial model; the
  mean runs over the participants only.  ``s_v`` grows by K̄, the mean of the participants' reported ``num-steps``
  with the strategy's weighting (= T when ``local-steps`` is fixed).
* A v̂ entry missing for a parameter (not a trainable key of the server) starts at 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from ..core import records as R
from ..core.ops import NamedArrays, state_like, writable_like
from ..core.strategy import FedAdaptStrategy, RoundInputs, ServerState
from ..core.validation import RecordSpec
from .baselines import FedOpt
from ..optimizers.fedlamb import (
    FEDLAMB_BIAS_CORRECTIONS, FedLAMBHParams, FedLAMBOptimizer, GRADIENT_POINTS, LAYER_GROUPINGS, M_STEP_COUNTS,
    STATE_M, STATE_M_STEPS, VHAT_MODES, V_HAT, V_LOCAL, V_STEPS, bias_factors, layer_groups, parse_milestones,
    trust_ratio,
)

#: This module's names and its client half's (:mod:`flower_strategies.optimizers.fedlamb`, re-exported).
__all__ = [
    "AdpFed", "FEDLAMB_BIAS_CORRECTIONS", "FedAMS", "FedLAMB", "FedLAMBHParams", "FedLAMBOptimizer",
    "GRADIENT_POINTS", "LAYER_GROUPINGS", "M_STEP_COUNTS", "STATE_M", "STATE_M_STEPS", "VHAT_MODES", "V_HAT",
    "V_LOCAL", "V_STEPS", "bias_factors", "layer_groups", "merge_vhat", "parse_milestones", "trust_ratio",
]


def merge_vhat(v_hat: NamedArrays, mean_v: Mapping[str, np.ndarray]) -> NamedArrays:
    """Server line 16: ``v̂ ← max(v̂, mean_i v_i)`` elementwise, in v̂'s dtype (the model's), into ``mean_v``'s
    buffers when they are the round's own (writable, same dtype)."""
    return {k: np.maximum(v, mean_v[k], out=mean_v[k] if writable_like(mean_v[k], v) else None)
            for k, v in v_hat.items()}


# ------------------------------------------------------------------------------------------ server
class FedLAMB(FedAdaptStrategy):
    """Fed-LAMB / Fed-AMS server (Algorithm 1 line 16).

    Update (over the participants' replies, uniform mean by default)::

        θ̄ ← mean_i θ_i^T          (record "arrays")
        v̂ ← max(v̂, mean_i v_i)    (record "v", trainable keys; v̂₀ = 0; sent down as "v_hat")
        s_v ← s_v + K̄              (sent down as "v_steps", for the clients' global bias correction)
    """

    method: ClassVar[str] = "fedlamb"
    hparams_class = FedLAMBHParams
    hparams: FedLAMBHParams
    local_optimizer = FedLAMBOptimizer
    default_weighting: ClassVar[str] = "uniform"

    def __init__(self, hparams: FedLAMBHParams | None = None, **kwargs: Any) -> None:
        super().__init__(hparams, **kwargs)
        self.milestones = self.hparams.milestones()

    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        return (RecordSpec(R.MODEL, "mean", "model"), RecordSpec(V_LOCAL, "mean", "params", floor=0.0))  # v >= 0

    def client_lr_at(self, server_round: int) -> float:
        return self.settings.client_lr * self.hparams.lr_gamma ** sum(server_round > m for m in self.milestones)

    def init_server_state(self, arrays: NamedArrays) -> ServerState:
        return {"v_hat": state_like(arrays, self.trainable(arrays)), "v_steps": 0.0}

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        state = self.server_state or {}
        return {V_HAT: state["v_hat"], V_STEPS: {"s_v": np.array([state["v_steps"]], dtype=np.float64)}}

    def server_update(
        self, inputs: RoundInputs, state: ServerState
    ) -> tuple[NamedArrays, ServerState, dict[str, float]]:
        mean = inputs.aggregates[R.MODEL]
        new_state = {
            "v_hat": merge_vhat(state["v_hat"], inputs.aggregates[V_LOCAL]),
            "v_steps": state["v_steps"] + inputs.mean_steps,
        }
        return self.merge_buffers({k: mean[k] for k in inputs.trainable}, inputs.current, mean), new_state, {}


class FedAMS(FedLAMB):
    """Fed-AMS (Chen et al. 2020, paper 004's baseline) = Fed-LAMB without the trust ratio: ``θ ← θ − α_r·(p + λθ)``."""

    method: ClassVar[str] = "fedams"
    hparam_defaults = {"trust_ratio": False}


class AdpFed(FedOpt):
    """Adp-Fed (paper 004, appendix A.1, Algorithm 2) = FedAdam with m₀ = v₀ = 0, β2 = 0.999, ε = 1e-8 [inferred],
    no bias correction and uniform averaging.

    The appendix writes the ascent sign ``Δ = θ^T − θ^0`` and ``θ ← θ + η_g·m/(√v+ε)``; we use the
    descent-positive ``D̄ = θ − mean θ_i`` and ``θ ← θ − η_g·m/(√v+ε)`` — the same update.
    """

    method: ClassVar[str] = "adpfed"
    hparam_defaults = {"server_opt": "adam", "server_lr": 0.01, "beta2": 0.999, "tau": 1e-8, "initial_v": 0.0}
    default_weighting: ClassVar[str] = "uniform"
