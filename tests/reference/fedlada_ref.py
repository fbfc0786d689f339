"""Float64 NumPy transcription of FedLADA (paper 002, Algorithm 3) on the synthetic least-squares task.

Independent of torch and of ``flower_strategies``' method code: only the task's data
(:func:`app_common.task.synthetic_client`) and the client mini-batch order
(:func:`flower_strategies.core.client.batch_indices`)
are reused so that the same data meet the same batches.  Round ``t = 0, 1, …`` of the algorithm is server round
``t + 1``.  The flags for the paper's ambiguities (A1…A12) are transcribed next to the line they modify.

Also holds the data/gradient helpers used by the FedCM and SCAFFOLD references.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from app_common.task import synthetic_client
from flower_strategies.core.client import batch_indices


# ------------------------------------------------------------------------------------------ task helpers
def load_clients(pids, dim: int, seed: int = 0, heterogeneity: float = 1.0) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``{pid: (A_i, y_i)}`` in float64 (the training split each ClientApp node uses)."""
    out = {}
    for pid in pids:
        a, y, _, _ = synthetic_client(pid, dim, heterogeneity, seed)
        out[pid] = (a.astype(np.float64), y.astype(np.float64))
    return out


def lsq_grad(w: np.ndarray, a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Gradient of ``½·mean((a·w − y)²)`` w.r.t. ``w`` of shape (1, d)."""
    r = a @ w.T - y  # (b, 1)
    return (r.T @ a) / len(a)


def steps_for(n: int, local_steps: int, local_epochs: int, batch_size: int) -> int:
    """K_i: ``local_steps`` if positive, else ``E·⌈n/B⌉``."""
    return local_steps if local_steps > 0 else local_epochs * math.ceil(n / batch_size)


def weights_for(ns, weighting: str) -> np.ndarray:
    w = np.asarray(ns, np.float64) if weighting == "examples" else np.ones(len(ns))
    return w / w.sum()


def wmean(arrs, w: np.ndarray) -> np.ndarray:
    return sum(wi * a for wi, a in zip(w, arrs, strict=True))


# ------------------------------------------------------------------------------------------ FedLADA
@dataclass
class LadaConfig:
    client_lr: float = 0.01                # η_l (round 1)
    server_lr: float = 1.0                 # η_g
    amend_weight: float = 0.1              # α
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.01             # λ (A6)
    decoupled_wd: bool = False             # A6
    client_lr_decay: float = 0.998         # A11
    initial_vhat: float = 1e-16            # v̂⁰ = ε_v² (A5)
    v_init: str = "zero"                   # A4: zero | server
    second_moment: str = "amsgrad"         # amsgrad | adam | sgd
    eps_placement: str = "none"            # A5: none | outside | inside
    eps: float = 1e-8
    local_updates: str = "K"               # A1: K | K-1
    offset_lr: str = "producing"           # A2: producing | consuming | initial
    offset_steps: str = "mean"             # unequal K_i: mean (÷ K̄) | per-client (÷ K_i inside the mean)
    precondition_offset: bool = False      # A12
    weighting: str = "uniform"             # A10
    local_steps: int = 5
    local_epochs: int = 1
    batch_size: int = 8
    seed: int = 0


@dataclass
class LadaTrace:
    xs: list = field(default_factory=list)          # x^0, x^1, …
    vsrv: list = field(default_factory=list)        # v^0, v^1, … (server's averaged v̂)
    offsets: list = field(default_factory=list)     # g_a^0, g_a^1, …
    dir_sums: list = field(default_factory=list)    # per round: mean_i Σ_τ m⊙ϑ
    client_vhats: list = field(default_factory=list)  # per round: list of per-step v̂ of every client


def _theta(den: np.ndarray, cfg: LadaConfig) -> np.ndarray:
    if cfg.eps_placement == "outside":
        return 1.0 / (np.sqrt(den) + cfg.eps)
    if cfg.eps_placement == "inside":
        return 1.0 / np.sqrt(den + cfg.eps)
    return 1.0 / np.sqrt(den)


def run_fedlada(x0: np.ndarray, clients, schedule, cfg: LadaConfig) -> LadaTrace:
    """Algorithm 3 with the participants ``schedule[t]`` (partition ids) of every round."""
    x = np.array(x0, np.float64)
    v = np.full_like(x, cfg.initial_vhat)              # v̂⁰ = ε_v²
    g_a = np.zeros_like(x)                             # g_a⁰ = 0
    tr = LadaTrace(xs=[x.copy()], vsrv=[v.copy()], offsets=[g_a.copy()])
    a = cfg.amend_weight
    for t, participants in enumerate(schedule):
        server_round = t + 1
        eta_l = cfg.client_lr * cfg.client_lr_decay**t
        deltas, vhats, ks, ns, dsums, traces = [], [], [], [], [], []
        for i in participants:
            A, Y = clients[i]
            n = len(A)
            K = steps_for(n, cfg.local_steps, cfg.local_epochs, cfg.batch_size)
            # line 4–5: x_{i,0} = x^t, m_{i,0} = 0, v̂_{i,0} = v^t ; v_{i,0} per A4
            xi = x.copy()
            m = np.zeros_like(x)
            vh = v.copy()
            vi = v.copy() if cfg.v_init == "server" else np.zeros_like(x)
            dsum = np.zeros_like(x)
            steps = []
            batches = batch_indices(n, cfg.batch_size, K, cfg.seed, server_round, i)
            n_updates = K if cfg.local_updates == "K" else K - 1
            for idx in batches[:n_updates]:
                g = lsq_grad(xi, A[idx], Y[idx])                       # line 7
                if not cfg.decoupled_wd:
                    g = g + cfg.weight_decay * xi
                m = cfg.beta1 * m + (1 - cfg.beta1) * g                # line 8
                if cfg.second_moment == "sgd":
                    theta = np.ones_like(x)
                else:
                    vi = cfg.beta2 * vi + (1 - cfg.beta2) * g * g      # line 9
                    if cfg.second_moment == "amsgrad":
                        vh = np.maximum(vi, vh)                        # line 10
                        theta = _theta(vh, cfg)                        # line 11
                    else:
                        theta = _theta(vi, cfg)
                steps.append(vh.copy())
                dsum = dsum + m * theta
                if cfg.precondition_offset:                            # A12 (appendix form)
                    direction = (a * m + (1 - a) * g_a) * theta
                else:                                                  # line 12
                    direction = a * m * theta + (1 - a) * g_a
                if cfg.decoupled_wd:
                    direction = direction + cfg.weight_decay * xi
                xi = xi - eta_l * direction
            deltas.append(x - xi)                                      # line 14
            vhats.append(vi.copy() if cfg.second_moment == "adam" else vh.copy())
            ks.append(K)
            ns.append(n)
            dsums.append(dsum)
            traces.append(steps)
        w = weights_for(ns, cfg.weighting)
        v = wmean(vhats, w)                                            # line 16
        x_next = x - cfg.server_lr * wmean(deltas, w)                  # line 17
        lr_for_offset = {
            "producing": eta_l,
            "consuming": cfg.client_lr * cfg.client_lr_decay ** (t + 1),
            "initial": cfg.client_lr,
        }[cfg.offset_lr]
        if cfg.offset_steps == "per-client":                           # line 18, each client's own K_i
            g_a = wmean([d / (lr_for_offset * k) for d, k in zip(deltas, ks, strict=True)], w)
        else:                                                          # line 18, the mean step count K̄
            k_bar = float(np.dot(w, ks))
            g_a = (x - x_next) / (cfg.server_lr * lr_for_offset * k_bar)
        x = x_next
        tr.xs.append(x.copy())
        tr.vsrv.append(v.copy())
        tr.offsets.append(g_a.copy())
        tr.dir_sums.append(wmean(dsums, w))
        tr.client_vhats.append(traces)
    return tr
