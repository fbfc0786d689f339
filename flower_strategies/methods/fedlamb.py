"""Fed-LAMB and Fed-AMS: layer-wise and dimension-wise local AMSGrad (paper 004), plus Adp-Fed.

Paper: *FED-LAMB: Layer-wise and Dimension-wise Locally Adaptive Optimization* (Belhal Karimi, Xiaoyun Li,
Ping Li; Baidu Research, 2021), seed file ``004_0cb0825507252aef.txt`` — Algorithm 1, §3.2 and
appendix A (Adp-Fed).  Spec: ALGORITHMS.md §5.  Fed-AMS is local AMSGrad with moment averaging (Chen et al.,
*Toward Communication Efficient Adaptive Gradient Method*, 2020) as used in 004; Adp-Fed is FedAdam (Reddi et
al., ICLR 2021) as written in 004's appendix A.1.

Client round (all operations per coordinate, ``t = 1..T`` local steps, round ``r``)::

    θ ← θ̄ ;  m ← m_i (persisted, else 0) ;  v ← v̂ ;  v_max ← v̂            # v̂ = server record "v_hat"
    g      = ∇f_i(θ; batch_t)                     # at the current iterate (A1; flag gradient_point)
    m      = β1·m + (1−β1)·g ;   v = β2·v + (1−β2)·g²                       # raw EMAs are the state (A3)
    m̂      = m / (1−β1^{s_m}) ;  v_hat = v / (1−β2^{s_v+t})                # bias correction (A4)
    v_max  = max(v_max, v_hat)                                              # local AMSGrad max (A2)
    p      = m̂ / (√v_max + ε)                                               # ε outside the sqrt (A9)
    for each layer ℓ:   u = p_ℓ + λ·θ_ℓ
        Fed-LAMB:  θ_ℓ ← θ_ℓ − α_r · φ(‖θ_ℓ‖)/‖u‖ · u      (ratio 1 if ‖θ_ℓ‖ = 0 or ‖u‖ = 0, A6)
        Fed-AMS:   θ_ℓ ← θ_ℓ − α_r · u
    upload θ_i^T (record "arrays") and v_i = v (record "v", raw EMA) ; persist m_i and s_m

Server::

    θ̄ ← mean_i θ_i^T ;   v̂ ← max(v̂, mean_i v_i) ;   s_v ← s_v + mean_i K_i      (uniform mean by default)

Symbol ↔ variable map
---------------------
``θ`` parameter ``p`` (``FedLAMBOptimizer``); ``m`` ``exp_avg``; ``v`` ``exp_avg_sq``; ``v_max``
``max_exp_avg_sq``; ``v̂`` server ``FedAMS.v_hat`` / downlink record ``"v_hat"``; ``v_i`` uplink record ``"v"``;
``α_r`` ``client-lr`` (``client_lr_at``, optional milestones); ``β1, β2, ε, λ`` ``beta1, beta2, eps,
weight_decay``; ``φ`` identity clipped to ``[phi_min, phi_max]``; ``s_v`` config ``lamb-v-steps``;
``s_m`` persisted ``fedlamb_m_steps``.

Conventions and deviations (each is a flag; defaults = ALGORITHMS.md §5.6)
--------------------------------------------------------------------------
* ``gradient_point`` (A1): ``current`` (default) | ``round_start`` (line 8 literally: every step uses the
  gradient of its own mini-batch at θ^0; the iterate is kept in a shadow buffer and written back at the end).
* ``vhat_mode`` (A2): ``local_max`` (default) | ``server_fixed`` (denominator = the received v̂, unchanged during the
  round) | ``none`` (plain Adam denominator v_hat).
* ``bias_correction`` (A4): ``global`` (default; ``s_v`` = local steps since v̂ was zero, sent by the server;
  ``s_m`` per ``m_step_count``) | ``as_written`` (local ``t`` for both, and the *corrected* v is uploaded) | ``none``.
  ``m_step_count``: ``client`` (default; steps this client's m has accumulated, persisted) | ``global`` (``s_v + t``).
* ``eps_placement``: ``outside`` (default, paper) ``√v+ε`` | ``inside`` ``√(v+ε)``.
* ``stateless`` (A7): False (default; m carried across this client's participations via ``Context.state``,
  zeros for a client sampled for the first time) | True (m = 0 every round).
* Zero-norm layers (A6): trust ratio 1 (the published code skips such layers; we do not).
* Layers: each parameter tensor (``layers="tensor"``, default) or each module (``layers="module"``: the tensors
  sharing a module-name prefix, e.g. ``fc1.weight`` + ``fc1.bias``, share one ratio computed from the joint norms).
* Server (A5, A8): one v̂ updated at the end of round r and broadcast in round r+1; one shared initial model; the
  mean runs over the participants only.  ``s_v`` grows by the uniform mean of the participants' reported
  ``num-steps`` (= T when ``local-steps`` is fixed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..core import records as R
from .baselines import FedAdam, FedAdamHParams
from ..core.hparams import ConfigError, HParams, param
from ..core.local import LocalOptimizer, Named, SGDOptimizer
from ..core.ops import NamedArrays
from ..core.registry import register
from ..core.strategy import FedAdaptStrategy, RecordSpec

#: Record names (downlink server v̂, uplink local v) and persistent client state names.
V_HAT = "v_hat"
V_LOCAL = "v"
STATE_M = "fedlamb_m"
STATE_M_STEPS = "fedlamb_m_steps"

VHAT_MODES = ("local_max", "server_fixed", "none")
BIAS_CORRECTIONS = ("global", "as_written", "none")
M_STEP_COUNTS = ("client", "global")
EPS_PLACEMENTS = ("outside", "inside")
GRADIENT_POINTS = ("current", "round_start")
LAYER_GROUPINGS = ("tensor", "module")

# Round-config keys (server → client).
K_BETA1, K_BETA2, K_EPS, K_WD = "lamb-beta1", "lamb-beta2", "lamb-eps", "lamb-weight-decay"
K_VHAT, K_BC, K_MCOUNT = "lamb-vhat-mode", "lamb-bias-correction", "lamb-m-step-count"
K_EPSPL, K_GRADPT, K_STATELESS = "lamb-eps-placement", "lamb-gradient-point", "lamb-stateless"
K_VSTEPS, K_LAYERS, K_PHI_MIN, K_PHI_MAX = "lamb-v-steps", "lamb-layers", "lamb-phi-min", "lamb-phi-max"


# ------------------------------------------------------------------------------------------ pure kernels
def phi_clip(w_norm: Tensor, phi_min: float = 0.0, phi_max: float = 0.0) -> Tensor:
    """φ: identity clipped to ``[phi_min, phi_max]`` (``phi_max <= 0`` = no upper bound)."""
    out = torch.clamp(w_norm, min=phi_min)
    return torch.clamp(out, max=phi_max) if phi_max > 0 else out


def trust_ratio(w_norm: Tensor, u_norm: Tensor, phi_min: float = 0.0, phi_max: float = 0.0) -> Tensor:
    """LAMB trust ratio ``φ(‖θ‖)/‖u‖``, or 1 when either norm is 0 (ALGORITHMS.md §5.6 A6)."""
    ok = (w_norm > 0) & (u_norm > 0)
    ratio = phi_clip(w_norm, phi_min, phi_max) / torch.where(ok, u_norm, torch.ones_like(u_norm))
    return torch.where(ok, ratio, torch.ones_like(ratio))


def bias_factors(
    mode: str, beta1: float, beta2: float, t: int, m_steps: float, v_steps: float
) -> tuple[float, float]:
    """``(1−β1^{s_m}, 1−β2^{s_v+t})`` for ``global``; ``(1−β1^t, 1−β2^t)`` for ``as_written``; ``(1, 1)`` for ``none``.

    ``m_steps`` = s_m (already including this step), ``v_steps`` = s_v (steps before this round), ``t`` = local step.
    """
    if mode == "none":
        return 1.0, 1.0
    if mode == "as_written":
        return 1.0 - beta1**t, 1.0 - beta2**t
    if mode == "global":
        return 1.0 - beta1**m_steps, 1.0 - beta2 ** (v_steps + t)
    raise ValueError(f"unknown bias_correction {mode!r}; valid: {', '.join(BIAS_CORRECTIONS)}")


def merge_vhat(v_hat: NamedArrays, mean_v: Mapping[str, np.ndarray]) -> NamedArrays:
    """Server line 16: ``v̂ ← max(v̂, mean_i v_i)`` elementwise, in float64."""
    return {k: np.maximum(np.asarray(v, dtype=np.float64), np.asarray(mean_v[k], dtype=np.float64)) for k, v in v_hat.items()}


def layer_groups(names: Iterable[str], mode: str) -> list[list[str]]:
    """Parameter names grouped into layers: one per tensor, or per module-name prefix (``fc1.weight`` → ``fc1``)."""
    names = list(names)
    if mode == "tensor":
        return [[n] for n in names]
    if mode != "module":
        raise ValueError(f"unknown layer grouping {mode!r}; valid: {', '.join(LAYER_GROUPINGS)}")
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(n.rsplit(".", 1)[0] if "." in n else n, []).append(n)
    return list(groups.values())


def parse_milestones(text: str) -> tuple[int, ...]:
    """``"30,70"`` → ``(30, 70)``; empty → ``()``."""
    text = text.strip()
    if not text:
        return ()
    try:
        out = tuple(sorted(int(s) for s in text.replace(" ", "").split(",") if s))
    except ValueError:
        raise ConfigError(f"lr-milestones must be comma-separated round numbers, got {text!r}") from None
    if any(m < 1 for m in out):
        raise ConfigError(f"lr-milestones must be >= 1, got {text!r}")
    return out


# ------------------------------------------------------------------------------------------ hparams
@dataclass(frozen=True)
class FedAMSHParams(HParams):
    """Fed-AMS: local AMSGrad, model averaging and ``v̂ ← max(v̂, mean v_i)`` (paper 004's baseline)."""

    beta1: float = param(0.9, lo=0.0, hi=1.0, help="first-moment decay β1")
    beta2: float = param(0.999, lo=0.0, hi=1.0, help="second-moment decay β2")
    eps: float = param(1e-8, lo=0.0, help="ε of the denominator (A9)")
    weight_decay: float = param(0.0, lo=0.0, help="decoupled weight decay λ added to the direction: u = p + λθ")
    vhat_mode: str = param("local_max", choices=VHAT_MODES, help="denominator: local_max (A2) | server_fixed | none")
    bias_correction: str = param("global", choices=BIAS_CORRECTIONS, help="global | as_written (local t, corrected v up) | none (A4)")
    m_step_count: str = param("client", choices=M_STEP_COUNTS, help="s_m for global bias correction: client | global (A4)")
    eps_placement: str = param("outside", choices=EPS_PLACEMENTS, help="outside: √v+ε (paper) | inside: √(v+ε)")
    gradient_point: str = param("current", choices=GRADIENT_POINTS, help="current iterate (A1) | round_start (line 8 literally)")
    stateless: bool = param(False, help="reset m to 0 every round instead of carrying it per client (A7)")
    lr_milestones: str = param("", help="comma-separated rounds after which client-lr is multiplied by lr-gamma (e.g. '30,70')")
    lr_gamma: float = param(0.1, lo=0.0, help="client-lr decay factor at each milestone")

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_milestones(self.lr_milestones)
        if self.beta1 >= 1.0 or self.beta2 >= 1.0:
            name = type(self).__name__
            raise ConfigError(f"{name}.beta1 and {name}.beta2 must be < 1 (got {self.beta1}, {self.beta2})")


@dataclass(frozen=True)
class FedLAMBHParams(FedAMSHParams):
    """Fed-LAMB: Fed-AMS with the layer-wise trust ratio ``φ(‖θ_ℓ‖)/‖p_ℓ + λθ_ℓ‖``."""

    layers: str = param("tensor", choices=LAYER_GROUPINGS, help="a layer = each parameter tensor | each module")
    phi_min: float = param(0.0, lo=0.0, help="lower clipping bound of φ (0 = none)")
    phi_max: float = param(0.0, lo=0.0, help="upper clipping bound of φ (0 = none)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.phi_max > 0 and self.phi_min > self.phi_max:
            name = type(self).__name__
            raise ConfigError(f"{name}.phi_min = {self.phi_min} must be <= {name}.phi_max = {self.phi_max}")


@dataclass(frozen=True)
class AdpFedHParams(FedAdamHParams):
    """Adp-Fed as in paper 004 appendix A.1: m₀ = v₀ = 0, β2 = 0.999, no bias correction, ε = 1e-8 [inferred]."""

    beta2: float = param(0.999, lo=0.0, hi=1.0, help="second-moment decay β2")
    tau: float = param(1e-8, lo=0.0, help="ε added to √v (not given by the paper; server_eps)")
    initial_v: float = param(0.0, help="v₀ (the paper initialises v₀ = 0)")


# ------------------------------------------------------------------------------------------ client
class FedLAMBOptimizer(LocalOptimizer):
    """Fed-LAMB local optimizer (Algorithm 1 lines 5–14 of paper 004; see the module docstring).

    Per step: AMSGrad direction ``p = m̂/(√v_max+ε)`` per tensor, then per layer
    ``θ ← θ − lr·φ(‖θ‖)/‖p+λθ‖·(p+λθ)``.  State: ``exp_avg`` (m, persisted across rounds unless ``stateless``),
    ``exp_avg_sq`` (v, starts at the server's v̂), ``max_exp_avg_sq`` (v_max, starts at v̂).
    """

    #: Fed-AMS sets this to False (trust ratio ≡ 1).
    layerwise: ClassVar[bool] = True

    config_keys: ClassVar[dict[str, str]] = {
        R.CLIENT_LR: "lr", K_BETA1: "beta1", K_BETA2: "beta2", K_EPS: "eps", K_WD: "weight_decay",
        K_VHAT: "vhat_mode", K_BC: "bias_correction", K_MCOUNT: "m_step_count", K_EPSPL: "eps_placement",
        K_GRADPT: "gradient_point", K_STATELESS: "stateless", K_VSTEPS: "v_steps", K_LAYERS: "layers",
        K_PHI_MIN: "phi_min", K_PHI_MAX: "phi_max",
    }

    def __init__(
        self,
        params: Iterable[tuple[str, Tensor]],
        lr: float = 0.01,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        vhat_mode: str = "local_max",
        bias_correction: str = "global",
        m_step_count: str = "client",
        eps_placement: str = "outside",
        gradient_point: str = "current",
        stateless: bool = False,
        v_steps: float = 0.0,
        layers: str = "tensor",
        phi_min: float = 0.0,
        phi_max: float = 0.0,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or v_steps < 0:
            raise ValueError(f"lr, eps, weight_decay and v_steps must be >= 0 (got {lr}, {eps}, {weight_decay}, {v_steps})")
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"beta1, beta2 must be in [0, 1), got {beta1}, {beta2}")
        for value, valid, what in (
            (vhat_mode, VHAT_MODES, "vhat_mode"), (bias_correction, BIAS_CORRECTIONS, "bias_correction"),
            (m_step_count, M_STEP_COUNTS, "m_step_count"), (eps_placement, EPS_PLACEMENTS, "eps_placement"),
            (gradient_point, GRADIENT_POINTS, "gradient_point"), (layers, LAYER_GROUPINGS, "layers"),
        ):
            if value not in valid:
                raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(valid)}")
        defaults = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.vhat_mode = vhat_mode
        self.bias_correction = bias_correction
        self.m_step_count = m_step_count
        self.eps_placement = eps_placement
        self.gradient_point = gradient_point
        self.stateless = bool(stateless)
        self.v_steps = float(v_steps)
        self.phi_min = float(phi_min)
        self.phi_max = float(phi_max)
        self.groups = layer_groups([n for n, _, _ in self.named_params()], layers)
        self.t = 0  # local steps taken this round
        self.m_steps0 = 0  # steps already accumulated in the persisted m (s_m before this round)
        self._shadow: Named = {}

    # -------------------------------------------------------------- round hooks
    def begin_round(
        self,
        downlink: Mapping[str, Mapping[str, Tensor]] | None = None,
        persistent: Mapping[str, Mapping[str, Tensor]] | None = None,
    ) -> None:
        super().begin_round(downlink, persistent)
        v_hat = (downlink or {}).get(V_HAT, {})
        saved_m = {} if self.stateless else (persistent or {}).get(STATE_M, {})
        self.m_steps0 = 0
        if saved_m and not self.stateless:
            count = (persistent or {}).get(STATE_M_STEPS, {}).get("count")
            self.m_steps0 = int(count.reshape(-1)[0]) if count is not None else 0
        restored = 0
        for name, p, _ in self.named_params():
            st = self.state[p]
            v0 = v_hat.get(name)
            v0 = torch.zeros_like(p) if v0 is None or v0.shape != p.shape else v0.to(p.device, p.dtype).clone()
            m0 = saved_m.get(name)
            if m0 is not None and m0.shape == p.shape:
                st["exp_avg"] = m0.to(p.device, p.dtype).clone()
                restored += 1
            else:
                st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = v0
            st["max_exp_avg_sq"] = v0.clone()
            if self.vhat_mode == "server_fixed":
                st["server_v_hat"] = v0.clone()
        if restored == 0:  # nothing carried over: m starts at 0, so does its step count
            self.m_steps0 = 0
        self.t = 0
        if self.gradient_point == "round_start":
            self._shadow = {name: p.detach().clone() for name, p, _ in self.named_params()}

    def _theta(self, name: str, p: Tensor) -> Tensor:
        return self._shadow[name] if self.gradient_point == "round_start" else p

    @torch.no_grad()
    def apply_step(self) -> None:
        self.t += 1
        t = self.t
        directions: dict[str, Tensor] = {}
        thetas: dict[str, Tensor] = {}
        lrs: dict[str, float] = {}
        wds: dict[str, float] = {}
        for name, p, group in self.named_params():
            if p.grad is None:
                continue
            beta1, beta2, eps = group["beta1"], group["beta2"], group["eps"]
            m_steps = self.v_steps + t if self.m_step_count == "global" else self.m_steps0 + t
            bc1, bc2 = bias_factors(self.bias_correction, beta1, beta2, t, m_steps, self.v_steps)
            st = self.state[p]
            g = p.grad
            st["exp_avg"].mul_(beta1).add_(g, alpha=1.0 - beta1)
            st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            v_corr = st["exp_avg_sq"] / bc2
            if self.vhat_mode == "local_max":
                torch.maximum(st["max_exp_avg_sq"], v_corr, out=st["max_exp_avg_sq"])
                den = st["max_exp_avg_sq"]
            elif self.vhat_mode == "server_fixed":
                den = st["server_v_hat"]
            else:
                den = v_corr
            den = den.sqrt().add_(eps) if self.eps_placement == "outside" else den.add(eps).sqrt_()
            directions[name] = (st["exp_avg"] / bc1) / den
            thetas[name] = self._theta(name, p)
            lrs[name], wds[name] = group["lr"], group["weight_decay"]
        for layer in self.groups:
            names = [n for n in layer if n in directions]
            if not names:
                continue
            us = {n: directions[n].add(thetas[n], alpha=wds[n]) if wds[n] else directions[n] for n in names}
            if self.layerwise:
                w_norm = torch.sqrt(sum(thetas[n].pow(2).sum() for n in names))
                u_norm = torch.sqrt(sum(us[n].pow(2).sum() for n in names))
                ratio = trust_ratio(w_norm, u_norm, self.phi_min, self.phi_max)
            else:
                ratio = None
            for n in names:
                step = us[n] * ratio if ratio is not None else us[n]
                thetas[n].sub_(step * lrs[n])

    def _upload_v(self, p: Tensor) -> Tensor:
        v = self.state[p]["exp_avg_sq"]
        if self.bias_correction == "as_written" and self.t > 0:
            group_beta2 = next(g["beta2"] for g in self.param_groups if any(q is p for q in g["params"]))
            return v / (1.0 - group_beta2**self.t)
        return v

    def end_round(self) -> dict[str, Named]:
        if self.gradient_point == "round_start":
            with torch.no_grad():
                for name, p, _ in self.named_params():
                    p.copy_(self._shadow[name])
        return {V_LOCAL: {name: self._upload_v(p).detach().clone() for name, p, _ in self.named_params()}}

    def persistent_state(self) -> dict[str, Named]:
        if self.stateless:
            return {}
        m = {name: self.state[p]["exp_avg"].detach().clone() for name, p, _ in self.named_params()}
        return {STATE_M: m, STATE_M_STEPS: {"count": torch.tensor([self.m_steps0 + self.t], dtype=torch.int64)}}


class FedAMSOptimizer(FedLAMBOptimizer):
    """Fed-AMS local optimizer: :class:`FedLAMBOptimizer` with the trust ratio ≡ 1 (``θ ← θ − lr·(p + λθ)``)."""

    layerwise: ClassVar[bool] = False


# ------------------------------------------------------------------------------------------ server
class FedAMS(FedAdaptStrategy):
    """Fed-AMS server (paper 004's baseline; Algorithm 1 line 16 without layer-wise client scaling).

    Update (over the participants' replies, uniform mean by default)::

        θ̄ ← mean_i θ_i^T          (record "arrays")
        v̂ ← max(v̂, mean_i v_i)    (record "v", trainable keys; v̂₀ = 0; sent down as "v_hat")
        s_v ← s_v + mean_i K_i     (config "lamb-v-steps", for the clients' global bias correction)
    """

    method: ClassVar[str] = "fedams"
    hparams_class = FedAMSHParams
    default_weighting: ClassVar[str] = "uniform"

    def __init__(self, hparams: HParams | None = None, **kwargs: Any) -> None:
        super().__init__(hparams, **kwargs)
        self.milestones = parse_milestones(self.hparams.lr_milestones)
        self.v_hat: NamedArrays = {}
        self.v_steps = 0.0
        self._dtypes: dict[str, np.dtype] = {}

    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        return (RecordSpec(R.MODEL, "mean", "model"), RecordSpec(V_LOCAL, "mean", "params"))

    def client_lr_at(self, server_round: int) -> float:
        drops = sum(1 for m in self.milestones if server_round > m)
        return self.client_lr * self.hparams.lr_gamma**drops

    def init_state(self, arrays: NamedArrays) -> None:
        keys = self.trainable(arrays)
        self._dtypes = {k: np.asarray(arrays[k]).dtype for k in keys}
        self.v_hat = {k: np.zeros(np.shape(arrays[k]), dtype=np.float64) for k in keys}
        self.v_steps = 0.0

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        return {V_HAT: {k: v.astype(self._dtypes[k]) for k, v in self.v_hat.items()}}

    def client_config(self) -> dict[str, Any]:
        hp = self.hparams
        return {
            K_BETA1: float(hp.beta1), K_BETA2: float(hp.beta2), K_EPS: float(hp.eps), K_WD: float(hp.weight_decay),
            K_VHAT: hp.vhat_mode, K_BC: hp.bias_correction, K_MCOUNT: hp.m_step_count, K_EPSPL: hp.eps_placement,
            K_GRADPT: hp.gradient_point, K_STATELESS: bool(hp.stateless), K_VSTEPS: float(self.v_steps),
        }

    def round_config(self, server_round: int) -> dict[str, Any]:
        cfg = super().round_config(server_round)
        cfg.update(self.client_config())
        return cfg

    def server_update(self, server_round: int, current: NamedArrays, aggregates: Mapping[str, NamedArrays]) -> NamedArrays:
        mean = aggregates[R.MODEL]
        self.v_hat = merge_vhat(self.v_hat, aggregates[V_LOCAL])
        metrics = getattr(self, "reply_metrics", [])
        steps = [float(m.get(R.NUM_STEPS, self.local_steps)) for m in metrics]
        self.v_steps += float(np.mean(steps)) if steps else float(self.local_steps)
        return self.merge_buffers({k: mean[k] for k in self.trainable(current)}, current, mean)


class FedLAMB(FedAMS):
    """Fed-LAMB server = Fed-AMS server; the clients add the layer-wise trust ratio (``lamb-layers``, ``lamb-phi-*``)."""

    method: ClassVar[str] = "fedlamb"
    hparams_class = FedLAMBHParams

    def client_config(self) -> dict[str, Any]:
        cfg = super().client_config()
        hp = self.hparams
        cfg.update({K_LAYERS: hp.layers, K_PHI_MIN: float(hp.phi_min), K_PHI_MAX: float(hp.phi_max)})
        return cfg


class AdpFed(FedAdam):
    """Adp-Fed (paper 004, appendix A.1, Algorithm 2) = FedAdam with 004's settings and uniform averaging.

    The appendix writes the ascent sign ``Δ = θ^T − θ^0`` and ``θ ← θ + η_g·m/(√v+ε)``; we use the
    descent-positive ``D̄ = θ − mean θ_i`` and ``θ ← θ − η_g·m/(√v+ε)`` — the same update.
    """

    method: ClassVar[str] = "adpfed"
    hparams_class = AdpFedHParams
    default_weighting: ClassVar[str] = "uniform"


_PAPER = "Karimi, Li, Li: FED-LAMB: Layer-wise and Dimension-wise Locally Adaptive Optimization (2021)"
register(FedLAMB, FedLAMBOptimizer, paper=_PAPER, summary="local AMSGrad + LAMB trust ratio; model averaging + max-merged v̂")
register(FedAMS, FedAMSOptimizer, paper="Chen et al. 2020, as used in " + _PAPER, summary="local AMSGrad; model averaging + max-merged v̂")
register(AdpFed, SGDOptimizer, paper="Reddi et al. 2021, as written in " + _PAPER, summary="FedAdam with paper 004's settings (v₀ = 0, β2 = 0.999)")
