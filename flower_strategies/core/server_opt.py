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
every update is computed in that dtype, a cache-sized chunk at a time, without model-sized temporaries;
``step(..., in_place=True)`` (what the strategies use) writes the new parameters into the pseudo-gradient's buffer
and updates ``m``/``v`` in place once a check pass has shown every new value finite.  For float64 parameters the
operations (and so the bits) are those of the textbook float64 expressions above.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .ops import NamedArrays, apply_update, dtype_of, owned

SERVER_OPTIMIZERS = ("sgd", "sgdm", "adagrad", "adam", "yogi")
BIAS_CORRECTIONS = ("none", "adam", "flower")

ServerState = dict[str, NamedArrays]


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

    def init(self, params: Mapping[str, np.ndarray]) -> ServerState:
        """Zero momentum (``m_t``) and ``v_t = v₀`` for every key of ``params``, in each parameter's dtype."""
        state: ServerState = {}
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
        state: ServerState,
        *,
        step: int,
        server_round: int,
        in_place: bool = False,
    ) -> tuple[NamedArrays, ServerState]:
        """Return ``(new_params, new_state)``.  ``in_place=False``: pure (new arrays; inputs untouched).
        ``in_place=True``: the new parameters go into ``pseudo_grad``'s arrays (a caller-owned temporary) and the
        state arrays are updated in place — after a check pass that proves every new value finite
        (:func:`~.ops.chunked`); if one would not be, nothing is written and the pure path's (non-finite) result is
        returned, which the strategy base then refuses to commit."""
        lr_s = float(self.effective_lr(step, server_round))
        kernel = self._kernel(lr_s)
        names = [n for n in ("m_t", "v_t") if n in state]
        keys = list(params)
        jobs = []
        for k in keys:
            x, d = np.asarray(params[k]), np.asarray(pseudo_grad[k])
            olds = [state[n][k] for n in names]
            outs = [d if in_place and owned(d, x) else None] + [o if in_place and owned(o, x) else None for o in olds]
            jobs.append((outs, [x, d, *olds]))
        results = apply_update(kernel, jobs, temps=3, persistent=range(1, 1 + len(names)))
        new_state: ServerState = {name: {k: outs[1 + j] for k, outs in zip(keys, results)}
                                  for j, name in enumerate(names)}
        return {k: outs[0] for k, outs in zip(keys, results)}, new_state

    def _kernel(self, lr_s: float):
        """The elementwise update on chunks: ``o = [x_new, m, v]``, ``i = [x, D̄, m_old, v_old]`` (as present),
        ``t`` three scratch chunks.  Alias-safe: ``x_new`` may be ``D̄``'s memory, ``m``/``v`` the old state's."""
        kind, b1, b2, tau = self.kind, self.beta1, self.beta2, self.tau

        def kernel(o, i, t):
            x, dc = i[0], i[1]
            tc, t2c, t3c = t
            if kind == "sgd":
                upd = dc
            elif kind == "sgdm":  # u = β1·u + D̄
                mc = o[1]
                np.multiply(i[2], b1, out=mc)
                np.add(mc, dc, out=mc)
                upd = mc
            else:
                mc, vc, m_old, v_old = o[1], o[2], i[2], i[3]
                np.multiply(m_old, b1, out=mc)  # m = β1·m + (1−β1)·D̄
                np.add(mc, np.multiply(dc, 1.0 - b1, out=tc), out=mc)
                d2 = np.multiply(dc, dc, out=t2c)  # D̄²
                if kind == "adagrad":  # v = v + D̄²
                    np.add(v_old, d2, out=vc)
                elif kind == "adam":  # v = β2·v + (1−β2)·D̄²
                    np.multiply(v_old, b2, out=vc)
                    np.add(vc, np.multiply(d2, 1.0 - b2, out=d2), out=vc)
                else:  # yogi: v = v − (1−β2)·D̄²·sign(v − D̄²)
                    sign = np.sign(np.subtract(v_old, d2, out=t3c), out=t3c)
                    np.multiply(d2, 1.0 - b2, out=d2)
                    np.subtract(v_old, np.multiply(d2, sign, out=d2), out=vc)
                upd = np.sqrt(vc, out=tc)  # m / (√v + τ)
                np.add(upd, tau, out=upd)
                np.divide(mc, upd, out=upd)
            step_ = np.multiply(upd, lr_s, out=tc)  # x − lr_s·upd
            np.subtract(x, step_, out=o[0])

        return kernel
