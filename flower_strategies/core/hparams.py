"""The run-wide settings every strategy takes (:class:`StrategyConfig`, plain kebab-case run-config keys) and the
``defence`` / native-DP profiles that resolve the keys left unset.

The hyper-parameter declaration itself (``HParams``, ``param``, ``ConfigError``) is :mod:`.params`, which the
client half uses too; it is re-exported here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

from .params import ConfigError, HParams, client_lr_decay_param, param, to_key, toml_value
from .robust import AGGREGATORS

__all__ = ["DEFENCES", "DP_PROFILE", "ConfigError", "HParams", "StrategyConfig", "client_lr_decay_param", "param",
           "to_key", "toml_value"]  # the declaration (.params) re-exported where callers always found it

#: What each ``defence`` profile sets (field: value).  A key given explicitly (not ``None``; ``""`` in a run-config)
#: overrides its profile's value (resolved when :class:`StrategyConfig` is built).  ``"off"`` is every method's
#: paper algorithm.
DEFENCES: dict[str, dict[str, Any]] = {
    "off": {"max_weight_ratio": 0.0, "update_clip_ratio": 0.0, "update_cosine_floor": -1.0, "aggregator": "mean"},
    "robust": {"max_weight_ratio": 1.5, "update_clip_ratio": 3.0, "update_cosine_floor": -1.0,
               "aggregator": "fltrust-gate"},
}
DEFENCE_CHOICES = tuple(DEFENCES)

#: What native DP (``dp-clip > 0``, core/privacy.py) sets for the keys left for it to decide (``weighting =
#: "default"``, ``update-norm-ratio`` unset): bounded, unweighted contributions, no median-relative rejection (the
#: clip bounds every reply).  A conflicting explicit value is a :class:`ConfigError` naming both keys.
DP_PROFILE: dict[str, Any] = {"weighting": "uniform", "update_norm_ratio": 0.0}
#: ``update-norm-ratio`` left unset without native DP.
UPDATE_NORM_RATIO = 100.0
#: The keys a profile may decide, and the value that leaves each unset (``""`` in a run-config for ``None``):
#: :class:`StrategyConfig` resolves them on construction.
UNSET: dict[str, Any] = {"weighting": "default", "update_norm_ratio": None, "max_weight_ratio": None,
                         "update_clip_ratio": None, "update_cosine_floor": None, "aggregator": None}

# --------------------------------------------------------------------------------------------------
# Settings every strategy takes (plain kebab-case run-config keys)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StrategyConfig(HParams):
    """Run-wide strategy settings (keys without a method prefix); an app may extend it with its own keys.

    It is also the settings object of :class:`~flower_strategies.core.strategy.FedAdaptStrategy` (validated here,
    once, whether built from a run-config or by keyword arguments).  ``method`` and ``num_server_rounds`` are read
    by the registry (which strategy to build, and its ``num_rounds``); the strategy itself does not read them."""

    method: str = param("fedavg", help="registry name of the method (see `methods` table)")
    num_server_rounds: int = param(10, lo=1, help="number of federated rounds")
    seed: int = param(0, lo=0, hi=2**32 - 1,  # scikit-learn's random_state (the data splits) takes 32-bit seeds
                      help="seeds model init, data partitioning, client sampling and batch order")
    # The local-training defaults (η_l, E, B) are the app's run-config defaults too (one declaration: the fedadapt
    # app's AppConfig inherits them); with them the default job (FedAvg, digits-mlp, Dirichlet(0.3), 10 nodes,
    # 10 rounds) reaches >= 0.90 test accuracy.
    client_lr: float = param(  # 0 is LocalUpdate's γ = 0 (every step's gradient taken at the round's start)
        0.5, lo=0.0,
        help="client (local) learning rate η_l, sent by the server each round",
    )
    local_epochs: int = param(5, lo=0, help="local epochs E (used when local-steps = 0)")
    local_steps: int = param(0, lo=0, help="local optimizer steps K per round; 0 = E·ceil(n_i/B)")
    batch_size: int = param(16, lo=1, help="local mini-batch size B")
    fraction_train: float = param(
        1.0, lo=0.0, hi=1.0, lo_open=True,
        help="fraction of available nodes sampled per round",
    )
    min_train_nodes: int = param(2, lo=1, help="minimum nodes sampled per round")
    min_available_nodes: int = param(
        2, lo=1,
        help="wait until this many live nodes are connected (rounds go on with the nodes that remain, down to this"
             " many)",
    )
    wait_for_nodes: float = param(
        600.0, lo=0.0,
        help="seconds a round waits for min-available-nodes live nodes before the run fails",
    )
    min_replies: int = param(1, lo=1, help="rounds with fewer valid replies keep the previous model")
    max_idle_rounds: int = param(
        3, lo=0,
        help="end the run as failed after this many consecutive rounds without a model update (every reply rejected or"
             " missing); 0 = never. A run in which no round updated the model always fails",
    )
    max_rejected_rounds: int = param(
        3, lo=0,
        help="end the run as failed, with the rejections counted by kind, after this many consecutive rounds in which "
             "the server rejected more than half of the sampled replies (client errors and Krum's selection not "
             "counted: a run that is mostly attack, or whose root update or settings reject honest replies); 0 = never",
    )
    fraction_evaluate: float = param(0.0, lo=0.0, hi=1.0, help="fraction of nodes asked for client-side evaluation")
    weighting: str = param(
        "default", choices=("default", "examples", "uniform"), profile=True,
        help="client weights of means; default = the method's paper (uniform with native DP, dp-clip > 0)",
    )
    max_update_norm: float = param(
        0.0, lo=0.0,
        help="reject replies whose update norm exceeds this absolute bound (0 = off)",
    )
    update_norm_ratio: float = param(
        None, lo=0.0, profile=True,
        help="reject replies whose update norm exceeds this multiple of the round's median (0 = off; honest "
             "training stays far below 100); empty = 100, or 0 with native DP (dp-clip > 0: the clip bounds every "
             "reply)",
    )
    defence: str = param(
        "off", choices=DEFENCE_CHOICES,
        help="off = every method is its paper's algorithm, bit for bit (only the guards that never change an honest "
             "run: malformed, oversized, stale, replayed, NaN/Inf, 100× norm, metric validity, steps within the plan); "
             "robust = the opt-in profile (aggregator fltrust-gate against the server's root-set update, "
             "update-clip-ratio 3, max-weight-ratio 1.5; docs/robustness.md). The four keys below override it when "
             "set",
    )
    max_weight_ratio: float = param(
        None, lo=0.0, profile=True,
        help="clip each reply's num-examples weight (and, in epochs mode, its num-steps) at this multiple of the "
             "round's median; empty = the defence profile's (off: 0 = exact n_k weighting; robust: 1.5)",
    )
    update_clip_ratio: float = param(
        None, lo=0.0, profile=True,
        help="scale each reply's update (and every other uplink record) back onto this multiple of the round's "
             "median norm of that record (needs ≥ 3 replies; 0 = off); empty = the defence profile's (off: 0; "
             "robust: 3)",
    )
    update_cosine_floor: float = param(
        None, lo=-1.0, hi=1.0, profile=True,
        help="reject a reply whose model update has a cosine below this with the round's robust centre (the mean of "
             "the updates, each scaled down onto the round's median norm; needs ≥ 3 replies; -1 = off); empty = the "
             "defence profile's (-1 in both)",
    )
    aggregator: str = param(
        None, choices=AGGREGATORS, profile=True,
        help="mean = the method's own rule; median / trimmed-mean = coordinate-wise robust aggregation of every "
             "mean-rule record (O(N·model) memory); centered-clip / bucketing = centered clipping around the last "
             "round's update, of the replies / of means of random pairs; krum / multi-krum = use only the "
             "best-scored reply / the N − ⌈byzantine-fraction·N⌉ best-scored replies; fltrust = weigh each reply by "
             "ReLU(cosine) with the server's own update on its root set (root-set-size) and rescale it to that "
             "update's norm; fltrust-gate = only reject the replies of cosine <= 0 with it; empty = the defence "
             "profile's (off: mean; robust: fltrust-gate)",
    )
    byzantine_fraction: float = param(
        0.2, lo=0.0, hi=0.49,
        help="fraction of replies the robust aggregators tolerate as Byzantine: trimmed-mean drops ⌈f·N⌉ values "
             "at each end per coordinate, krum / multi-krum score against the max(1, N − ⌈f·N⌉ − 2) nearest "
             "replies (as Flower's Krum); a sample smaller than 2·⌈f·N⌉ + 1 for these three fails the run before "
             "round 1",
    )
    max_reply_bytes: int = param(
        0, lo=0,
        help="reject train replies larger than this many bytes before reading them; 0 = 2 × the bytes of the "
             "method's declared uplink records + 1 MiB",
    )
    loss_before_max_examples: int = param(
        0, lo=0,
        help="clients compute train-loss-before (metrics, LocalUpdateDecay's controller) on a seeded sample of at "
             "most this many of their examples; 0 = all",
    )

    dp_clip: float = param(
        0.0, lo=0.0,
        help="native user-level DP: clip each client's whole uplink (joint L2 norm of its model update and every "
             "statistic record) at this bound and noise every aggregate; weighting = default and update-norm-ratio "
             "empty then mean uniform and 0 (the clip bounds every reply), a conflicting value is an error; 0 = off "
             "(docs/privacy.md)",
    )
    dp_noise_multiplier: float = param(
        0.0, lo=0.0,
        help="native DP noise multiplier z: Gaussian noise of std z·dp-clip on every sum, z·dp-clip/n on a mean over "
             "the n sampled clients; 0 = clipping only (no privacy guarantee)",
    )
    dp_delta: float = param(1e-5, lo=0.0, hi=1.0, lo_open=True, help="δ of the ε reported per round (native DP)")

    def _profile_value(self, name: str) -> Any:
        """What a key left unset runs with: with native DP (``dp-clip > 0``) :data:`DP_PROFILE`'s (``weighting``,
        ``update-norm-ratio``), else the ``defence`` profile's (:data:`DEFENCES`; ``update-norm-ratio``:
        :data:`UPDATE_NORM_RATIO`).  ``weighting`` without DP stays ``"default"``: the method's own, which only the
        strategy knows (``FedAdaptStrategy.weighting``)."""
        if self.dp_clip > 0 and name in DP_PROFILE:
            return DP_PROFILE[name]
        if name in DEFENCES[self.defence]:
            return DEFENCES[self.defence][name]
        return UPDATE_NORM_RATIO if name == "update_norm_ratio" else UNSET[name]

    def replace(self, **changes: Any) -> StrategyConfig:
        """A validated copy with ``changes``; a key a profile decided stays unset, so that the copy's profiles
        decide it again (``replace(defence="robust")`` changes ``aggregator`` unless it was given)."""
        if not changes:
            return self
        return super().replace(**{**{name: UNSET[name] for name in self.decided_by_profile}, **changes})

    def __post_init__(self) -> None:
        super().__post_init__()
        # Settings resolved once: a key left unset (UNSET) takes its profile's value here, so that every reader
        # reads the attribute (``settings.aggregator``) and gets the value the run uses.
        decided = [name for name, unset in UNSET.items() if getattr(self, name) == unset
                   and self._profile_value(name) != unset]
        for name in decided:
            object.__setattr__(self, name, self._profile_value(name))
        #: The keys a profile decided (left unset): :meth:`replace` leaves them to the copy's profiles.
        self.decided_by_profile: frozenset[str]
        object.__setattr__(self, "decided_by_profile", frozenset(decided))
        if self.dp_clip > 0:  # native DP (core/privacy.py): bounded, unweighted contributions
            conflicts = [f"{key} = {value}" for key, value, ok in (
                ("weighting", self.weighting, self.weighting != "examples"),
                ("update-norm-ratio", self.update_norm_ratio, not self.update_norm_ratio),
                ("aggregator", self.aggregator, self.aggregator == "mean"),
                ("update-clip-ratio", self.update_clip_ratio, self.update_clip_ratio <= 0),
                ("update-cosine-floor", self.update_cosine_floor, self.update_cosine_floor <= -1),
            ) if not ok]
            if conflicts:
                raise ConfigError(f"dp-clip = {self.dp_clip} conflicts with {', '.join(conflicts)}: native DP needs "
                                  "weighting = uniform (or default), update-norm-ratio = 0 (or empty) and defence = "
                                  "off, i.e. aggregator = mean, update-clip-ratio = 0 and update-cosine-floor = -1: a "
                                  "weighted or robust aggregate, or a clip bound or rejection set by the other "
                                  "clients' replies, has no bounded sensitivity to one client")
            if self.dp_noise_multiplier > 0 and importlib.util.find_spec("dp_accounting") is None:
                raise ConfigError("dp-noise-multiplier > 0: native DP reports ε with Google's dp-accounting, which "
                                  "is not installed; install fedadapt's 'dp' extra (pip install 'fedadapt[dp]', or "
                                  "pip install dp-accounting)")
        for f in dataclasses.fields(self):  # an int given for a float field is stored as that float
            value = getattr(self, f.name)
            if f.type in (float, "float", "float | None") and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
        if self.local_steps == 0 and self.local_epochs == 0:
            raise ConfigError("local-steps and local-epochs are both 0: clients would not train")
