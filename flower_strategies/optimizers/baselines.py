"""The client half of :mod:`flower_strategies.methods.baselines`: its hyper-parameters, local optimizer and record
names.  A device imports this module (through :mod:`flower_strategies.optimizers`), never the strategy."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.params import param
from ..core.local import SGDHParams

#: The server optimizers (:class:`~flower_strategies.core.server_opt.ServerOptimizer`) and bias corrections a
#: method's ``server-opt`` / ``bias-correction`` may name (declared here, with the hyper-parameters that name them).
SERVER_OPTIMIZERS = ("sgd", "sgdm", "adagrad", "adam", "yogi")
BIAS_CORRECTIONS = ("none", "adam", "flower")

@dataclass(frozen=True)
class FedOptHParams(SGDHParams):
    """FedOpt: local SGD (client fields ``weight_decay``, ``mu``) + a server optimizer on ``D̄``."""

    server_opt: str = param(
        "sgd", choices=SERVER_OPTIMIZERS,
        help="server optimizer: sgd (FedAvg) | sgdm (FedAvgM) | adagrad | adam | yogi",
    )
    server_lr: float = param(1.0, lo=0.0, help="server learning rate η (1 with sgd = model averaging)")
    beta1: float = param(0.9, lo=0.0, hi=1.0, help="server momentum β1 (heavy-ball β for sgdm; m₀ = 0)")
    beta2: float = param(0.99, lo=0.0, hi=1.0, help="second-moment decay β2 (adam, yogi)")
    tau: float = param(1e-3, lo=0.0, help="adaptivity τ (added to √v)")
    initial_v: float | None = param(None, lo=0.0, help="v₀; empty = τ² (Reddi et al.); 0 = Flower's built-ins")
    bias_correction: str = param(
        "none", choices=BIAS_CORRECTIONS, help="none | adam (Keras) | flower (Flower 1.42 FedAdam)",
    )

