"""Per-task presets: run-config values that make every method learn on the app's default job.

The library's defaults are the papers' values (tuned for other models, data and round budgets); on the app's
default job — ``task = "digits-mlp"``, Dirichlet(0.3) over 10 nodes, 10 rounds, E = 5 local epochs, B = 16
(:class:`app_common.config.AppConfig`) — several of them barely move the model in 10 rounds (FedDA's server lr,
adaptive clients' lrs).  ``PRESETS[task][method]`` holds the values that make ``method`` learn there; the
ServerApp applies them with :func:`apply` before it builds the strategy:

* only to keys the user left at their **declared default** (Flower passes every declared key, so a value equal
  to the default counts as "not set": to run with exactly the declared default value, set ``presets=false``);
* only for the run's task (tasks without an entry get nothing) and only when ``presets = true`` (the default);
* one log line lists the values applied.

How the values were found: a short grid per method with the in-process engine on the default job (seed 0,
10 rounds), picking the highest final test accuracy, then checked on seed 1 (``docs/results/presets.md`` lists each
grid's outcome; docs/methods/index.md's "Every method on the default job" table lists what the presets reach).
A method absent from the task's table, or with ``{}``, learns at the app's defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO
from typing import Any

from flwr.common import log

from app_common.config import AppConfig
from flower_strategies.core.registry import run_config_defaults

# task → method → run-config values (comment: the grid tried).  What each reaches: docs/results/presets.md.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "digits-mlp": {
        "adpfed": {},
        "fedadagrad": {"fedadagrad.server-lr": 0.3},  # grid: server-lr 0.03, 0.1, 0.3
        "fedadam": {"fedadam.server-lr": 0.1},  # grid: 0.01, 0.03, 0.1
        "fedams": {"client-lr": 0.01},  # grid: 0.003, 0.01
        "fedavg": {},
        "fedavgm": {},
        "fedcm": {"client-lr": 1.0},  # grid: 0.5, 1
        "fedda": {},
        "fedda-adagrad": {"fedda-adagrad.server-lr": 1.0},  # grid: 0.1, 1
        "fedda-adam": {"fedda-adam.server-lr": 1.0},  # grid: 0.1, 1
        "fedda-sgdm": {},
        "fedlada": {"client-lr": 0.01},  # grid: 0.003, 0.01
        "fedlamb": {"client-lr": 0.01},  # grid: 0.003, 0.01
        "fedlocal": {"client-lr": 0.3, "fedlocal.server-lr": 1.0},  # grid: η_l 0.1, 0.3 × server-lr 1
        "fedlocal-sync": {"client-lr": 0.3, "fedlocal-sync.server-lr": 1.0},  # grid: same grid
        "fedprox": {},
        "fedyogi": {"fedyogi.server-lr": 0.1},  # grid: 0.01, 0.03, 0.1
        "localadam": {"client-lr": 0.003},  # grid: 0.003, 0.01
        "localupdate": {"localupdate.server-lr": 1.0},  # grid: η_l 0.5, 1 × server-lr 1
        "localupdatedecay": {"localupdatedecay.server-lr": 1.0},  # grid: same grid
        "mimelite": {"client-lr": 0.1},  # grid: 0.1, 0.2
        "scaffold": {},
    },
}


def preset(task: str, method: str) -> dict[str, Any]:
    """The preset values of ``method`` on ``task`` (``{}`` if none)."""
    return dict(PRESETS.get(task, {}).get(method, {}))


#: The run-config keys :func:`apply` reads.
_READS = ("task", "method", "presets")


def apply(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """``run_config`` with the task's preset values for its method on every key left at its declared default.

    Reads (and checks) only the keys it needs (``task``, ``method``, ``presets``): the ServerApp validates the whole
    run-config once, after this; an unknown method gets no preset (that validation names the valid ones).
    """
    config = dict(run_config)
    fed = AppConfig.from_run_config({k: config[k] for k in _READS if k in config}, None)
    values = preset(fed.task, fed.method)
    if not fed.presets or not values:
        return config
    defaults = run_config_defaults(AppConfig)
    applied = {k: v for k, v in values.items() if config.get(k, defaults[k]) == defaults[k] and v != defaults[k]}
    config.update(applied)
    log(INFO, "fedadapt: presets for %s on %s applied: %s (presets=false turns them off)", fed.method, fed.task,
        " ".join(f"{k}={v!r}" for k, v in applied.items()) or "none (every preset key was set)")
    return config
