"""MimeLite: local steps with the server optimizer's *frozen* statistics (baseline of FedDA).

Paper: Sai Praneeth Karimireddy, Martin Jaggi, Satyen Kale, Mehryar Mohri, Sashank J. Reddi, Sebastian U. Stich,
Ananda Theertha Suresh, *Mime: Mimicking Centralized Stochastic Algorithms in Federated Learning*, ICLR 2021 —
as compared against in Jin et al., ICML 2022 (FedDA; seed file ``001_7e69cb14711dc6c0.txt``).  Spec:
ALGORITHMS.md §6 "MimeLite".

Server state ``s`` = the base optimizer's statistics (``m``; plus ``v`` for Adam/AdaGrad), broadcast with the
model.  Client ``i`` computes the full-batch gradient ``∇f_i(x_t)`` (uploaded as ``"full-gradient"``) and runs
``K`` local steps ``y ← y − η·d(g)`` with ``s`` frozen (never written back)::

    sgdm     d = (1−β1)·g + β1·m
    adam     d = ((1−β1)·g + β1·m) / (√((1−β2)·g² + β2·v) + ε)
    adagrad  d = g / (√(v + g²) + ε)

Server: ``x ← x − η_g·(x − mean_i y_i)`` (``η_g = 1``: model averaging), then ``s`` is updated with
``ḡ = mean_i ∇f_i(x_t)``: ``m ← β1·m + (1−β1)·ḡ``; Adam ``v ← β2·v + (1−β2)·ḡ²``; AdaGrad ``v ← v + ḡ²``.

Symbol ↔ variable: ``m`` record/state ``"momentum"`` / ``m_t``, ``v`` ``"second-moment"`` / ``v_t``, ``η``
``client-lr``, ``η_g`` ``server-lr``, ``β1`` ``beta1``, ``β2`` ``beta2``, ``ε`` ``eps``.

Conventions and deviations
--------------------------
* No bias correction anywhere (the spec's "as commonly implemented" Adam form); ``m_0 = v_0 = 0``.
* AdaGrad base = Duchi et al.'s AdaGrad without momentum (``beta1`` unused); an [inferred] choice: the seeds
  give no formula for MimeLite+AdaGrad.
* ``ε`` default 1e-3 [inferred]; weighting default ``examples`` (FedDA's experiments; ``uniform`` per run-config).
* Full Mime's SVRG correction ``g(y) − g(x_t) + ḡ`` is *not* applied (that is what makes it "Lite").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..core.hparams import HParams, param
from ..core.local import LocalOptimizer, Named
from ..core.ops import NamedArrays
from ..core.registry import register
from ..core.strategy import FedAdaptStrategy, RecordSpec

MOMENTUM = "momentum"
SECOND_MOMENT = "second-moment"
FULL_GRADIENT = "full-gradient"

CFG_BASE = "mime-base"
CFG_BETA1 = "mime-beta1"
CFG_BETA2 = "mime-beta2"
CFG_EPS = "mime-eps"

BASES = ("sgdm", "adam", "adagrad")


# ------------------------------------------------------------------------------------------ pure math
def mimelite_direction(base: str, g: Any, m: Any, v: Any, *, beta1: float, beta2: float, eps: float) -> Any:
    """Base-optimizer direction ``d(g)`` with frozen statistics (works on numpy arrays and torch tensors)."""
    if base == "sgdm":
        return (1.0 - beta1) * g + beta1 * m
    if base == "adam":
        sq = (1.0 - beta2) * g * g + beta2 * v
        return ((1.0 - beta1) * g + beta1 * m) / (sq**0.5 + eps)
    if base == "adagrad":
        return g / ((v + g * g) ** 0.5 + eps)
    raise ValueError(f"unknown MimeLite base optimizer {base!r}; valid: {', '.join(BASES)}")


def mimelite_server_step(
    base: str,
    params: Mapping[str, np.ndarray],
    mean_model: Mapping[str, np.ndarray],
    mean_grad: Mapping[str, np.ndarray],
    m: Mapping[str, np.ndarray],
    v: Mapping[str, np.ndarray],
    *,
    server_lr: float = 1.0,
    beta1: float = 0.9,
    beta2: float = 0.99,
) -> tuple[NamedArrays, NamedArrays, NamedArrays]:
    """``(new_params, new_m, new_v)``: ``x ← x − η_g·(x − ȳ)`` and the statistics updated with ``ḡ``."""
    if base not in BASES:
        raise ValueError(f"unknown MimeLite base optimizer {base!r}; valid: {', '.join(BASES)}")
    new_params: NamedArrays = {}
    new_m: NamedArrays = {}
    new_v: NamedArrays = {}
    for k, x in params.items():
        x64 = np.asarray(x, np.float64)
        y = np.asarray(mean_model[k], np.float64)
        g = np.asarray(mean_grad[k], np.float64)
        new_params[k] = (x64 - server_lr * (x64 - y)).astype(np.asarray(x).dtype, copy=False)
        m_k = np.asarray(m[k], np.float64)
        new_m[k] = beta1 * m_k + (1.0 - beta1) * g if base != "adagrad" else m_k
        if base != "sgdm":
            v_k = np.asarray(v[k], np.float64)
            new_v[k] = beta2 * v_k + (1.0 - beta2) * g * g if base == "adam" else v_k + g * g
    return new_params, new_m, new_v


# ------------------------------------------------------------------------------------------ hyper-parameters
@dataclass(frozen=True)
class MimeLiteHParams(HParams):
    """MimeLite (Karimireddy et al. 2021) with a SGDM / Adam / AdaGrad base optimizer."""

    base: str = param("sgdm", choices=BASES, help="base optimizer whose statistics the server keeps")
    server_lr: float = param(1.0, lo=0.0, lo_open=True, help="server learning rate η_g on the averaged model delta")
    beta1: float = param(0.9, lo=0.0, hi=0.999, help="momentum β1 (sgdm, adam)")
    beta2: float = param(0.99, lo=0.0, hi=1.0, help="second-moment decay β2 (adam)")
    eps: float = param(1e-3, lo=0.0, help="ε outside the square root (adam, adagrad)")


# ------------------------------------------------------------------------------------------ client
class MimeLiteOptimizer(LocalOptimizer):
    """Local steps with the broadcast (frozen) server statistics; uploads the full-batch gradient at ``x_t``."""

    config_keys: ClassVar[dict[str, str]] = {
        "client-lr": "lr", CFG_BASE: "base", CFG_BETA1: "beta1", CFG_BETA2: "beta2", CFG_EPS: "eps",
    }
    sends_model: ClassVar[bool] = True
    needs_full_gradient: ClassVar[bool] = True

    def __init__(
        self,
        params: Iterable[tuple[str, Tensor]],
        lr: float = 0.1,
        base: str = "sgdm",
        beta1: float = 0.9,
        beta2: float = 0.99,
        eps: float = 1e-3,
    ) -> None:
        if base not in BASES:
            raise ValueError(f"unknown MimeLite base optimizer {base!r}; valid: {', '.join(BASES)}")
        if lr < 0 or eps < 0 or not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 <= 1.0:
            raise ValueError(f"need lr >= 0, eps >= 0, 0 <= beta1 < 1, 0 <= beta2 <= 1 (got {lr}, {eps}, {beta1}, {beta2})")
        super().__init__(params, {"lr": lr, "base": base, "beta1": beta1, "beta2": beta2, "eps": eps})
        self.frozen_m: Named = {}
        self.frozen_v: Named = {}

    def begin_round(self, downlink=None, persistent=None) -> None:  # type: ignore[override]
        super().begin_round(downlink, persistent)
        down = downlink or {}
        for name, p, _ in self.named_params():
            for rec, store in ((MOMENTUM, self.frozen_m), (SECOND_MOMENT, self.frozen_v)):
                t = down.get(rec, {}).get(name)
                store[name] = t.detach().to(dtype=p.dtype, device=p.device) if t is not None else torch.zeros_like(p)

    def update_param(self, name: str, p: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
        d = mimelite_direction(
            group["base"], grad, self.frozen_m[name], self.frozen_v[name],
            beta1=group["beta1"], beta2=group["beta2"], eps=group["eps"],
        )
        p.add_(d, alpha=-group["lr"])

    def end_round(self) -> dict[str, Named]:
        if self.full_gradient is None:
            raise RuntimeError("MimeLite needs the full-batch gradient at x_t (the client driver sets full_gradient)")
        names = [name for name, _, _ in self.named_params()]
        return {FULL_GRADIENT: {n: self.full_gradient[n] for n in names}}


# ------------------------------------------------------------------------------------------ server
class MimeLite(FedAdaptStrategy):
    """MimeLite server: averages the local models, keeps the base optimizer's statistics ``m_t`` (``v_t``)."""

    method: ClassVar[str] = "mimelite"
    hparams_class = MimeLiteHParams
    default_weighting: ClassVar[str] = "examples"

    def __init__(self, hparams: HParams | None = None, **kwargs: Any) -> None:
        super().__init__(hparams, **kwargs)
        self.m_t: NamedArrays = {}
        self.v_t: NamedArrays = {}
        self._param_dtypes: dict[str, np.dtype] = {}

    def uplink_specs(self) -> tuple[RecordSpec, ...]:
        return (RecordSpec("arrays", "mean", "model"), RecordSpec(FULL_GRADIENT, "mean", "params"))

    def init_state(self, arrays: NamedArrays) -> None:
        keys = self.trainable(arrays)
        self._param_dtypes = {k: np.asarray(arrays[k]).dtype for k in keys}
        self.m_t = {k: np.zeros(np.shape(arrays[k]), np.float64) for k in keys}
        self.v_t = {k: np.zeros(np.shape(arrays[k]), np.float64) for k in keys} if self.hparams.base != "sgdm" else {}

    def downlink(self, server_round: int) -> dict[str, NamedArrays]:
        cast = lambda state: {k: a.astype(self._param_dtypes[k]) for k, a in state.items()}  # noqa: E731
        out = {}
        if self.hparams.base != "adagrad":
            out[MOMENTUM] = cast(self.m_t)
        if self.hparams.base != "sgdm":
            out[SECOND_MOMENT] = cast(self.v_t)
        return out

    def round_config(self, server_round: int) -> dict[str, Any]:
        cfg = super().round_config(server_round)
        hp = self.hparams
        cfg.update({CFG_BASE: hp.base, CFG_BETA1: float(hp.beta1), CFG_BETA2: float(hp.beta2), CFG_EPS: float(hp.eps)})
        return cfg

    def server_update(self, server_round: int, current: NamedArrays, aggregates: Mapping[str, NamedArrays]) -> NamedArrays:
        hp = self.hparams
        keys = self.trainable(current)
        mean = aggregates["arrays"]
        new_params, self.m_t, new_v = mimelite_server_step(
            hp.base, {k: current[k] for k in keys}, mean, aggregates[FULL_GRADIENT], self.m_t, self.v_t,
            server_lr=hp.server_lr, beta1=hp.beta1, beta2=hp.beta2,
        )
        self.v_t = new_v
        return self.merge_buffers(new_params, current, mean)


register(
    MimeLite, MimeLiteOptimizer,
    paper="Karimireddy et al., Mime: Mimicking Centralized Stochastic Algorithms in Federated Learning, ICLR 2021",
    summary="local steps with frozen server optimizer statistics; server averages models, updates stats with full gradients",
)
