"""The client half of :mod:`flower_strategies.methods.fedda`: its hyper-parameters, local optimizer and record
names.  A device imports this module (through :mod:`flower_strategies.optimizers`), never the strategy."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..core.params import ConfigError, HParams, param
from ..core.local import LocalOptimizer

#: Record names (downlink: MOMENTUM; uplink: MOMENTUM_SUM and MOMENTUM).
MOMENTUM = "momentum"
MOMENTUM_SUM = "momentum-sum"

VARIANTS = ("sgdm", "adam", "adagrad")
FEDDA_BIAS_CORRECTIONS = ("updates", "round", "none")
V_HATS = ("new", "stale")
#: Table 12 server learning rates α on EMNIST (used by ``fedda`` when ``server-lr`` is empty).
TABLE12_SERVER_LR = {"sgdm": 1.0, "adam": 0.1, "adagrad": 0.1}


# ------------------------------------------------------------------------------------------ hyper-parameters
@dataclass(frozen=True)
class FedDAClientHParams(HParams):
    """The client half of FedDA's declaration (:class:`FedDAOptimizer`'s hyper-parameters besides ``lr``)."""

    beta1: float = param(0.9, lo=0.0, hi=0.999, client=True, help="momentum β1 (Table 12: 0.9)")
    prox_mu: float = param(0.0, lo=0.0, client=True, help="FedDA+Prox μ (local step and momentum); 0 = off")
    eta_in_momentum: bool = param(False, client=True, help="A1: momentum fed with η·g (Eq. 25) vs g (Algorithm 1)")


@dataclass(frozen=True)
class FedDAHParams(FedDAClientHParams):
    """FedDA (Algorithms 1–2); the server optimizer is the ``variant`` field.  Defaults: Table 12, EMNIST."""

    variant: str = param(
        "sgdm", choices=VARIANTS, help="server optimizer: sgdm (Algorithm 1) | adam | adagrad (Algorithm 2)",
    )
    server_lr: float | None = param(
        None, lo=0.0, lo_open=True,
        help="server learning rate α; empty = the variant's Table 12 EMNIST value (sgdm 1, adam/adagrad 0.1)",
    )
    beta2: float = param(0.99, lo=0.0, hi=1.0, help="second-moment decay β2 (Table 12: 0.99; adam only)")
    eps: float = param(0.1, lo=0.0, help="fuzz factor ε outside the square root (Table 12 EMNIST: 0.1; adam, adagrad)")
    initial_v: float = param(0.0, lo=0.0, help="V_0 (A10: 0; adam, adagrad)")
    bias_correction: str = param(
        "updates", choices=FEDDA_BIAS_CORRECTIONS, help="A3 (adam): s = server updates | round | none",
    )
    v_hat: str = param("new", choices=V_HATS, help="A4 (adam): V̂ from V_{r+1} (Algorithm 2) or stale V_r (Eq. 35)")
    full_batch_last: float = param(
        0.05, lo=0.0, hi=1.0, help="A8: fraction of the final rounds with one full-batch step",
    )
    full_batch_from: int | None = param(
        None, lo=1, help="A8: first full-batch round; overrides full-batch-last (empty = unset)",
    )
    eta_in_server: bool = param(True, help="A1: server step η·α (Algorithm 1) vs α only")

    @property
    def alpha(self) -> float:
        """The server learning rate α in effect (``server_lr``, or the variant's Table 12 value)."""
        return TABLE12_SERVER_LR[self.variant] if self.server_lr is None else self.server_lr

    def full_batch(self, server_round: int, num_rounds: int | None) -> bool:
        """Whether ``server_round`` is in the full-batch stabilization phase (A8) of a ``num_rounds`` run."""
        if self.full_batch_from is not None:
            return server_round >= self.full_batch_from
        if self.full_batch_last == 0:
            return False
        if num_rounds is None:
            raise ConfigError(
                "FedDA's full-batch-last needs the run's number of rounds: pass num_rounds= to the strategy "
                "(Strategy.start sets it), or set full-batch-from, or full-batch-last = 0"
            )
        return server_round > num_rounds - math.ceil(self.full_batch_last * num_rounds - 1e-9)

    def bias_step(self, num_updates: int, server_round: int) -> int | None:
        """Adam's bias-correction exponent ``s`` (A3) for the update after ``num_updates`` updates; None = off."""
        if self.bias_correction == "none":
            return None
        return num_updates + 1 if self.bias_correction == "updates" else server_round


# ------------------------------------------------------------------------------------------ client
class FedDAOptimizer(LocalOptimizer):
    """FedDA's client: plain SGD on the model + the global-momentum track ``m`` and its running sum ``P``.

    Parameters
    ----------
    params, lr, downlink, hparams
        As :class:`~flower_strategies.core.local.LocalOptimizer`; ``downlink`` must hold ``"momentum"``
        (``m_r``, one tensor per parameter).
    beta1, prox_mu, eta_in_momentum
        The client fields of :class:`FedDAClientHParams` (β1, μ, A1).

    Per step, for each parameter (state ``round_start`` = ``W_r``, ``momentum`` = ``m``, ``momentum_sum`` = ``P``)::

        g ← grad + μ·(W − W_r)         (grad = 0 for a parameter without one)
        W ← W − η·g
        m ← β1·m + (1−β1)·g            (η·g with eta_in_momentum)
        P ← P + m

    :meth:`uplink` returns ``{"momentum-sum": P, "momentum": m}``; the reply carries no model.
    """

    hparams_class = FedDAClientHParams
    sends_model: ClassVar[bool] = False

    def downlink_records(self) -> tuple[str, ...]:
        return (MOMENTUM,)

    def init_state(self, name: str, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        m_r = self.received(MOMENTUM, name, p)
        if m_r is None:
            raise ValueError(f"{type(self).__name__}: the downlink record '{MOMENTUM}' has no tensor '{name}'")
        state["momentum"] = m_r
        state["momentum_sum"] = torch.zeros_like(p)

    def apply_step(self) -> None:
        for name, p, group in self.named_params():  # every parameter: the momentum track runs with g = 0 too
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            self.update_param(name, p, grad, self.param_state(name, p, group), group)

    def update_param(self, name: str, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        g = grad
        if group["prox_mu"]:
            g = g.add(p - state["round_start"], alpha=group["prox_mu"])
        p.add_(g, alpha=-group["lr"])
        feed = g.mul(group["lr"]) if group["eta_in_momentum"] else g
        state["momentum"].mul_(group["beta1"]).add_(feed, alpha=1.0 - group["beta1"])
        state["momentum_sum"].add_(state["momentum"])

    def uplink_arrays(self) -> dict[str, dict[str, Tensor]]:
        states = [(name, self.state[p]) for name, p, _ in self.named_params()]
        return {
            MOMENTUM_SUM: {name: st["momentum_sum"] for name, st in states},
            MOMENTUM: {name: st["momentum"] for name, st in states},
        }
