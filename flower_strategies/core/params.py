"""Hyper-parameter dataclasses: the declaration (``param``), run-config parsing and validation.

Every method has a frozen ``<Name>HParams`` dataclass (paper defaults).  Fields map to run-config keys
``"<method>.<field-with-dashes>"`` (e.g. ``FedAdamHParams.server_lr`` ↔ ``fedadam.server-lr``).  Validation is
declarative: ``param(default, lo=…, hi=…, choices=…, help=…)``; errors name the key, the bad value and the valid
choices/range, and are raised before the first round.

Both halves use it (a method's client hyper-parameters are read on the device), so it imports nothing else of the
package; the run-wide settings (:class:`~.hparams.StrategyConfig`) are the server's, in :mod:`.hparams`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

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
    profile: bool = False,
    help: str = "",  # noqa: A002 - mirrors argparse
) -> Any:
    """Declare a hyper-parameter with its validation rule and one-line documentation.

    ``client=True`` marks a hyper-parameter of the method's local optimizer: the server sends it in every
    round's ConfigRecord under the same key as in the run-config (``"<method>.<field-with-dashes>"``), and
    the optimizer takes it as a keyword argument of the same (snake_case) name and keeps it in its
    ``param_groups``.  This one declaration is the only place the flag is written.

    ``profile=True`` (default ``None``; ``""`` in a run-config): a key that may be left unset for a profile to
    decide; the class resolves it on construction (:class:`~.hparams.StrategyConfig`), so that the attribute is
    always the value the run uses, of the declared type.
    """
    return field(
        default=default,
        metadata={"lo": lo, "hi": hi, "lo_open": lo_open, "choices": choices, "help": help, "client": client,
                  "profile": profile},
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
    unset_ok = _optional(tp) or meta.get("profile")
    if value is None or (unset_ok and value == ""):  # run-configs cannot hold None: "" means "not set"
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
        if _optional(tp) or meta.get("profile"):
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
