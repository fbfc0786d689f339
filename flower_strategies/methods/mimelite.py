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
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..core import records as R
from ..core.hparams import HParams, param
from ..core.local import LocalOptimizer, Named
from ..core.ops import NamedArrays, averaging_step, state_like
from ..core.registry import register
from ..core.strategy import FedAdaptStrategy, RoundInputs, ServerState
from ..core.validation import RecordSpec

MOMENTUM = "momentum"
SECOND_MOMENT = "second-moment"
FULL_GRADIENT = "full-gradient"

#: The server statistics ``s`` of each base optimizer (downlink records = server-state entries).
STATISTICS: dict[str, tuple[str, ...]] = {
    "sgdm": (MOMENTUM,), "adam": (MOMENTUM, SECOND_MOMENT), "adagrad": (SECOND_MOMENT,),
}
BASES = tuple(STATISTICS)


# ------------------------------------------------------------------------------------------ pure math
def mimelite_direction(base: str, g: Any, m: Any, v: Any, *, beta1: float, beta2: float, eps: float) -> Any:
    """Base-optimizer direction ``d(g)`` with frozen statistics (works on numpy arrays and torch tensors)."""
    if base == "sgdm":
        return (1.0 - beta1) * g + beta1 * m
    if base == "adam":
        sq = (1.0 - beta2) * g * g + beta2 * v
        return ((1.0 - beta1) * g + beta1 * m) / (sq**0.5 + eps)
    if base == "adagrad":
        return g / ((v + g * g) ** 0.5 + eps)
    raise ValueError(f"unknown MimeLite base optimizer {base!r}; valid: {', '.join(BASES)}")


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


# ------------------------------------------------------------------------------------------ hyper-parameters
@dataclass(frozen=True)
class MimeLiteHParams(HParams):
    """MimeLite (Karimireddy et al. 2021) with a SGDM / Adam / AdaGrad base optimizer."""

    base: str = param("sgdm", choices=BASES, client=True, help="base optimizer whose statistics the server keeps")
    beta1: float = param(0.9, lo=0.0, hi=0.999, client=True, help="momentum β1 (sgdm, adam)")
    beta2: float = param(0.99, lo=0.0, hi=1.0, client=True, help="second-moment decay β2 (adam)")
    eps: float = param(1e-3, lo=0.0, client=True, help="ε outside the square root (adam, adagrad)")
    server_lr: float = param(1.0, lo=0.0, lo_open=True, help="server learning rate η_g on the averaged model delta")


# ------------------------------------------------------------------------------------------ client
class MimeLiteOptimizer(LocalOptimizer):
    """Local steps with the broadcast (frozen) server statistics; uploads the full-batch gradient at ``x_t``."""

    hparams_class = MimeLiteHParams
    needs_full_gradient: ClassVar[bool] = True

    def downlink_records(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r for group in self.param_groups for r in STATISTICS[group["base"]]))

    def init_state(self, name: str, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        assert self.full_gradient is not None  # the base requires it (needs_full_gradient)
        if name not in self.full_gradient:
            raise ValueError(f"{type(self).__name__}: full_gradient has no entry for parameter {name!r}")
        for key, record in (("m", MOMENTUM), ("v", SECOND_MOMENT)):
            if record in STATISTICS[group["base"]]:
                s = self.received(record, name, p)
                state[key] = torch.zeros_like(p) if s is None else s

    def update_param(self, name: str, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        d = mimelite_direction(group["base"], grad, state.get("m"), state.get("v"),
                               beta1=group["beta1"], beta2=group["beta2"], eps=group["eps"])
        p.add_(d, alpha=-group["lr"])

    def uplink_arrays(self) -> dict[str, Named]:
        assert self.full_gradient is not None
        return {FULL_GRADIENT: {name: self.full_gradient[name] for name, _, _ in self.named_params()}}


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


register(
    MimeLite,
    paper="Karimireddy et al., Mime: Mimicking Centralized Stochastic Algorithms in Federated Learning, ICLR 2021",
    summary=(
        "local steps with frozen server optimizer statistics; server averages models, updates stats with full gradients"
    ),
)
