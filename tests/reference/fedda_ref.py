"""Float64 NumPy transcription of FedDA's Algorithms 1–2 (Jin et al., ICML 2022, appendix A.2; seed
``001_7e69cb14711dc6c0.txt``), of MimeLite (Karimireddy et al. 2020) and of the centralized SGDM/Adam/AdaGrad that
FedDA reduces to (§2.7), on the least-squares model ``f_i(w) = ½·mean_j (a_j·w − y_j)²``.

Independent of torch and of ``flower_strategies``' implementation; only ``batch_indices`` is shared so that the
same mini-batches are replayed.  Written line by line from the algorithm boxes (line numbers in comments).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from flower_strategies.core.client import batch_indices

Data = Mapping[int, tuple[np.ndarray, np.ndarray]]  # partition id -> (A (n, d), y (n, 1))


def linear_grad(w: np.ndarray, a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """∇ of ½·mean((a·wᵀ − y)²) w.r.t. ``w`` of shape (1, d)."""
    r = a @ w.T - y  # (n, 1)
    return (r.T @ a) / len(a)


def global_grad(w: np.ndarray, data: Data, ids: Sequence[int] | None = None) -> np.ndarray:
    """Sample-weighted global gradient Σ n_i g_i / Σ n_i."""
    ids = list(data) if ids is None else ids
    total = sum(len(data[i][0]) for i in ids)
    return sum(len(data[i][0]) * linear_grad(w, *data[i]) for i in ids) / total


def _batches(n: int, cfg: Mapping, r: int, pid: int, full: bool) -> list[np.ndarray]:
    if full:
        return [np.arange(n)]
    return batch_indices(n, cfg["batch_size"], cfg["local_steps"], cfg["seed"], r, pid)


def _weights(data: Data, ids: Sequence[int], weighting: str) -> np.ndarray:
    n = np.array([len(data[i][0]) for i in ids], dtype=np.float64)
    if weighting == "uniform":
        n = np.ones_like(n)
    return n / n.sum()


# ------------------------------------------------------------------------------------------ FedDA
def fedda_client(w_r, m_r, a, y, batches, *, lr, beta1, mu=0.0, eta_in_momentum=False):
    """Algorithm 1/2 lines 4–8 (+ FedDA+Prox, §4): returns (P_{r,T}, m_{r,T})."""
    p_sum = np.zeros_like(w_r)  # line 4
    w = w_r.copy()
    m = m_r.copy()
    for idx in batches:  # line 5
        g = linear_grad(w, a[idx], y[idx])
        if mu:
            g = g + mu * (w - w_r)
        w = w - g * lr  # line 6
        m = beta1 * m + (1 - beta1) * (g * lr if eta_in_momentum else g)  # line 7
        p_sum = p_sum + m  # line 8
    return p_sum, m


def fedda_reference(w0: np.ndarray, data: Data, sampled: Sequence[Sequence[int]], cfg: Mapping) -> list[np.ndarray]:
    """Run FedDA for ``len(sampled)`` rounds; returns ``[W_0, W_1, …]``.

    ``cfg``: variant, client_lr (η), server_lr (α), beta1, beta2, eps, mu, local_steps, batch_size, seed,
    full_batch_rounds (set of 1-based rounds), eta_in_server, eta_in_momentum, bias_correction
    (updates|round|none), v_hat (new|stale), initial_v, weighting.
    """
    variant = cfg["variant"]
    eta, alpha = cfg["client_lr"], cfg["server_lr"]
    b1, b2, eps = cfg["beta1"], cfg.get("beta2", 0.99), cfg.get("eps", 0.0)
    step_lr = eta * alpha if cfg.get("eta_in_server", True) else alpha
    w = np.asarray(w0, np.float64).copy()
    m = np.zeros_like(w)  # m_0
    v = np.full_like(w, cfg.get("initial_v", 0.0))  # V_0
    out = [w.copy()]
    for r0, ids in enumerate(sampled):  # line 1 (r0 = 0-based r of the paper)
        rnd = r0 + 1
        full = rnd in cfg.get("full_batch_rounds", set())
        ps, ms = [], []
        for pid in ids:  # line 3
            a, y = data[pid]
            p_i, m_i = fedda_client(
                w, m, a, y, _batches(len(a), cfg, rnd, pid, full), lr=eta, beta1=b1, mu=cfg.get("mu", 0.0),
                eta_in_momentum=cfg.get("eta_in_momentum", False),
            )
            ps.append(p_i)
            ms.append(m_i)
        wt = _weights(data, ids, cfg.get("weighting", "examples"))
        p_r = sum(c * p for c, p in zip(wt, ps, strict=True))  # line 9
        m_next = sum(c * mi for c, mi in zip(wt, ms, strict=True))  # line 10
        if variant == "sgdm":
            w = w - p_r * eta * alpha if cfg.get("eta_in_server", True) else w - p_r * alpha  # Alg. 1 line 11
        else:
            g_r = (p_r - b1 * m) / (1 - b1)  # Alg. 2 line 11
            s = rnd  # A3: 1-based (all rounds update here, so "updates" == "round")
            bc = cfg.get("bias_correction", "updates") != "none"
            if variant == "adam":
                m_hat = (b1 * m + (1 - b1) * g_r) / ((1 - b1**s) if bc else 1.0)  # line 13
                v_prev = v
                v = b2 * v + (1 - b2) * g_r**2  # line 14
                v_hat = (v if cfg.get("v_hat", "new") == "new" else v_prev) / ((1 - b2**s) if bc else 1.0)  # line 15
                w = w - m_hat / (np.sqrt(v_hat) + eps) * step_lr  # line 16
            else:
                v = v + g_r**2  # line 18
                w = w - g_r / (np.sqrt(v) + eps) * step_lr  # line 19
        m = m_next
        out.append(w.copy())
    return out


# ------------------------------------------------------------------------------------------ centralized
def centralized(kind: str, w0: np.ndarray, data: Data, rounds: int, *, lr, beta1=0.9, beta2=0.99, eps=0.0):
    """Full-batch centralized SGDM (EMA form) / Adam (bias-corrected, ε outside √) / AdaGrad on Σ n_i f_i / N."""
    w = np.asarray(w0, np.float64).copy()
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    out = [w.copy()]
    for t in range(1, rounds + 1):
        g = global_grad(w, data)
        if kind == "sgdm":
            m = beta1 * m + (1 - beta1) * g
            w = w - lr * m
        elif kind == "adam":
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            w = w - lr * (m / (1 - beta1**t)) / (np.sqrt(v / (1 - beta2**t)) + eps)
        elif kind == "adagrad":
            v = v + g * g
            w = w - lr * g / (np.sqrt(v) + eps)
        else:
            raise ValueError(kind)
        out.append(w.copy())
    return out


# ------------------------------------------------------------------------------------------ MimeLite
def mimelite_reference(w0: np.ndarray, data: Data, sampled: Sequence[Sequence[int]], cfg: Mapping) -> list[np.ndarray]:
    """MimeLite with base sgdm | adam | adagrad; returns ``[x_0, x_1, …]``."""
    base, eta = cfg["base"], cfg["client_lr"]
    b1, b2, eps, eta_g = cfg.get("beta1", 0.9), cfg.get("beta2", 0.99), cfg.get("eps", 1e-3), cfg.get("server_lr", 1.0)
    x = np.asarray(w0, np.float64).copy()
    m = np.zeros_like(x)
    v = np.zeros_like(x)
    out = [x.copy()]
    for r0, ids in enumerate(sampled):
        rnd = r0 + 1
        ys, gs = [], []
        for pid in ids:
            a, yv = data[pid]
            gs.append(linear_grad(x, a, yv))  # full-batch gradient at x_t
            y = x.copy()
            for idx in _batches(len(a), cfg, rnd, pid, False):
                g = linear_grad(y, a[idx], yv[idx])
                if base == "sgdm":
                    d = (1 - b1) * g + b1 * m
                elif base == "adam":
                    d = ((1 - b1) * g + b1 * m) / (np.sqrt((1 - b2) * g * g + b2 * v) + eps)
                else:
                    d = g / (np.sqrt(v + g * g) + eps)
                y = y - eta * d
            ys.append(y)
        wt = _weights(data, ids, cfg.get("weighting", "examples"))
        y_bar = sum(c * y for c, y in zip(wt, ys, strict=True))
        g_bar = sum(c * g for c, g in zip(wt, gs, strict=True))
        x = x - eta_g * (x - y_bar)
        if base in ("sgdm", "adam"):
            m = b1 * m + (1 - b1) * g_bar
        if base == "adam":
            v = b2 * v + (1 - b2) * g_bar**2
        elif base == "adagrad":
            v = v + g_bar**2
        out.append(x.copy())
    return out
