"""Client-side local optimizers: real ``torch.optim.Optimizer`` subclasses, usable in any training loop.

A local optimizer is built once per round from the round's inputs and then driven like any torch optimizer::

    opt = FedLADAOptimizer(model.named_parameters(), lr=0.01,
                           downlink={"v-hat": {...}, "global-offset": {...}},   # records the server sent
                           amend_weight=0.1)                                    # client hyper-parameters
    for x, y in loader:                                                        # the user's own loop
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    extras = opt.uplink()          # named arrays to upload besides the model ({"v-hat": {...}})
    saved = opt.client_state()     # arrays that must survive until this client's next round

* **Hyper-parameters** are the client fields of the method's :class:`~flower_strategies.core.hparams.HParams`
  declaration (``param(..., client=True)``): they are the constructor's keyword arguments, live in
  ``param_groups`` (so per-group values and schedulers work) and are validated by the declaration.
* **State** is created lazily at the first :meth:`step` and kept in ``self.state[p]`` (round start ``x_t`` as
  ``"round_start"``, moments, offsets …), so ``state_dict()``/``load_state_dict()`` round-trip all of it.
  The number of steps taken is counted by the optimizer (``self.state["round"]["steps"]``): methods whose
  server math needs K (SCAFFOLD, FedLADA, FedDA) use the steps actually taken.
* **Misuse is an error**: bare parameters instead of ``named_parameters()``, a missing downlink record, a
  missing full-batch gradient, or asking for the reply before any step raise ``ValueError``/``RuntimeError``
  with the fix, never a ``KeyError`` or a silently degraded method.

Parameters must be passed as ``named_parameters()`` so that every uplink/downlink array is addressed by the
same name as in the model's ``state_dict`` (never by position).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .params import ConfigError, HParams, param

Named = dict[str, Tensor]
NamedRecords = Mapping[str, Mapping[str, Tensor]]

#: Key of the optimizer-wide (not per-parameter) entry of ``self.state``.
ROUND = "round"

#: Where ε enters an adaptive preconditioner: not at all, ``1/(√v+ε)`` or ``1/√(v+ε)``.
EPS_PLACEMENTS = ("none", "outside", "inside")


def inverse_sqrt(v: Tensor, eps: float, placement: str) -> Tensor:
    """The adaptive preconditioner ``1/√v`` (``none``), ``1/(√v+ε)`` (``outside``) or ``1/√(v+ε)`` (``inside``)."""
    if placement == "outside":
        return 1.0 / (v.sqrt() + eps)
    if placement == "inside":
        return 1.0 / (v + eps).sqrt()
    if placement == "none":
        return v.rsqrt()
    raise ValueError(f"unknown eps placement {placement!r}; valid: {', '.join(EPS_PLACEMENTS)}")


class LocalOptimizer(torch.optim.Optimizer):
    """Base class of fedadapt client optimizers (see the module docstring for the contract).

    Parameters
    ----------
    params
        ``model.named_parameters()`` (names address the records).
    lr
        Client learning rate η_l of this round (the server sends it as ``client-lr``).
    downlink
        ``{record name: {param name: tensor}}``: the extra records the server sent this round
        (:attr:`downlink_records` lists the ones this optimizer requires).
    client_state
        ``{name: {param name: tensor}}``: what :meth:`client_state` returned in this client's previous round
        (empty for a client sampled for the first time).
    full_gradient
        ``{param name: tensor}``: the full-batch gradient at ``x_t`` (required when :attr:`needs_full_gradient`).
    planned_steps
        The number of local steps the round plans (required when :attr:`needs_planned_steps`).
    hparams
        An instance of :attr:`hparams_class` (or a subclass: the method's full declaration); its client fields
        are the defaults, ``**hyper`` overrides them.
    """

    #: The declaration of this optimizer's hyper-parameters (its ``client=True`` fields).
    hparams_class: ClassVar[type[HParams]] = HParams
    #: Whether the reply carries the local model under ``"arrays"``.
    sends_model: ClassVar[bool] = True
    #: Whether the full-batch gradient at ``x_t`` must be passed as ``full_gradient`` (MimeLite-style methods).
    needs_full_gradient: ClassVar[bool] = False
    #: Whether the round's driver (``train_reply``, ``ClientRound``) passes the planned number of local steps as
    #: ``planned_steps`` to this optimizer class.  Whether an instance cannot run without it:
    #: :meth:`requires_planned_steps`.
    needs_planned_steps: ClassVar[bool] = False
    #: ``None``: one client's parameters (the normal case).  An int C: every parameter (and the client state) is
    #: stacked on a leading client axis of C clients trained together (:mod:`simulations.engine.vectorized`); downlink
    #: tensors from :meth:`received` are then repeated along it, and reductions use :meth:`client_sum`.
    clients: int | None = None

    def __init__(
        self,
        params: Iterable[tuple[str, Tensor]],
        lr: float,
        *,
        downlink: NamedRecords | None = None,
        client_state: NamedRecords | None = None,
        full_gradient: Mapping[str, Tensor] | None = None,
        planned_steps: int | None = None,
        hparams: HParams | None = None,
        **hyper: Any,
    ) -> None:
        params = list(params)
        if not params or not isinstance(params[0], tuple):
            raise TypeError(f"{type(self).__name__} needs model.named_parameters(), not bare parameters")
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"{type(self).__name__}: lr must be a finite number >= 0, got {lr!r}")
        hp = self.hparams_class() if hparams is None else hparams
        if not isinstance(hp, self.hparams_class):
            raise TypeError(
                f"{type(self).__name__} needs {self.hparams_class.__name__} hparams, got {type(hp).__name__}"
            )
        unknown = sorted(set(hyper) - set(hp.client_fields()))
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown hyper-parameter(s) {unknown}; "
                f"valid: lr, {', '.join(hp.client_fields()) or '(none)'}"
            )
        try:
            hp = hp.replace(**hyper)
        except ConfigError as err:
            raise ValueError(f"{type(self).__name__}: {err}") from None
        self.hparams = hp
        super().__init__(params, {"lr": float(lr), **hp.client_values()})
        self.downlink: dict[str, Named] = {k: dict(v) for k, v in (downlink or {}).items()}
        self.client_state_in: dict[str, Named] = {k: dict(v) for k, v in (client_state or {}).items()}
        self.full_gradient = None if full_gradient is None else dict(full_gradient)
        if self.needs_full_gradient and self.full_gradient is None:
            raise ValueError(
                f"{type(self).__name__} needs full_gradient= (the gradient of the mean loss over all local data at the "
                "received model; flower_strategies.full_gradient_from computes it)"
            )
        if planned_steps is not None and (not isinstance(planned_steps, int) or planned_steps < 1):
            raise ValueError(f"{type(self).__name__}: planned_steps must be a positive int, got {planned_steps!r}")
        if planned_steps is None and self.requires_planned_steps():
            raise ValueError(
                f"{type(self).__name__} needs planned_steps= (the number of local steps this round; "
                "with ClientRound.optimizer pass num_examples=)"
            )
        self.planned_steps = planned_steps
        missing = [r for r in self.downlink_records() if r not in self.downlink]
        if missing:
            raise ValueError(
                f"{type(self).__name__} needs the downlink record(s) {missing} that the server sends with the model "
                f"(pass downlink={{name: arrays}} from the train message); got {sorted(self.downlink) or 'none'}"
            )
        self.state[ROUND] = {"steps": 0}  # type: ignore[index]  # torch keys state by tensor; one str entry

    def rebind(self, client_state: NamedRecords | None, full_gradient: Mapping[str, Tensor] | None,
               planned_steps: int | None) -> None:
        """Start another client's round on the same parameters, lr, downlink and hyper-parameters: its saved state,
        full-batch gradient and planned steps replace the current ones and the optimizer state is cleared (what a
        new instance would hold, without re-validating the unchanged inputs; the vectorized engine builds one
        reply optimizer per chunk this way)."""
        self.client_state_in = {k: dict(v) for k, v in (client_state or {}).items()}
        self.full_gradient = None if full_gradient is None else dict(full_gradient)
        self.planned_steps = planned_steps
        self.state.clear()
        self.state[ROUND] = {"steps": 0}  # type: ignore[index]

    # -------------------------------------------------------------- declaration hooks
    def requires_planned_steps(self) -> bool:
        """Whether this instance (its hyper-parameters) cannot run without ``planned_steps``; default
        :attr:`needs_planned_steps`."""
        return self.needs_planned_steps

    def downlink_records(self) -> tuple[str, ...]:
        """Downlink records this optimizer requires (may depend on its hyper-parameters)."""
        return ()

    def init_state(self, name: str, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Create the per-parameter state at the first step (``state["round_start"]`` is already set)."""

    def update_param(self, name: str, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """The per-tensor update rule (in place on ``p``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement update_param() or apply_step()")

    def apply_step(self) -> None:
        """One local step on the current gradients: :meth:`update_param` for every parameter that has one.

        Override for rules that need more than one tensor at a time (layer-wise scaling, step-indexed weights)."""
        for name, p, group in self.named_params():
            if p.grad is not None:
                self.update_param(name, p, p.grad, self.param_state(name, p, group), group)

    def uplink_arrays(self) -> dict[str, Named]:
        """Named extra arrays to upload besides the model (default: none)."""
        return {}

    def persistent_arrays(self) -> dict[str, Named]:
        """Client state that must survive until this client is sampled again (default: none)."""
        return {}

    # -------------------------------------------------------------- helpers
    def named_params(self) -> Iterable[tuple[str, Tensor, dict[str, Any]]]:
        for group in self.param_groups:
            for name, p in zip(group["param_names"], group["params"], strict=True):
                yield name, p, group

    def param_state(self, name: str, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """``self.state[p]``, created on first use (round start + :meth:`init_state`)."""
        st = self.state[p]
        if "round_start" not in st:
            st["round_start"] = p.detach().clone()
            self.init_state(name, p, st, group)
        return st

    def received(self, record: str, name: str, p: Tensor) -> Tensor | None:
        """Tensor ``name`` of downlink record ``record`` as a fresh copy on ``p``'s device/dtype (None if absent)."""
        arrays = self.downlink.get(record)
        if arrays is None or name not in arrays:
            return None
        t = torch.as_tensor(arrays[name]).to(device=p.device, dtype=p.dtype)
        return t.clone() if self.clients is None else t.expand(self.clients, *t.shape).clone()

    def client_sum(self, x: Tensor) -> Tensor:
        """The sum of ``x``'s elements: one scalar, or with stacked clients one value per client (shape (C,))."""
        if self.clients is None:
            return x.sum()
        return x.reshape(x.shape[0], -1).sum(1)

    def per_client(self, value: Any, like: Tensor) -> Any:
        """``value`` from :meth:`client_sum` (or a float) shaped to broadcast against ``like``: with stacked clients
        (C,) becomes (C, 1, …, 1); otherwise ``value`` as it is."""
        if self.clients is None or not isinstance(value, Tensor):
            return value
        return value.reshape(-1, *([1] * (like.dim() - 1))).to(device=like.device, dtype=like.dtype)

    def saved(self, record: str, name: str, p: Tensor) -> Tensor | None:
        """Tensor ``name`` of this client's saved state ``record`` on ``p``'s device/dtype (None if absent)."""
        arrays = self.client_state_in.get(record)
        if arrays is None or name not in arrays:
            return None
        return torch.as_tensor(arrays[name]).to(device=p.device, dtype=p.dtype).clone()

    @property
    def steps_taken(self) -> int:
        """Local steps taken so far this round."""
        return int(self.state[ROUND]["steps"])  # type: ignore[index]

    def _all_states(self) -> Iterable[tuple[str, Tensor, dict[str, Any]]]:
        if self.steps_taken == 0:
            raise RuntimeError(
                f"{type(self).__name__}: no local step was taken; call step() at least once before asking for the reply"
            )
        for name, p, group in self.named_params():
            yield name, p, self.param_state(name, p, group)

    # -------------------------------------------------------------- torch API + reply
    @torch.no_grad()
    def step(self, closure=None):
        """torch's step contract (optional closure re-evaluating the loss), then :meth:`apply_step`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for name, p, group in self.named_params():
            self.param_state(name, p, group)
        self.apply_step()
        self.state[ROUND]["steps"] += 1
        return loss

    def uplink(self) -> dict[str, Named]:
        """The round's extra uplink records (call after the last step)."""
        list(self._all_states())
        return self.uplink_arrays()

    def client_state(self) -> dict[str, Named]:
        """Arrays to keep on the client until its next round (pass them back as ``client_state=``)."""
        list(self._all_states())
        return self.persistent_arrays()


@dataclass(frozen=True)
class SGDHParams(HParams):
    """Local SGD (the FedAvg/FedOpt/FedProx client)."""

    weight_decay: float = param(0.0, lo=0.0, client=True, help="coupled L2 weight decay λ in the local SGD steps")
    mu: float = param(0.0, lo=0.0, client=True, help="FedProx proximal coefficient μ (0 = plain local SGD)")


class SGDOptimizer(LocalOptimizer):
    """Plain local SGD with optional coupled L2 weight decay and proximal term.

    Per step, for each parameter ``x`` with round start ``x_t``::

        d = g + weight_decay·x + mu·(x − x_t)
        x ← x − lr·d

    ``mu > 0`` is FedProx's local objective ``F_i(x) + (mu/2)·‖x − x_t‖²`` (Li et al., 2020).
    """

    hparams_class = SGDHParams

    def update_param(self, name: str, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        d = grad
        if group["weight_decay"]:
            d = d.add(p, alpha=group["weight_decay"])
        if group["mu"]:
            d = d.add(p - state["round_start"], alpha=group["mu"])
        p.add_(d, alpha=-group["lr"])


def has_client_half(optimizer: type[LocalOptimizer], client_values: Mapping[str, Any]) -> bool:
    """Whether a method needs its client half — the one place this is decided (the strategy sends the answer to
    its clients as the round's ``client-half``): its local optimizer is not plain SGD, or one of its client
    hyper-parameters is set (FedProx's ``mu``).  ``False``: an app's own optimizer (e.g. SGD with momentum) may
    train, as with a stock Flower client."""
    return optimizer is not SGDOptimizer or any(bool(v) for v in client_values.values())


#: The local optimizers a round's ``local-optimizer`` may name, by class name: :class:`SGDOptimizer`, every built-in
#: method's (:mod:`flower_strategies.optimizers`, the client half) and every registered method's
#: (:func:`~flower_strategies.core.registry.register` adds it with :func:`add_local_optimizer`).
LOCAL_OPTIMIZERS: dict[str, type[LocalOptimizer]] = {SGDOptimizer.__name__: SGDOptimizer}


def add_local_optimizer(optimizer: type[LocalOptimizer]) -> str:
    """Make ``optimizer`` findable by a client under its class name (returned); the same class again is a no-op."""
    known = LOCAL_OPTIMIZERS.setdefault(optimizer.__name__, optimizer)
    if known is not optimizer:
        raise TypeError(f"two local optimizers are named {optimizer.__name__!r} ({known.__module__} and "
                        f"{optimizer.__module__}): rename one")
    return optimizer.__name__


def local_optimizer_named(name: str) -> type[LocalOptimizer]:
    """The local optimizer a round's ``local-optimizer`` names (:data:`LOCAL_OPTIMIZERS`)."""
    try:
        return LOCAL_OPTIMIZERS[name]
    except KeyError:
        raise ValueError(
            f"the round's local optimizer {name!r} is unknown to this client (known: "
            f"{', '.join(sorted(LOCAL_OPTIMIZERS))}): import the module that registers its method in your ClientApp, "
            "or run the server's fedadapt version"
        ) from None
