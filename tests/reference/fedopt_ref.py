"""Float64 NumPy transcription of FedAvg / FedAvgM / FedAdagrad / FedAdam / FedYogi / FedProx on least squares.

Written from the algorithm boxes, independently of ``flower_strategies``:
* clients: local SGD on ``f_i(w) = ½·mean_b (a_b·w − y_b)²`` (+ FedProx ``(μ/2)‖w − x_t‖²``, + coupled L2);
* server: Reddi et al., *Adaptive Federated Optimization*, Algorithm 2 in its own (ascent) sign convention:
  ``Δ = Σ p_i (x_i − x)``, ``m = β1 m + (1−β1) Δ``, ``v`` per AdaGrad/Adam/Yogi, ``x ← x + η m / (√v + τ)``;
  FedAvgM (Hsu et al.): ``u = β u − Δ``, ``x ← x − η u``.
Only plumbing is shared with the implementation: the data and the mini-batch index lists.
"""

from __future__ import annotations

import random

import numpy as np

from app_common.task import synthetic_client
from flower_strategies.core.client import batch_indices


def ls_grad(w: np.ndarray, a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Gradient of ½·mean((a w − y)²) for w of shape (1, d), a (b, d), y (b, 1)."""
    r = a @ w.T - y
    return (r.T @ a) / len(a)


def client_update(w, a, y, batches, lr, mu=0.0, wd=0.0):
    w_start = w.copy()
    for idx in batches:
        g = ls_grad(w, a[idx], y[idx]) + wd * w + mu * (w - w_start)
        w = w - lr * g
    return w


def run(kind: str, *, rounds: int, num_clients: int, dim: int, seed: int, client_lr: float, local_steps: int,
        batch_size: int, server_lr: float = 1.0, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3,
        v0: float | None = None, momentum: float = 0.0, mu: float = 0.0, fraction: float = 1.0,
        weighting: str = "examples", min_nodes: int = 2, w0: np.ndarray | None = None) -> list[np.ndarray]:
    """Global weights after every round (index 0 = initial)."""
    data = [synthetic_client(i, dim, 1.0, seed) for i in range(num_clients)]
    x = np.zeros((1, dim)) if w0 is None else np.array(w0, dtype=np.float64)
    m = np.zeros_like(x)
    v = np.full_like(x, tau**2 if v0 is None else v0)
    u = np.zeros_like(x)
    rng = random.Random(seed)
    nodes = list(range(1, num_clients + 1))
    out = [x.copy()]
    for t in range(1, rounds + 1):
        k = min(len(nodes), max(int(len(nodes) * fraction), min_nodes))
        picked = sorted(rng.sample(nodes, k))
        locals_, weights = [], []
        for node in picked:
            i = node - 1
            a, y = data[i][0].astype(np.float64), data[i][1].astype(np.float64)
            batches = batch_indices(len(a), batch_size, local_steps, seed, t, i)
            locals_.append(client_update(x, a, y, batches, client_lr, mu=mu))
            weights.append(len(a) if weighting == "examples" else 1.0)
        p = np.array(weights) / np.sum(weights)
        delta = sum(pi * (xi - x) for pi, xi in zip(p, locals_, strict=True))  # ascent sign (Reddi et al.)
        if kind in ("fedavg", "fedprox"):
            x = x + server_lr * delta
        elif kind == "fedavgm":
            u = momentum * u - delta
            x = x - server_lr * u
        else:
            m = beta1 * m + (1 - beta1) * delta
            if kind == "fedadagrad":
                v = v + delta**2
            elif kind == "fedadam":
                v = beta2 * v + (1 - beta2) * delta**2
            elif kind == "fedyogi":
                v = v - (1 - beta2) * delta**2 * np.sign(v - delta**2)
            x = x + server_lr * m / (np.sqrt(v) + tau)
        out.append(x.copy())
    return out
