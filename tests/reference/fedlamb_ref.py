"""Float64 NumPy transcription of paper 004's Algorithm 1 (Fed-LAMB) and of Fed-AMS.

*FED-LAMB: Layer-wise and Dimension-wise Locally Adaptive Optimization* (Karimi, Li, Li, 2021), seed file
``004_0cb0825507252aef.txt``.  The line numbers below are those of Algorithm 1.

Independence: this module imports neither torch nor ``flower_strategies.methods.fedlamb``.  Gradients are closed
forms in NumPy for the two models the tests use:

* ``synthetic-linear``: ``L(w) = ½·mean((A wᵀ − y)²)`` → ``∇w = (A wᵀ − y)ᵀ A / B``;
* ``digits-mlp``: ``z = W2·relu(W1 x + b1) + b2``, mean softmax cross-entropy, back-propagated by hand
  (ReLU derivative ``1[a > 0]``, as torch).

Data, initial weights and mini-batch order come from outside (the task's loaders and
``flower_strategies.core.client.batch_indices``, passed in by the caller) so that the reference sees exactly the
clients' batches.  Every §5.6 ambiguity is a field of :class:`RefConfig` with the spec's default.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

Arrays = dict[str, np.ndarray]
GradFn = Callable[[Arrays, np.ndarray, np.ndarray], Arrays]
BatchFn = Callable[[int, int, int, int, int, int], list]  # (n, B, K, seed, round, client) -> index arrays


# ------------------------------------------------------------------------------------------ gradients
def linear_grad(theta: Arrays, x: np.ndarray, y: np.ndarray) -> Arrays:
    """Gradient of ``½·mean((x wᵀ − y)²)`` for the key ``w.weight`` of shape (1, d)."""
    w = theta["w.weight"]
    r = x @ w.T - y  # (B, 1)
    return {"w.weight": (r.T @ x) / len(x)}


def mlp_grad(theta: Arrays, x: np.ndarray, y: np.ndarray) -> Arrays:
    """Gradient of the mean cross-entropy of ``fc2(relu(fc1(x)))`` (keys fc1/fc2 .weight/.bias)."""
    w1, b1, w2, b2 = theta["fc1.weight"], theta["fc1.bias"], theta["fc2.weight"], theta["fc2.bias"]
    a = x @ w1.T + b1
    h = np.maximum(a, 0.0)
    z = h @ w2.T + b2
    z = z - z.max(axis=1, keepdims=True)
    s = np.exp(z)
    s /= s.sum(axis=1, keepdims=True)
    s[np.arange(len(y)), y] -= 1.0
    dz = s / len(y)
    dh = dz @ w2
    da = dh * (a > 0)
    return {"fc1.weight": da.T @ x, "fc1.bias": da.sum(0), "fc2.weight": dz.T @ h, "fc2.bias": dz.sum(0)}


def mlp_loss(theta: Arrays, x: np.ndarray, y: np.ndarray) -> float:
    h = np.maximum(x @ theta["fc1.weight"].T + theta["fc1.bias"], 0.0)
    z = h @ theta["fc2.weight"].T + theta["fc2.bias"]
    z = z - z.max(axis=1, keepdims=True)
    return float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y]))


# ------------------------------------------------------------------------------------------ algorithm
@dataclass
class RefConfig:
    lamb: bool = True                      # False = Fed-AMS (no layer-wise scaling)
    lr: float = 0.01                       # α (before milestones)
    lr_milestones: tuple[int, ...] = ()    # α_r = lr·gamma^{#milestones < r}
    lr_gamma: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0              # λ
    phi_min: float = 0.0
    phi_max: float = 0.0                   # 0 = unbounded
    layers: str = "tensor"                 # tensor | module
    vhat_mode: str = "local_max"           # A2: local_max | server_fixed | none
    bias_correction: str = "global"        # A4: global | as_written | none
    m_step_count: str = "client"           # A4: client | global
    eps_placement: str = "outside"         # outside | inside
    gradient_point: str = "current"        # A1: current | round_start
    stateless: bool = False                # A7
    weighting: str = "uniform"             # uniform | examples
    local_steps: int = 3
    batch_size: int = 16
    seed: int = 0


@dataclass
class RefResult:
    models: list[Arrays]                   # θ̄_0, θ̄_1, …
    v_hats: list[Arrays]                   # v̂ after each round (v̂_0 = 0 first)
    client_m: dict[int, Arrays] = field(default_factory=dict)
    client_steps: dict[int, int] = field(default_factory=dict)


def _layers(keys: Sequence[str], mode: str) -> list[list[str]]:
    if mode == "tensor":
        return [[k] for k in keys]
    out: dict[str, list[str]] = {}
    for k in keys:
        out.setdefault(k.rsplit(".", 1)[0], []).append(k)
    return list(out.values())


def client_round(
    cfg: RefConfig, r: int, theta_bar: Arrays, v_hat: Arrays, v_steps: float, m_prev: Arrays | None, m_count: int,
    x: np.ndarray, y: np.ndarray, batches: list, grad: GradFn,
) -> tuple[Arrays, Arrays, Arrays, int]:
    """Lines 5–14 for one device: returns (θ_i^T, uploaded v_i, final m, its step count)."""
    keys = list(theta_bar)
    b1, b2, eps, lam = cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay
    alpha = cfg.lr * cfg.lr_gamma ** sum(1 for ms in cfg.lr_milestones if r > ms)
    theta = {k: theta_bar[k].copy() for k in keys}                               # line 5
    theta0 = {k: theta_bar[k].copy() for k in keys}
    if cfg.stateless or m_prev is None:                                          # line 6 (A7)
        m, s_m0 = {k: np.zeros_like(theta[k]) for k in keys}, 0
    else:
        m, s_m0 = {k: m_prev[k].copy() for k in keys}, m_count
    v = {k: v_hat[k].copy() for k in keys}                                       # line 6
    vmax = {k: v_hat[k].copy() for k in keys}                                    # A2: seeded with v̂
    t = 0
    for t, idx in enumerate(batches, start=1):                                   # line 7
        g = grad(theta0 if cfg.gradient_point == "round_start" else theta, x[idx], y[idx])   # line 8 (A1)
        if cfg.bias_correction == "global":                                      # A4
            s_m = (v_steps + t) if cfg.m_step_count == "global" else (s_m0 + t)
            c1, c2 = 1 - b1**s_m, 1 - b2 ** (v_steps + t)
        elif cfg.bias_correction == "as_written":
            c1, c2 = 1 - b1**t, 1 - b2**t
        else:
            c1, c2 = 1.0, 1.0
        p: Arrays = {}
        for k in keys:
            m[k] = b1 * m[k] + (1 - b1) * g[k]                                   # line 9 (raw EMA kept)
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2                              # line 10 (A3)
            vc = v[k] / c2
            if cfg.vhat_mode == "local_max":
                vmax[k] = np.maximum(vmax[k], vc)
                den = vmax[k]
            elif cfg.vhat_mode == "server_fixed":
                den = v_hat[k]
            else:
                den = vc
            root = np.sqrt(den) + eps if cfg.eps_placement == "outside" else np.sqrt(den + eps)
            p[k] = (m[k] / c1) / root                                            # line 11
        for layer in _layers(keys, cfg.layers):                                  # line 12, eq. (2)
            u = {k: p[k] + lam * theta[k] for k in layer}
            if cfg.lamb:
                wn = np.sqrt(sum(np.sum(theta[k] ** 2) for k in layer))
                un = np.sqrt(sum(np.sum(u[k] ** 2) for k in layer))
                phi = max(wn, cfg.phi_min)
                if cfg.phi_max > 0:
                    phi = min(phi, cfg.phi_max)
                ratio = phi / un if (wn > 0 and un > 0) else 1.0                 # A6
            else:
                ratio = 1.0
            for k in layer:
                theta[k] = theta[k] - alpha * ratio * u[k]
    v_up = {k: v[k] / (1 - b2 ** t) for k in keys} if cfg.bias_correction == "as_written" and t > 0 else v
    return theta, v_up, m, s_m0 + t                                              # line 14


def run_reference(
    theta_init: Mapping[str, np.ndarray],
    data: Mapping[int, tuple[np.ndarray, np.ndarray]],
    sampled: Sequence[Sequence[int]],
    cfg: RefConfig,
    grad: GradFn,
    batches: BatchFn,
) -> RefResult:
    """Run ``len(sampled)`` rounds; ``sampled[r-1]`` = client ids of round r (partition ids)."""
    theta_bar = {k: np.asarray(v, dtype=np.float64).copy() for k, v in theta_init.items()}
    v_hat = {k: np.zeros_like(v) for k, v in theta_bar.items()}                  # line 2
    v_steps = 0.0
    res = RefResult(models=[{k: a.copy() for k, a in theta_bar.items()}],
                    v_hats=[{k: a.copy() for k, a in v_hat.items()}])
    for r, clients in enumerate(sampled, start=1):                              # line 3
        thetas, vs, weights, steps = [], [], [], []
        for cid in clients:                                                      # line 4
            x, y = data[cid]
            idx = batches(len(x), cfg.batch_size, cfg.local_steps, cfg.seed, r, cid)
            th, v_i, m_i, cnt = client_round(
                cfg, r, theta_bar, v_hat, v_steps, res.client_m.get(cid), res.client_steps.get(cid, 0), x, y, idx, grad
            )
            if not cfg.stateless:
                res.client_m[cid], res.client_steps[cid] = m_i, cnt
            thetas.append(th)
            vs.append(v_i)
            weights.append(float(len(x)) if cfg.weighting == "examples" else 1.0)
            steps.append(len(idx))
        w = np.asarray(weights) / np.sum(weights)
        theta_bar = {k: sum(wi * th[k] for wi, th in zip(w, thetas, strict=True)) for k in theta_bar}     # line 16
        mean_v = {k: sum(wi * vi[k] for wi, vi in zip(w, vs, strict=True)) for k in v_hat}
        v_hat = {k: np.maximum(v_hat[k], mean_v[k]) for k in v_hat}                          # line 16 (A5)
        v_steps += float(np.mean(steps))
        res.models.append({k: a.copy() for k, a in theta_bar.items()})
        res.v_hats.append({k: a.copy() for k, a in v_hat.items()})
    return res
