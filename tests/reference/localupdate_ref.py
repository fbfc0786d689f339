"""Float64 NumPy transcription of LocalUpdate / LocalUpdateDecay for the ``synthetic-linear`` task.

Charles & Konečný, *On the Outsized Importance of Learning Rates in Local Update Methods*, 2020
(seed ``003_2dc7ddae5cbdc81f.txt``): Algorithm 1 (OuterLoop), Algorithm 2 (InnerLoop), Algorithm 3
(LocalUpdateDecay OuterLoop), Algorithm 4 (InnerLoop with the loss before training) and the §9.1 refinements
(window W, patience P, cooldown C) as we read §9.1 — both the ``paper`` and the ``tff``
plateau pseudo-code, transcribed line by line.

Independent of torch and of ``flower_strategies.methods.localupdate``: it only borrows ``batch_indices`` (to replay the
clients' mini-batches) and the synthetic task's data generator.  Loss of client i: ``½·mean((a·w − y)²)``.
"""

from __future__ import annotations

import math

import numpy as np

from app_common.task import synthetic_client
from flower_strategies.core.client import batch_indices


def client_data(pid: int, dim: int, heterogeneity: float = 1.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    a, y, _, _ = synthetic_client(pid, dim, heterogeneity, seed)
    return a.astype(np.float64), y.astype(np.float64)[:, 0]


def loss(w: np.ndarray, a: np.ndarray, y: np.ndarray) -> float:
    return float(0.5 * np.mean((a @ w - y) ** 2))


def grad(w: np.ndarray, a: np.ndarray, y: np.ndarray) -> np.ndarray:
    return a.T @ (a @ w - y) / len(y)


def inner_loop(x, a, y, gamma, theta, batches):
    """Algorithms 2 and 4: returns (ℓ, Σ_k θ_k g_k)."""
    ell = loss(x, a, y)                     # ℓ ← E_{z∼D_i}[f(x; z)]  (whole client data set, before training)
    xk = x.copy()
    q = np.zeros_like(x)
    for k in range(len(theta)):             # for k = 1..K(Θ)
        idx = batches[k]                    #   sample S_k of size B
        g = grad(xk, a[idx], y[idx])        #   g_k = (1/B) Σ_{z∈S_k} ∇f(x_k; z)
        q = q + theta[k] * g
        xk = xk - gamma * g                 #   x_{k+1} ← x_k − γ g_k
    return ell, q


class PaperPlateau:
    """The ``paper`` rule (§9.1 read literally)."""

    def __init__(self, W, P, C, delta):
        self.W, self.P, self.C, self.delta = W, P, C, delta
        self.hist, self.lhat_hist, self.count, self.cool = [], [], 0, C

    def update(self, ell):
        self.hist.append(ell)
        lhat = float(np.mean(self.hist[-self.W:]))
        best = min(self.lhat_hist) if self.lhat_hist else math.inf
        self.lhat_hist.append(lhat)
        if self.cool > 0:
            self.cool -= 1
            self.count = 0
            return False
        if lhat > best - self.delta:
            self.count += 1
            if self.count >= self.P:
                self.count = 0
                self.cool = self.C
                return True
            return False
        self.count = 0
        return False


class TffPlateau:
    """The ``tff`` rule (the released code's controller)."""

    def __init__(self, W, P, C, delta):
        self.P, self.C, self.delta = P, C, delta
        self.best, self.window, self.wait, self.cooldown_counter = math.inf, [math.inf] * W, 0, C

    def update(self, ell):
        self.window = self.window[1:] + [ell]
        avg = float(np.mean(self.window))
        decay = False
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if avg < self.best - self.delta:
            self.best = avg
            self.wait = 0
        elif self.cooldown_counter <= 0:
            self.wait += 1
            if self.wait >= self.P:
                decay = True
                self.cooldown_counter = self.C
                self.wait = 0
        return decay


def decay_rounds(losses, W, P, C, delta, rule="paper"):
    """1-based rounds in which the controller fires for a scripted loss sequence."""
    ctl = (PaperPlateau if rule == "paper" else TffPlateau)(W, P, C, delta)
    return [t for t, ell in enumerate(losses, start=1) if ctl.update(ell)]


def outer_loop(
    w0, pids_per_round, *, gamma, eta, theta, batch_size, seed=0, dim=5, heterogeneity=1.0,
    weighting="uniform", server="sgd", beta1=0.9, beta2=0.99, eps=1e-5,
    decay=None,
):
    """Algorithm 1 (``decay=None``) or Algorithm 3 + §9.1 (``decay=dict(W, P, C, delta, rule, client_decay,
    server_decay, loss_weighting)``).  ``pids_per_round[t-1]`` = partition ids sampled in round t.

    Returns (iterates [w_0, w_1, …], trace [(γ_t, η_t, decayed_t), …]).
    """
    data = {}
    w = np.asarray(w0, dtype=np.float64).copy()
    out, trace = [w.copy()], []
    m = np.zeros_like(w)
    v = np.zeros_like(w)  # Yogi: initial accumulator 0 (§8.4)
    ctl = None
    if decay is not None:
        ctl = (PaperPlateau if decay["rule"] == "paper" else TffPlateau)(decay["W"], decay["P"], decay["C"],
                                                                         decay["delta"])
    for t, pids in enumerate(pids_per_round, start=1):
        qs, ells, ns = [], [], []
        for pid in pids:
            if pid not in data:
                data[pid] = client_data(pid, dim, heterogeneity, seed)
            a, y = data[pid]
            batches = batch_indices(len(y), batch_size, len(theta), seed, t, pid)
            ell, q = inner_loop(w, a, y, gamma, theta, batches)
            qs.append(q), ells.append(ell), ns.append(len(y))
        p = np.full(len(qs), 1.0 / len(qs)) if weighting == "uniform" else np.asarray(ns, float) / sum(ns)
        qbar = sum(pi * qi for pi, qi in zip(p, qs, strict=True))
        if server == "sgd":
            w = w - eta * qbar                                  # x_{t+1} = x_t − η_t q_t
        else:  # yogi (Zaheer et al.; no bias correction)
            m = beta1 * m + (1 - beta1) * qbar
            v = v - (1 - beta2) * np.sign(v - qbar**2) * qbar**2
            w = w - eta * m / (np.sqrt(v) + eps)
        decayed = False
        if ctl is not None:
            if decay.get("loss_weighting", "uniform") == "uniform":
                ell_t = float(np.mean(ells))                    # ℓ_t = (1/M) Σ ℓ_t^i  (Eq. 24)
            else:
                ell_t = float(np.dot(ells, ns) / sum(ns))
            trace.append((gamma, eta, False))
            if ctl.update(ell_t):
                decayed = True
                gamma, eta = decay["client_decay"] * gamma, decay["server_decay"] * eta
            trace[-1] = (trace[-1][0], trace[-1][1], decayed)
        else:
            trace.append((gamma, eta, False))
        out.append(w.copy())
    return out, trace
