"""The client half of :mod:`flower_strategies.methods.fedlocal`: its hyper-parameters, local optimizer and record
names.  A device imports this module (through :mod:`flower_strategies.optimizers`), never the strategy."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..core.params import ConfigError, HParams, param
from ..core.local import EPS_PLACEMENTS, LocalOptimizer, Named, inverse_sqrt
from .baselines import SERVER_OPTIMIZERS

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
