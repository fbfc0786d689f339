"""MimeLite: local steps with the server optimizer's *frozen* statistics (baseline of FedDA).

Paper: Sai Praneeth Karimireddy, Martin Jaggi, Satyen Kale, Mehryar Mohri, Sashank J. Reddi, Sebastian U. Stich,
Ananda Theertha Suresh, *Mime: Mimicking Centralized Stochastic Algorithms in Federated Learning*, ICLR 2021 —
as compared against in Jin et al., ICML 2022 (FedDA; seed file ``001_7e69cb14711dc6c0.txt``).

Server state ``s`` = the base optimizer's statistics (``m``; ``m, v`` for Adam; ``v`` for AdaGrad), broadcast
with the model.  Client ``i`` computes the full-batch gradient ``∇f_i(x_t)`` (uploaded as ``"full-gradient"``)
and runs ``K`` local steps ``y ← y − η·d(g)`` with ``s`` frozen (never written back)::

    sgdm     d = (1−β1)·g + β1·m
    adam     d = ((1−β1)·g + β1·m) / (√((1−β2)·g² + β2·v) + ε)
    adagrad  d = g / (√(v + g²) + ε)

Server: ``x ← x − η_g·(x − mean_i y_i)`` (``η_g = 1``: model averaging), then ``s`` is updated with
``ḡ = mean_i ∇f_i(x_t)``: ``m ← β1·m + (1−β1)·ḡ``; Adam ``v ← β2·v + (1−β2)·ḡ²``; AdaGrad ``v ← v + ḡ²``.

Symbol ↔ variable: ``m`` downlink record / server-state entry ``"momentum"``, optimizer ``state["m"]``;
``v`` ``"second-moment"`` / ``state["v"]``; ``∇f_i(x_t)`` the optimizer's ``full_gradient`` (uplink
``"full-gradient"``); ``η`` ``client-lr``; ``η_g`` ``mimelite.server-lr``; ``β1``, ``β2``, ``ε``
``mimelite.beta1``, ``mimelite.beta2``, ``mimelite.eps``; base optimizer ``mimelite.base``.

Conventions and deviations
--------------------------
* No bias correction anywhere (the spec's "as commonly implemented" Adam form); ``m_0 = v_0 = 0``.
* AdaGrad base = Duchi et al.'s AdaGrad without momentum (``beta1`` unused); an [inferred] choice: the seeds
  give no formula for MimeLite+AdaGrad.
* ``ε`` default 1e-3 [inferred]; weighting default ``examples`` (FedDA's experiments; ``uniform`` per run-config).
* Only the statistics of the chosen base are sent down (:data:`STATISTICS`); a parameter absent from a record
  (not trained by the server) steps with zero statistics.
* Full Mime's SVRG correction ``g(y) − g(x_t) + ḡ`` is *not* applied (that is what makes it "Lite").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from ..core import records as R
from ..core.ops import NamedArrays, averaging_step, state_like
from ..core.strategy import FedAdaptStrategy, RoundInputs, ServerState
from ..core.validation import RecordSpec
from ..optimizers.mimelite import (
    BASES, FULL_GRADIENT, MOMENTUM, MimeLiteHParams, MimeLiteOptimizer, SECOND_MOMENT, STATISTICS,
    mimelite_direction,
)

#: This module's names and its client half's (:mod:`flower_strategies.optimizers.mimelite`, re-exported).
__all__ = [
    "BASES", "FULL_GRADIENT", "MOMENTUM", "MimeLite", "MimeLiteHParams", "MimeLiteOptimizer", "SECOND_MOMENT",
    "STATISTICS", "mimelite_direction", "update_statistics",
]


def update_statistics(
    base: str, state: Mapping[str, NamedArrays], g_bar: NamedArrays, *, beta1: float, beta2: float,
) -> dict[str, NamedArrays]:
    """The server statistics after a round, in new arrays (in the statistics' dtype = the model's):
    ``m ← β1·m + (1−β1)·ḡ``; Adam ``v ← β2·v + (1−β2)·ḡ²``; AdaGrad ``v ← v + ḡ²``."""
    out: dict[str, NamedArrays] = {}
    with np.errstate(over="ignore", invalid="ignore"):
        if MOMENTUM in state:
            out[MOMENTUM] = {k: m * beta1 + g_bar[k] * (1.0 - beta1) for k, m in state[MOMENTUM].items()}
        if SECOND_MOMENT in state:
            v, g = state[SECOND_MOMENT], g_bar
            out[SECOND_MOMENT] = {k: v[k] * beta2 + g[k] * (1.0 - beta2) * g[k] if base == "adam"  # else adagrad
                                  else v[k] + g[k] * g[k] for k in v}
    return out


# ------------------------------------------------------------------------------------------ server
class MimeLite(FedAdaptStrategy):
    """MimeLite server: averages the local models, keeps the base optimizer's statistics (server state)."""

    method: ClassVar[str] = "mimelite"
    hparams_class = MimeLiteHParams
    hparams: MimeLiteHParams
    local_optimizer = MimeLiteOptimizer
    default_weighting: ClassVar[str] = "examples"

    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        return (RecordSpec(R.MODEL, "mean", "model"), RecordSpec(FULL_GRADIENT, "mean", "params"))

    def init_server_state(self, arrays: NamedArrays) -> ServerState:
        keys = self.trainable(arrays)
        return {r: state_like(arrays, keys) for r in STATISTICS[self.hparams.base]}

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        return dict(self.server_state or {})

    def server_update(
        self, inputs: RoundInputs, state: ServerState
    ) -> tuple[NamedArrays, ServerState, dict[str, float]]:
        hp = self.hparams
        mean = inputs.aggregates[R.MODEL]
        new_params, _ = averaging_step(inputs.current, mean, inputs.trainable, hp.server_lr)
        new_state = update_statistics(hp.base, state, inputs.aggregates[FULL_GRADIENT], beta1=hp.beta1, beta2=hp.beta2)
        return self.merge_buffers(new_params, inputs.current, mean), new_state, {}
