"""Float64 NumPy transcription of SCAFFOLD option II (Karimireddy et al. 2020) on the synthetic task.

Server state ``x, c``; client state ``c_i`` (0 before the client is first sampled, kept across rounds).
Client: ``y ← y − η_l·(g(y) + λ·y − c_i + c)`` for K_i steps; ``c_i⁺ = c_i − c + (x − y)/(K_i·η_l)``.
Server: ``x ← x + η_g·mean_i(y_i − x)``; ``c ← c + (1/N_total)·Σ_i (c_i⁺ − c_i)``.
Independent of torch and of the method code (data and batch order are shared with the ClientApp).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flower_strategies.core.client import batch_indices
from tests.reference.fedlada_ref import lsq_grad, steps_for, weights_for, wmean


@dataclass
class ScaffoldConfig:
    client_lr: float = 0.05
    server_lr: float = 1.0
    num_clients: int = 10          # N_total
    weight_decay: float = 1e-3
    client_lr_decay: float = 1.0
    weighting: str = "uniform"
    local_steps: int = 5
    local_epochs: int = 1
    batch_size: int = 8
    seed: int = 0


@dataclass
class ScaffoldTrace:
    xs: list = field(default_factory=list)
    cs: list = field(default_factory=list)
    client_c: dict = field(default_factory=dict)   # final c_i of every client ever sampled


def run_scaffold(x0: np.ndarray, clients, schedule, cfg: ScaffoldConfig) -> ScaffoldTrace:
    x = np.array(x0, np.float64)
    c = np.zeros_like(x)
    c_i: dict[int, np.ndarray] = {}
    tr = ScaffoldTrace(xs=[x.copy()], cs=[c.copy()])
    for t, participants in enumerate(schedule):
        eta_l = cfg.client_lr * cfg.client_lr_decay**t
        dys, dcs, ns = [], [], []
        for i in participants:
            A, Y = clients[i]
            K = steps_for(len(A), cfg.local_steps, cfg.local_epochs, cfg.batch_size)
            ci = c_i.get(i, np.zeros_like(x))
            y = x.copy()
            for idx in batch_indices(len(A), cfg.batch_size, K, cfg.seed, t + 1, i):
                g = lsq_grad(y, A[idx], Y[idx]) + cfg.weight_decay * y
                y = y - eta_l * (g - ci + c)
            ci_plus = ci - c + (x - y) / (K * eta_l)          # option II
            dys.append(y - x)
            dcs.append(ci_plus - ci)
            ns.append(len(A))
            c_i[i] = ci_plus
        w = weights_for(ns, cfg.weighting)
        x = x + cfg.server_lr * wmean(dys, w)
        c = c + sum(dcs) / cfg.num_clients
        tr.xs.append(x.copy())
        tr.cs.append(c.copy())
    tr.client_c = {i: v.copy() for i, v in c_i.items()}
    return tr
