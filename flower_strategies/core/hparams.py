"""Hyper-parameter dataclasses and their run-config parsing/validation.

Every method has a frozen ``<Name>HParams`` dataclass (paper defaults).  Fields map to run-config keys
``"<method>.<field-with-dashes>"`` (e.g. ``FedAdamHParams.server_lr`` ↔ ``fedadam.server-lr``); shared
settings live in :class:`FederationConfig` under plain kebab-case keys (``num-server-rounds``).

Validation is declarative: ``param(default, lo=…, hi=…, choices=…, help=…)``.  Errors name the key, the
bad value and the valid choices/range, and are raised before the first round.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .robust import AGGREGATORS

#: What each ``defence`` profile sets (field: value).  A key given explicitly (not ``None``; ``""`` in a run-config)
#: overrides its profile's value (:meth:`StrategyConfig.setting`).  ``"off"`` is every method's paper algorithm.
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
#: ``update-norm-ratio`` left unset without native DP (``StrategyConfig.setting``).
UPDATE_NORM_RATIO = 100.0

T = TypeVar("T", bound="HParams")


class ConfigError(ValueError):
    """A run-config value is unknown, of the wrong type or out of range."""


def param(
    default: Any,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    choices: tuple[Any, ...] | None = None,
    client: bool = False,
    help: str = "",  # noqa: A002 - mirrors argparse
) -> Any:
    """Declare a hyper-parameter with its validation rule and one-line documentation.

    ``client=True`` marks a hyper-parameter of the method's local optimizer: the server sends it in every
    round's ConfigRecord under the same key as in the run-config (``"<method>.<field-with-dashes>"``), and
    the optimizer takes it as a keyword argument of the same (snake_case) name and keeps it in its
    ``param_groups``.  This one declaration is the only place the flag is written.
    """
    return field(
        default=default,
        metadata={"lo": lo, "hi": hi, "lo_open": lo_open, "choices": choices, "help": help, "client": client},
    )


def client_lr_decay_param(default: float, note: str) -> Any:
    """Declare a method's ``client_lr_decay`` field (the only way to write it): the strategy base then sends the
    client learning rate ``client_lr·decay^(round−1)`` (:meth:`FedAdaptStrategy.client_lr_at`,
    :func:`.ops.decayed_lr`).  ``note``: the method's reference value, appended to the help text."""
    return param(default, lo=0.0, lo_open=True, hi=1.0, help=f"client lr × this after every round ({note})")


def to_key(name: str) -> str:
    return name.replace("_", "-")


_HINTS: dict[type, dict[str, Any]] = {}
_CLIENT_FIELDS: dict[type, tuple[str, ...]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, once per class (it re-evaluates every annotation string on each call, and
    every local optimizer and hyper-parameter object of every client round needs it)."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


_KEYS: dict[tuple[type, str | None], dict[str, dataclasses.Field]] = {}


def _keys(cls: type, prefix: str | None) -> dict[str, dataclasses.Field]:
    """``{run-config key: field}`` of a hyper-parameter class, once per class and prefix (a dataclass's fields are
    fixed; every run-config parse and every registered method's defaults read them)."""
    keys = _KEYS.get((cls, prefix))
    if keys is None:
        pre = f"{prefix}." if prefix else ""
        keys = _KEYS[cls, prefix] = {pre + to_key(f.name): f for f in dataclasses.fields(cls)}
    return keys


def _client_fields(cls: type) -> tuple[str, ...]:
    names = _CLIENT_FIELDS.get(cls)
    if names is None:
        names = _CLIENT_FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("client"))
    return names


@dataclass(frozen=True)
class HParams:
    """Base class: frozen, validated on construction, buildable from a run-config."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check(type(self).__name__ + "." + f.name, value, hints[f.name], f.metadata)

    @classmethod
    def keys(cls, prefix: str | None) -> dict[str, dataclasses.Field]:
        return dict(_keys(cls, prefix))

    @classmethod
    def defaults(cls, prefix: str | None, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Run-config defaults (``None`` is written as ``""``: TOML has no null); ``overrides`` by field name."""
        over = overrides or {}
        vals = {k: over.get(f.name, f.default) for k, f in _keys(cls, prefix).items()}
        return {k: ("" if v is None else v) for k, v in vals.items()}

    @classmethod
    def from_run_config(
        cls: type[T], config: Mapping[str, Any], prefix: str | None, overrides: Mapping[str, Any] | None = None
    ) -> T:
        """Build from the keys of ``config`` that belong to this dataclass (others are ignored); fields absent
        from ``config`` take ``overrides`` (an alias's defaults, by field name), then the declared default."""
        hints = _hints(cls)
        kwargs: dict[str, Any] = dict(overrides or {})
        for key, f in _keys(cls, prefix).items():
            if key in config:
                kwargs[f.name] = _coerce(key, config[key], hints[f.name], f.metadata)
        try:
            return cls(**kwargs)
        except ConfigError as err:  # re-raise with the run-config key instead of the field name
            raise ConfigError(_rename(str(err), cls, prefix)) from None

    @classmethod
    def client_fields(cls) -> tuple[str, ...]:
        """Names of the fields declared with ``client=True`` (the local optimizer's hyper-parameters)."""
        return _client_fields(cls)

    def client_values(self) -> dict[str, Any]:
        """``{field: value}`` of the client fields (the optimizer's keyword arguments)."""
        return {name: getattr(self, name) for name in self.client_fields()}

    def to_wire(self, prefix: str) -> dict[str, Any]:
        """The client fields as ConfigRecord entries ``"<prefix>.<field-with-dashes>"`` (``None`` is not sent)."""
        return {f"{prefix}.{to_key(k)}": v for k, v in self.client_values().items() if v is not None}

    @classmethod
    def client_kwargs_from_wire(cls, config: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        """Inverse of :meth:`to_wire`: the optimizer's keyword arguments found in a round's ConfigRecord."""
        hints = _hints(cls)
        fields = cls.__dataclass_fields__
        out: dict[str, Any] = {}
        for name in cls.client_fields():
            key = f"{prefix}.{to_key(name)}"
            if key in config:
                out[name] = _coerce(key, config[key], hints[name], fields[name].metadata)
        return out

    def replace(self: T, **changes: Any) -> T:
        """A copy with ``changes`` applied (validated); unknown names raise :class:`ConfigError`.  Without changes,
        ``self`` (frozen, and validated when it was built)."""
        if not changes:
            return self
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigError(f"{type(self).__name__} has no field(s) {unknown}; fields: {', '.join(sorted(names))}")
        return dataclasses.replace(self, **changes)


def _rename(msg: str, cls: type, prefix: str | None) -> str:
    for f in dataclasses.fields(cls):
        msg = msg.replace(f"{cls.__name__}.{f.name}", (f"{prefix}." if prefix else "") + to_key(f.name))
    return msg


def toml_value(value: Any) -> str:
    """``value`` as a TOML literal: the project's one TOML writer (run-config tables; ``--run-config`` strings,
    simulations/launch/flwr_cli.py)."""
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


@functools.cache
def _optional(tp: Any) -> bool:
    return type(None) in typing.get_args(tp)


@functools.cache
def _base_type(tp: Any) -> type:
    if tp in (int, float, bool, str):
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1 and args[0] in (int, float, bool, str):
        return args[0]
    raise TypeError(f"unsupported hyper-parameter type {tp!r}")


def _coerce(key: str, value: Any, tp: Any, meta: Mapping[str, Any]) -> Any:
    base = _base_type(tp)
    if value is None or (_optional(tp) and value == ""):  # run-configs cannot hold None: "" means "not set"
        value = None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if base is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    _check(key, value, tp, meta)
    return value


def _check(name: str, value: Any, tp: Any, meta: Mapping[str, Any]) -> None:
    base = _base_type(tp)
    if value is None:
        if _optional(tp):
            return
        raise ConfigError(f"{name} must be {base.__name__}, got None")
    ok_type = isinstance(value, base) and not (base is not bool and isinstance(value, bool))
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        ok_type = True
    if not ok_type:
        raise ConfigError(f"{name} must be {base.__name__}, got {type(value).__name__} {value!r}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{name} = {value!r} is not valid; choose one of: {', '.join(map(str, choices))}")
    if base in (int, float):
        if base is float and not math.isfinite(value):
            raise ConfigError(f"{name} must be finite, got {value!r}")
        lo, hi = meta.get("lo"), meta.get("hi")
        if lo is not None and (value < lo or (meta.get("lo_open") and value == lo)):
            op = ">" if meta.get("lo_open") else ">="
            upper = f" and <= {hi}" if hi is not None else ""
            raise ConfigError(f"{name} = {value!r} is out of range; must be {op} {lo}{upper}")
        if hi is not None and value > hi:
            raise ConfigError(f"{name} = {value!r} is out of range; must be <= {hi}")


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
        "default", choices=("default", "examples", "uniform"),
        help="client weights of means; default = the method's paper (uniform with native DP, dp-clip > 0)",
    )
    max_update_norm: float = param(
        0.0, lo=0.0,
        help="reject replies whose update norm exceeds this absolute bound (0 = off)",
    )
    update_norm_ratio: float | None = param(
        None, lo=0.0,
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
    max_weight_ratio: float | None = param(
        None, lo=0.0,
        help="clip each reply's num-examples weight (and, in epochs mode, its num-steps) at this multiple of the "
             "round's median; empty = the defence profile's (off: 0 = exact n_k weighting; robust: 1.5)",
    )
    update_clip_ratio: float | None = param(
        None, lo=0.0,
        help="scale each reply's update (and every other uplink record) back onto this multiple of the round's "
             "median norm of that record (needs ≥ 3 replies; 0 = off); empty = the defence profile's (off: 0; "
             "robust: 3)",
    )
    update_cosine_floor: float | None = param(
        None, lo=-1.0, hi=1.0,
        help="reject a reply whose model update has a cosine below this with the round's robust centre (the mean of "
             "the updates, each scaled down onto the round's median norm; needs ≥ 3 replies; -1 = off); empty = the "
             "defence profile's (-1 in both)",
    )
    aggregator: str | None = param(
        None, choices=AGGREGATORS,
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

    def setting(self, name: str) -> Any:
        """The value field ``name`` runs with: its own, or, for a key left for a profile to decide, the profile's
        value: with native DP (``dp-clip > 0``) :data:`DP_PROFILE`'s (``weighting = "default"``, ``update-norm-ratio``
        unset), else the ``defence`` profile's (:data:`DEFENCES`; ``update-norm-ratio``: :data:`UPDATE_NORM_RATIO`).
        ``weighting = "default"`` without DP stays ``"default"``: the method's own (``FedAdaptStrategy.weighting``)."""
        value = getattr(self, name)
        unset = value is None or (name == "weighting" and value == "default")
        if unset and self.dp_clip > 0 and name in DP_PROFILE:
            return DP_PROFILE[name]
        if value is None and name in DEFENCES[self.defence]:
            return DEFENCES[self.defence][name]
        if value is None and name == "update_norm_ratio":
            return UPDATE_NORM_RATIO
        return value

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dp_clip > 0:  # native DP (core/privacy.py): bounded, unweighted contributions
            conflicts = [f"{key} = {value}" for key, value, ok in (
                ("weighting", self.weighting, self.weighting != "examples"),
                ("update-norm-ratio", self.update_norm_ratio, not self.update_norm_ratio),
                ("aggregator", self.setting("aggregator"), self.setting("aggregator") == "mean"),
                ("update-clip-ratio", self.setting("update_clip_ratio"), self.setting("update_clip_ratio") <= 0),
                ("update-cosine-floor", self.setting("update_cosine_floor"), self.setting("update_cosine_floor") <= -1),
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
