"""FedCM — federated learning with client-level momentum (baseline of paper 002).

Xu, Wang, Wang, Wang, Wang, *FedCM: Federated Learning with Client-level Momentum*, 2021; used as the main
SGD baseline of Sun et al., *Efficient Federated Learning via Local Adaptive Amended Optimizer with Linear
Speedup* (FedLADA), 2023 (seed ``002_be4d0f1e88a9ebd5.txt``).

Round ``t`` (``Δ_i = x_t − x_{i,K}``, descent-positive)::

    client i:  x ← x_t;  K_i times:  d = α·(g + λ·x) + (1−α)·Δ_t ;  x ← x − η_l·d
    server:    Δ̄ = mean_i Δ_i ;  x_{t+1} = x_t − η_g·Δ̄ ;  Δ_{t+1} = Δ̄ / (η_l^{(t)}·K̄)

``Δ_0 = 0``; ``η_l^{(t)}`` is the client learning rate *used in round t* (the server decays it by
``client-lr-decay`` per round and undoes exactly that decay); ``K̄`` is the mean of the clients' local step
counts with the same weights as ``Δ̄`` (= K when all clients take K steps).

Symbols ↔ code: α ``amend_weight`` (client), λ ``weight_decay`` (client), η_g ``server_lr``, η_l
``client_lr_at(t)`` (the base applies ``client_lr_decay``), ``Δ_t`` server state / downlink record
``"global-update"`` (optimizer state ``global_update``), K̄ ``RoundInputs.mean_steps``.

Records: downlink ``"global-update"`` (Δ_t, trainable keys; only when α < 1) besides the model; uplink the
local model (``"arrays"``).  Communication per round: 2× FedAvg's download (1× when α = 1), 1× its upload.

Conventions and deviations
--------------------------
* Xu et al.'s server writes ``x_{t+1} = x_t − η_g·Δ_{t+1}`` (η_g multiplying the lr-normalised update); we
  follow paper 002 (``η_g = 1`` ⇒ model averaging), i.e. their ``η_g`` equals ours times
  ``η_l·K``.
* α = 1 is FedAvg with coupled weight decay: ``Δ_t`` has weight 0 and is not broadcast.
* Means are uniform by default (paper 002); ``weighting="examples"`` is the common flag.
"""

from __future__ import annotations

from typing import ClassVar

from ..core import records as R
from ..core.ops import NamedArrays, averaging_step, state_like
from ..core.strategy import FedAdaptStrategy, RoundInputs, ServerState
from ..optimizers.fedcm import (
    FedCMHParams, FedCMOptimizer, GLOBAL_UPDATE,
)

#: This module's names and its client half's (:mod:`flower_strategies.optimizers.fedcm`, re-exported).
__all__ = [
    "FedCM", "FedCMHParams", "FedCMOptimizer", "GLOBAL_UPDATE",
]


class FedCM(FedAdaptStrategy):
    """FedCM server: model averaging (server lr η_g) and broadcast of ``Δ_t = Δ̄/(η_l·K̄)``."""

    method: ClassVar[str] = "fedcm"
    hparams_class = FedCMHParams
    hparams: FedCMHParams
    local_optimizer = FedCMOptimizer
    default_weighting: ClassVar[str] = "uniform"

    def init_server_state(self, arrays: NamedArrays) -> ServerState:
        return {GLOBAL_UPDATE: state_like(arrays, self.trainable(arrays))}  # Δ_0 = 0

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        return {} if self.hparams.amend_weight == 1.0 else {GLOBAL_UPDATE: (self.server_state or {})[GLOBAL_UPDATE]}

    def server_update(
        self, inputs: RoundInputs, state: ServerState
    ) -> tuple[NamedArrays, ServerState, dict[str, float]]:
        current, mean = inputs.current, inputs.aggregates[R.MODEL]
        new, update = averaging_step(current, mean, inputs.trainable, self.hparams.server_lr,  # x_{t+1}, Δ_{t+1}
                                     state[GLOBAL_UPDATE], self.client_lr_at(inputs.server_round), inputs.mean_steps)
        return self.merge_buffers(new, current, mean), {GLOBAL_UPDATE: update}, {}
