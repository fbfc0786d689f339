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

from typing import ClassVar

import numpy as np

from ..core import records as R
from ..core.ops import NamedArrays, averaging_step, state_like, writable_like
from ..core.strategy import FedAdaptStrategy, RecordSpec, RoundInputs, ServerState
from ..optimizers.fedlada import (
    DELTA_PER_STEP, FedLADAHParams, FedLADAOptimizer, GLOBAL_OFFSET, LOCAL_UPDATES, OFFSET_LRS, OFFSET_STEPS,
    SECOND_MOMENTS, VHAT, V_INITS,
)

#: This module's names and its client half's (:mod:`flower_strategies.optimizers.fedlada`, re-exported).
__all__ = [
    "DELTA_PER_STEP", "FedLADA", "FedLADAHParams", "FedLADAOptimizer", "GLOBAL_OFFSET", "LOCAL_UPDATES",
    "OFFSET_LRS", "OFFSET_STEPS", "SECOND_MOMENTS", "VHAT", "V_INITS",
]


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
            offset = {k: np.divide(per_step[k], lr, out=per_step[k] if writable_like(per_step[k], current[k]) else None)
                      for k in inputs.trainable}
        else:
            # lines 17–18: x_{t+1} = x_t − η_g·Δ̄, g_a = Δ̄/(η_l·K̄), both in new arrays (ops.averaging_step)
            new, offset = averaging_step(current, mean, inputs.trainable, self.hparams.server_lr, state[GLOBAL_OFFSET],
                                         lr, inputs.mean_steps)
        vhat = inputs.aggregates[VHAT]  # line 16: v_srv = the round's aggregate itself
        new_state = {VHAT: {k: vhat[k] for k in inputs.trainable}, GLOBAL_OFFSET: offset}
        return self.merge_buffers(new, current, mean), new_state, {}
