"""Differential privacy: fedadapt's native user-level DP, and the rules for Flower's own privacy layer.

**Native DP** (``dp-clip`` C > 0, ``dp-noise-multiplier`` z, ``dp-delta`` δ; see docs/privacy.md).  The server clips
each client's *whole* uplink — the model update ``x_i − x_t`` of every model-keyed record and the values of every
statistic / control-variate record — at one joint L2 norm C, so that one client moves the vector of all the round's
sums by at most C (add/remove) or 2C (replace-one), whatever records the method sends.  Each sum then gets Gaussian
noise of std z·C; a mean record is that noisy sum over the n *sampled* clients (a fixed denominator: std z·C/n), so
``x_t + (Σ_i s_i (x_i − x_t) + N(0, z²C²)) / n`` for the model.  A missing reply counts as a zero update.

Accounting: the sampler draws a fixed-size uniform sample of n of the N live nodes each round; the fixed
denominator n makes the sample size public, so the neighbouring relation is *replace one client* and the
L2 sensitivity of the sums is 2C: each round is a ``SampledWithoutReplacementDpEvent(N, n, GaussianDpEvent(z/2))``
of Google's ``dp-accounting`` RDP accountant (the backend of Flower's own ``RdpAccountant``).  The rounds that were
released are read back from the strategy's history, so a resumed run reports the same ε.

**Flower's privacy layer** clips every ArrayRecord of a reply as if it were the model
(``DifferentialPrivacy*Clipping`` wrappers, ``fixedclipping_mod``, ``adaptiveclipping_mod``, ``LocalDpMod``) and
noises the strategy's *output* model.  That is right only where the uplink is the model alone; the server-side
wrappers are right only where, in addition, the output is the mean of the replies and the server keeps no state
built from un-noised means (:func:`composes_with_flower_dp`).  Every other combination is refused when the round
is prepared (server wrappers) or when the client builds its reply (client mods), naming :data:`FIX`.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import cache
from logging import INFO
from types import CodeType, FrameType
from typing import Any

import numpy as np
from flwr.common import log

from . import records as R
from .hparams import ConfigError
from .ops import NamedArrays, is_float

#: What a refused combination says to do instead.
FIX = ("use fedadapt's native user-level DP instead: dp-clip = C > 0 and dp-noise-multiplier = z in the run config "
       "(or FedAdaptStrategy(..., dp_clip=C, dp_noise_multiplier=z)), which clips each client's whole uplink and "
       "noises every aggregate; see docs/privacy.md")

#: RDP orders of the accountant: any set gives a valid bound; this one is within 0.5 % of dp-accounting's default
#: (orders up to 1024) for ε ≥ 0.4 at δ = 1e-5, and 10× faster for sampling without replacement (its cost grows
#: with the square of the order).
RDP_ORDERS = (1.25, 1.5, 1.75, 2, 2.25, 2.5, 3, 3.5, 4, 4.5, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64)

#: Aggregation rules native DP supports: a mean over the sampled clients, or a sum.
_MEAN_RULES = ("mean", "wmean", "umean")


# ------------------------------------------------------------------ Flower's privacy layer: compose or refuse
@cache
def flower_dp_wrappers() -> tuple[type, ...]:
    """Flower 1.42's DP strategy wrappers: Message API (``flwr.serverapp.strategy``) and legacy
    (``flwr.server.strategy``)."""
    import flwr.server.strategy as legacy
    import flwr.serverapp.strategy as message_api

    names = [f"DifferentialPrivacy{side}Side{kind}Clipping" for side in ("Server", "Client")
             for kind in ("Fixed", "Adaptive")]
    return tuple(getattr(mod, n) for mod in (message_api, legacy) for n in names) + (legacy.DPFedAvgFixed,)


@cache
def flower_dp_mods() -> dict[CodeType, str]:
    """``{code object: name}`` of Flower's client-side DP mods (``flwr.clientapp.mod`` and ``flwr.client.mod``)."""
    import flwr.client.mod as legacy
    import flwr.clientapp.mod as message_api

    out: dict[CodeType, str] = {}
    for mod in (message_api, legacy):
        out[mod.fixedclipping_mod.__code__] = "fixedclipping_mod"
        out[mod.adaptiveclipping_mod.__code__] = "adaptiveclipping_mod"
        out[mod.LocalDpMod.__call__.__code__] = "LocalDpMod"
    return out


def _callers(depth: int) -> list[FrameType]:
    """The ``depth`` frames above the caller of the caller."""
    frames: list[FrameType] = []
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and len(frames) < depth:
        frames.append(frame)
        frame = frame.f_back
    return frames


def composes_with_flower_dp(strategy: Any) -> bool:
    """Whether Flower's server-side DP wrappers are right for ``strategy``: its uplink and downlink are the model
    alone and its new model is the mean of the (clipped) replies (``averages_models``: FedAvg / FedProx with the
    plain server step), so that clipping each reply and noising the output is the DP-FedAvg mechanism."""
    specs = strategy.uplink_specs()
    model_only = len(specs) == 1 and specs[0].name == R.MODEL and specs[0].keys == "model"
    return model_only and bool(getattr(strategy, "averages_models", False)) and not strategy.downlink(1)


def refuse_flower_dp(strategy: Any) -> None:
    """Raise :class:`~.hparams.ConfigError` when a Flower DP wrapper drives ``strategy`` (found among the callers of
    :meth:`~.strategy.FedAdaptStrategy.prepare_round`) and would not be right for it."""
    wrappers = flower_dp_wrappers()
    wrapper = next((f.f_locals["self"] for f in _callers(6) if isinstance(f.f_locals.get("self"), wrappers)), None)
    if wrapper is None or composes_with_flower_dp(strategy):
        return
    raise ConfigError(
        f"Flower's {type(wrapper).__name__} cannot wrap fedadapt method '{strategy.method}': it clips every "
        f"ArrayRecord of a reply as if it were the model and adds noise to the new model, but "
        f"'{strategy.method}' sends {[s.name for s in strategy.uplink_specs()]} and keeps server state built from "
        f"the replies (only FedAvg/FedProx with server-opt sgd and server-lr 1 compose). Fix: {FIX}")


def refuse_flower_dp_mods(method: str, record_names: Sequence[str]) -> None:
    """Raise :class:`~.hparams.ConfigError` when one of Flower's DP mods runs around this client round
    (:meth:`~.client.ClientRound.reply`) and the reply carries more or other than the model: the mod would clip and
    noise statistics and control variates as model weights.  Model-only replies compose (``LocalDpMod`` is local DP
    of everything the client sends; the clipping mods need a server wrapper, refused by :func:`refuse_flower_dp`)."""
    if list(record_names) == [R.MODEL]:
        return
    mods = flower_dp_mods()
    name = next((mods[f.f_code] for f in _callers(40) if f.f_code in mods), None)
    if name is not None:
        raise ConfigError(
            f"Flower's {name} cannot wrap the client half of fedadapt method '{method}': it clips (and noises) the "
            f"reply as one model update, but the reply carries the records {list(record_names)}. Fix: remove the mod "
            f"and {FIX}")


def mod_refusal_hint(client_error: str) -> str:
    """The fix to append to a client error raised by one of Flower's DP mods itself (they refuse messages with
    more than one ArrayRecord, e.g. a method's downlink extras, before the client half runs)."""
    mods = ("fixedclipping_mod", "adaptiveclipping_mod", "LocalDpMod")
    return f" (Flower's DP mods handle model-only messages; {FIX})" if any(
        m in client_error for m in mods) and FIX not in client_error else ""


# ------------------------------------------------------------------ native user-level DP
def check_specs(method: str, specs: Sequence[Any]) -> None:
    """Native DP supports mean and sum records (a max-merged record has no bounded noise calibration)."""
    bad = [s.name for s in specs if s.rule not in (*_MEAN_RULES, "sum")]
    if bad:
        raise ConfigError(f"dp-clip > 0: method '{method}' max-merges the records {bad}, which native DP cannot "
                          f"noise with a calibrated sensitivity; set dp-clip = 0 or use a method that averages them")


def joint_clip_scales(kept: Sequence[Mapping[str, NamedArrays]], specs: Sequence[Any], current: NamedArrays,
                      clip: float) -> tuple[list[float], list[float]]:
    """``(scales, norms)``: each reply's joint L2 norm over all its records (model-keyed records: ``x_i − x_t``;
    statistic records: their values; floating-point arrays only) and its scale ``min(1, C / norm)``."""
    norms = []
    for parsed in kept:
        sq = 0.0
        for spec in specs:
            for key, arr in parsed[spec.name].items():
                if is_float(arr):
                    d = np.asarray(arr, np.float64) - (current[key] if spec.keys == "model" else 0.0)
                    sq += float(np.vdot(d, d))
        norms.append(math.sqrt(sq))
    return [min(1.0, clip / n) if n > 0 else 1.0 for n in norms], norms


def private_aggregates(kept: Sequence[Mapping[str, NamedArrays]], specs: Sequence[Any], current: NamedArrays,
                       scales: Sequence[float], num_sampled: int, sum_std: float,
                       rng: np.random.Generator) -> dict[str, NamedArrays]:
    """``{record: aggregate}``: each record's scaled sum (model-keyed: of the updates) plus N(0, ``sum_std``²)
    per coordinate, over ``num_sampled`` for mean rules, added back onto ``x_t`` for model-keyed records, in each
    array's dtype.  Integer arrays of model-keyed records keep the server's value."""
    out: dict[str, NamedArrays] = {}
    for spec in specs:
        agg: NamedArrays = {}
        for key, first in kept[0][spec.name].items():
            ref = np.asarray(current[key]) if spec.keys == "model" else None
            if not is_float(first):
                agg[key] = np.array(ref if ref is not None else first)
                continue
            acc = np.zeros(first.shape, np.float64)
            for parsed, scale in zip(kept, scales):
                acc += scale * (np.asarray(parsed[spec.name][key], np.float64) - (0.0 if ref is None else ref))
            if sum_std > 0:
                acc += rng.normal(0.0, sum_std, acc.shape)
            if spec.rule in _MEAN_RULES:
                acc /= num_sampled
            agg[key] = (acc if ref is None else acc + ref).astype(first.dtype)
        out[spec.name] = agg
    return out


def epsilon(events: Sequence[tuple[int, int]], noise_multiplier: float, delta: float) -> float:
    """ε at ``delta`` after the rounds ``events`` = ``[(population N, sample size n), …]`` with noise std z·C on
    sums of sensitivity 2C (replace one client): Google's ``dp-accounting`` RDP accountant, each round a
    ``SampledWithoutReplacementDpEvent(N, n, GaussianDpEvent(z / 2))``, orders :data:`RDP_ORDERS`.  ``inf`` without
    noise."""
    if noise_multiplier <= 0:
        return math.inf
    if not events:
        return 0.0
    from dp_accounting import dp_event, privacy_accountant, rdp

    acc = rdp.RdpAccountant(RDP_ORDERS, privacy_accountant.NeighboringRelation.REPLACE_ONE)
    gaussian = dp_event.GaussianDpEvent(noise_multiplier / 2.0)
    for (population, sampled), count in Counter(events).items():
        acc.compose(dp_event.SampledWithoutReplacementDpEvent(population, sampled, gaussian), count)
    return float(acc.get_epsilon(delta))


def privatize(strategy: Any, screened: Any, sampled: int) -> dict[str, float]:
    """With ``dp-clip`` > 0: replace ``screened.aggregates`` by the clipped, noised aggregates of the kept replies
    and return the round's DP metrics (``dp-epsilon`` = ε spent so far at ``dp-delta`` if this round is released);
    else nothing.  ``sampled``: the n clients the round asked (the fixed denominator)."""
    s = strategy.settings
    if s.dp_clip <= 0 or not screened.kept:
        return {}
    specs = strategy.uplink_specs()
    check_specs(strategy.method, specs)
    kept = [parsed for _, parsed in screened.kept]
    scales, norms = joint_clip_scales(kept, specs, strategy.current, s.dp_clip)
    sum_std = s.dp_noise_multiplier * s.dp_clip
    screened.aggregates = private_aggregates(kept, specs, strategy.current, scales, sampled, sum_std,
                                             np.random.default_rng())  # OS entropy: the noise is not reproducible
    population = max(strategy.sampler.population, sampled)
    released = [(int(h.round_metrics["dp-population"]), int(h.round_metrics["dp-sampled"]))
                for h in strategy.history if "dp-sampled" in h.round_metrics]
    metrics = {"dp-clipped": float(sum(x < 1.0 for x in scales)), "dp-max-norm": max(norms),
               "dp-noise-std": sum_std / sampled, "dp-sampled": float(sampled), "dp-population": float(population)}
    eps = epsilon([*released, (population, sampled)], s.dp_noise_multiplier, s.dp_delta)
    if math.isfinite(eps):
        metrics["dp-epsilon"] = eps
    log(INFO, "native DP: %d of %d replies clipped at %g, noise std %.4g on the mean, ε = %.4g at δ = %g",
        int(metrics["dp-clipped"]), len(kept), s.dp_clip, metrics["dp-noise-std"], eps, s.dp_delta)
    return metrics
