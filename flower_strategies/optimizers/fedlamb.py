"""The client half of :mod:`flower_strategies.methods.fedlamb`: its hyper-parameters, local optimizer and record
names.  A device imports this module (through :mod:`flower_strategies.optimizers`), never the strategy."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from ..core.params import ConfigError, HParams, param
from ..core.local import EPS_PLACEMENTS, LocalOptimizer, Named, inverse_sqrt

#: Records: downlink server v̂ and its step count s_v, uplink local v; persistent client state names.
V_HAT = "v_hat"
V_STEPS = "v_steps"
V_LOCAL = "v"
STATE_M = "fedlamb_m"
STATE_M_STEPS = "fedlamb_m_steps"

VHAT_MODES = ("local_max", "server_fixed", "none")
FEDLAMB_BIAS_CORRECTIONS = ("global", "as_written", "none")
M_STEP_COUNTS = ("client", "global")
GRADIENT_POINTS = ("current", "round_start")
LAYER_GROUPINGS = ("tensor", "module")


# ------------------------------------------------------------------------------------------ pure kernels
def trust_ratio(w_norm: Tensor, u_norm: Tensor, phi_min: float = 0.0, phi_max: float | None = None) -> Tensor:
    """LAMB trust ratio ``φ(‖θ‖)/‖u‖`` with ``φ`` = identity clipped to ``[phi_min, phi_max]``, or 1 when either
    norm is 0 (A6)."""
    phi = torch.clamp(w_norm, min=phi_min, max=phi_max)
    ok = (w_norm > 0) & (u_norm > 0)
    return torch.where(ok, phi / torch.where(ok, u_norm, torch.ones_like(u_norm)), torch.ones_like(w_norm))


def bias_factors(
    mode: str, beta1: float, beta2: float, t: int, m_steps: Any, v_steps: float
) -> tuple[Any, float]:
    """``(1−β1^{s_m}, 1−β2^{s_v+t})`` for ``global``; ``(1−β1^t, 1−β2^t)`` for ``as_written``; ``(1, 1)`` for ``none``.

    ``m_steps`` = s_m (already including this step), ``v_steps`` = s_v (steps before this round), ``t`` = local step.
    """
    if mode == "global":
        return 1.0 - beta1**m_steps, 1.0 - beta2 ** (v_steps + t)
    if mode == "as_written":
        return 1.0 - beta1**t, 1.0 - beta2**t
    return 1.0, 1.0


def layer_groups(names: Iterable[str], mode: str) -> list[list[str]]:
    """Parameter names grouped into layers: one per tensor, or per module-name prefix (``fc1.weight`` → ``fc1``)."""
    if mode == "tensor":
        return [[n] for n in names]
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(n.rsplit(".", 1)[0], []).append(n)
    return list(groups.values())


def parse_milestones(text: str) -> tuple[int, ...]:
    """``"30,70"`` → ``(30, 70)``; empty → ``()``."""
    try:
        out = tuple(sorted(int(s) for s in text.replace(" ", "").split(",") if s))
    except ValueError:
        raise ConfigError(f"lr-milestones must be comma-separated round numbers, got {text!r}") from None
    if any(m < 1 for m in out):
        raise ConfigError(f"lr-milestones must be >= 1, got {text!r}")
    return out


# ------------------------------------------------------------------------------------------ declaration
@dataclass(frozen=True)
class FedLAMBHParams(HParams):
    """Fed-LAMB (``trust_ratio=True``) and Fed-AMS (``trust_ratio=False``): local AMSGrad, model averaging and
    ``v̂ ← max(v̂, mean v_i)``."""

    trust_ratio: bool = param(True, client=True, help="layer-wise LAMB trust ratio φ(‖θ_ℓ‖)/‖u_ℓ‖ (false = Fed-AMS)")
    beta1: float = param(0.9, lo=0.0, hi=1.0, client=True, help="first-moment decay β1 (< 1)")
    beta2: float = param(0.999, lo=0.0, hi=1.0, client=True, help="second-moment decay β2 (< 1)")
    eps: float = param(1e-8, lo=0.0, client=True, help="ε of the denominator (A9)")
    eps_placement: str = param(
        "outside", choices=EPS_PLACEMENTS, client=True, help="outside: √v+ε (paper) | inside: √(v+ε) | none: √v",
    )
    weight_decay: float = param(
        0.0, lo=0.0, client=True, help="decoupled weight decay λ added to the direction: u = p + λθ",
    )
    vhat_mode: str = param(
        "local_max", choices=VHAT_MODES, client=True, help="denominator: local_max (A2) | server_fixed | none",
    )
    bias_correction: str = param(
        "global", choices=FEDLAMB_BIAS_CORRECTIONS, client=True,
        help="global | as_written (local t, corrected v up) | none (A4)",
    )
    m_step_count: str = param(
        "client", choices=M_STEP_COUNTS, client=True, help="s_m for global bias correction: client | global (A4)",
    )
    gradient_point: str = param(
        "current", choices=GRADIENT_POINTS, client=True, help="current iterate (A1) | round_start (line 8 literally)",
    )
    stateless: bool = param(False, client=True, help="reset m to 0 every round instead of carrying it per client (A7)")
    layers: str = param(
        "tensor", choices=LAYER_GROUPINGS, client=True, help="trust-ratio layer = each parameter tensor | each module",
    )
    phi_min: float = param(0.0, lo=0.0, client=True, help="lower clipping bound of φ")
    phi_max: float | None = param(
        None, lo=0.0, lo_open=True, client=True, help="upper clipping bound of φ (empty = none)",
    )
    lr_milestones: str = param(
        "", help="comma-separated rounds after which client-lr is multiplied by lr-gamma (e.g. '30,70')",
    )
    lr_gamma: float = param(0.1, lo=0.0, help="client-lr decay factor at each milestone")

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        self.milestones()
        if self.beta1 >= 1.0 or self.beta2 >= 1.0:
            raise ConfigError(f"{name}.beta1 and {name}.beta2 must be < 1 (got {self.beta1}, {self.beta2})")
        if self.phi_max is not None and self.phi_min > self.phi_max:
            raise ConfigError(f"{name}.phi_min = {self.phi_min} must be <= {name}.phi_max = {self.phi_max}")
        if not self.trust_ratio and (self.layers != "tensor" or self.phi_min != 0.0 or self.phi_max is not None):
            raise ConfigError(
                f"{name}.layers, {name}.phi_min and {name}.phi_max only act with {name}.trust_ratio = true"
            )

    def milestones(self) -> tuple[int, ...]:
        """The parsed :attr:`lr_milestones`."""
        return parse_milestones(self.lr_milestones)


# ------------------------------------------------------------------------------------------ client
class FedLAMBOptimizer(LocalOptimizer):
    """Fed-LAMB / Fed-AMS local optimizer (Algorithm 1 lines 5–14 of paper 004; see the module docstring).

    Downlink: ``"v_hat"`` (v̂) and ``"v_steps"`` (``{"s_v": s_v}``).  Uplink: ``"v"``.  Client state:
    ``"fedlamb_m"`` (m) and ``"fedlamb_m_steps"`` (``{"count": s_m}``), absent when ``stateless`` (an
    optimizer-wide setting, read from :attr:`hparams`; every other hyper-parameter is read per param group).
    A trust-ratio layer never spans two param groups.
    """

    hparams_class = FedLAMBHParams
    hparams: FedLAMBHParams

    def downlink_records(self) -> tuple[str, ...]:
        return (V_HAT, V_STEPS)

    @property
    def v_steps(self) -> float:
        """s_v: local steps since the server's v̂ was zero (before this round)."""
        return float(torch.as_tensor(self.downlink[V_STEPS]["s_v"]).reshape(-1)[0])

    @property
    def m_steps0(self) -> int | Tensor:
        """Steps accumulated in the persisted m before this round (0 when it starts from zero); with stacked clients
        one count per client (a float64 tensor of shape (C,))."""
        if self.hparams.stateless or STATE_M not in self.client_state_in:
            return 0
        count = self.client_state_in.get(STATE_M_STEPS, {}).get("count")
        if count is None:
            return 0
        if self.clients is not None:
            return torch.as_tensor(count).reshape(self.clients, -1)[:, 0].double()
        return int(torch.as_tensor(count).reshape(-1)[0])

    def init_state(self, name: str, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        v_hat = self.received(V_HAT, name, p)
        v_hat = torch.zeros_like(p) if v_hat is None else v_hat
        m = None if self.hparams.stateless else self.saved(STATE_M, name, p)
        state["exp_avg"] = torch.zeros_like(p) if m is None else m
        state["exp_avg_sq"] = v_hat.clone()
        if group["vhat_mode"] == "local_max":
            state["max_exp_avg_sq"] = v_hat
        elif group["vhat_mode"] == "server_fixed":
            state["v_hat"] = v_hat
        if group["gradient_point"] == "round_start":
            state["iterate"] = p.detach().clone()

    def amsgrad_direction(self, grad: Tensor, state: dict[str, Any], group: dict[str, Any], t: int) -> Tensor:
        """``p = m̂ / (√v_max + ε)`` after updating the raw EMAs ``m``, ``v`` and the running max ``v_max``."""
        beta1, beta2 = group["beta1"], group["beta2"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        s_m = self.v_steps + t if group["m_step_count"] == "global" else self.m_steps0 + t
        bc1, bc2 = bias_factors(group["bias_correction"], beta1, beta2, t, s_m, self.v_steps)
        bc1 = self.per_client(bc1, m)
        v_c = v / bc2
        if group["vhat_mode"] == "local_max":
            den = torch.maximum(state["max_exp_avg_sq"], v_c, out=state["max_exp_avg_sq"])
        elif group["vhat_mode"] == "server_fixed":
            den = state["v_hat"]
        else:
            den = v_c
        return (m / bc1) * inverse_sqrt(den, group["eps"], group["eps_placement"])

    def apply_step(self) -> None:
        t = self.steps_taken + 1
        for group in self.param_groups:
            params = dict(zip(group["param_names"], group["params"], strict=True))
            for layer in layer_groups(group["param_names"], group["layers"]):
                ps = [params[n] for n in layer if params[n].grad is not None]
                if not ps:
                    continue
                states = [self.state[p] for p in ps]
                thetas = [st["iterate"] if group["gradient_point"] == "round_start" else p
                          for p, st in zip(ps, states, strict=True)]
                u = [self.amsgrad_direction(p.grad, st, group, t) for p, st in zip(ps, states, strict=True)]
                if group["weight_decay"]:
                    u = [u_j.add(theta, alpha=group["weight_decay"]) for u_j, theta in zip(u, thetas, strict=True)]
                ratio: float | Tensor = 1.0
                if group["trust_ratio"]:
                    ratio = trust_ratio(self._norm(thetas), self._norm(u), group["phi_min"], group["phi_max"])
                for theta, u_j in zip(thetas, u, strict=True):
                    theta.sub_(u_j * self.per_client(ratio, u_j) * group["lr"])

    def _norm(self, tensors: list[Tensor]) -> Tensor:
        """Joint L2 norm of a layer's tensors (per client when clients are stacked)."""
        return torch.sqrt(cast(Tensor, sum(self.client_sum(x.pow(2)) for x in tensors)))

    def uplink_arrays(self) -> dict[str, Named]:
        """``{"v": v}`` (bias-corrected with the local t under ``as_written``).  Under ``gradient_point =
        round_start`` this also writes the iterate into the model: the round ends here."""
        v_up: Named = {}
        for name, p, group in self.named_params():
            st = self.state[p]
            if group["gradient_point"] == "round_start":
                with torch.no_grad():
                    p.copy_(st["iterate"])
            v = st["exp_avg_sq"]
            if group["bias_correction"] == "as_written":
                v = v / (1.0 - group["beta2"] ** self.steps_taken)
            v_up[name] = v.detach().clone()
        return {V_LOCAL: v_up}

    def persistent_arrays(self) -> dict[str, Named]:
        if self.hparams.stateless:
            return {}
        m = {name: self.state[p]["exp_avg"].detach().clone() for name, p, _ in self.named_params()}
        count = torch.tensor([self.m_steps0 + self.steps_taken], dtype=torch.int64)
        return {STATE_M: m, STATE_M_STEPS: {"count": count}}
