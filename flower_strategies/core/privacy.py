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
built from un-noised means (:func:`composes_with_flower_dp`).  Every other combination is refused, naming
:data:`FIX`, from what fedadapt sees through Flower's public API (no call-stack inspection): a wrapper when the round
is prepared (:func:`refuse_flower_dp`), a clipping mod when the client builds its reply and a mod that rewrote a
reply when the server screens it (:func:`.dpmods.guard_reply`, :func:`rewritten_reply_reason`); docs/privacy.md lists
what is detected.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from logging import INFO
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from flwr.app import ArrayRecord
from flwr.common import log

from . import records as R
from .aggregation import Private, aggregate
from .dpmods import CLIENT_WRAPPERS, CLIPPING_NORM_KEY, FIX, MODS, UPLINK_CRC, reply_crc
from .hparams import ConfigError
from .ops import NamedArrays, is_float
from .rejections import Kind, Rejection

if TYPE_CHECKING:
    from .rounds import RoundLog
    from .validation import RecordSpec


#: RDP orders of the accountant: any set gives a valid bound; this one is within 0.5 % of dp-accounting's default
#: (orders up to 1024) for ε ≥ 0.4 at δ = 1e-5, and 10× faster for sampling without replacement (its cost grows
#: with the square of the order).
RDP_ORDERS = (1.25, 1.5, 1.75, 2, 2.25, 2.5, 3, 3.5, 4, 4.5, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64)

#: Aggregation rules native DP supports: a mean over the sampled clients, or a sum.
_MEAN_RULES = ("mean", "wmean", "umean")


# ------------------------------------------------------------------ Flower's privacy layer: compose or refuse


#: Flower's DP components that clip a reply as the model, for the refusal messages.
_SERVER_WRAPPERS = "DifferentialPrivacyServerSide{Fixed,Adaptive}Clipping"


class Wrapped(Protocol):
    """What the rules for Flower's DP wrappers read of a strategy (:class:`~.strategy.FedAdaptStrategy`): its method,
    uplink and downlink, and whether its new model is the mean of the replies (``averages_models``)."""

    @property
    def method(self) -> str: ...

    @property
    def averages_models(self) -> bool: ...

    def uplink_specs(self) -> Sequence[RecordSpec]: ...

    def downlink(self, server_round: int) -> Mapping[str, NamedArrays]: ...


def composes_with_flower_dp(strategy: Wrapped) -> bool:
    """Whether Flower's server-side DP wrappers are right for ``strategy``: its uplink and downlink are the model
    alone and its new model is the mean of the (clipped) replies (``averages_models``: FedAvg / FedProx with the
    plain server step), so that clipping each reply and noising the output is the DP-FedAvg mechanism."""
    specs = strategy.uplink_specs()
    model_only = len(specs) == 1 and specs[0].name == R.MODEL and specs[0].keys == "model"
    return model_only and strategy.averages_models and not strategy.downlink(1)


def flower_dp_wrapper(config: Mapping[str, Any]) -> str | None:
    """Which of Flower's DP wrappers may drive this round, from the ``config`` the round hands ``configure_train``
    (nothing else, nothing kept between rounds): a client-side clipping wrapper puts :data:`CLIPPING_NORM_KEY` into
    it; a server-side wrapper hands on the config its ``start()`` (Flower's ``Strategy.start``) got, without the mark
    fedadapt's own loops set (:data:`.records.OWN_LOOP`, :func:`.loop.own_loop_config`).  Flower's public API shows
    the wrapped strategy nothing that tells a server-side DP wrapper from any other wrapper, so a round without the
    mark counts as one.  ``None``: a fedadapt loop runs the round."""
    if CLIPPING_NORM_KEY in config:
        return f"{CLIENT_WRAPPERS} (the round's config carries '{CLIPPING_NORM_KEY}')"
    if not config.get(R.OWN_LOOP, False):
        return (f"{_SERVER_WRAPPERS} (the round's config lacks '{R.OWN_LOOP}', the mark of fedadapt's own loops: "
                f"another loop runs this strategy, such as Flower's Strategy.start of a wrapper. A wrapper of your "
                f"own that is not a DP wrapper: start it with train_config=own_loop_config() "
                f"(flower_strategies.core.loop); a loop of your own: hand configure_train own_loop_config(config))")
    return None


def refuse_flower_dp(strategy: Wrapped, config: Mapping[str, Any]) -> None:
    """Raise :class:`~.hparams.ConfigError` when a Flower DP wrapper drives ``strategy`` (:func:`flower_dp_wrapper`,
    checked in :meth:`~.strategy.FedAdaptStrategy.prepare_round` with the config the wrapper handed down) and would
    not be right for it."""
    if composes_with_flower_dp(strategy):
        return
    wrapper = flower_dp_wrapper(config)
    if wrapper is None:
        return
    raise ConfigError(
        f"Flower's {wrapper} cannot wrap fedadapt method '{strategy.method}': it clips every "
        f"ArrayRecord of a reply as if it were the model and adds noise to the new model, but "
        f"'{strategy.method}' sends {[s.name for s in strategy.uplink_specs()]} and keeps server state built from "
        f"the replies (only FedAvg/FedProx with server-opt sgd and server-lr 1 compose). Fix: {FIX}")


def rewritten_reply_reason(content: Any, info: Mapping[str, Any]) -> Rejection | None:
    """Why a reply is rejected (:attr:`~.rejections.Kind.REWRITTEN`) when its ``ReplyInfo`` carries
    :data:`UPLINK_CRC` and its only ArrayRecord no longer matches it (a ClientApp mod rewrote the record after
    fedadapt's client half built it), else ``None``."""
    if UPLINK_CRC not in info:
        return None
    arrays = list(R.of_type(content, ArrayRecord))
    if len(arrays) == 1 and info[UPLINK_CRC] == reply_crc(arrays[0][1]):
        return None
    name = arrays[0][0] if len(arrays) == 1 else [n for n, _ in arrays]
    return Rejection(None, Kind.REWRITTEN, f"a ClientApp mod rewrote the reply's record {name!r} after fedadapt's "
                     f"client half built it: Flower's {MODS} clip (and noise) a reply's only ArrayRecord as the "
                     f"model update. Fix: remove the mod and {FIX}")


def mod_refusal_hint(error: Rejection) -> str:
    """The fix to append to a client error returned by a ClientApp mod that refused the message
    (:attr:`~.rejections.Kind.MOD_REFUSED`: in Flower, its DP mods, which refuse messages with more than one
    ArrayRecord, e.g. a method's downlink extras, before the client half runs)."""
    return f" (Flower's DP mods handle model-only messages; {FIX})" if error.kind is Kind.MOD_REFUSED else ""


# ------------------------------------------------------------------ native user-level DP
def check_specs(method: str, specs: Sequence[RecordSpec]) -> None:
    """Native DP supports mean and sum records (a max-merged record has no bounded noise calibration)."""
    bad = [s.name for s in specs if s.rule not in (*_MEAN_RULES, "sum")]
    if bad:
        raise ConfigError(f"dp-clip > 0: method '{method}' max-merges the records {bad}, which native DP cannot "
                          f"noise with a calibrated sensitivity; set dp-clip = 0 or use a method that averages them")


def joint_clip_scales(kept: Sequence[Mapping[str, NamedArrays]], specs: Sequence[RecordSpec], current: NamedArrays,
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
    return {spec.name: aggregate([parsed[spec.name] for parsed in kept], scales, Private(
        sum_std, num_sampled if spec.rule in _MEAN_RULES else 1, rng, current if spec.keys == "model" else None))
        for spec in specs}


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


class DpSettings(Protocol):
    """The settings native DP reads (:class:`~.hparams.StrategyConfig`: ``dp-clip``, ``dp-noise-multiplier``,
    ``dp-delta``)."""

    @property
    def dp_clip(self) -> float: ...

    @property
    def dp_noise_multiplier(self) -> float: ...

    @property
    def dp_delta(self) -> float: ...


def released_rounds(history: Sequence[RoundLog]) -> list[tuple[int, int]]:
    """The ``(population N, sample size n)`` of every round of ``history`` whose private aggregate was released
    (its round metrics carry ``dp-sampled``): the accountant's events so far, so that a resumed run reports the
    same ε."""
    return [(int(h.round_metrics["dp-population"]), int(h.round_metrics["dp-sampled"]))
            for h in history if "dp-sampled" in h.round_metrics]


@dataclass(frozen=True)
class PrivacyPolicy:
    """Native user-level DP, beside :class:`~.screen.ScreenPolicy`: the joint clip norm C (``dp-clip``; 0 = off),
    the noise multiplier z and the δ the accountant reports ε at.  Its methods take the round's values and return new
    ones; it holds no state (the released rounds are the strategy's history, :func:`released_rounds`)."""

    clip: float = 0.0
    noise_multiplier: float = 0.0
    delta: float = 1e-5

    @classmethod
    def from_settings(cls, settings: DpSettings) -> PrivacyPolicy:
        """The policy of a :class:`~.hparams.StrategyConfig`."""
        return cls(settings.dp_clip, settings.dp_noise_multiplier, settings.dp_delta)

    @property
    def enabled(self) -> bool:
        """Whether native DP is on (``dp-clip`` > 0)."""
        return self.clip > 0

    def epsilon(self, events: Sequence[tuple[int, int]]) -> float:
        """ε at :attr:`delta` after the rounds ``events`` (:func:`epsilon`)."""
        return epsilon(events, self.noise_multiplier, self.delta)

    def privatize(self, method: str, specs: Sequence[RecordSpec], kept: Sequence[Mapping[str, NamedArrays]],
                  current: NamedArrays, sampled: int, population: int,
                  released: Sequence[tuple[int, int]]) -> tuple[dict[str, NamedArrays], dict[str, float]]:
        """``(aggregates, metrics)``: the clipped, noised ``{record: aggregate}`` of the ``kept`` replies' records
        (``specs``, around the global arrays ``current``) and the round's DP metrics (``dp-epsilon`` = ε spent so far
        if this round is released after the ``released`` ones).  ``sampled``: the n clients the round asked (the
        fixed denominator); ``population``: the N live nodes it sampled from.  Raises
        :class:`~.hparams.ConfigError` for records native DP cannot noise (:func:`check_specs`)."""
        check_specs(method, specs)
        scales, norms = joint_clip_scales(kept, specs, current, self.clip)
        sum_std = self.noise_multiplier * self.clip
        aggregates = private_aggregates(kept, specs, current, scales, sampled, sum_std,
                                        np.random.default_rng())  # OS entropy: the noise is not reproducible
        metrics = {"dp-clipped": float(sum(x < 1.0 for x in scales)), "dp-max-norm": max(norms),
                   "dp-noise-std": sum_std / sampled, "dp-sampled": float(sampled), "dp-population": float(population)}
        eps = self.epsilon([*released, (population, sampled)])
        if math.isfinite(eps):
            metrics["dp-epsilon"] = eps
        log(INFO, "native DP: %d of %d replies clipped at %g, noise std %.4g on the mean, ε = %.4g at δ = %g",
            int(metrics["dp-clipped"]), len(kept), self.clip, metrics["dp-noise-std"], eps, self.delta)
        return aggregates, metrics
