"""The client half of :mod:`flower_strategies.methods.localupdate`: its hyper-parameters, local optimizer and record
names.  A device imports this module (through :mod:`flower_strategies.optimizers`), never the strategy."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from ..core.params import ConfigError, HParams, param
from ..core.local import LocalOptimizer
from .baselines import BIAS_CORRECTIONS, SERVER_OPTIMIZERS

#: Uplink record holding ``q_i = Σ_k θ_k g_k``.
Q_RECORD = "q"

THETA_PRESETS = ("fedavg", "reptile", "fomaml", "kmaml", "sgd")
PLATEAU_RULES = ("paper", "tff")
WINDOW_FILLS = ("rule", "partial", "inf")
LOSS_WEIGHTINGS = ("uniform", "examples")


# ------------------------------------------------------------------------------------------ Θ
def normalize_theta(values: Sequence[float]) -> tuple[float, ...]:
    """Validate Θ (finite, ≥ 0, at least one θ_k > 0) and drop trailing zeros (K(Θ) = len of the result)."""
    theta = [float(v) for v in values]
    if any(not math.isfinite(v) for v in theta):
        raise ValueError(f"Θ entries must be finite, got {theta}")
    if any(v < 0 for v in theta):
        raise ValueError(f"Θ entries must be >= 0 (paper §2.1: θ_k ∈ R≥0), got {theta}")
    while theta and theta[-1] == 0.0:
        theta.pop()
    if not theta:
        raise ValueError("Θ needs at least one positive entry (K(Θ) = max{k: θ_k > 0} must exist)")
    return tuple(theta)


def theta_preset(name: str, steps: int) -> tuple[float, ...]:
    """Named Θ: ``fedavg``/``reptile`` → (1,)*K, ``fomaml`` → e_K, ``kmaml`` → e_{2K+1}, ``sgd`` → (1,)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if name in ("fedavg", "reptile"):
        return (1.0,) * steps
    if name == "fomaml":
        return (0.0,) * (steps - 1) + (1.0,)
    if name == "kmaml":
        return (0.0,) * (2 * steps) + (1.0,)
    if name == "sgd":
        return (1.0,)
    raise ValueError(f"unknown Θ preset {name!r}; valid: {', '.join(THETA_PRESETS)} or comma-separated numbers")


@functools.lru_cache(maxsize=64)
def parse_theta(spec: str, steps: int) -> tuple[float, ...]:
    """Θ from a preset name (using ``steps``) or a comma-separated list of numbers (``steps`` ignored)."""
    text = spec.strip().lower()
    if text in THETA_PRESETS:
        return theta_preset(text, steps)
    try:
        values = [float(tok) for tok in text.split(",") if tok.strip()]
    except ValueError:
        raise ValueError(
            f"Θ {spec!r} is neither a preset ({', '.join(THETA_PRESETS)}) nor comma-separated numbers"
        ) from None
    return normalize_theta(values)


# ------------------------------------------------------------------------------------------ hparams
@dataclass(frozen=True)
class ThetaHParams(HParams):
    """The client half of LocalUpdate: Θ (the local optimizer's hyper-parameters)."""

    theta: str = param(
        "fedavg", client=True,
        help="Θ: preset (" + "|".join(THETA_PRESETS) + ") or comma-separated weights θ_1,…,θ_K >= 0",
    )
    theta_steps: int = param(
        10, lo=1, client=True, help="K of the presets: fedavg/fomaml use K steps, kmaml 2K+1, sgd 1",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            parse_theta(self.theta, self.theta_steps)
        except ValueError as err:
            raise ConfigError(f"{type(self).__name__}.theta = {self.theta!r}: {err}") from None

    @property
    def weights(self) -> tuple[float, ...]:
        """Θ = (θ_1, …, θ_K) with K = K(Θ)."""
        return parse_theta(self.theta, self.theta_steps)


@dataclass(frozen=True)
class LocalUpdateHParams(ThetaHParams):
    """LocalUpdate: Θ, server lr η and the (optional) FedOpt server optimizer applied to q̄."""

    server_lr: float = param(0.1, lo=0.0, help="server learning rate η")
    server_opt: str = param("sgd", choices=SERVER_OPTIMIZERS, help="server optimizer on q̄ (paper: sgd; §8.4: yogi)")
    beta1: float = param(0.9, lo=0.0, hi=1.0, help="server momentum β1 (sgdm: heavy-ball β; adaptive: EMA)")
    beta2: float = param(0.99, lo=0.0, hi=1.0, help="server second-moment decay β2 (adam/yogi)")
    eps: float = param(1e-5, lo=0.0, help="server ε added to √v (adaptive servers; §8.4: 1e-5)")
    initial_v: float = param(0.0, lo=0.0, help="server v₀ (§8.4: initial accumulator 0)")
    bias_correction: str = param(
        "none", choices=BIAS_CORRECTIONS, help="none (Zaheer et al.) | adam (TFF: lr·√(1−β2^s)/(1−β1^s)) | flower"
    )

@dataclass(frozen=True)
class LocalUpdateDecayHParams(LocalUpdateHParams):
    """LocalUpdateDecay: LocalUpdate + a server-side plateau controller (Algorithm 3, §9.1)."""

    client_decay: float = param(0.1, lo=0.0, hi=1.0, lo_open=True, help="γ ← client_decay·γ on a plateau (paper α)")
    server_decay: float = param(0.9, lo=0.0, hi=1.0, lo_open=True, help="η ← server_decay·η on a plateau (paper β)")
    min_delta: float = param(1e-4, lo=0.0, help="Δ: progress means ℓ̂_t <= min_{j<t} ℓ̂_j − Δ")
    window: int = param(100, lo=1, help="W: moving-window length of the loss estimate ℓ̂_t")
    patience: int = param(100, lo=1, help="P: decay after P consecutive rounds without progress")
    cooldown: int = param(100, lo=0, help="C: no decay in the first C rounds and the C rounds after a decay")
    plateau_rule: str = param("paper", choices=PLATEAU_RULES, help="paper (§9.1 literally) | tff (released code)")
    window_fill: str = param(
        "rule", choices=WINDOW_FILLS, help="early rounds: rule (paper→partial, tff→inf) | partial | inf",
    )
    reset_best_on_decay: bool = param(False, help="forget the best windowed loss after a decay (paper/tff: False)")
    loss_weighting: str = param(
        "uniform", choices=LOSS_WEIGHTINGS, help="mean of ℓ_i: uniform (Eq. 24) | examples (ref-impl)",
    )
    min_client_lr: float = param(0.0, lo=0.0, help="floor of γ")
    min_server_lr: float = param(0.0, lo=0.0, help="floor of η")

    def controller(self) -> PlateauController:
        return PlateauController(
            self.window, self.patience, self.cooldown, self.min_delta, rule=self.plateau_rule,
            window_fill=self.window_fill, reset_best_on_decay=self.reset_best_on_decay,
        )


# ------------------------------------------------------------------------------------------ plateau controller
@dataclass(frozen=True)
class PlateauController:
    """Decide, from one loss estimate per round, whether to decay the learning rates (pure: ``init``/``update``
    on a state dict of plain numbers, stored in the strategy's server state).

    ``rule="paper"`` (§9.1 read literally)::

        ℓ̂_t = mean of the last W losses
        best = min_{j<t} ℓ̂_j  (+inf if none)
        cooldown > 0        → cooldown −= 1, counter = 0, no decay            (C rounds also at the start)
        ℓ̂_t <= best − Δ     → counter = 0                                     (progress)
        else                → counter += 1; counter >= P → decay, counter = 0, cooldown = C

    ``rule="tff"`` (the authors' released ``ReduceLROnPlateau``)::

        cooldown > 0 → cooldown −= 1, wait = 0
        ℓ̂_t < best − Δ → best = ℓ̂_t, wait = 0
        elif cooldown <= 0 → wait += 1; wait >= P → decay, cooldown = C, wait = 0

    ``window_fill``: ``partial`` = mean of the ``min(t, W)`` losses seen so far; ``inf`` = the window starts filled
    with +inf, so ℓ̂_t = +inf (never progress) until W real losses are in; ``rule`` = partial for paper, inf for tff.
    ``reset_best_on_decay``: after a decay the comparison point ``best`` restarts at +inf (the decay round's ℓ̂ is
    forgotten).  ``W = P = 1, C = 0`` with the paper rule is exactly Algorithm 3.

    State (:meth:`init`): ``plateau-losses`` (the last ≤ W real losses; the +inf fill is implied by fewer than W),
    ``plateau-best`` (``None`` = +inf, so that the state holds only finite numbers), ``plateau-counter``,
    ``plateau-cooldown``.
    """

    window: int = 100
    patience: int = 100
    cooldown: int = 100
    min_delta: float = 1e-4
    rule: str = "paper"
    window_fill: str = "rule"
    reset_best_on_decay: bool = False

    def __post_init__(self) -> None:
        if self.window < 1 or self.patience < 1 or self.cooldown < 0 or self.min_delta < 0:
            raise ValueError(f"need window >= 1, patience >= 1, cooldown >= 0, min_delta >= 0 "
                             f"(got {self.window}, {self.patience}, {self.cooldown}, {self.min_delta})")
        if self.rule not in PLATEAU_RULES:
            raise ValueError(f"unknown plateau rule {self.rule!r}; valid: {', '.join(PLATEAU_RULES)}")
        if self.window_fill not in WINDOW_FILLS:
            raise ValueError(f"unknown window fill {self.window_fill!r}; valid: {', '.join(WINDOW_FILLS)}")

    @property
    def fill(self) -> str:
        if self.window_fill == "rule":
            return "partial" if self.rule == "paper" else "inf"
        return self.window_fill

    def init(self) -> dict[str, Any]:
        """The state before round 1 (cooldown at the start too, §9.1)."""
        return {"plateau-losses": [], "plateau-best": None, "plateau-counter": 0, "plateau-cooldown": self.cooldown}

    def estimate(self, losses: Sequence[float]) -> float:
        """ℓ̂_t: mean of the window (+inf while an +inf-filled window is not full, or for a non-finite loss)."""
        if (self.fill == "inf" and len(losses) < self.window) or not math.isfinite(sum(losses)):
            return math.inf
        return math.fsum(losses) / len(losses)

    def update(self, state: Mapping[str, Any], loss: float) -> tuple[dict[str, Any], bool]:
        """Feed this round's loss ℓ_t: ``(new state, whether γ and η must be decayed now)``."""
        losses = [*state["plateau-losses"], float(loss)][-self.window:]
        lhat = self.estimate(losses)
        best = math.inf if state["plateau-best"] is None else float(state["plateau-best"])
        counter, cool = int(state["plateau-counter"]), int(state["plateau-cooldown"])
        decay = False
        if self.rule == "paper":  # best = min of all earlier ℓ̂
            progress = math.isfinite(lhat) and lhat <= best - self.min_delta
            best = min(best, lhat)
            if cool > 0:
                cool, counter = cool - 1, 0
            elif progress:
                counter = 0
            else:
                counter += 1
                if counter >= self.patience:
                    decay, counter, cool = True, 0, self.cooldown
        else:  # tff: best = last Δ-improving ℓ̂
            if cool > 0:
                cool, counter = cool - 1, 0
            if lhat < best - self.min_delta:
                best, counter = lhat, 0
            elif cool <= 0:
                counter += 1
                if counter >= self.patience:
                    decay, counter, cool = True, 0, self.cooldown
        if decay and self.reset_best_on_decay:
            best = math.inf
        new = {"plateau-losses": losses, "plateau-best": best if math.isfinite(best) else None,
               "plateau-counter": counter, "plateau-cooldown": cool}
        return new, decay


# ------------------------------------------------------------------------------------------ client
class LocalUpdateOptimizer(LocalOptimizer):
    """Algorithm 2's inner loop: SGD with lr γ that accumulates ``q = Σ_k θ_k g_k`` and uploads it as ``"q"``.

    Per step ``k`` (= :attr:`steps_taken`, 0-based) and parameter ``x`` with gradient ``g``::

        q ← q + θ_{k+1}·g ;   x ← x − γ·g

    The round must take exactly ``K(Θ)`` steps (``planned_steps``): more steps, or asking for :meth:`uplink`
    after fewer, raise ``RuntimeError``.  The reply carries ``q``, not the model.
    """

    hparams_class = ThetaHParams
    sends_model: ClassVar[bool] = False
    needs_planned_steps: ClassVar[bool] = True

    def init_state(self, name: str, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        k_theta = len(parse_theta(group["theta"], group["theta_steps"]))
        if k_theta != self.planned_steps:
            raise ValueError(
                f"LocalUpdate needs exactly K(Θ) = {k_theta} local steps, the round plans {self.planned_steps} "
                f"(the server sets local-steps = K(Θ); full-batch rounds are not supported)"
            )
        state["q"] = p.new_zeros(p.shape)

    def apply_step(self) -> None:
        assert self.planned_steps is not None  # needs_planned_steps: the constructor requires it
        if self.steps_taken >= self.planned_steps:
            raise RuntimeError(f"LocalUpdate: step {self.steps_taken + 1} exceeds K(Θ) = {self.planned_steps}")
        super().apply_step()

    def update_param(self, name: str, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        theta_k = parse_theta(group["theta"], group["theta_steps"])[self.steps_taken]
        if theta_k != 0.0:
            state["q"].add_(grad, alpha=theta_k)
        p.add_(grad, alpha=-group["lr"])

    def uplink_arrays(self) -> dict[str, dict[str, Tensor]]:
        if self.steps_taken != self.planned_steps:
            raise RuntimeError(f"LocalUpdate: took {self.steps_taken} steps, K(Θ) = {self.planned_steps}")
        return {Q_RECORD: {name: self.state[p]["q"].clone() for name, p, _ in self.named_params()}}
