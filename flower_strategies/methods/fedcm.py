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

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from ..core import records as R
from ..core.hparams import HParams, client_lr_decay_param, param
from ..core.local import LocalOptimizer
from ..core.ops import NamedArrays, averaging_step, state_like
from ..core.registry import register
from ..core.strategy import FedAdaptStrategy, RoundInputs, ServerState

#: Downlink record (and server state) of the broadcast global update Δ_t.
GLOBAL_UPDATE = "global-update"


@dataclass(frozen=True)
class FedCMHParams(HParams):
    """FedCM (client-level momentum), defaults as in paper 002's setup."""

    amend_weight: float = param(
        0.1, lo=0.0, hi=1.0, client=True, help="α: weight of the local gradient in d = α·g + (1−α)·Δ_t (1 = FedAvg)",
    )
    weight_decay: float = param(
        1e-3, lo=0.0, client=True, help="coupled L2 weight decay λ added to g (paper 002: 1e-3)",
    )
    server_lr: float = param(1.0, lo=0.0, help="server learning rate η_g (1 = model averaging)")
    client_lr_decay: float = client_lr_decay_param(0.998, "paper 002: 0.998")


class FedCMOptimizer(LocalOptimizer):
    """Client of FedCM: ``x ← x − η_l·(α·(g + λx) + (1−α)·Δ_t)`` with ``Δ_t`` from the downlink."""

    hparams_class = FedCMHParams

    def downlink_records(self) -> tuple[str, ...]:
        return (GLOBAL_UPDATE,) if any(g["amend_weight"] < 1.0 for g in self.param_groups) else ()

    def init_state(self, name: str, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        if group["amend_weight"] < 1.0:  # α = 1: Δ_t has weight 0 and is not sent
            state["global_update"] = self.received(GLOBAL_UPDATE, name, p)
            if state["global_update"] is None:
                raise ValueError(
                    f"FedCMOptimizer: downlink record '{GLOBAL_UPDATE}' has no entry for parameter '{name}'"
                )

    def update_param(self, name: str, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        a, lam = group["amend_weight"], group["weight_decay"]
        g = grad.add(p, alpha=lam) if lam else grad                 # g + λx
        d = g.mul(a)                                                # d = α·g + (1−α)·Δ_t
        if a < 1.0:
            d.add_(state["global_update"], alpha=1.0 - a)
        p.add_(d, alpha=-group["lr"])                               # x ← x − η_l·d


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


register(
    FedCM,
    paper="Xu et al., FedCM: Federated Learning with Client-level Momentum, 2021 (baseline of paper 002)",
    summary="local SGD on α·g + (1−α)·Δ_t (broadcast global update) + model averaging",
)
