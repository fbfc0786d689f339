"""LocalUpdate (Θ-weighted local gradients) and LocalUpdateDecay (learning-rate decay on loss plateaus).

Zachary Charles and Jakub Konečný, *On the Outsized Importance of Learning Rates in Local Update Methods*,
2020 (seed ``003_2dc7ddae5cbdc81f.txt``): Algorithms 1–2 (LocalUpdate), Algorithms 3–4 and §9.1
(LocalUpdateDecay with window W, patience P, cooldown C).

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

Symbols ↔ code
--------------
==============  ==========================================================================================
γ               common ``client-lr`` (Decay: its initial value); server state ``"client-lr"``; ``group["lr"]``
η               ``<method>.server-lr``; server state ``"server-lr"`` (current value)
Θ, K(Θ)         ``<method>.theta`` + ``<method>.theta-steps`` (client fields, sent on the wire as they are);
                :func:`parse_theta`; ``K(Θ) = len(Θ)`` = the optimizer's ``planned_steps``
k               ``self.steps_taken`` (0-based index of the step being taken)
q_i             ``self.state[p]["q"]``; uplink record ``"q"``
ℓ_i, ℓ_t        reply metric ``train-loss-before``; their (uniform/example-weighted) mean
ℓ̂_t, W, P, C, Δ :class:`PlateauController`; its state is the server state's ``plateau-*`` entries
==============  ==========================================================================================

``K = len(Θ)`` (trailing zeros dropped): the strategy sends ``local-steps = K`` in every round config, overriding
the common ``local-steps``/``local-epochs`` setting.  Θ is a preset name (``fedavg``/``reptile``, ``fomaml``,
``kmaml``, ``sgd``; K from ``theta-steps``) or a comma-separated list of non-negative numbers.  The round metrics
(``client-lr``, ``server-lr`` and, for Decay, the controller's values) are returned by ``server_update``.
See ``docs/methods/localupdate.md``.

Conventions and deviations
--------------------------
* Mini-batches are the common driver's epoch-wise permutations (§4.6-A8 allows it), not sampling with replacement.
* The server optimizer is the shared :class:`~flower_strategies.core.server_opt.ServerOptimizer` with q̄ as its
  descent-positive pseudo-gradient and ``tau = eps``; the decayed η is its lr, its moments are not reset on a decay.
* The client raises unless the round plans exactly K(Θ) steps (no full-batch phase).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar

from flwr.common import log

from ..core import records as R
from ..core.ops import NamedArrays
from ..core.rounds import robust_mean
from ..core.server_opt import ServerOptimizer
from ..core.strategy import FedAdaptStrategy, RoundInputs, ServerState
from ..core.validation import RecordSpec
from ..optimizers.localupdate import (
    LOSS_WEIGHTINGS, LocalUpdateDecayHParams, LocalUpdateHParams, LocalUpdateOptimizer, PLATEAU_RULES,
    PlateauController, Q_RECORD, THETA_PRESETS, ThetaHParams, WINDOW_FILLS, normalize_theta, parse_theta,
    theta_preset,
)

#: This module's names and its client half's (:mod:`flower_strategies.optimizers.localupdate`, re-exported).
__all__ = [
    "LOSS_WEIGHTINGS", "LocalUpdate", "LocalUpdateDecay", "LocalUpdateDecayHParams", "LocalUpdateHParams",
    "LocalUpdateOptimizer", "PLATEAU_RULES", "PlateauController", "Q_RECORD", "THETA_PRESETS", "ThetaHParams",
    "WINDOW_FILLS", "localupdate_server_optimizer", "normalize_theta", "parse_theta", "theta_preset",
]


# ------------------------------------------------------------------------------------------ server
def _optimizer_state(state: ServerState) -> ServerState:
    """The server optimizer's entries of the server state (its named arrays; the rest are scalars)."""
    return {k: v for k, v in state.items() if isinstance(v, Mapping)}


def localupdate_server_optimizer(h: LocalUpdateHParams) -> ServerOptimizer:
    """The server optimizer the hyper-parameters ``h`` configure (the strategy's ``opt``)."""
    return ServerOptimizer(
        h.server_opt, lr=h.server_lr, beta1=h.beta1, beta2=h.beta2, tau=h.eps,
        initial_v=h.initial_v, bias_correction=h.bias_correction,
    )


class LocalUpdate(FedAdaptStrategy):
    """Algorithm 1: ``x ← ServerOpt(x, q̄, η)`` with ``q̄`` the (uniform) mean of the clients' ``q_i``.

    Server state: the server optimizer's arrays, ``client-lr`` (γ) and ``server-lr`` (η).
    Round metrics: the ``client-lr`` and ``server-lr`` used in the round.
    """

    method: ClassVar[str] = "localupdate"
    accepts_zero_client_lr: ClassVar[bool] = True  # γ = 0: every step's gradient at the round's start
    hparams_class = LocalUpdateHParams
    hparams: LocalUpdateHParams
    local_optimizer = LocalUpdateOptimizer
    default_weighting: ClassVar[str] = "uniform"

    def __init__(self, hparams: LocalUpdateHParams | None = None, **kwargs: Any) -> None:
        super().__init__(hparams, **kwargs)
        self.theta: tuple[float, ...] = self.hparams.weights
        if self.settings.local_steps not in (0, len(self.theta)):
            log(INFO, "%s: local-steps %d overridden by K(Θ) = %d", self.method, self.settings.local_steps,
                len(self.theta))
        self.settings = self.settings.replace(local_steps=len(self.theta))  # K(Θ) overrides local-steps / -epochs
        self.opt = localupdate_server_optimizer(self.hparams)

    def log_settings(self) -> list[str]:
        return super().log_settings() + [f"Θ = {self.theta} (K = {len(self.theta)} local steps per round)"]

    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        return (RecordSpec(Q_RECORD, "mean", "params"),)

    def init_server_state(self, arrays: NamedArrays) -> ServerState:
        return {
            **self.opt.init({k: arrays[k] for k in self.trainable(arrays)}),
            "client-lr": self.settings.client_lr, "server-lr": float(self.hparams.server_lr),
        }

    def client_lr_at(self, server_round: int) -> float:
        return self.settings.client_lr if self.server_state is None else float(self.server_state["client-lr"])

    def server_update(
        self, inputs: RoundInputs, state: ServerState
    ) -> tuple[NamedArrays, ServerState, dict[str, float]]:
        current, qbar = inputs.current, inputs.aggregates[Q_RECORD]
        opt = dataclasses.replace(self.opt, lr=state["server-lr"])
        new_params, opt_state = opt.step(
            {k: current[k] for k in inputs.trainable}, {k: qbar[k] for k in inputs.trainable},
            _optimizer_state(state), step=inputs.num_updates + 1, server_round=inputs.server_round,
        )
        metrics = {"client-lr": state["client-lr"], "server-lr": state["server-lr"]}
        return self.merge_buffers(new_params, current, None), {**state, **opt_state}, metrics


class LocalUpdateDecay(LocalUpdate):
    """Algorithms 3–4 + §9.1: LocalUpdate whose γ and η are decayed by a server-side plateau controller.

    Server state: LocalUpdate's + the controller's ``plateau-*`` entries.  Round metrics of a round whose replies
    report ``train-loss-before``: ``plateau-loss`` (ℓ_t), ``plateau-estimate`` (ℓ̂_t), ``plateau-best``,
    ``plateau-counter``, ``plateau-cooldown``, ``decayed``, the ``client-lr``/``server-lr`` used in the round and
    the ``next-client-lr``/``next-server-lr`` used from the next round on (:attr:`decay_trace` collects them).
    """

    method: ClassVar[str] = "localupdatedecay"
    hparams_class = LocalUpdateDecayHParams
    needs_train_loss_before: ClassVar[bool] = True  # the plateau controller's loss ℓ_t
    hparams: LocalUpdateDecayHParams

    def __init__(self, hparams: LocalUpdateDecayHParams | None = None, **kwargs: Any) -> None:
        super().__init__(hparams, **kwargs)
        self.controller = self.hparams.controller()

    def init_server_state(self, arrays: NamedArrays) -> ServerState:
        return {**super().init_server_state(arrays), **self.controller.init()}

    @property
    def decay_trace(self) -> list[dict[str, float]]:
        """One row per round that updated the controller: ``round`` + the round metrics above."""
        return [
            {"round": float(h.server_round), **h.round_metrics} for h in self.history if "decayed" in h.round_metrics
        ]

    def server_update(
        self, inputs: RoundInputs, state: ServerState
    ) -> tuple[NamedArrays, ServerState, dict[str, float]]:
        new, state, metrics = super().server_update(inputs, state)  # model step with this round's η
        hp = self.hparams
        # the robust mean of the metrics path: a NaN/Inf or outlying value of one reply is left out
        loss = robust_mean([(m.get(R.TRAIN_LOSS_BEFORE), float(m[R.NUM_EXAMPLES])) for m in inputs.reply_metrics],
                           hp.loss_weighting)
        if loss is None:
            log(WARNING, "%s round %d: no reply reported a usable '%s'; plateau controller not updated",
                self.method, inputs.server_round, R.TRAIN_LOSS_BEFORE)
            return new, state, metrics
        plateau, decayed = self.controller.update(state, loss)
        gamma, eta = state["client-lr"], state["server-lr"]
        if decayed:
            gamma, eta = max(hp.client_decay * gamma, hp.min_client_lr), max(hp.server_decay * eta, hp.min_server_lr)
        best = plateau["plateau-best"]
        metrics.update({
            "plateau-loss": loss, "plateau-estimate": self.controller.estimate(plateau["plateau-losses"]),
            "plateau-best": math.inf if best is None else best, "plateau-counter": plateau["plateau-counter"],
            "plateau-cooldown": plateau["plateau-cooldown"], "decayed": float(decayed),
            "next-client-lr": gamma, "next-server-lr": eta,
        })
        log(
            INFO,
            "%s round %d: loss %.6g, estimate %.6g, best %.6g, counter %d, cooldown %d%s; γ %.4g, η %.4g",
            self.method, inputs.server_round, loss, metrics["plateau-estimate"], metrics["plateau-best"],
            plateau["plateau-counter"], plateau["plateau-cooldown"], " → DECAY" if decayed else "", gamma, eta,
        )
        return new, {**state, **plateau, "client-lr": gamma, "server-lr": eta}, metrics
