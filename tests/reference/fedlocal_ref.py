"""Float64 NumPy transcription of paper 000's Algorithm 1, for the synthetic least-squares task.

Wang, Xu, Garrett, Charles, Liu, Joshi, *Local Adaptivity in Federated Learning: Convergence and Consistency*
(seed ``000_effec18ea8c14ed3.txt``).  Independent of torch and of ``flower_strategies.methods.fedlocal``: it
re-derives the defaults, the client steps, the aggregation and the server optimizers (Keras and FedOpt forms) from
the paper.
Only the data (``app_common.task.synthetic_client``) and the mini-batch order (``batch_indices``) are shared.

Settings are a plain dict with the ``FedLocalHParams`` field names (missing ones take the spec defaults).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

DEFAULTS = {
    "client_opt": "adagrad",
    "correction": "none",
    "client_beta1": -1.0,
    "client_beta2": 0.999,
    "client_eps": 1e-7,
    "eps_placement": "outside",
    "initial_accumulator": 0.1,
    "adam_initial_v": 0.0,
    "yogi_initial_v": 1.0,
    "adam_bias_correction": True,
    "include_lr_in_n": False,
    "exact_n": False,
    "server_opt": "adagrad",
    "server_form": "keras",
    "server_lr": 0.1,
    "server_eps": 1e-3,
    "server_beta1": -1.0,
    "server_beta2": -1.0,
    "server_initial_v": -1.0,
}


def settings(**overrides) -> dict:
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise KeyError(f"unknown settings {sorted(unknown)}")
    return {**DEFAULTS, **overrides}


# ------------------------------------------------------------------------------------------ client
def _beta1(st: dict) -> float:
    if st["client_beta1"] >= 0:
        return st["client_beta1"]
    return 0.9 if st["client_opt"] in ("sgdm", "adam", "yogi") else 0.0


def _v0(st: dict) -> float:
    return {"adagrad": st["initial_accumulator"], "adam": st["adam_initial_v"], "yogi": st["yogi_initial_v"]}.get(
        st["client_opt"], 0.0
    )


def _div0(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.zeros_like(a, dtype=np.float64)
    np.divide(a, b, out=out, where=b != 0)
    return out


def initial_client_state(st: dict, d: int) -> dict:
    """The restart state (Algorithm 1 line 4): m = 0, second moment = its initial value."""
    return {"m": np.zeros(d), "v": np.full(d, _v0(st))}


def client_round(st, x_t, grad, batches, lr, start=None, step_offset=0.0):
    """One client's round.  ``grad(x, idx)`` is the mini-batch gradient.

    Returns ``dict(x, delta, N, upload, ninv, m, v)``; ``upload`` is Δ (none) or Δ/N (local/joint).
    """
    opt = st["client_opt"]
    b1, b2, eps = _beta1(st), st["client_beta2"], st["client_eps"]
    state = start if start is not None else initial_client_state(st, x_t.size)
    m, v = state["m"].copy(), state["v"].copy()
    x = x_t.astype(np.float64).copy()
    M = np.zeros_like(x)
    N = np.zeros_like(x)
    for k, idx in enumerate(batches):
        s = step_offset + k + 1
        g = grad(x, idx)
        m = b1 * m + (1 - b1) * g
        if opt in ("sgd", "sgdm"):
            P = np.ones_like(x)
        else:
            if opt == "adagrad":
                v = v + g**2
            elif opt == "adam":
                v = b2 * v + (1 - b2) * g**2
            else:  # yogi
                v = v - (1 - b2) * np.sign(v - g**2) * g**2
            if st["eps_placement"] == "outside":
                P = 1.0 / (np.sqrt(v) + eps)
            elif st["eps_placement"] == "inside":
                P = 1.0 / np.sqrt(v + eps)
            else:
                P = 1.0 / np.sqrt(v)
        c = 1.0
        if opt in ("adam", "yogi") and st["adam_bias_correction"]:
            c = math.sqrt(1 - b2**s) / (1 - b1**s)
        x = x - lr * c * P * m
        if st["exact_n"]:
            N = N + c * (1 - b1 ** (k + 1)) * P
        else:
            M = b1 * M + (1 - b1) * P
            N = N + M
    delta = x_t - x
    if st["include_lr_in_n"]:
        N = lr * N
    out = {"x": x, "delta": delta, "N": N, "m": m, "v": v, "ninv": _div0(np.ones_like(N), N)}
    out["upload"] = delta if st["correction"] == "none" else _div0(delta, N)
    return out


# ------------------------------------------------------------------------------------------ server
@dataclass
class ServerRef:
    """SERVEROPT of Algorithm 1 in the Keras (default) or FedOpt form (A12)."""

    st: dict
    m: np.ndarray | None = None
    v: np.ndarray | None = None
    s: int = 0
    params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        st, kind = self.st, self.st["server_opt"]
        if st["server_form"] == "keras":
            b1 = 0.0 if kind == "adagrad" else 0.9
            b2 = 0.999
            v0 = {"adagrad": 0.1, "adam": 0.0, "yogi": 1.0}.get(kind, 0.0)
            bias = kind in ("adam", "yogi")
        else:
            b1, b2, v0, bias = 0.9, 0.99, st["server_eps"] ** 2, False
        if st["server_beta1"] >= 0:
            b1 = st["server_beta1"]
        if st["server_beta2"] >= 0:
            b2 = st["server_beta2"]
        if st["server_initial_v"] >= 0:
            v0 = st["server_initial_v"]
        self.params = {"b1": b1, "b2": b2, "v0": v0, "bias": bias}

    def step(self, x: np.ndarray, d: np.ndarray) -> np.ndarray:
        kind, lr, eps = self.st["server_opt"], self.st["server_lr"], self.st["server_eps"]
        b1, b2, v0, bias = (self.params[k] for k in ("b1", "b2", "v0", "bias"))
        self.s += 1
        if self.m is None:
            self.m, self.v = np.zeros_like(x), np.full_like(x, v0)
        if kind == "sgd":
            return x - lr * d
        if kind == "sgdm":  # heavy ball
            self.m = b1 * self.m + d
            return x - lr * self.m
        self.m = b1 * self.m + (1 - b1) * d
        if kind == "adagrad":
            self.v = self.v + d**2
        elif kind == "adam":
            self.v = b2 * self.v + (1 - b2) * d**2
        else:
            self.v = self.v - (1 - b2) * np.sign(self.v - d**2) * d**2
        lr_s = lr * math.sqrt(1 - b2**self.s) / (1 - b1**self.s) if bias else lr
        return x - lr_s * self.m / (np.sqrt(self.v) + eps)


def aggregate(uploads, weights):
    w = np.asarray(weights, dtype=np.float64)
    return sum(wi * u for wi, u in zip(w, uploads, strict=True)) / w.sum()


# ------------------------------------------------------------------------------------------ full run
def least_squares_grad(a: np.ndarray, y: np.ndarray):
    """Gradient of ½·mean((a·x − y)²) on the rows ``idx``."""

    def grad(x, idx):
        ai, yi = a[idx], y[idx]
        return ai.T @ (ai @ x - yi) / len(idx)

    return grad


def run(st, x0, clients, sampled, *, lr, local_steps, batch_size, seed, weighting="examples", sync=False,
        local_epochs=1, batches_fn=None):
    """Algorithm 1 for ``len(sampled)`` rounds.

    ``clients[pid] = (a, y)`` (float64, y flat); ``sampled[t]`` = partition ids of round t+1;
    ``batches_fn(n, B, K, seed, round, pid)`` gives the mini-batch indices.
    ``sync=True`` is the synchronized-state comparison (averaged m, v and step counter carried over).
    Returns the global iterate after every round (``[x0, x1, …]``).
    """
    server = ServerRef(st)
    x = np.asarray(x0, dtype=np.float64).copy()
    d = x.size
    shared = initial_client_state(st, d)
    offset = 0.0
    xs = [x.copy()]
    for t, pids in enumerate(sampled, start=1):
        outs, ws, ks = [], [], []
        for pid in pids:
            a, y = clients[pid]
            n = len(a)
            K = local_steps if local_steps > 0 else local_epochs * math.ceil(n / batch_size)
            batches = batches_fn(n, batch_size, K, seed, t, pid)
            outs.append(
                client_round(st, x, least_squares_grad(a, y), batches, lr,
                             start=shared if sync else None, step_offset=offset if sync else 0.0)
            )
            ws.append(float(n) if weighting == "examples" else 1.0)
            ks.append(K)
        dbar = aggregate([o["upload"] for o in outs], ws)
        if st["correction"] == "joint":
            dbar = _div0(dbar, aggregate([o["ninv"] for o in outs], ws))
        x = server.step(x, dbar)
        if sync:
            shared = {"m": aggregate([o["m"] for o in outs], ws), "v": aggregate([o["v"] for o in outs], ws)}
            if _beta1(st) == 0:
                shared["m"] = np.zeros(d)
            offset += aggregate([float(k) for k in ks], ws)
        xs.append(x.copy())
    return xs


# ------------------------------------------------------------------------------------------ Theorem 2
def theorem2_fixed_point(H, xstar_i, P, lr, tau, w):
    """x̃ = [Σ w_i(I−K_i)]⁻¹ Σ w_i (I−K_i) x_i*,  K_i = (I − η P_i H_i)^τ_i  (P_i diagonal given as vectors)."""
    d = H[0].shape[0]
    lhs, rhs = np.zeros((d, d)), np.zeros(d)
    for Hi, xi, Pi, ti, wi in zip(H, xstar_i, P, tau, w, strict=True):
        Ki = np.linalg.matrix_power(np.eye(d) - lr * np.diag(Pi) @ Hi, ti)
        lhs += wi * (np.eye(d) - Ki)
        rhs += wi * (np.eye(d) - Ki) @ xi
    return np.linalg.solve(lhs, rhs)


def theorem2_limit(H, xstar_i, P, tau, w):
    """lim_{η→0} x̃ = (Σ w_i τ_i P_i H_i)⁻¹ Σ w_i τ_i P_i H_i x_i*  (Eq. 8, γ_i = 1)."""
    d = H[0].shape[0]
    lhs, rhs = np.zeros((d, d)), np.zeros(d)
    for Hi, xi, Pi, ti, wi in zip(H, xstar_i, P, tau, w, strict=True):
        A = wi * ti * np.diag(Pi) @ Hi
        lhs += A
        rhs += A @ xi
    return np.linalg.solve(lhs, rhs)


def global_optimum(H, xstar_i, w):
    """x* = (Σ w_i H_i)⁻¹ Σ w_i H_i x_i*."""
    lhs = sum(wi * Hi for Hi, wi in zip(H, w, strict=True))
    rhs = sum(wi * Hi @ xi for Hi, xi, wi in zip(H, xstar_i, w, strict=True))
    return np.linalg.solve(lhs, rhs)
