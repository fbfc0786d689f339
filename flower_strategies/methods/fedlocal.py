"""FedLocal: local adaptive FedOpt with restarted client states and local / joint correction.

Paper 000 (seed file ``000_effec18ea8c14ed3.txt``): Jianyu Wang, Zheng Xu, Zachary Garrett, Zachary Charles,
Luyang Liu, Gauri Joshi, *Local Adaptivity in Federated Learning: Convergence and Consistency*, 2021
(called "FedLocal" by the FedDA paper).  Specification: ALGORITHMS.md §1 (Algorithm 1 of the paper's appendix A.3).

Client (every round, state **restarted**: ``m = 0``, ``v = v₀``, ``s = 0``, ``M = N = 0``), per local step with
mini-batch gradient ``g``::

    s += 1
    m ← β1·m + (1−β1)·g                              (β1 = 0 ⇒ m = g)
    sgd/sgdm  P = 1
    adagrad   v ← v + g² ;                       P = 1/(√v + ε)
    adam      v ← β2·v + (1−β2)·g² ;             P = 1/(√v + ε)
    yogi      v ← v − (1−β2)·sign(v − g²)·g² ;   P = 1/(√v + ε)
    x ← x − η·c_s·P·m        c_s = √(1−β2^s)/(1−β1^s) for adam/yogi with bias correction, else 1
    M ← β1·M + (1−β1)·P ;  N ← N + M             (only when correction ≠ none)

End of round, ``Δ_i = x_t − x``: ``none`` uploads the local model (the server forms ``Δ``), ``local`` uploads
``D_i = Δ_i / N`` (divide-no-nan), ``joint`` uploads ``D_i`` and ``Ninv_i = 1/N``.

Server: ``D̄ = mean_i D_i`` (``x_t − mean_i x_i`` without correction); joint: ``D̄ ← D̄ / mean_i Ninv_i``; then a FedOpt
server optimizer (:class:`~flower_strategies.core.server_opt.ServerOptimizer`) in the Keras form (default; what the
paper's Table 5 was tuned with) or the FedOpt form of Reddi et al.

``fedlocal-sync`` is the paper's comparison: the server averages the clients' final optimizer states (``m``,
``v``) and sends them down; clients start the next round from them instead of restarting (extra uplink and
downlink records, counted in the round's bytes).

Every ambiguity of ALGORITHMS.md §1.6 is a hyper-parameter (see :class:`FedLocalHParams` and
``docs/methods/fedlocal.md``).
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
from ..core.local import LocalOptimizer, Named
from ..core.ops import NamedArrays, safe_divide
from ..core.registry import register
from ..core.server_opt import SERVER_OPTIMIZERS, ServerOptimizer, ServerState
from ..core.strategy import FedAdaptStrategy, RecordSpec

CLIENT_OPTIMIZERS = ("sgd", "sgdm", "adagrad", "adam", "yogi")
CORRECTIONS = ("none", "local", "joint")
EPS_PLACEMENTS = ("outside", "inside", "none")
SERVER_FORMS = ("keras", "fedopt")

#: Uplink record names (besides the model under ``"arrays"`` when correction = none).
D_RECORD = "fedlocal-d"
NINV_RECORD = "fedlocal-ninv"
#: Optimizer-state records of ``fedlocal-sync`` (uplink: client's final state; downlink: the average).
M_RECORD = "fedlocal-m"
V_RECORD = "fedlocal-v"

#: Round-config keys (resolved values) read by :class:`FedLocalOptimizer`.
CFG = {
    "client_opt": "fedlocal.client-opt",
    "correction": "fedlocal.correction",
    "beta1": "fedlocal.beta1",
    "beta2": "fedlocal.beta2",
    "eps": "fedlocal.eps",
    "eps_placement": "fedlocal.eps-placement",
    "initial_v": "fedlocal.initial-v",
    "bias_correction": "fedlocal.bias-correction",
    "include_lr_in_n": "fedlocal.include-lr-in-n",
    "exact_n": "fedlocal.exact-n",
    "step_offset": "fedlocal.step-offset",
}


# ------------------------------------------------------------------------------------------ hparams
@dataclass(frozen=True)
class FedLocalHParams(HParams):
    """Hyper-parameters of ``fedlocal`` / ``fedlocal-sync`` (run-config keys ``<method>.<field-with-dashes>``)."""

    client_opt: str = param("adagrad", choices=CLIENT_OPTIMIZERS, help="client optimizer (state restarted every round)")
    correction: str = param("none", choices=CORRECTIONS, help="none | local (upload Δ/N) | joint (also 1/N; server rescales)")
    client_beta1: float = param(-1.0, hi=1.0, help="client momentum β1 (EMA form); <0 = 0.9 for sgdm/adam/yogi, 0 for sgd/adagrad (A6, A11)")
    client_beta2: float = param(0.999, lo=0.0, hi=1.0, help="client second-moment decay β2 (adam, yogi) (A11)")
    client_eps: float = param(1e-7, lo=0.0, help="client ε in P = 1/(√v+ε) (paper: fixed 1e-7)")
    eps_placement: str = param("outside", choices=EPS_PLACEMENTS, help="P = 1/(√v+ε) (outside, Keras) | 1/√(v+ε) (inside) | 1/√v (none, Eq. 3) (A5)")
    initial_accumulator: float = param(0.1, lo=0.0, help="AdaGrad initial accumulator acc0 (Keras default; A5, A11)")
    adam_initial_v: float = param(0.0, lo=0.0, help="Adam initial second moment (A11)")
    yogi_initial_v: float = param(1.0, lo=0.0, help="Yogi initial second moment (authors' utility; A11)")
    adam_bias_correction: bool = param(True, help="client Adam/Yogi step factor c_s = √(1−β2^s)/(1−β1^s) (A7)")
    include_lr_in_n: bool = param(False, help="N_i = η·Σ_k M_k (Sec. 5) instead of Σ_k M_k (Algorithm 1 / code) (A1)")
    exact_n: bool = param(False, help="N_i = Σ_k c_k·(1−β1^(k+1))·P_k, the exact weight of the gradients in Δ_i (A3)")
    server_opt: str = param("adagrad", choices=SERVER_OPTIMIZERS, help="server optimizer (FedOpt family)")
    server_form: str = param("keras", choices=SERVER_FORMS, help="keras (Table 5) | fedopt (Reddi et al.) server semantics (A12)")
    server_lr: float = param(0.1, lo=0.0, help="server learning rate α")
    server_eps: float = param(1e-3, lo=0.0, help="server adaptivity ε_s (τ)")
    server_beta1: float = param(-1.0, hi=1.0, help="server β1; <0 = form default (keras: 0 AdaGrad, 0.9 else; fedopt: 0.9)")
    server_beta2: float = param(-1.0, hi=1.0, help="server β2; <0 = form default (keras 0.999, fedopt 0.99)")
    server_initial_v: float = param(-1.0, help="server v₀; <0 = form default (keras: 0.1 AdaGrad, 0 Adam, 1 Yogi; fedopt: ε_s²)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.client_beta1 >= 1.0:
            raise ConfigError(f"client-beta1 = {self.client_beta1} must be < 1 (negative = optimizer default)")
        if self.eps_placement == "none" and self.client_opt in ("adagrad", "adam", "yogi") and self.resolved_initial_v() <= 0:
            raise ConfigError("eps-placement = none needs a positive initial second moment (P = 1/sqrt(v) with v0 = 0 is infinite)")

    # -------------------------------------------------------------- resolved client settings
    def resolved_beta1(self) -> float:
        if self.client_beta1 >= 0:
            return float(self.client_beta1)
        return 0.9 if self.client_opt in ("sgdm", "adam", "yogi") else 0.0

    def resolved_initial_v(self) -> float:
        return {"adagrad": self.initial_accumulator, "adam": self.adam_initial_v, "yogi": self.yogi_initial_v}.get(
            self.client_opt, 0.0
        )

    def client_config(self) -> dict[str, Any]:
        """The round-config entries (resolved, scalar) the client optimizer is built from."""
        return {
            CFG["client_opt"]: self.client_opt,
            CFG["correction"]: self.correction,
            CFG["beta1"]: self.resolved_beta1(),
            CFG["beta2"]: float(self.client_beta2),
            CFG["eps"]: float(self.client_eps),
            CFG["eps_placement"]: self.eps_placement,
            CFG["initial_v"]: float(self.resolved_initial_v()),
            CFG["bias_correction"]: bool(self.adam_bias_correction),
            CFG["include_lr_in_n"]: bool(self.include_lr_in_n),
            CFG["exact_n"]: bool(self.exact_n),
        }


def make_server_optimizer(hp: FedLocalHParams) -> ServerOptimizer:
    """Map ``server_opt`` × ``server_form`` (ALGORITHMS.md §1.3, A12) onto a :class:`ServerOptimizer`.

    keras : SGD; SGDM heavy-ball β1 = 0.9; AdaGrad without momentum, A₀ = 0.1; Adam β1 = 0.9, β2 = 0.999, v₀ = 0,
            bias factor √(1−β2^s)/(1−β1^s) folded into the lr (ε_s not rescaled); Yogi as Adam with v₀ = 1 [inferred].
    fedopt: Reddi et al.: momentum β1 = 0.9 on every adaptive server (AdaGrad included), β2 = 0.99, v₀ = ε_s²,
            no bias correction.  In both forms τ = ε_s.
    """
    kind, form = hp.server_opt, hp.server_form
    if kind == "sgd":
        return ServerOptimizer("sgd", lr=hp.server_lr)
    if form == "keras":
        beta1 = 0.0 if kind == "adagrad" else 0.9
        beta2 = 0.999
        v0: float | None = {"adagrad": 0.1, "adam": 0.0, "yogi": 1.0}.get(kind, 0.0)
        bias = "adam" if kind in ("adam", "yogi") else "none"
    else:
        beta1, beta2, v0, bias = 0.9, 0.99, None, "none"
    if hp.server_beta1 >= 0:
        beta1 = hp.server_beta1
    if hp.server_beta2 >= 0:
        beta2 = hp.server_beta2
    if hp.server_initial_v >= 0:
        v0 = hp.server_initial_v
    return ServerOptimizer(kind, lr=hp.server_lr, beta1=beta1, beta2=beta2, tau=hp.server_eps, initial_v=v0, bias_correction=bias)


# ------------------------------------------------------------------------------------------ pure server math
def pseudo_gradient(
    correction: str, current: Mapping[str, np.ndarray], aggregates: Mapping[str, NamedArrays], keys: Iterable[str]
) -> NamedArrays:
    """Server input ``D̄`` (float64) of the FedOpt step, per ALGORITHMS.md §1.3.

    none : ``x_t − mean_i x_i`` (from the aggregated local models under ``"arrays"``)
    local: ``mean_i D_i``
    joint: ``mean_i D_i / mean_i Ninv_i`` (divide-no-nan)
    """
    out: NamedArrays = {}
    for k in keys:
        if correction == "none":
            out[k] = np.asarray(current[k], np.float64) - np.asarray(aggregates[R.MODEL][k], np.float64)
        elif correction == "local":
            out[k] = np.asarray(aggregates[D_RECORD][k], np.float64)
        elif correction == "joint":
            out[k] = safe_divide(
                np.asarray(aggregates[D_RECORD][k], np.float64), np.asarray(aggregates[NINV_RECORD][k], np.float64)
            )
        else:
            raise ValueError(f"unknown correction {correction!r}; valid: {', '.join(CORRECTIONS)}")
    return out


# ------------------------------------------------------------------------------------------ strategies
class FedLocal(FedAdaptStrategy):
    """Local adaptive FedOpt with restarted client optimizer states (+ local / joint correction)."""

    method: ClassVar[str] = "fedlocal"
    hparams_class = FedLocalHParams
    default_weighting: ClassVar[str] = "examples"  # [ref-impl]; Algorithm 1 prints a uniform mean (A2)
    #: True for the synchronized-state comparison (``fedlocal-sync``).
    sync: ClassVar[bool] = False

    def __init__(self, hparams: FedLocalHParams | None = None, **kwargs: Any) -> None:
        super().__init__(hparams, **kwargs)
        self.step_offset = 0.0
        self.sync_state: dict[str, NamedArrays] = {}

    # -------------------------------------------------------------- records
    def sync_records(self) -> tuple[str, ...]:
        """Optimizer-state records exchanged by ``fedlocal-sync`` (none for plain SGD, which has no state)."""
        if not self.sync:
            return ()
        names: list[str] = []
        if self.hparams.resolved_beta1() > 0:
            names.append(M_RECORD)
        if self.hparams.client_opt in ("adagrad", "adam", "yogi"):
            names.append(V_RECORD)
        return tuple(names)

    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        c = self.hparams.correction
        specs = [RecordSpec(R.MODEL, "mean", "model")] if c == "none" else [RecordSpec(D_RECORD, "mean", "params")]
        if c == "joint":
            specs.append(RecordSpec(NINV_RECORD, "mean", "params"))
        specs += [RecordSpec(name, "mean", "params") for name in self.sync_records()]
        return tuple(specs)

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        return {name: self.sync_state[name] for name in self.sync_records()}

    def round_config(self, server_round: int) -> dict[str, Any]:
        cfg = super().round_config(server_round)
        cfg.update(self.hparams.client_config())
        if self.sync:
            cfg[CFG["step_offset"]] = float(self.step_offset)
        return cfg

    # -------------------------------------------------------------- server
    def init_state(self, arrays: NamedArrays) -> None:
        params = {k: arrays[k] for k in self.trainable(arrays)}
        self.opt = make_server_optimizer(self.hparams)
        self.opt_state: ServerState = self.opt.init(params)
        # fedlocal-sync round 1: the restart values (m = 0, v = v₀), in the model's dtypes.
        v0 = self.hparams.resolved_initial_v()
        self.sync_state = {
            M_RECORD: {k: np.zeros_like(p) for k, p in params.items()},
            V_RECORD: {k: np.full_like(p, v0) for k, p in params.items()},
        }
        self.step_offset = 0.0

    def server_update(self, server_round: int, current: NamedArrays, aggregates: Mapping[str, NamedArrays]) -> NamedArrays:
        keys = self.trainable(current)
        d_bar = pseudo_gradient(self.hparams.correction, current, aggregates, keys)
        new_params, self.opt_state = self.opt.step(
            {k: current[k] for k in keys}, d_bar, self.opt_state, step=self.num_updates, server_round=server_round
        )
        if self.sync:
            for name in self.sync_records():
                self.sync_state[name] = {k: aggregates[name][k] for k in keys}
            self.step_offset += self._mean_steps()
        return self.merge_buffers(new_params, current, aggregates.get(R.MODEL))

    def _mean_steps(self) -> float:
        """Mean local steps of this round's replies (same weights as the records): the synced step counter."""
        pairs = [(float(m.get(R.NUM_STEPS, 0.0)), float(m[R.NUM_EXAMPLES])) for m in self.reply_metrics]
        if not pairs:
            return 0.0
        if self.weighting == "uniform":
            return sum(k for k, _ in pairs) / len(pairs)
        return sum(k * n for k, n in pairs) / sum(n for _, n in pairs)


class FedLocalSync(FedLocal):
    """Comparison variant: clients start each round from the server-averaged optimizer states (m, v)."""

    method: ClassVar[str] = "fedlocal-sync"
    sync: ClassVar[bool] = True


# ------------------------------------------------------------------------------------------ client
def safe_divide_t(num: Tensor, den: Tensor) -> Tensor:
    """Elementwise ``num / den`` with 0 where ``den == 0`` (torch twin of :func:`flower_strategies.core.ops.safe_divide`)."""
    nz = den != 0
    return torch.where(nz, num / torch.where(nz, den, torch.ones_like(den)), torch.zeros_like(num))


class FedLocalOptimizer(LocalOptimizer):
    """Client optimizer of ``fedlocal``: SGD / SGDM / AdaGrad / Adam / Yogi with correction accumulators.

    A fresh instance every round = the paper's restart (``m = 0``, ``v = initial_v``, ``s = 0``, ``M = N = 0``).
    ``fixed_preconditioner`` (debug/tests only, not reachable from a run-config) replaces the computed ``P``
    by a given ``{name: Tensor}`` – the preconditioned GD of Theorem 2.
    """

    config_keys: ClassVar[dict[str, str]] = {R.CLIENT_LR: "lr", **{v: k for k, v in CFG.items()}}
    #: ``fedlocal-sync``: initialise m, v from the downlink and upload the final ones.
    sync: ClassVar[bool] = False

    def __init__(
        self,
        params: Iterable[tuple[str, Tensor]],
        lr: float = 0.1,
        client_opt: str = "adagrad",
        correction: str = "none",
        beta1: float = 0.0,
        beta2: float = 0.999,
        eps: float = 1e-7,
        eps_placement: str = "outside",
        initial_v: float = 0.1,
        bias_correction: bool = True,
        include_lr_in_n: bool = False,
        exact_n: bool = False,
        step_offset: float = 0.0,
        fixed_preconditioner: Mapping[str, Tensor] | None = None,
    ) -> None:
        if client_opt not in CLIENT_OPTIMIZERS:
            raise ConfigError(f"unknown client optimizer {client_opt!r}; valid: {', '.join(CLIENT_OPTIMIZERS)}")
        if correction not in CORRECTIONS:
            raise ConfigError(f"unknown correction {correction!r}; valid: {', '.join(CORRECTIONS)}")
        if eps_placement not in EPS_PLACEMENTS:
            raise ConfigError(f"unknown eps placement {eps_placement!r}; valid: {', '.join(EPS_PLACEMENTS)}")
        if lr < 0 or not 0 <= beta1 < 1 or not 0 <= beta2 <= 1 or eps < 0 or initial_v < 0:
            raise ConfigError(f"invalid client settings lr={lr}, beta1={beta1}, beta2={beta2}, eps={eps}, initial_v={initial_v}")
        super().__init__(params, {"lr": float(lr)})
        self.client_opt = client_opt
        self.correction = correction
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        self.eps_placement = eps_placement
        self.initial_v = float(initial_v)
        self.bias_correction = bool(bias_correction) and client_opt in ("adam", "yogi")
        self.include_lr_in_n = bool(include_lr_in_n)
        self.exact_n = bool(exact_n)
        self.step_offset = float(step_offset)
        self.fixed_preconditioner = dict(fixed_preconditioner) if fixed_preconditioner is not None else None
        self.local_step = 0
        #: Instance attribute (shadows the class default): with correction the model is replaced by D_i.
        self.sends_model = correction == "none"
        self._reset_state()

    @property
    def adaptive(self) -> bool:
        return self.client_opt in ("adagrad", "adam", "yogi")

    def _reset_state(self) -> None:
        for _, p, _ in self.named_params():
            st = self.state[p]
            st["m"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if self.adaptive:
                st["v"] = torch.full_like(p, self.initial_v)
            if self.correction != "none":
                st["M"] = torch.zeros_like(p)
                st["N"] = torch.zeros_like(p)

    def begin_round(self, downlink=None, persistent=None) -> None:  # type: ignore[override]
        super().begin_round(downlink, persistent)
        self.local_step = 0
        if self.sync and downlink:
            for name, p, _ in self.named_params():
                st = self.state[p]
                if M_RECORD in downlink:
                    st["m"].copy_(downlink[M_RECORD][name].to(p))
                if V_RECORD in downlink and self.adaptive:
                    st["v"].copy_(downlink[V_RECORD][name].to(p))

    def _precondition(self, v: Tensor) -> Tensor:
        if self.eps_placement == "outside":
            return 1.0 / (v.sqrt() + self.eps)
        if self.eps_placement == "inside":
            return 1.0 / (v + self.eps).sqrt()
        return 1.0 / v.sqrt()

    def step_factor(self, s: float) -> float:
        """``c_s`` (1 unless Adam/Yogi with bias correction)."""
        if not self.bias_correction:
            return 1.0
        return math.sqrt(1.0 - self.beta2**s) / (1.0 - self.beta1**s)

    @torch.no_grad()
    def apply_step(self) -> None:
        self.local_step += 1
        s = self.step_offset + self.local_step
        c = self.step_factor(s)
        b1, b2 = self.beta1, self.beta2
        for name, p, group in self.named_params():
            if p.grad is None:
                continue
            g = p.grad
            st = self.state[p]
            m = st["m"]
            if b1 == 0.0:
                m.copy_(g)
            else:
                m.mul_(b1).add_(g, alpha=1.0 - b1)
            precond: Tensor | None = None
            if self.adaptive:
                v = st["v"]
                g2 = g * g
                if self.client_opt == "adagrad":
                    v.add_(g2)
                elif self.client_opt == "adam":
                    v.mul_(b2).add_(g2, alpha=1.0 - b2)
                else:  # yogi
                    v.sub_((1.0 - b2) * torch.sign(v - g2) * g2)
                precond = self._precondition(v)
            if self.fixed_preconditioner is not None:
                precond = self.fixed_preconditioner[name].to(p)
            upd = m if precond is None else m * precond
            p.add_(upd, alpha=-group["lr"] * c)
            if self.correction != "none":
                pk = torch.ones_like(p) if precond is None else precond
                if self.exact_n:
                    st["N"].add_(pk, alpha=c * (1.0 - b1**self.local_step))
                else:
                    st["M"].mul_(b1).add_(pk, alpha=1.0 - b1)
                    st["N"].add_(st["M"])

    def correction_matrix(self) -> Named:
        """``N_i`` per parameter (times η when ``include_lr_in_n``)."""
        out: Named = {}
        for name, p, group in self.named_params():
            n = self.state[p]["N"]
            out[name] = n * group["lr"] if self.include_lr_in_n else n.clone()
        return out

    def end_round(self) -> dict[str, Named]:
        up: dict[str, Named] = {}
        if self.correction != "none":
            n = self.correction_matrix()
            up[D_RECORD] = {}
            for name, p, _ in self.named_params():
                up[D_RECORD][name] = safe_divide_t(self.round_start[name] - p.detach(), n[name])
            if self.correction == "joint":
                up[NINV_RECORD] = {name: safe_divide_t(torch.ones_like(t), t) for name, t in n.items()}
        if self.sync:
            if self.beta1 > 0:
                up[M_RECORD] = {name: self.state[p]["m"].clone() for name, p, _ in self.named_params()}
            if self.adaptive:
                up[V_RECORD] = {name: self.state[p]["v"].clone() for name, p, _ in self.named_params()}
        return up


class FedLocalSyncOptimizer(FedLocalOptimizer):
    """``fedlocal-sync`` client: starts from the downlinked averaged states, uploads its final states."""

    sync: ClassVar[bool] = True


_PAPER = (
    "Wang, Xu, Garrett, Charles, Liu, Joshi: Local Adaptivity in Federated Learning: Convergence and Consistency, 2021"
)
register(
    FedLocal, FedLocalOptimizer, paper=_PAPER,
    summary="restarted local SGD/SGDM/AdaGrad/Adam/Yogi + none/local/joint correction + FedOpt server",
)
register(
    FedLocalSync, FedLocalSyncOptimizer, paper=_PAPER,
    summary="FedLocal with server-averaged client optimizer states (paper's comparison; extra communication)",
)
