"""Float64 NumPy transcription of FedCM (Xu et al. 2021, in paper 002's form) on the synthetic task.

Client: ``d = α·(g + λ·x) + (1−α)·Δ_t``, ``x ← x − η_l·d`` for K steps.
Server: ``x_{t+1} = x_t − η_g·mean_i(x_t − x_{i,K})``,
``Δ_{t+1} = mean_i(x_t − x_{i,K}) / (η_l^{(t)}·K̄)``, ``Δ_0 = 0``; η_l decays by ``client_lr_decay`` per round.
Independent of torch and of the method code (data and batch order are shared with the ClientApp).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flower_strategies.core.client import batch_indices
from tests.reference.fedlada_ref import lsq_grad, steps_for, weights_for, wmean


@dataclass
class CMConfig:
    client_lr: float = 0.05
    server_lr: float = 1.0
    amend_weight: float = 0.1
    weight_decay: float = 1e-3
    client_lr_decay: float = 0.998
    weighting: str = "uniform"
    local_steps: int = 5
    local_epochs: int = 1
    batch_size: int = 8
    seed: int = 0


@dataclass
class CMTrace:
    xs: list = field(default_factory=list)
    updates: list = field(default_factory=list)   # Δ_0, Δ_1, …


def run_fedcm(x0: np.ndarray, clients, schedule, cfg: CMConfig) -> CMTrace:
    x = np.array(x0, np.float64)
    big_delta = np.zeros_like(x)
    tr = CMTrace(xs=[x.copy()], updates=[big_delta.copy()])
    a = cfg.amend_weight
    for t, participants in enumerate(schedule):
        eta_l = cfg.client_lr * cfg.client_lr_decay**t
        deltas, ks, ns = [], [], []
        for i in participants:
            A, Y = clients[i]
            K = steps_for(len(A), cfg.local_steps, cfg.local_epochs, cfg.batch_size)
            xi = x.copy()
            for idx in batch_indices(len(A), cfg.batch_size, K, cfg.seed, t + 1, i):
                g = lsq_grad(xi, A[idx], Y[idx]) + cfg.weight_decay * xi
                xi = xi - eta_l * (a * g + (1 - a) * big_delta)
            deltas.append(x - xi)
            ks.append(K)
            ns.append(len(A))
        w = weights_for(ns, cfg.weighting)
        mean_delta = wmean(deltas, w)
        big_delta = mean_delta / (eta_l * float(np.dot(w, ks)))
        x = x - cfg.server_lr * mean_delta
        tr.xs.append(x.copy())
        tr.updates.append(big_delta.copy())
    return tr
