"""Quadratic surrogate-loss analysis for LocalUpdate (pure NumPy kernels).

Charles & Konečný, *On the Outsized Importance of Learning Rates in Local Update Methods*, 2020
(seed ``003_2dc7ddae5cbdc81f.txt``), §2–6 (the readings we chose: ``docs/methods/localupdate.md``).

Client ``i`` has the quadratic loss ``f_i(x) = ½ (x − c_i)ᵀ A_i (x − c_i)`` (``A_i`` symmetric).  One LocalUpdate
round with client lr γ and weights ``Θ = (θ_1, …, θ_K)`` uploads, in expectation (Theorem 3),

    E q_i = Q_i A_i (x − c_i),      Q_i(γ, Θ) = Σ_k θ_k (I − γ A_i)^{k−1}          (Eq. 8)

i.e. the gradient of the surrogate ``f̃_i = ½ ‖(Q_i A_i)^{1/2} (x − c_i)‖²`` (Eq. 9, with the square of §4.6-A1).
Iterated to convergence (small η, full participation) LocalUpdate therefore reaches

    x*(γ, Θ) = (Σ_i p_i Q_i A_i)^{-1} Σ_i p_i Q_i A_i c_i

which differs from the true minimiser ``(Σ p_i A_i)^{-1} Σ p_i A_i c_i`` unless γ = 0 or K(Θ) = 1 (Lemma 5).

Θ conventions: entries are ≥ 0 (paper §2.1), trailing zeros are dropped so ``K(Θ) = max{k: θ_k > 0}`` = ``len(Θ)``.
Named presets (:func:`~flower_strategies.methods.localupdate.theta_preset`, Θ parsing lives in the method module):
``fedavg``/``reptile`` = Θ_{1:K}, ``fomaml`` = Θ_K = (0,…,0,1),
``kmaml`` = Θ_{2K+1} (K-MAML with gradient-descent clients on quadratics, Theorem 4), ``sgd`` = Θ_1 = (1).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Θ parsing belongs to the method module (the library's methods never import analysis); presets re-exported here.
from ..methods.localupdate import theta_preset  # noqa: F401


# ------------------------------------------------------------------------------------------ surrogate
def _mat(a: np.ndarray | float) -> np.ndarray:
    m = np.atleast_2d(np.asarray(a, dtype=np.float64))
    if m.shape[0] != m.shape[1]:
        raise ValueError(f"A must be square, got shape {m.shape}")
    return m


def distortion(a: np.ndarray | float, gamma: float, theta: Sequence[float]) -> np.ndarray:
    """``Q(γ, Θ) = Σ_k θ_k (I − γA)^{k−1}`` (Eq. 8)."""
    m = _mat(a)
    eye = np.eye(len(m))
    step = eye - gamma * m
    power = eye.copy()
    q = np.zeros_like(m)
    for th in theta:
        q += th * power
        power = power @ step
    return q


def surrogate_hessian(a: np.ndarray | float, gamma: float, theta: Sequence[float]) -> np.ndarray:
    """``Q(γ, Θ)·A``, the Hessian of the client surrogate ``f̃_i`` (for Θ_{1:K}: ``(I − (I−γA)^K)/γ``)."""
    m = _mat(a)
    return distortion(m, gamma, theta) @ m


def expected_update(x, a, c, gamma: float, theta: Sequence[float]) -> np.ndarray:
    """``E[InnerLoop(i, x, γ, Θ)] = Q_i A_i (x − c_i)`` (Theorem 3)."""
    x = np.atleast_1d(np.asarray(x, dtype=np.float64))
    c = np.atleast_1d(np.asarray(c, dtype=np.float64))
    return surrogate_hessian(a, gamma, theta) @ (x - c)


def _probs(n: int, probs: Sequence[float] | None) -> np.ndarray:
    p = np.full(n, 1.0 / n) if probs is None else np.asarray(probs, dtype=np.float64)
    if p.shape != (n,) or np.any(p < 0) or not np.isclose(p.sum(), 1.0):
        raise ValueError(f"probs must be {n} non-negative numbers summing to 1, got {probs}")
    return p


def expected_round_update(x, mats, centers, gamma: float, theta: Sequence[float], probs=None) -> np.ndarray:
    """``E q = Σ_i p_i Q_i A_i (x − c_i) = ∇f̃(x, γ, Θ)``; one round is ``x ← x − η·E q`` in expectation."""
    p = _probs(len(mats), probs)
    return sum(pi * expected_update(x, a, c, gamma, theta) for pi, a, c in zip(p, mats, centers, strict=True))


def surrogate_minimizer(mats, centers, gamma: float, theta: Sequence[float], probs=None) -> np.ndarray:
    """``x*(γ, Θ) = (Σ p_i Q_i A_i)^{-1} Σ p_i Q_i A_i c_i``, the fixed point of LocalUpdate (§3–4)."""
    p = _probs(len(mats), probs)
    hs = [surrogate_hessian(a, gamma, theta) for a in mats]
    h = sum(pi * hi for pi, hi in zip(p, hs, strict=True))
    b = sum(pi * hi @ np.atleast_1d(np.asarray(c, dtype=np.float64)) for pi, hi, c in zip(p, hs, centers, strict=True))
    return np.linalg.solve(h, b)


def true_minimizer(mats, centers, probs=None) -> np.ndarray:
    """``argmin f = (Σ p_i A_i)^{-1} Σ p_i A_i c_i`` (= the surrogate minimiser with Θ = (1))."""
    return surrogate_minimizer(mats, centers, 0.0, (1.0,), probs)


def surrogate_condition_number(mats, gamma: float, theta: Sequence[float], probs=None) -> float:
    """Condition number of the surrogate Hessian ``Σ p_i Q_i A_i`` (assumed symmetric positive definite)."""
    p = _probs(len(mats), probs)
    h = sum(pi * surrogate_hessian(a, gamma, theta) for pi, a in zip(p, mats, strict=True))
    ev = np.linalg.eigvalsh(0.5 * (h + h.T))
    return float(ev[-1] / ev[0])


# ------------------------------------------------------------------------------------------ simulation
def gd_inner_loop(x, a, c, gamma: float, theta: Sequence[float]) -> np.ndarray:
    """Algorithm 2 with exact (full-batch) gradients ``g_k = A(x_k − c)``: returns ``Σ_k θ_k g_k``."""
    m = _mat(a)
    x = np.atleast_1d(np.asarray(x, dtype=np.float64)).copy()
    c = np.atleast_1d(np.asarray(c, dtype=np.float64))
    q = np.zeros_like(x)
    for th in theta:
        g = m @ (x - c)
        q += th * g
        x = x - gamma * g
    return q


def kmaml_gradient(x, a, c, gamma: float, steps: int) -> np.ndarray:
    """``∇_x m_K(x)`` with ``m_K(x) = f(X_K(x))`` and ``X_K`` = K gradient-descent steps (§3.1, Eq. 12–14)."""
    m = _mat(a)
    jac = np.linalg.matrix_power(np.eye(len(m)) - gamma * m, steps)  # dX_K/dx
    x = np.atleast_1d(np.asarray(x, dtype=np.float64))
    c = np.atleast_1d(np.asarray(c, dtype=np.float64))
    xk = c + jac @ (x - c)
    return jac.T @ (m @ (xk - c))


def run_deterministic(x0, mats, centers, gamma: float, theta: Sequence[float], eta: float, rounds: int,
                      probs=None) -> np.ndarray:
    """Algorithm 1 with every client participating and GD clients: ``x ← x − η Σ p_i q_i``. Returns all iterates."""
    p = _probs(len(mats), probs)
    x = np.atleast_1d(np.asarray(x0, dtype=np.float64)).copy()
    out = [x.copy()]
    for _ in range(rounds):
        x = x - eta * sum(pi * gd_inner_loop(x, a, c, gamma, theta) for pi, a, c in zip(p, mats, centers, strict=True))
        out.append(x.copy())
    return np.asarray(out)


# ------------------------------------------------------------------------------------------ paper examples
def two_client_example() -> tuple[list[np.ndarray], list[np.ndarray]]:
    """§4's analytic example: A = 1, c = 1 and A = 2, c = ½, equally likely (true minimiser 2/3)."""
    return [np.array([[1.0]]), np.array([[2.0]])], [np.array([1.0]), np.array([0.5])]


def continuum_minimizer(gamma: float, steps: int, num: int = 4001) -> float:
    """§4's continuum example (Fig. 1): ``f_i(x) = ½ i x² − x``, i ∈ [0.5, 2] with density 8i/15, Θ = Θ_{1:K}.

    Returns ``E[Q_i i · (1/i)] / E[Q_i i]`` by the trapezoidal rule (γ = 0 or K = 1: 1/E[i] ≈ 0.714;
    K → ∞ with γ > 0: E[1/i] = 0.8).
    """
    i = np.linspace(0.5, 2.0, num)
    dens = 8.0 * i / 15.0
    qa = i * steps if gamma == 0.0 else (1.0 - (1.0 - gamma * i) ** steps) / gamma  # Q_i A_i for Θ_{1:K}
    trapezoid = getattr(np, "trapezoid", None) or getattr(np, "trapz")  # noqa: B009 - NumPy < 2.0 names it trapz (absent in NumPy 2.x stubs)
    return float(trapezoid(dens * qa / i, i) / trapezoid(dens * qa, i))
