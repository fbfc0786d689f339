"""Hyper-parameter dataclasses and their run-config parsing/validation.

Every method has a frozen ``<Name>HParams`` dataclass (paper defaults).  Fields map to run-config keys
``"<method>.<field-with-dashes>"`` (e.g. ``FedAdamHParams.server_lr`` ↔ ``fedadam.server-lr``); shared
settings live in :class:`FederationConfig` under plain kebab-case keys (``num-server-rounds``).

Validation is declarative: ``param(default, lo=…, hi=…, choices=…, help=…)``.  Errors name the key, the
bad value and the valid choices/range, and are raised before the first round.
"""

from __future__ import annotations

import dataclasses
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
    help: str = "",  # noqa: A002 - mirrors argparse
) -> Any:
    """Declare a hyper-parameter with its validation rule and one-line documentation."""
    return field(
        default=default,
        metadata={"lo": lo, "hi": hi, "lo_open": lo_open, "choices": choices, "help": help},
    )


def to_key(name: str) -> str:
    return name.replace("_", "-")


@dataclass(frozen=True)
class HParams:
    """Base class: frozen, validated on construction, buildable from a run-config."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check(type(self).__name__ + "." + f.name, value, hints[f.name], f.metadata)

    @classmethod
    def keys(cls, prefix: str | None) -> dict[str, dataclasses.Field]:
        pre = f"{prefix}." if prefix else ""
        return {pre + to_key(f.name): f for f in dataclasses.fields(cls)}

    @classmethod
    def defaults(cls, prefix: str | None) -> dict[str, Any]:
        return {k: f.default for k, f in cls.keys(prefix).items()}

    @classmethod
    def from_run_config(cls: type[T], config: Mapping[str, Any], prefix: str | None) -> T:
        """Build from the keys of ``config`` that belong to this dataclass (others are ignored)."""
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for key, f in cls.keys(prefix).items():
            if key in config:
                kwargs[f.name] = _coerce(key, config[key], hints[f.name], f.metadata)
        try:
            return cls(**kwargs)
        except ConfigError as err:  # re-raise with the run-config key instead of the field name
            raise ConfigError(_rename(str(err), cls, prefix)) from None

    def to_run_config(self, prefix: str | None) -> dict[str, Any]:
        pre = f"{prefix}." if prefix else ""
        return {pre + to_key(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}


def _rename(msg: str, cls: type, prefix: str | None) -> str:
    for f in dataclasses.fields(cls):
        msg = msg.replace(f"{cls.__name__}.{f.name}", (f"{prefix}." if prefix else "") + to_key(f.name))
    return msg


def _base_type(tp: Any) -> type:
    if tp in (int, float, bool, str):
        return tp
    raise TypeError(f"unsupported hyper-parameter type {tp!r}")


def _coerce(key: str, value: Any, tp: Any, meta: Mapping[str, Any]) -> Any:
    base = _base_type(tp)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if base is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    _check(key, value, tp, meta)
    return value


def _check(name: str, value: Any, tp: Any, meta: Mapping[str, Any]) -> None:
    base = _base_type(tp)
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
            raise ConfigError(f"{name} = {value!r} is out of range; must be {op} {lo}" + (f" and <= {hi}" if hi is not None else ""))
        if hi is not None and value > hi:
            raise ConfigError(f"{name} = {value!r} is out of range; must be <= {hi}")


# --------------------------------------------------------------------------------------------------
# Settings shared by every method (plain kebab-case run-config keys)
# --------------------------------------------------------------------------------------------------

TASKS = ("digits-mlp", "digits-cnn", "synthetic-linear", "shakespeare-lstm",
         "cifar10-resnet18", "cifar100-resnet18", "mnist-cnn", "fashion-mnist-cnn", "femnist-cnn")  # last five: hub data
PARTITIONERS = ("iid", "dirichlet", "classes")


@dataclass(frozen=True)
class FederationConfig(HParams):
    """Run-wide settings (keys without a method prefix)."""

    method: str = param("fedavg", help="registry name of the method (see `methods` table)")
    num_server_rounds: int = param(10, lo=1, help="number of federated rounds")
    seed: int = param(0, lo=0, help="seeds model init, data partitioning, client sampling and batch order")
    task: str = param("digits-mlp", choices=TASKS, help="data set + model")
    partitioner: str = param("dirichlet", choices=PARTITIONERS, help="how the training split is divided")
    dirichlet_alpha: float = param(0.3, lo=0.0, lo_open=True, help="concentration of the Dirichlet label skew")
    classes_per_client: int = param(2, lo=1, hi=10, help="labels per client for `partitioner=classes`")
    client_lr: float = param(0.1, lo=0.0, help="client (local) learning rate η_l, sent by the server each round")
    local_epochs: int = param(1, lo=0, help="local epochs E (used when local-steps = 0)")
    local_steps: int = param(0, lo=0, help="local optimizer steps K per round; 0 = E·ceil(n_i/B)")
    batch_size: int = param(32, lo=1, help="local mini-batch size B")
    fraction_train: float = param(1.0, lo=0.0, hi=1.0, lo_open=True, help="fraction of available nodes sampled per round")
    min_train_nodes: int = param(2, lo=1, help="minimum nodes sampled per round")
    min_available_nodes: int = param(2, lo=1, help="wait until this many nodes are connected")
    min_replies: int = param(1, lo=1, help="rounds with fewer valid replies keep the previous model")
    fraction_evaluate: float = param(0.0, lo=0.0, hi=1.0, help="fraction of nodes asked for client-side evaluation")
    weighting: str = param("default", choices=("default", "examples", "uniform"), help="client weights of means; default = the method's paper")
    output_dir: str = param("outputs", help="metrics/model directory (relative paths: to the ServerApp's cwd)")
    run_name: str = param("", help="sub-directory of output-dir; empty = <method>-<task>-seed<seed>")
    synthetic_clients: int = param(10, lo=1, help="clients of the synthetic task (partitions)")
    synthetic_dim: int = param(10, lo=1, help="dimension of the synthetic least-squares task")
    synthetic_heterogeneity: float = param(1.0, lo=0.0, help="spread of the clients' optima (synthetic task)")
    precision: str = param("float32", choices=("float32", "float64"), help="model/data dtype (float64 for exactness checks)")
    round_timeout: float = param(3600.0, lo=0.0, lo_open=True, help="seconds to wait for replies")
    data_dir: str = param(".cache/fedadapt", help="prepared data cache of file-based tasks (shakespeare-lstm); relative to the app's cwd")
    checkpoint_every: int = param(0, lo=0, help="write <output-dir>/<run-name>/checkpoint.pkl every N rounds, at the end and on SIGINT/SIGTERM; 0 = off")
    resume: str = param("", help="path of a checkpoint to continue from (next round on; a trusted file); empty = fresh run")
    max_update_norm: float = param(0.0, lo=0.0, help="reject replies whose update norm exceeds this (0 = off)")
    loss_before_max_examples: int = param(0, lo=0, help="clients compute train-loss-before (metrics, LocalUpdateDecay's controller) on a seeded sample of at most this many of their examples; 0 = all")
    test_max_examples: int = param(0, lo=0, help="central test set: a seeded sample of at most this many examples; 0 = the task's default (digits: all 360; shakespeare-lstm: 2,000)")
