"""Client-side local optimizers: ``torch.optim.Optimizer`` subclasses with round hooks.

A local optimizer is created by the client at the start of every round (so its state is *restarted* unless
the method carries something over explicitly) from the round's ConfigRecord::

    opt = Cls.from_config(model.named_parameters(), config)     # server-owned hyper-parameters
    opt.begin_round(downlink, persistent)                         # extras sent down + client's saved state
    for batch in batches: loss.backward(); opt.step(); opt.zero_grad()
    uplink = opt.end_round()                                      # named extra arrays to send up
    saved = opt.persistent_state()                                # goes into Context.state

Parameters must be passed as ``named_parameters()`` so that every uplink/downlink array is addressed by the
same name as in the model's ``state_dict`` (never by position).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from . import records as R

Named = dict[str, Tensor]


class LocalOptimizer(torch.optim.Optimizer):
    """Base class of fedadapt client optimizers.

    Class attributes
    ----------------
    config_keys
        Maps round-config keys to constructor keyword arguments (``{"client-lr": "lr"}``).
    sends_model
        Whether the reply carries the local model under ``"arrays"`` (False when a method uploads something
        else instead, e.g. FedDA's ``P_i``).
    """

    config_keys: ClassVar[dict[str, str]] = {R.CLIENT_LR: "lr"}
    sends_model: ClassVar[bool] = True
    #: If True, the client computes the full-batch gradient of its local data at ``x_t`` and stores it in
    #: :attr:`full_gradient` before :meth:`begin_round` (MimeLite-style methods).
    needs_full_gradient: ClassVar[bool] = False

    def __init__(self, params: Iterable[tuple[str, Tensor]], defaults: dict[str, Any]) -> None:
        params = list(params)
        if not params or not isinstance(params[0], tuple):
            raise TypeError(f"{type(self).__name__} needs model.named_parameters(), not bare parameters")
        super().__init__(params, defaults)
        self.round_start: Named = {}
        #: Set by the client driver before :meth:`begin_round`: local steps K_i of this round and n_i.
        self.num_steps: int = 0
        self.num_examples: int = 0
        #: Full-batch gradient at x_t (only when :attr:`needs_full_gradient`).
        self.full_gradient: Named | None = None

    @classmethod
    def from_config(cls, params: Iterable[tuple[str, Tensor]], config: Mapping[str, Any]) -> "LocalOptimizer":
        """Build from a round ConfigRecord using :attr:`config_keys`."""
        kwargs = {kw: config[key] for key, kw in cls.config_keys.items() if key in config}
        return cls(params, **kwargs)

    # -------------------------------------------------------------- iteration helpers
    def named_params(self) -> Iterable[tuple[str, Tensor, dict[str, Any]]]:
        for group in self.param_groups:
            for name, p in zip(group["param_names"], group["params"]):
                yield name, p, group

    # -------------------------------------------------------------- round hooks
    def begin_round(
        self,
        downlink: Mapping[str, Mapping[str, Tensor]] | None = None,
        persistent: Mapping[str, Mapping[str, Tensor]] | None = None,
    ) -> None:
        """Snapshot the round's starting point ``x_t``; subclasses also read downlink extras / saved state."""
        self.round_start = {name: p.detach().clone() for name, p, _ in self.named_params()}

    def end_round(self) -> dict[str, Named]:
        """Named extra arrays to upload (default: none)."""
        return {}

    def persistent_state(self) -> dict[str, Named]:
        """Client state that must survive to the next round this client is sampled in (default: none)."""
        return {}

    # -------------------------------------------------------------- the local step
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """torch's step contract (optional closure re-evaluating the loss), then :meth:`apply_step`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.apply_step()
        return loss

    def apply_step(self) -> None:
        """One local step on the current gradients: :meth:`update_param` for every parameter that has one.

        Override this for rules that need more than one tensor at a time (per-step counters, layer-wise scaling)."""
        for name, p, group in self.named_params():
            if p.grad is not None:
                self.update_param(name, p, p.grad, group)

    def update_param(self, name: str, p: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
        """The per-tensor update rule (in place on ``p``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement update_param() or apply_step()")


class SGDOptimizer(LocalOptimizer):
    """Plain local SGD with optional coupled L2 weight decay and proximal term.

    Per step, for each parameter ``x`` with round start ``x_t``::

        d = g + weight_decay·x + mu·(x − x_t)
        x ← x − lr·d

    ``mu > 0`` is FedProx's local objective ``F_i(x) + (mu/2)·‖x − x_t‖²`` (Li et al., 2020).
    """

    config_keys: ClassVar[dict[str, str]] = {R.CLIENT_LR: "lr", "weight-decay": "weight_decay", "prox-mu": "mu"}

    def __init__(self, params: Iterable[tuple[str, Tensor]], lr: float = 0.1, weight_decay: float = 0.0, mu: float = 0.0) -> None:
        if lr < 0 or weight_decay < 0 or mu < 0:
            raise ValueError(f"lr, weight_decay and mu must be >= 0 (got {lr}, {weight_decay}, {mu})")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "mu": mu})

    def update_param(self, name: str, p: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
        d = grad
        if group["weight_decay"]:
            d = d.add(p, alpha=group["weight_decay"])
        if group["mu"]:
            d = d.add(p - self.round_start[name], alpha=group["mu"])
        p.add_(d, alpha=-group["lr"])
