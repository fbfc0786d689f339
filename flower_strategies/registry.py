"""The method registry: run-config ``method`` name → strategy, local optimizer, hyper-parameters.

Adding a method costs one module, one test module and one :func:`register` call in ``__init__``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .hparams import ConfigError, FederationConfig, HParams
from .local import LocalOptimizer
from .strategy import FedAdaptStrategy


@dataclass(frozen=True)
class MethodSpec:
    name: str
    strategy: type[FedAdaptStrategy]
    local_optimizer: type[LocalOptimizer]
    hparams: type[HParams]
    paper: str
    summary: str


METHODS: dict[str, MethodSpec] = {}


def register(
    strategy: type[FedAdaptStrategy], local_optimizer: type[LocalOptimizer], *, paper: str, summary: str
) -> MethodSpec:
    name = strategy.method
    if not name or name in METHODS:
        raise ValueError(f"method name {name!r} is empty or already registered")
    spec = MethodSpec(name, strategy, local_optimizer, strategy.hparams_class, paper, summary)
    METHODS[name] = spec
    return spec


def get_method(name: str) -> MethodSpec:
    try:
        return METHODS[name]
    except KeyError:
        raise ConfigError(f"unknown method {name!r}; valid methods: {', '.join(sorted(METHODS))}") from None


def run_config_defaults() -> dict[str, Any]:
    """Every run-config key the apps accept, with its default (what pyproject's config table holds)."""
    out = FederationConfig.defaults(None)
    for name, spec in METHODS.items():
        out.update(spec.hparams.defaults(name))
    return out


def parse_run_config(run_config: Mapping[str, Any]) -> tuple[FederationConfig, MethodSpec, HParams]:
    """Validate a whole run-config; raise :class:`ConfigError` naming the valid choices on any problem."""
    known = run_config_defaults()
    unknown = sorted(set(run_config) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown run-config key(s) {unknown}; valid keys: {', '.join(sorted(known))}"
        )
    fed = FederationConfig.from_run_config(run_config, None)
    spec = get_method(fed.method)
    hp = spec.hparams.from_run_config(run_config, spec.name)
    # A key of another method that differs from its default is a mistake (e.g. a FedDA flag on a FedAvg run).
    # (Flower passes every declared key with its default, so only changed values can be detected.)
    foreign = sorted(
        key for name, other in METHODS.items() if name != spec.name
        for key, default in other.hparams.defaults(name).items()
        if key in run_config and run_config[key] != default
    )
    if foreign:
        raise ConfigError(
            f"run-config key(s) {foreign} belong to other methods, but method = {spec.name!r}; "
            f"{spec.name}'s keys are: {', '.join(spec.hparams.keys(spec.name)) or '(none)'}"
        )
    return fed, spec, hp


def build_strategy(
    run_config: Mapping[str, Any], trainable_keys: list[str] | None = None
) -> tuple[FedAdaptStrategy, FederationConfig]:
    """Build the configured strategy from a (validated) run-config."""
    fed, spec, hp = parse_run_config(run_config)
    strategy = spec.strategy(
        hp,
        client_lr=fed.client_lr,
        local_epochs=fed.local_epochs,
        local_steps=fed.local_steps,
        batch_size=fed.batch_size,
        fraction_train=fed.fraction_train,
        min_train_nodes=fed.min_train_nodes,
        min_available_nodes=fed.min_available_nodes,
        min_replies=fed.min_replies,
        fraction_evaluate=fed.fraction_evaluate,
        weighting=None if fed.weighting == "default" else fed.weighting,
        seed=fed.seed,
        trainable_keys=trainable_keys,
        loss_before_max_examples=fed.loss_before_max_examples,
    )
    if fed.local_steps == 0 and fed.local_epochs == 0:
        raise ConfigError("local-steps and local-epochs are both 0: clients would not train")
    return strategy, fed
