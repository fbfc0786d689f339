"""FedLocal: local adaptive FedOpt with restarted client states and local / joint correction.

Paper 000 (seed file ``000_effec18ea8c14ed3.txt``): Jianyu Wang, Zheng Xu, Zachary Garrett, Zachary Charles,
Luyang Liu, Gauri Joshi, *Local Adaptivity in Federated Learning: Convergence and Consistency*, 2021
(called "FedLocal" by the FedDA paper).  Specification: Algorithm 1 of the paper's appendix A.3.

Client (every round, state **restarted**: ``m = 0``, ``v = v₀``, ``s = 0``, ``M = N = 0``), per local step
``k = 1, 2, …`` with mini-batch gradient ``g``::

    s = s₀ + k                                        (s₀ = step_offset: 0, or the synced counter of fedlocal-sync)
    m ← β1·m + (1−β1)·g                              (β1 = 0 ⇒ m = g)
    sgd/sgdm  P = 1
    adagrad   v ← v + g² ;                       P = 1/(√v + ε)
    adam      v ← β2·v + (1−β2)·g² ;             P = 1/(√v + ε)
    yogi      v ← v − (1−β2)·sign(v − g²)·g² ;   P = 1/(√v + ε)
    x ← x − η·c_s·P·m        c_s = √(1−β2^s)/(1−β1^s) for adam/yogi with bias correction, else 1
    M ← β1·M + (1−β1)·P ;  N ← N + M             (correction ≠ none; exact_n: N ← N + c_s·(1−β1^k)·P)

End of round, ``Δ_i = x_t − x``: ``none`` uploads the local model (the server forms ``Δ``), ``local`` uploads
``D_i = Δ_i / N`` (divide-no-nan; ``N ← η·N`` with ``include_lr_in_n``), ``joint`` uploads ``D_i`` and ``Ninv_i = 1/N``.

Server: ``D̄ = mean_i D_i`` (``x_t − mean_i x_i`` without correction); joint: ``D̄ ← D̄ / mean_i Ninv_i``; then a FedOpt
server optimizer (:class:`~flower_strategies.core.server_opt.ServerOptimizer`) in the Keras form (default; what the
paper's Table 5 was tuned with) or the FedOpt form of Reddi et al.

``fedlocal-sync`` (``sync = True``) is the paper's comparison: the server averages the clients' final optimizer states
(``m``, ``v``) and sends them down; clients start the next round from them instead of restarting, and the step counter
continues (``step_offset`` = Σ over past rounds of the mean local steps K̄).

Symbols ↔ variables
-------------------
``η`` = ``group["lr"]``; ``β1`` = :func:`resolved_beta1` (``client_beta1``, or the optimizer default); ``β2`` =
``client_beta2``; ``ε`` = ``client_eps`` (placement ``eps_placement``); ``v₀`` = :func:`resolved_initial_v`; ``x_t`` =
``state["round_start"]``; ``m, v, M, N`` = ``state["m"], state["v"], state["M"], state["N"]``; ``k`` = local step;
``D_i`` / ``Ninv_i`` = uplink records ``"fedlocal-d"`` / ``"fedlocal-ninv"``; synced ``m, v`` = records
``"fedlocal-m"`` / ``"fedlocal-v"``; ``α, ε_s`` = ``server_lr, server_eps``.

Conventions and deviations
--------------------------
* Δ is descent-positive (``x_t − x_local``) everywhere.
* With correction the client uploads ``D_i`` on the trainable parameters only (no model: :attr:`sends_model` is
  False); non-trainable floating buffers then keep the server's value.
* ``client_beta1``, ``server_beta1``, ``server_beta2``, ``server_initial_v``: ``None`` (run-config ``""``) = the
  optimizer / server-form default (A6, A11, A12).
* ``correction`` and ``sync`` are structural (they decide the records exchanged): the optimizer reads them from its
  hyper-parameters, not per ``param_group``; every numeric hyper-parameter is read per group.
* ``exact_n`` assumes restarted momentum (it ignores a synced non-zero ``m₀`` in ``fedlocal-sync``); the sync
  variant's step-counter continuation is our choice (not in the paper).
* Weighting: example-weighted means by default [ref-impl]; Algorithm 1 prints a uniform mean (A2).

Every ambiguity of the paper is a hyper-parameter (see :class:`FedLocalHParams` and ``docs/methods/fedlocal.md``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import numpy as np

from ..core import records as R
from ..core.ops import NamedArrays, safe_divide, writable_like
from ..core.ops import pseudo_gradient
from ..core.server_opt import ServerOptimizer
from ..core.strategy import FedAdaptStrategy, RoundInputs, ServerState
from ..core.validation import RecordSpec
from ..optimizers.fedlocal import (
    ADAPTIVE, CLIENT_OPTIMIZERS, CORRECTIONS, D_RECORD, FedLocalClientHParams, FedLocalHParams, FedLocalOptimizer,
    M_RECORD, NINV_RECORD, SERVER_FORMS, STEP_OFFSET, V_RECORD, resolved_beta1, resolved_initial_v, safe_divide_t,
)

#: This module's names and its client half's (:mod:`flower_strategies.optimizers.fedlocal`, re-exported).
__all__ = [
    "ADAPTIVE", "CLIENT_OPTIMIZERS", "CORRECTIONS", "D_RECORD", "FedLocal", "FedLocalClientHParams",
    "FedLocalHParams", "FedLocalOptimizer", "FedLocalSync", "M_RECORD", "NINV_RECORD", "SERVER_FORMS",
    "STEP_OFFSET", "V_RECORD", "corrected_pseudo_gradient", "fedlocal_server_optimizer", "resolved_beta1",
    "resolved_initial_v", "safe_divide_t",
]


# ------------------------------------------------------------------------------------------ pure server math
def corrected_pseudo_gradient(
    correction: str, current: Mapping[str, np.ndarray], aggregates: Mapping[str, NamedArrays], keys: Iterable[str]
) -> NamedArrays:
    """Server input ``D̄`` of the FedOpt step, per Algorithm 1, in the parameters' dtype and in the round's
    aggregate buffers (no model-sized allocation when they are the round's own).

    none : ``x_t − mean_i x_i`` (from the aggregated local models under ``"arrays"``)
    local: ``mean_i D_i``
    joint: ``mean_i D_i / mean_i Ninv_i`` (divide-no-nan)
    """
    if correction == "none":
        return pseudo_gradient(current, aggregates[R.MODEL], keys)
    out: NamedArrays = {}
    for k in keys:
        if correction == "local":
            out[k] = aggregates[D_RECORD][k]
        elif correction == "joint":
            d, n = aggregates[D_RECORD][k], np.asarray(aggregates[NINV_RECORD][k])
            if writable_like(d, d):
                zero = n == 0
                out[k] = np.divide(d, n, out=d, where=~zero)
                d[zero] = 0.0
            else:
                out[k] = safe_divide(d, n)
        else:
            raise ValueError(f"unknown correction {correction!r}; valid: {', '.join(CORRECTIONS)}")
    return out


# ------------------------------------------------------------------------------------------ strategies

def fedlocal_server_optimizer(h: FedLocalHParams) -> ServerOptimizer:
    """Map ``server_opt`` × ``server_form`` (A12) onto a :class:`ServerOptimizer`.

    keras : SGD; SGDM heavy-ball β1 = 0.9; AdaGrad without momentum, A₀ = 0.1; Adam β1 = 0.9, β2 = 0.999,
            v₀ = 0, bias factor √(1−β2^s)/(1−β1^s) folded into the lr (ε_s not rescaled); Yogi as Adam with
            v₀ = 1 [inferred].
    fedopt: Reddi et al.: momentum β1 = 0.9 on every adaptive server (AdaGrad included), β2 = 0.99, v₀ = ε_s²,
            no bias correction.  In both forms τ = ε_s.
    """
    kind = h.server_opt
    if kind == "sgd":
        return ServerOptimizer("sgd", lr=h.server_lr)
    if h.server_form == "keras":
        beta1, beta2 = (0.0 if kind == "adagrad" else 0.9), 0.999
        v0: float | None = {"adagrad": 0.1, "adam": 0.0, "yogi": 1.0}.get(kind, 0.0)
        bias = "adam" if kind in ("adam", "yogi") else "none"
    else:
        beta1, beta2, v0, bias = 0.9, 0.99, None, "none"
    return ServerOptimizer(
        kind, lr=h.server_lr, tau=h.server_eps, bias_correction=bias,
        beta1=beta1 if h.server_beta1 is None else h.server_beta1,
        beta2=beta2 if h.server_beta2 is None else h.server_beta2,
        initial_v=v0 if h.server_initial_v is None else h.server_initial_v,
    )


class FedLocal(FedAdaptStrategy):
    """Local adaptive FedOpt with restarted (or, ``sync``, server-averaged) client optimizer states."""

    method: ClassVar[str] = "fedlocal"
    hparams_class = FedLocalHParams
    hparams: FedLocalHParams
    local_optimizer = FedLocalOptimizer
    default_weighting: ClassVar[str] = "examples"  # [ref-impl]; Algorithm 1 prints a uniform mean (A2)

    def __init__(self, hparams: FedLocalHParams | None = None, **kwargs: Any) -> None:
        super().__init__(hparams, **kwargs)
        self.opt = fedlocal_server_optimizer(self.hparams)

    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        c = self.hparams.correction
        specs = [RecordSpec(R.MODEL, "mean", "model")] if c == "none" else [RecordSpec(D_RECORD, "mean", "params")]
        if c == "joint":
            specs.append(RecordSpec(NINV_RECORD, "mean", "params"))
        return (*specs, *(RecordSpec(name, "mean", "params", floor=0.0 if name == V_RECORD else None)  # v >= 0
                          for name in self.hparams.sync_records()))

    def init_server_state(self, arrays: NamedArrays) -> ServerState:
        params = {k: arrays[k] for k in self.trainable(arrays)}
        state: ServerState = dict(self.opt.init(params))
        if self.hparams.sync:  # round 1 sends the restart values (m = 0, v = v₀) in the model's dtypes
            restart = {M_RECORD: 0.0, V_RECORD: self.hparams.resolved_initial_v()}
            state.update({
                r: {k: np.full_like(p, restart[r]) for k, p in params.items()} for r in self.hparams.sync_records()
            })
            state[STEP_OFFSET] = float(self.hparams.step_offset)
        return state

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        state = self.server_state or {}
        return {name: state[name] for name in self.hparams.sync_records()}

    def client_config(self, server_round: int) -> dict[str, Any]:
        assert self.server_state is not None
        return {f"{self.method}.{STEP_OFFSET}": self.server_state[STEP_OFFSET]} if self.hparams.sync else {}

    def server_update(
        self, inputs: RoundInputs, state: ServerState
    ) -> tuple[NamedArrays, ServerState, dict[str, float]]:
        keys, current = inputs.trainable, inputs.current
        d_bar = corrected_pseudo_gradient(self.hparams.correction, current, inputs.aggregates, keys)
        sync_keys = (*self.hparams.sync_records(), STEP_OFFSET)
        new_params, opt_state = self.opt.step(
            {k: current[k] for k in keys}, d_bar, {k: v for k, v in state.items() if k not in sync_keys},
            step=inputs.num_updates + 1, server_round=inputs.server_round,
        )
        new_state: ServerState = dict(opt_state)
        if self.hparams.sync:
            new_state.update({name: dict(inputs.aggregates[name]) for name in self.hparams.sync_records()})
            new_state[STEP_OFFSET] = state[STEP_OFFSET] + inputs.mean_steps
        return self.merge_buffers(new_params, current, inputs.aggregates.get(R.MODEL)), new_state, {}


class FedLocalSync(FedLocal):
    """Comparison variant: clients start each round from the server-averaged optimizer states (m, v)."""

    method: ClassVar[str] = "fedlocal-sync"
    hparam_defaults = {"sync": True}
