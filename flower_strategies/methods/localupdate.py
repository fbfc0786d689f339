"""LocalUpdate (Θ-weighted local gradients) and LocalUpdateDecay (learning-rate decay on loss plateaus).

Zachary Charles and Jakub Konečný, *On the Outsized Importance of Learning Rates in Local Update Methods*,
2020 (seed ``003_2dc7ddae5cbdc81f.txt``): Algorithms 1–2 (LocalUpdate), Algorithms 3–4 and §9.1
(LocalUpdateDecay with window W, patience P, cooldown C); spec ``ALGORITHMS.md`` §4.

Client (Algorithm 2/4), per round, with client lr γ and weights ``Θ = (θ_1, …, θ_K)``::

    ℓ_i = mean loss of x_t on the whole client data set           (the common driver's "train-loss-before")
    x = x_t ; q = 0
    for k = 1..K:  g = mini-batch gradient at x ;  q += θ_k·g ;  x −= γ·g
    upload q_i   (record "q", trainable keys; the local model is NOT uploaded)

Server (Algorithm 1/3)::

    q̄ = mean_i q_i                       (uniform by default, Eq. 24; ``weighting="examples"`` = ref-impl)
    x ← x − η·q̄                          (or any FedOpt server optimizer on q̄, e.g. Yogi as in §8.4)
    Decay: ℓ = mean_i ℓ_i ; if the plateau controller fires: γ ← max(client_decay·γ, min_client_lr),
           η ← max(server_decay·η, min_server_lr)   (used from the next round on)

``K = len(Θ)`` (trailing zeros dropped): the strategy sends ``local-steps = K`` in every round config, overriding
the common ``local-steps``/``local-epochs`` setting.  γ is the common ``client-lr`` (LocalUpdateDecay: its initial
value).  Θ is a preset name (``fedavg``/``reptile``, ``fomaml``, ``kmaml``, ``sgd``; K from ``theta-steps``) or a
comma-separated list of non-negative numbers.  See ``docs/methods/localupdate.md``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, ClassVar

import torch
from flwr.app import ArrayRecord, MetricRecord
from flwr.common import log
from torch import Tensor

from ..core import records as R
from ..core.hparams import ConfigError, HParams, param
from ..core.local import LocalOptimizer
from ..core.ops import NamedArrays
from ..analysis.quadratic import THETA_PRESETS, normalize_theta, parse_theta
from ..core.registry import register
from ..core.server_opt import BIAS_CORRECTIONS, SERVER_OPTIMIZERS, ServerOptimizer, ServerState
from ..core.strategy import FedAdaptStrategy, RecordSpec

#: Uplink record holding ``q_i = Σ_k θ_k g_k``.
Q_RECORD = "q"
#: Round-config key carrying Θ to the client optimizer, as comma-separated ``repr`` floats (exact round trip; a
#: plain string also survives the legacy API, whose ``FitIns.config`` holds scalars only).
THETA_KEY = "localupdate-theta"

PLATEAU_RULES = ("paper", "tff")
WINDOW_FILLS = ("rule", "partial", "inf")
LOSS_WEIGHTINGS = ("uniform", "examples")


# ------------------------------------------------------------------------------------------ hparams
@dataclass(frozen=True)
class LocalUpdateHParams(HParams):
    """LocalUpdate: Θ, server lr η and the (optional) FedOpt server optimizer applied to q̄."""

    theta: str = param(
        "fedavg",
        help="Θ: preset (" + "|".join(THETA_PRESETS) + ") or comma-separated weights θ_1,…,θ_K >= 0",
    )
    theta_steps: int = param(10, lo=1, help="K of the presets: fedavg/fomaml use K steps, kmaml 2K+1, sgd 1")
    server_lr: float = param(0.1, lo=0.0, help="server learning rate η")
    server_opt: str = param("sgd", choices=SERVER_OPTIMIZERS, help="server optimizer on q̄ (paper: sgd; §8.4: yogi)")
    beta1: float = param(0.9, lo=0.0, hi=1.0, help="server momentum β1 (sgdm: heavy-ball β; adaptive: EMA)")
    beta2: float = param(0.99, lo=0.0, hi=1.0, help="server second-moment decay β2 (adam/yogi)")
    eps: float = param(1e-5, lo=0.0, help="server ε added to √v (adaptive servers; §8.4: 1e-5)")
    initial_v: float = param(0.0, lo=0.0, help="server v₀ (§8.4: initial accumulator 0)")
    bias_correction: str = param(
        "none", choices=BIAS_CORRECTIONS, help="none (Zaheer et al.) | adam (TFF: lr·√(1−β2^s)/(1−β1^s)) | flower"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            parse_theta(self.theta, self.theta_steps)
        except ValueError as err:
            raise ConfigError(f"{type(self).__name__}.theta = {self.theta!r}: {err}") from None


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
    window_fill: str = param("rule", choices=WINDOW_FILLS, help="early rounds: rule (paper→partial, tff→inf) | partial | inf")
    reset_best_on_decay: bool = param(False, help="forget the best windowed loss after a decay (paper/tff: False)")
    loss_weighting: str = param("uniform", choices=LOSS_WEIGHTINGS, help="mean of ℓ_i: uniform (Eq. 24) | examples (ref-impl)")
    min_client_lr: float = param(0.0, lo=0.0, help="floor of γ")
    min_server_lr: float = param(0.0, lo=0.0, help="floor of η")


# ------------------------------------------------------------------------------------------ plateau controller
class PlateauController:
    """Decide, from one loss estimate per round, whether to decay the learning rates (pure, no I/O).

    ``rule="paper"`` (§9.1 read literally, ALGORITHMS.md §4.3)::

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
    """

    def __init__(
        self,
        window: int = 100,
        patience: int = 100,
        cooldown: int = 100,
        min_delta: float = 1e-4,
        *,
        rule: str = "paper",
        window_fill: str = "rule",
        reset_best_on_decay: bool = False,
    ) -> None:
        if window < 1 or patience < 1 or cooldown < 0 or min_delta < 0:
            raise ValueError(f"need window >= 1, patience >= 1, cooldown >= 0, min_delta >= 0 "
                             f"(got {window}, {patience}, {cooldown}, {min_delta})")
        if rule not in PLATEAU_RULES:
            raise ValueError(f"unknown plateau rule {rule!r}; valid: {', '.join(PLATEAU_RULES)}")
        if window_fill not in WINDOW_FILLS:
            raise ValueError(f"unknown window fill {window_fill!r}; valid: {', '.join(WINDOW_FILLS)}")
        self.window, self.patience, self.cooldown, self.min_delta = window, patience, cooldown, float(min_delta)
        self.rule = rule
        self.fill = ("partial" if rule == "paper" else "inf") if window_fill == "rule" else window_fill
        self.reset_best_on_decay = reset_best_on_decay
        self.losses: deque[float] = deque([math.inf] * window if self.fill == "inf" else [], maxlen=window)
        self.best = math.inf  # paper: min of all ℓ̂ so far; tff: last Δ-improving ℓ̂
        self.counter = 0
        self.cooldown_left = cooldown  # cooldown at the start too (§9.1)
        self.rounds = 0
        self.last_estimate = math.nan

    def update(self, loss: float) -> bool:
        """Feed this round's loss ℓ_t; True if γ and η must be decayed now."""
        self.rounds += 1
        self.losses.append(float(loss))
        lhat = math.fsum(self.losses) / len(self.losses) if math.isfinite(sum(self.losses)) else math.inf
        self.last_estimate = lhat
        decay = False
        if self.rule == "paper":
            best_before = self.best
            self.best = min(self.best, lhat)
            if self.cooldown_left > 0:
                self.cooldown_left -= 1
                self.counter = 0
            elif math.isfinite(lhat) and lhat <= best_before - self.min_delta:
                self.counter = 0
            else:
                self.counter += 1
                if self.counter >= self.patience:
                    decay, self.counter, self.cooldown_left = True, 0, self.cooldown
        else:  # tff
            if self.cooldown_left > 0:
                self.cooldown_left -= 1
                self.counter = 0
            if lhat < self.best - self.min_delta:
                self.best, self.counter = lhat, 0
            elif self.cooldown_left <= 0:
                self.counter += 1
                if self.counter >= self.patience:
                    decay, self.counter, self.cooldown_left = True, 0, self.cooldown
        if decay and self.reset_best_on_decay:
            self.best = math.inf
        return decay

    def state(self) -> dict[str, float]:
        return {
            "plateau-estimate": self.last_estimate, "plateau-best": self.best,
            "plateau-counter": float(self.counter), "plateau-cooldown": float(self.cooldown_left),
        }


def mean_loss_before(reply_metrics: Sequence[Mapping[str, Any]], weighting: str) -> float | None:
    """ℓ_t = uniform (Eq. 24) or example-weighted mean of the replies' ``train-loss-before``; None if absent."""
    vals = [(float(m[R.TRAIN_LOSS_BEFORE]), float(m.get(R.NUM_EXAMPLES, 1.0))) for m in reply_metrics
            if isinstance(m.get(R.TRAIN_LOSS_BEFORE), (int, float))]
    if not vals:
        return None
    if weighting == "examples":
        return math.fsum(v * n for v, n in vals) / math.fsum(n for _, n in vals)
    return math.fsum(v for v, _ in vals) / len(vals)


# ------------------------------------------------------------------------------------------ client
class LocalUpdateOptimizer(LocalOptimizer):
    """Algorithm 2's inner loop: SGD with lr γ that accumulates ``q = Σ_k θ_k g_k`` and uploads it as ``"q"``.

    The k-th call of :meth:`step` uses ``θ_k``; the round must take exactly ``len(Θ)`` steps.
    """

    config_keys: ClassVar[dict[str, str]] = {R.CLIENT_LR: "lr", THETA_KEY: "theta"}
    sends_model: ClassVar[bool] = False

    def __init__(self, params: Iterable[tuple[str, Tensor]], lr: float = 0.1, theta: str | Sequence[float] = (1.0,)) -> None:
        if lr < 0:
            raise ValueError(f"client lr γ must be >= 0, got {lr}")
        if isinstance(theta, str):
            theta = [float(tok) for tok in theta.split(",") if tok.strip()]
        self.theta = normalize_theta(theta)
        super().__init__(params, {"lr": float(lr)})
        self.k = 0
        self.q: dict[str, Tensor] = {}

    def begin_round(self, downlink=None, persistent=None) -> None:
        super().begin_round(downlink, persistent)
        if self.num_steps and self.num_steps != len(self.theta):
            raise ValueError(
                f"LocalUpdate needs exactly K(Θ) = {len(self.theta)} local steps, the round plans {self.num_steps} "
                f"(the server sets local-steps = len(Θ); full-batch rounds are not supported)"
            )
        self.k = 0
        self.q = {name: torch.zeros_like(p) for name, p, _ in self.named_params()}

    @torch.no_grad()
    def apply_step(self) -> None:
        if self.k >= len(self.theta):
            raise RuntimeError(f"LocalUpdate: step {self.k + 1} exceeds K(Θ) = {len(self.theta)}")
        if not self.q:
            self.q = {name: torch.zeros_like(p) for name, p, _ in self.named_params()}
        th = self.theta[self.k]
        for name, p, group in self.named_params():
            if p.grad is None:
                continue
            if th != 0.0:
                self.q[name].add_(p.grad, alpha=th)
            p.add_(p.grad, alpha=-group["lr"])
        self.k += 1

    def end_round(self) -> dict[str, dict[str, Tensor]]:
        if self.k != len(self.theta):
            raise RuntimeError(f"LocalUpdate: took {self.k} steps, K(Θ) = {len(self.theta)}")
        return {Q_RECORD: {name: q.clone() for name, q in self.q.items()}}


# ------------------------------------------------------------------------------------------ server
class LocalUpdate(FedAdaptStrategy):
    """Algorithm 1: ``x ← ServerOpt(x, q̄, η)`` with ``q̄`` the (uniform) mean of the clients' ``q_i``."""

    method: ClassVar[str] = "localupdate"
    hparams_class = LocalUpdateHParams
    default_weighting: ClassVar[str] = "uniform"
    #: Keys this strategy adds to every round's train metrics (for a metrics writer to pick up).
    logged_metrics: ClassVar[tuple[str, ...]] = ("client-lr", "server-lr")

    def __init__(self, hparams: HParams | None = None, **kwargs: Any) -> None:
        super().__init__(hparams, **kwargs)
        hp = self.hparams
        self.theta: tuple[float, ...] = parse_theta(hp.theta, hp.theta_steps)
        if self.local_steps not in (0, len(self.theta)):
            log(INFO, "%s: local-steps %d overridden by K(Θ) = %d", self.method, self.local_steps, len(self.theta))
        self.local_steps = len(self.theta)  # K(Θ) overrides the common local-steps / local-epochs
        self.server_lr = float(hp.server_lr)  # current η (LocalUpdateDecay decays it)
        self.opt = ServerOptimizer(
            hp.server_opt, lr=self.server_lr, beta1=hp.beta1, beta2=hp.beta2, tau=hp.eps,
            initial_v=hp.initial_v, bias_correction=hp.bias_correction,
        )
        self.opt_state: ServerState = {}
        self._round_extras: dict[str, float] = {}

    def log_settings(self) -> list[str]:
        return super().log_settings() + [f"Θ = {self.theta} (K = {len(self.theta)} local steps per round)"]

    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        return (RecordSpec(Q_RECORD, "mean", "params"),)

    def round_config(self, server_round: int) -> dict[str, Any]:
        cfg = super().round_config(server_round)
        cfg[R.LOCAL_STEPS] = len(self.theta)
        cfg[THETA_KEY] = ",".join(repr(float(t)) for t in self.theta)
        return cfg

    def init_state(self, arrays: NamedArrays) -> None:
        self.opt_state = self.opt.init({k: arrays[k] for k in self.trainable(arrays)})

    def server_update(self, server_round: int, current: NamedArrays, aggregates: Mapping[str, NamedArrays]) -> NamedArrays:
        qbar = aggregates[Q_RECORD]
        keys = self.trainable(current)
        opt = dataclasses.replace(self.opt, lr=self.server_lr)
        new_params, self.opt_state = opt.step(
            {k: current[k] for k in keys}, {k: qbar[k] for k in keys}, self.opt_state,
            step=self.num_updates, server_round=server_round,
        )
        self._round_extras = {"client-lr": self.client_lr_at(server_round), "server-lr": self.server_lr}
        return self.merge_buffers(new_params, current, None)

    def aggregate_train(self, server_round: int, replies: Iterable[Any]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The base aggregation, plus this round's learning rates (and Decay's controller state) in the metrics."""
        self._round_extras = {}
        arrays, metrics = super().aggregate_train(server_round, replies)
        if self._round_extras:
            extras = {k: float(v) for k, v in self._round_extras.items()}
            if metrics is not None:
                for k, v in extras.items():
                    metrics[k] = v
            if self.history and self.history[-1].server_round == server_round and self.history[-1].train_metrics is not None:
                self.history[-1].train_metrics.update(extras)
        return arrays, metrics


class LocalUpdateDecay(LocalUpdate):
    """Algorithms 3–4 + §9.1: LocalUpdate whose γ and η are decayed by a server-side plateau controller.

    ``decay_trace`` holds one dict per updated round: the loss ℓ_t, the controller state after it, whether it
    fired, and the γ, η used in that round and in the next one.
    """

    method: ClassVar[str] = "localupdatedecay"
    hparams_class = LocalUpdateDecayHParams
    logged_metrics: ClassVar[tuple[str, ...]] = (
        "plateau-loss", "plateau-estimate", "plateau-best", "plateau-counter", "plateau-cooldown", "decayed",
        "client-lr", "server-lr", "next-client-lr", "next-server-lr",
    )

    def __init__(self, hparams: HParams | None = None, **kwargs: Any) -> None:
        super().__init__(hparams, **kwargs)
        hp = self.hparams
        self.gamma = float(self.client_lr)  # current γ
        self.controller = PlateauController(
            hp.window, hp.patience, hp.cooldown, hp.min_delta, rule=hp.plateau_rule,
            window_fill=hp.window_fill, reset_best_on_decay=hp.reset_best_on_decay,
        )
        self.decay_trace: list[dict[str, float]] = []

    def client_lr_at(self, server_round: int) -> float:
        return self.gamma

    def server_update(self, server_round: int, current: NamedArrays, aggregates: Mapping[str, NamedArrays]) -> NamedArrays:
        gamma_used, eta_used = self.gamma, self.server_lr
        new = super().server_update(server_round, current, aggregates)  # model step with this round's η
        hp = self.hparams
        loss = mean_loss_before(getattr(self, "reply_metrics", []), hp.loss_weighting)
        if loss is None:
            log(WARNING, "%s round %d: no reply reported '%s'; plateau controller not updated",
                self.method, server_round, R.TRAIN_LOSS_BEFORE)
            return new
        decayed = self.controller.update(loss)
        if decayed:
            self.gamma = max(hp.client_decay * self.gamma, hp.min_client_lr)
            self.server_lr = max(hp.server_decay * self.server_lr, hp.min_server_lr)
        row = {
            "round": float(server_round), "plateau-loss": loss, **self.controller.state(), "decayed": float(decayed),
            "client-lr": gamma_used, "server-lr": eta_used, "next-client-lr": self.gamma, "next-server-lr": self.server_lr,
        }
        self.decay_trace.append(row)
        self._round_extras = {k: v for k, v in row.items() if k != "round"}
        log(
            INFO,
            "%s round %d: loss %.6g, estimate %.6g, best %.6g, counter %d, cooldown %d%s; γ %.4g, η %.4g",
            self.method, server_round, loss, row["plateau-estimate"], row["plateau-best"],
            int(row["plateau-counter"]), int(row["plateau-cooldown"]), " → DECAY" if decayed else "",
            self.gamma, self.server_lr,
        )
        return new


_PAPER = "Charles & Konečný, On the Outsized Importance of Learning Rates in Local Update Methods, 2020"
register(LocalUpdate, LocalUpdateOptimizer, paper=_PAPER,
         summary="clients upload Θ-weighted sums of local gradients; server step η (or FedOpt) on their mean")
register(LocalUpdateDecay, LocalUpdateOptimizer, paper=_PAPER,
         summary="LocalUpdate + decay of client/server lr on training-loss plateaus (window, patience, cooldown)")
