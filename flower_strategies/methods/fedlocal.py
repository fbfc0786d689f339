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

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..core import records as R
from ..core.hparams import ConfigError, HParams, param
from ..core.local import EPS_PLACEMENTS, LocalOptimizer, Named, inverse_sqrt
from ..core.ops import NamedArrays, owned, safe_divide
from ..core.ops import pseudo_gradient as model_pseudo_gradient
from ..core.registry import register
from ..core.server_opt import SERVER_OPTIMIZERS, ServerOptimizer
from ..core.strategy import FedAdaptStrategy, RoundInputs, ServerState
from ..core.validation import RecordSpec

CLIENT_OPTIMIZERS = ("sgd", "sgdm", "adagrad", "adam", "yogi")
ADAPTIVE = ("adagrad", "adam", "yogi")
CORRECTIONS = ("none", "local", "joint")
SERVER_FORMS = ("keras", "fedopt")

#: Uplink record names (besides the model under ``"arrays"`` when correction = none).
D_RECORD = "fedlocal-d"
NINV_RECORD = "fedlocal-ninv"
#: Optimizer-state records of ``fedlocal-sync`` (uplink: client's final state; downlink: the average).
M_RECORD = "fedlocal-m"
V_RECORD = "fedlocal-v"
#: Server-state entry of ``fedlocal-sync``'s step counter.
STEP_OFFSET = "step-offset"


def resolved_beta1(h: Mapping[str, Any]) -> float:
    """β1: ``client_beta1``, or (not set) 0.9 for sgdm/adam/yogi and 0 for sgd/adagrad (A6, A11)."""
    if h["client_beta1"] is not None:
        return float(h["client_beta1"])
    return 0.9 if h["client_opt"] in ("sgdm", "adam", "yogi") else 0.0


def resolved_initial_v(h: Mapping[str, Any]) -> float:
    """v₀ of the client optimizer (0 for sgd/sgdm, which have no v)."""
    return {"adagrad": h["initial_accumulator"], "adam": h["adam_initial_v"], "yogi": h["yogi_initial_v"]}.get(
        h["client_opt"], 0.0
    )


# ------------------------------------------------------------------------------------------ hparams
@dataclass(frozen=True)
class FedLocalClientHParams(HParams):
    """The client optimizer's hyper-parameters (sent every round under ``<method>.<field-with-dashes>``)."""

    client_opt: str = param(
        "adagrad", choices=CLIENT_OPTIMIZERS, client=True, help="client optimizer (state restarted every round)",
    )
    correction: str = param(
        "none", choices=CORRECTIONS, client=True, help="none | local (upload Δ/N) | joint (also 1/N; server rescales)",
    )
    sync: bool = param(
        False, client=True,
        help="start from the server-averaged optimizer states m, v and step counter (fedlocal-sync)",
    )
    step_offset: float = param(
        0.0, lo=0.0, client=True,
        help="sync: steps already taken by the synced state (the server advances it by K̄ each round)",
    )
    client_beta1: float | None = param(
        None, lo=0.0, hi=1.0, client=True,
        help="client momentum β1 (EMA form); empty = 0.9 for sgdm/adam/yogi, 0 for sgd/adagrad (A6, A11)",
    )
    client_beta2: float = param(
        0.999, lo=0.0, hi=1.0, client=True, help="client second-moment decay β2 (adam, yogi) (A11)",
    )
    client_eps: float = param(1e-7, lo=0.0, client=True, help="client ε in P = 1/(√v+ε) (paper: fixed 1e-7)")
    eps_placement: str = param(
        "outside", choices=EPS_PLACEMENTS, client=True,
        help="P = 1/(√v+ε) (outside, Keras) | 1/√(v+ε) (inside) | 1/√v (none, Eq. 3) (A5)",
    )
    initial_accumulator: float = param(
        0.1, lo=0.0, client=True, help="AdaGrad initial accumulator acc0 (Keras default; A5, A11)",
    )
    adam_initial_v: float = param(0.0, lo=0.0, client=True, help="Adam initial second moment (A11)")
    yogi_initial_v: float = param(1.0, lo=0.0, client=True, help="Yogi initial second moment (authors' utility; A11)")
    adam_bias_correction: bool = param(
        True, client=True, help="client Adam/Yogi step factor c_s = √(1−β2^s)/(1−β1^s) (A7)",
    )
    include_lr_in_n: bool = param(
        False, client=True, help="N_i = η·Σ_k M_k (Sec. 5) instead of Σ_k M_k (Algorithm 1 / code) (A1)",
    )
    exact_n: bool = param(
        False, client=True, help="N_i = Σ_k c_k·(1−β1^k)·P_k, the exact weight of the gradients in Δ_i (A3)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.client_beta1 is not None and self.client_beta1 >= 1.0:
            raise ConfigError(f"client-beta1 = {self.client_beta1} must be < 1 (empty = the optimizer's default)")
        if self.eps_placement == "none" and self.client_opt in ADAPTIVE and self.resolved_initial_v() <= 0:
            raise ConfigError(
                "eps-placement = none needs a positive initial second moment (P = 1/sqrt(v) with v0 = 0 is infinite)"
            )
        if self.step_offset and not self.sync:
            raise ConfigError("step-offset is the synced step counter; it must be 0 unless sync = true (fedlocal-sync)")

    def resolved_beta1(self) -> float:
        return resolved_beta1(vars(self))

    def resolved_initial_v(self) -> float:
        return resolved_initial_v(vars(self))

    def sync_records(self) -> tuple[str, ...]:
        """Optimizer-state records exchanged with ``sync`` (m if β1 > 0, v if adaptive; none for plain SGD)."""
        if not self.sync:
            return ()
        return (M_RECORD,) * (self.resolved_beta1() > 0) + (V_RECORD,) * (self.client_opt in ADAPTIVE)


@dataclass(frozen=True)
class FedLocalHParams(FedLocalClientHParams):
    """Hyper-parameters of ``fedlocal`` / ``fedlocal-sync``: the client's plus the server optimizer's."""

    server_opt: str = param("adagrad", choices=SERVER_OPTIMIZERS, help="server optimizer (FedOpt family)")
    server_form: str = param(
        "keras", choices=SERVER_FORMS, help="keras (Table 5) | fedopt (Reddi et al.) server semantics (A12)",
    )
    server_lr: float = param(0.1, lo=0.0, help="server learning rate α")
    server_eps: float = param(1e-3, lo=0.0, help="server adaptivity ε_s (τ)")
    server_beta1: float | None = param(
        None, lo=0.0, hi=1.0, help="server β1; empty = form default (keras: 0 AdaGrad, 0.9 else; fedopt: 0.9)",
    )
    server_beta2: float | None = param(
        None, lo=0.0, hi=1.0, help="server β2; empty = form default (keras 0.999, fedopt 0.99)",
    )
    server_initial_v: float | None = param(
        None, lo=0.0, help="server v₀; empty = form default (keras: 0.1 AdaGrad, 0 Adam, 1 Yogi; fedopt: ε_s²)",
    )

    def server_optimizer(self) -> ServerOptimizer:
        """Map ``server_opt`` × ``server_form`` (A12) onto a :class:`ServerOptimizer`.

        keras : SGD; SGDM heavy-ball β1 = 0.9; AdaGrad without momentum, A₀ = 0.1; Adam β1 = 0.9, β2 = 0.999,
                v₀ = 0, bias factor √(1−β2^s)/(1−β1^s) folded into the lr (ε_s not rescaled); Yogi as Adam with
                v₀ = 1 [inferred].
        fedopt: Reddi et al.: momentum β1 = 0.9 on every adaptive server (AdaGrad included), β2 = 0.99, v₀ = ε_s²,
                no bias correction.  In both forms τ = ε_s.
        """
        kind = self.server_opt
        if kind == "sgd":
            return ServerOptimizer("sgd", lr=self.server_lr)
        if self.server_form == "keras":
            beta1, beta2 = (0.0 if kind == "adagrad" else 0.9), 0.999
            v0: float | None = {"adagrad": 0.1, "adam": 0.0, "yogi": 1.0}.get(kind, 0.0)
            bias = "adam" if kind in ("adam", "yogi") else "none"
        else:
            beta1, beta2, v0, bias = 0.9, 0.99, None, "none"
        return ServerOptimizer(
            kind, lr=self.server_lr, tau=self.server_eps, bias_correction=bias,
            beta1=beta1 if self.server_beta1 is None else self.server_beta1,
            beta2=beta2 if self.server_beta2 is None else self.server_beta2,
            initial_v=v0 if self.server_initial_v is None else self.server_initial_v,
        )


# ------------------------------------------------------------------------------------------ pure server math
def pseudo_gradient(
    correction: str, current: Mapping[str, np.ndarray], aggregates: Mapping[str, NamedArrays], keys: Iterable[str]
) -> NamedArrays:
    """Server input ``D̄`` of the FedOpt step, per Algorithm 1, in the parameters' dtype and in the round's
    aggregate buffers (no model-sized allocation when they are the round's own).

    none : ``x_t − mean_i x_i`` (from the aggregated local models under ``"arrays"``)
    local: ``mean_i D_i``
    joint: ``mean_i D_i / mean_i Ninv_i`` (divide-no-nan)
    """
    if correction == "none":
        return model_pseudo_gradient(current, aggregates[R.MODEL], keys)
    out: NamedArrays = {}
    for k in keys:
        if correction == "local":
            out[k] = aggregates[D_RECORD][k]
        elif correction == "joint":
            d, n = aggregates[D_RECORD][k], np.asarray(aggregates[NINV_RECORD][k])
            if owned(d, d):
                zero = n == 0
                out[k] = np.divide(d, n, out=d, where=~zero)
                d[zero] = 0.0
            else:
                out[k] = safe_divide(d, n)
        else:
            raise ValueError(f"unknown correction {correction!r}; valid: {', '.join(CORRECTIONS)}")
    return out


# ------------------------------------------------------------------------------------------ client
def safe_divide_t(num: Tensor, den: Tensor) -> Tensor:
    """Elementwise ``num / den`` with 0 where ``den == 0`` (torch twin of
    :func:`flower_strategies.core.ops.safe_divide`)."""
    nz = den != 0
    return torch.where(nz, num / torch.where(nz, den, torch.ones_like(den)), torch.zeros_like(num))


class FedLocalOptimizer(LocalOptimizer):
    """Client optimizer of ``fedlocal``: SGD / SGDM / AdaGrad / Adam / Yogi with correction accumulators.

    A fresh instance every round = the paper's restart (``m = 0``, ``v = v₀``, ``s = 0``, ``M = N = 0``); with
    ``sync=True`` ``m`` and ``v`` start from the downlink records ``"fedlocal-m"`` / ``"fedlocal-v"`` instead, and the
    final ones are uploaded.  :meth:`preconditioner` is the hook for ``P`` (Theorem 2's fixed-P analysis overrides it).
    """

    hparams_class = FedLocalClientHParams
    hparams: FedLocalClientHParams

    @property
    def sends_model(self) -> bool:  # type: ignore[override]
        """With correction the reply carries ``D_i`` (and ``Ninv_i``) instead of the local model."""
        return self.hparams.correction == "none"

    def downlink_records(self) -> tuple[str, ...]:
        return self.hparams.sync_records()

    def _start(self, record: str, name: str, p: Tensor, restart: Tensor) -> Tensor:
        """The synced start value of ``m``/``v`` when ``record`` is exchanged, else the restart value."""
        if record not in self.downlink_records():
            return restart
        value = self.received(record, name, p)
        if value is None:
            raise ValueError(f"{type(self).__name__}: downlink record {record!r} has no entry for parameter {name!r}")
        return value

    def init_state(self, name: str, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["m"] = self._start(M_RECORD, name, p, torch.zeros_like(p))
        if group["client_opt"] in ADAPTIVE:
            state["v"] = self._start(V_RECORD, name, p, torch.full_like(p, resolved_initial_v(group)))
        if self.hparams.correction != "none":
            state["M"], state["N"] = torch.zeros_like(p), torch.zeros_like(p)

    def preconditioner(self, name: str, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> Tensor | None:
        """``P`` of this step (``None`` = 1 for sgd/sgdm)."""
        if group["client_opt"] not in ADAPTIVE:
            return None
        return inverse_sqrt(state["v"], group["client_eps"], group["eps_placement"])

    def update_param(self, name: str, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        k = self.steps_taken + 1
        s = group["step_offset"] + k
        opt, b1, b2 = group["client_opt"], resolved_beta1(group), group["client_beta2"]
        m = state["m"].mul_(b1).add_(grad, alpha=1.0 - b1)
        if opt == "adagrad":
            state["v"].add_(grad * grad)
        elif opt == "adam":
            state["v"].mul_(b2).add_(grad * grad, alpha=1.0 - b2)
        elif opt == "yogi":
            g2 = grad * grad
            state["v"].sub_((1.0 - b2) * torch.sign(state["v"] - g2) * g2)
        P = self.preconditioner(name, p, state, group)
        c = math.sqrt(1.0 - b2**s) / (1.0 - b1**s) if opt in ("adam", "yogi") and group["adam_bias_correction"] else 1.0
        p.add_(m if P is None else m * P, alpha=-group["lr"] * c)
        if self.hparams.correction != "none":
            P = torch.ones_like(p) if P is None else P
            if group["exact_n"]:
                state["N"].add_(P, alpha=c * (1.0 - b1**k))
            else:
                state["M"].mul_(b1).add_(P, alpha=1.0 - b1)
                state["N"].add_(state["M"])

    def correction_matrix(self) -> Named:
        """``N_i`` per parameter (times η when ``include_lr_in_n``)."""
        return {
            name: st["N"] * group["lr"] if group["include_lr_in_n"] else st["N"].clone()
            for name, _, group, st in self._states()
        }

    def _states(self) -> Iterable[tuple[str, Tensor, dict[str, Any], dict[str, Any]]]:
        for name, p, group in self.named_params():
            yield name, p, group, self.state[p]

    def uplink_arrays(self) -> dict[str, Named]:
        up: dict[str, Named] = {}
        if self.hparams.correction != "none":
            n = self.correction_matrix()
            up[D_RECORD] = {
                name: safe_divide_t(st["round_start"] - p.detach(), n[name]) for name, p, _, st in self._states()
            }
            if self.hparams.correction == "joint":
                up[NINV_RECORD] = {name: safe_divide_t(torch.ones_like(t), t) for name, t in n.items()}
        for record, key in ((M_RECORD, "m"), (V_RECORD, "v")):
            if record in self.hparams.sync_records():
                up[record] = {name: st[key].clone() for name, _, _, st in self._states()}
        return up


# ------------------------------------------------------------------------------------------ strategies
class FedLocal(FedAdaptStrategy):
    """Local adaptive FedOpt with restarted (or, ``sync``, server-averaged) client optimizer states."""

    method: ClassVar[str] = "fedlocal"
    hparams_class = FedLocalHParams
    hparams: FedLocalHParams
    local_optimizer = FedLocalOptimizer
    default_weighting: ClassVar[str] = "examples"  # [ref-impl]; Algorithm 1 prints a uniform mean (A2)

    def __init__(self, hparams: FedLocalHParams | None = None, **kwargs: Any) -> None:
        super().__init__(hparams, **kwargs)
        self.opt = self.hparams.server_optimizer()

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
        d_bar = pseudo_gradient(self.hparams.correction, current, inputs.aggregates, keys)
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


_PAPER = (
    "Wang, Xu, Garrett, Charles, Liu, Joshi: Local Adaptivity in Federated Learning: Convergence and Consistency, 2021"
)
register(
    FedLocal, paper=_PAPER,
    summary="restarted local SGD/SGDM/AdaGrad/Adam/Yogi + none/local/joint correction + FedOpt server",
)
register(
    FedLocalSync, paper=_PAPER,
    summary="FedLocal with server-averaged client optimizer states (paper's comparison; extra communication)",
)
