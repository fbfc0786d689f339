"""Server optimizers of the FedOpt family as pure functions on named arrays.

Reddi et al., *Adaptive Federated Optimization* (ICLR 2021); conventions in ``docs/methods/fedopt.md``.
The input is the aggregated **descent-positive** pseudo-gradient ``D̄ = x_t − mean_i x_i`` (so plain SGD
with ``lr = 1`` and the example-weighted mean is FedAvg).

Update rules (elementwise, ``s`` = number of server steps taken so far, starting at 1)::

    sgd      x ← x − lr·D̄
    sgdm     u ← β1·u + D̄ ;            x ← x − lr·u                 (heavy ball, FedAvgM; u₀ = 0)
    adagrad  m ← β1·m + (1−β1)·D̄ ;     v ← v + D̄²
    adam     m ← β1·m + (1−β1)·D̄ ;     v ← β2·v + (1−β2)·D̄²
    yogi     m ← β1·m + (1−β1)·D̄ ;     v ← v − (1−β2)·D̄²·sign(v − D̄²)
             x ← x − lr_s · m / (√v + τ)       (adaptive three)

Flags (each ambiguity of the sources is explicit):

``initial_v``        ``v₀``; ``None`` means ``τ²`` (Reddi et al.: ``v_{−1} ≥ τ²``). Flower's built-ins use 0.
``bias_correction``  ``"none"`` (Reddi et al.; default) → ``lr_s = lr``;
                     ``"adam"`` → ``lr_s = lr·√(1−β2^s)/(1−β1^s)`` (Keras form, paper 000);
                     ``"flower"`` → the same with exponent ``server_round + 1`` (what Flower 1.42's FedAdam does).
``m₀ = 0`` always.

State (``m``, ``v``) lives in each parameter's dtype (float64 exactness runs: float64; float32 models: float32) and
every update is computed in that dtype, in new arrays.  For float64 parameters the operations (and so the bits) are
those of the textbook float64 expressions above.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .ops import NamedArrays, dtype_of, writable_like

from ..optimizers.baselines import BIAS_CORRECTIONS, SERVER_OPTIMIZERS  # the names hyper-parameters validate

OptimizerState = dict[str, NamedArrays]


@dataclass(frozen=True)
class ServerOptimizer:
    """A FedOpt server optimizer: ``init`` then ``step`` (both pure)."""

    kind: str = "sgd"
    lr: float = 1.0
    beta1: float = 0.0
    beta2: float = 0.99
    tau: float = 1e-3
    initial_v: float | None = None
    bias_correction: str = "none"

    def __post_init__(self) -> None:
        if self.kind not in SERVER_OPTIMIZERS:
            raise ValueError(f"unknown server optimizer {self.kind!r}; valid: {', '.join(SERVER_OPTIMIZERS)}")
        if self.bias_correction not in BIAS_CORRECTIONS:
            raise ValueError(
                f"unknown bias_correction {self.bias_correction!r}; valid: {', '.join(BIAS_CORRECTIONS)}"
            )

    @property
    def adaptive(self) -> bool:
        return self.kind in ("adagrad", "adam", "yogi")

    @property
    def v0(self) -> float:
        return self.tau**2 if self.initial_v is None else float(self.initial_v)

    def init(self, params: Mapping[str, np.ndarray]) -> OptimizerState:
        """Zero momentum (``m_t``) and ``v_t = v₀`` for every key of ``params``, in each parameter's dtype."""
        state: OptimizerState = {}
        if self.kind == "sgd":
            return state
        state["m_t"] = {k: np.zeros(np.shape(p), dtype=dtype_of(p)) for k, p in params.items()}
        if self.adaptive:
            state["v_t"] = {k: np.full(np.shape(p), self.v0, dtype=dtype_of(p)) for k, p in params.items()}
        return state

    def effective_lr(self, step: int, server_round: int) -> float:
        if self.bias_correction == "none" or not self.adaptive:
            return self.lr
        s = float(step) if self.bias_correction == "adam" else float(server_round) + 1.0
        return self.lr * np.sqrt(1.0 - self.beta2**s) / (1.0 - self.beta1**s)

    def step(
        self,
        params: Mapping[str, np.ndarray],
        pseudo_grad: Mapping[str, np.ndarray],
        state: OptimizerState,
        *,
        step: int,
        server_round: int,
        reuse_grad: bool = False,
    ) -> tuple[NamedArrays, OptimizerState]:
        """Return ``(new_params, new_state)`` in new arrays (inputs untouched; the strategy base commits them only
        when every value is finite).  ``reuse_grad=True``: the new parameters are written into ``pseudo_grad``'s
        arrays where they can take them (buffers the caller owns: the round's aggregate), the same operations in
        the same order, so the same bits."""
        lr_s = float(self.effective_lr(step, server_round))
        b1, b2, tau = self.beta1, self.beta2, self.tau
        new_params: NamedArrays = {}
        new_state: OptimizerState = {name: {} for name in state}
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for k, x in params.items():
                d = np.asarray(pseudo_grad[k], dtype_of(x))
                if self.kind == "sgd":
                    upd = d
                elif self.kind == "sgdm":
                    upd = new_state["m_t"][k] = state["m_t"][k] * b1 + d
                else:
                    m = new_state["m_t"][k] = state["m_t"][k] * b1 + d * (1.0 - b1)
                    v_old, d2 = state["v_t"][k], d * d
                    if self.kind == "adagrad":
                        v = v_old + d2
                    elif self.kind == "adam":
                        v = v_old * b2 + d2 * (1.0 - b2)
                    else:  # yogi
                        v = v_old - d2 * (1.0 - b2) * np.sign(v_old - d2)
                    new_state["v_t"][k] = v
                    upd = m / (np.sqrt(v) + tau)
                out = d if reuse_grad and writable_like(d, x) else None
                new_params[k] = np.subtract(x, np.multiply(upd, lr_s, out=out), out=out)
        return new_params, new_state
