"""SCAFFOLD, option II (baseline of papers 001 and 002).

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, *SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning*, ICML 2020; compared against in Sun et al. (FedLADA, seed ``002_be4d0f1e88a9ebd5.txt``).

Round ``t`` (server state ``x, c``; client state ``c_i``, 0 until the client is first sampled)::

    client i:  y ← x_t ;  K_i times:  y ← y − η_l·(g(y) + λ·y − c_i + c)
               c_i⁺ = c_i − c + (x_t − y)/(K_i·η_l)            (option II)
               upload y (model) and Δc_i = c_i⁺ − c_i ;  keep c_i ← c_i⁺
    server:    x ← x − η_g·mean_i(x_t − y_i)                  (= x + η_g·mean_i Δy_i)
               c ← c + (1/N_total)·Σ_i Δc_i

Symbols ↔ code: c server state / downlink record ``"server-control"`` (optimizer state ``c``); c_i saved
client state ``"client-control"`` (optimizer state ``ci``); K_i ``steps_taken`` (the steps this client really
took); η_l the optimizer's ``lr`` (server: ``client_lr_at(t)``); λ ``weight_decay`` (client); η_g ``server_lr``;
N_total ``num_clients`` or ``RoundInputs.nodes_seen``.

Records: downlink ``"server-control"`` (c); uplink ``"arrays"`` (y_i) and ``"control-delta"`` (Δc_i, summed);
persistent client state ``"client-control"`` (c_i, in the node's ``Context.state`` as
``fedadapt.client-control``).  Communication: 2× FedAvg's in both directions.

Conventions and deviations
--------------------------
* ``N_total`` is ``num-clients`` when set, else the most nodes the server ever saw connected when sampling
  (``nodes_seen``), else — a strategy driven without sampling — the number of valid replies.  With every
  ``c_i`` starting at 0 this keeps ``c = (1/N_total)·Σ_all c_i``; the round's N_total is returned as the round
  metric ``num-clients-total``.
* Uploading ``y_i`` instead of ``Δy_i`` is equivalent for a mean and lets non-trainable buffers be averaged.
* Coupled L2 weight decay enters ``g`` (paper 002 uses 1e-3 for its SGD baselines); it therefore also
  enters ``c_i⁺`` through ``x_t − y``.  ``K_i·η_l = 0`` leaves ``c_i`` unchanged (option II is undefined there).
* A client updates its ``c_i`` before the server validates its reply; if the reply is rejected, ``c`` does not
  receive that ``Δc_i`` (inherent to SCAFFOLD).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..core import records as R
from ..core.ops import NamedArrays, averaging_step, state_like, writable_like
from ..core.strategy import FedAdaptStrategy, RecordSpec, RoundInputs, ServerState
from ..optimizers.scaffold import (
    CLIENT_CONTROL, CONTROL_DELTA, SERVER_CONTROL, ScaffoldHParams, ScaffoldOptimizer,
)

#: This module's names and its client half's (:mod:`flower_strategies.optimizers.scaffold`, re-exported).
__all__ = [
    "CLIENT_CONTROL", "CONTROL_DELTA", "SERVER_CONTROL", "Scaffold", "ScaffoldHParams", "ScaffoldOptimizer",
]


class Scaffold(FedAdaptStrategy):
    """SCAFFOLD option II server; the server state ``"server-control"`` is c (float64)."""

    method: ClassVar[str] = "scaffold"
    hparams_class = ScaffoldHParams
    hparams: ScaffoldHParams
    local_optimizer = ScaffoldOptimizer
    default_weighting: ClassVar[str] = "uniform"

    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        return (RecordSpec(R.MODEL, "mean", "model"), RecordSpec(CONTROL_DELTA, "sum", "params"))

    def init_server_state(self, arrays: NamedArrays) -> ServerState:
        return {SERVER_CONTROL: state_like(arrays, self.trainable(arrays))}

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        return {SERVER_CONTROL: (self.server_state or {})[SERVER_CONTROL]}

    def server_update(
        self, inputs: RoundInputs, state: ServerState
    ) -> tuple[NamedArrays, ServerState, dict[str, float]]:
        current, mean, delta_sum = inputs.current, inputs.aggregates[R.MODEL], inputs.aggregates[CONTROL_DELTA]
        n_total = self.hparams.num_clients or inputs.nodes_seen or len(inputs.reply_metrics)
        new, _ = averaging_step(current, mean, inputs.trainable, self.hparams.server_lr)      # x − η_g·(x − mean y)
        control = {}
        for k in inputs.trainable:  # c + Σ Δc_i / N, into the round's Σ Δc_i buffers
            c, d = state[SERVER_CONTROL][k], delta_sum[k]
            out = d if writable_like(d, c) else None
            control[k] = np.add(c, np.divide(d, n_total, out=out), out=out)
        return self.merge_buffers(new, current, mean), {SERVER_CONTROL: control}, {"num-clients-total": n_total}
