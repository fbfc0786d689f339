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

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from .ops import CHUNK, NamedArrays, dtype_of, writable_like

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
        in_place: bool = False,
    ) -> tuple[NamedArrays, OptimizerState]:
        """Return ``(new_params, new_state)``, by default in new arrays (inputs untouched; the strategy base commits
        them only when every value is finite).

        ``in_place=True`` (FedOpt's round, which owns ``pseudo_grad``'s arrays: the round's aggregate): when a dry run
        shows every new value finite, the state's arrays are updated in place and the new parameters written into
        ``pseudo_grad``'s arrays, so the round needs no model copy beyond its aggregate; otherwise new arrays, as by
        default (and the commit refuses them).  Every path runs the same operations in the same order
        (:meth:`_update`, chunk by chunk: the same bits)."""
        lr_s = float(self.effective_lr(step, server_round))
        names = [name for name in ("m_t", "v_t") if name in state]
        grads = {k: np.asarray(pseudo_grad[k], dtype_of(x)) for k, x in params.items()}
        owned = in_place and all(writable_like(grads[k], x) and all(writable_like(state[n][k], x) for n in names)
                                 for k, x in params.items())
        if owned and self._finite_dry_run(params, grads, state, lr_s):
            new_params, new_state = grads, state
        else:
            new_params = {k: np.empty_like(d) for k, d in grads.items()}
            new_state = {n: {k: np.empty_like(a) for k, a in state[n].items()} for n in names}
        for k, x in params.items():
            outs = (new_params[k], *(new_state[n][k] for n in names))
            for part in _chunks(np.asarray(x), grads[k], *(state[n][k] for n in names), *outs):
                self._update(list(part[:2 + len(names)]), list(part[2 + len(names):]), lr_s)
        return new_params, new_state

    def _finite_dry_run(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray],
                        state: OptimizerState, lr_s: float) -> bool:
        """Whether every new value would be finite (the update run chunk by chunk into scratch, nothing written)."""
        names = [name for name in ("m_t", "v_t") if name in state]
        for k, x in params.items():
            scratch = [np.empty(min(CHUNK, np.size(x)), dtype_of(x)) for _ in range(1 + len(names))]
            for part in _chunks(np.asarray(x), grads[k], *(state[n][k] for n in names)):
                outs = [b[: part[0].size] for b in scratch]
                self._update(list(part), outs, lr_s)
                if not all(np.isfinite(o).all() for o in outs):
                    return False
        return True

    def _update(self, inputs: list[np.ndarray], outs: list[np.ndarray], lr_s: float) -> None:
        """One chunk: ``inputs`` = (x, D̄[, m[, v]]) → ``outs`` = (x', [m', [v']]), flat arrays of one dtype; an
        output may be its input's own array (m' into m) or D̄'s (x' into D̄).  One scratch chunk."""
        x, d, *old = inputs
        ox, *new = outs
        b1, b2, tau = self.beta1, self.beta2, self.tau
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            if self.kind == "sgd":
                np.multiply(d, lr_s, out=ox)  # (d may be ox: read before written, element by element)
            elif self.kind == "sgdm":
                upd = np.add(np.multiply(old[0], b1, out=new[0]), d, out=new[0])
                np.multiply(upd, lr_s, out=ox)
            else:
                m = np.add(np.multiply(old[0], b1, out=new[0]), d * (1.0 - b1), out=new[0])
                d2 = d * d
                if self.kind == "adagrad":
                    v = np.add(old[1], d2, out=new[1])
                elif self.kind == "adam":
                    v = np.add(np.multiply(old[1], b2, out=new[1]), np.multiply(d2, 1.0 - b2, out=d2), out=new[1])
                else:  # yogi: v − (1−β2)·D̄²·sign(v − D̄²), the sign of the old v
                    sign = np.sign(old[1] - d2)
                    v = np.subtract(old[1], np.multiply(np.multiply(d2, 1.0 - b2, out=d2), sign, out=d2),
                                    out=new[1])
                np.multiply(np.divide(m, np.add(np.sqrt(v), tau), out=d2), lr_s, out=ox)
            np.subtract(x, ox, out=ox)


def _chunks(*arrays: np.ndarray) -> Iterator[tuple[np.ndarray, ...]]:
    """The flat views of ``arrays`` (one shape), :data:`.ops.CHUNK` elements at a time."""
    flats = [a.reshape(-1) for a in arrays]
    for start in range(0, flats[0].size if flats else 0, CHUNK):
        yield tuple(f[start:start + CHUNK] for f in flats)
