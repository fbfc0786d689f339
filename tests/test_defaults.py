"""One source of defaults: the library's ``build()`` trains with the values the app's run-config declares.

``get_method(m).build()`` (no arguments) and the ServerApp's strategy built from the run-config Flower passes when the
user sets nothing but ``method`` (every key of ``pyproject.toml``'s ``[tool.flwr.app.config]`` at its declared value)
must agree on every strategy setting and every hyper-parameter, and so on what they send the clients in round 1.  The
app's per-task presets (``presets = true``, :mod:`server_app.presets`) are the one documented difference: they are
switched off here, and checked to touch only the keys they name.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import numpy as np
import pytest
import flower_strategies as fs
from app_common.config import AppConfig
from flower_strategies.core.hparams import StrategyConfig
from flower_strategies.core.registry import METHODS, get_method
from server_app import presets

ROOT = Path(__file__).resolve().parent.parent


def declared_run_config() -> dict:
    from flwr.common.config import flatten_dict

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(flatten_dict(project["tool"]["flwr"]["app"]["config"]))


def app_strategy(method: str, **extra):
    from server_app.app import build

    return build({**declared_run_config(), "method": method, "presets": False, **extra})[2]


def test_local_training_defaults_are_declared_once() -> None:
    lib, app = StrategyConfig(), AppConfig()
    declared = declared_run_config()
    for name in ("client_lr", "local_epochs", "local_steps", "batch_size"):
        key = name.replace("_", "-")
        assert getattr(lib, name) == getattr(app, name) == declared[key], key
        # the app does not redeclare the library's field: one default, one place
        assert AppConfig.__dataclass_fields__[name] is StrategyConfig.__dataclass_fields__[name]
    assert (lib.client_lr, lib.local_epochs, lib.batch_size) == (0.5, 5, 16)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_build_defaults_equal_run_config_defaults(method: str) -> None:
    lib = get_method(method).build(num_rounds=declared_run_config()["num-server-rounds"])  # what start() sets
    app = app_strategy(method)
    for f in dataclasses.fields(StrategyConfig):
        if f.name == "method":
            continue
        assert getattr(lib.settings, f.name) == getattr(app.settings, f.name), f.name
    assert lib.hparams == app.hparams
    # ... and so the first round's instructions to the clients are the same
    for strategy in (lib, app):
        strategy.server_state = strategy.init_server_state({"w": np.zeros(3, dtype=np.float32)})
    assert lib.round_config(1) == app.round_config(1)
    assert lib.round_config(1)["local-epochs"] == declared_run_config()["local-epochs"]


def test_presets_change_only_the_keys_they_name() -> None:
    """The documented exception (presets = true, the app's default): per task and method, only the listed keys."""
    for task, table in presets.PRESETS.items():
        for method, values in table.items():
            given = {**declared_run_config(), "method": method, "task": task}
            applied = presets.apply(given)
            assert {k for k in given if applied[k] != given[k]} == {k for k, v in values.items() if v != given[k]}


def test_library_class_defaults_match_too() -> None:
    """A strategy class built directly (``FedAdam()``) takes the same local-training settings."""
    s = fs.FedAdam()
    assert (s.settings.client_lr, s.settings.local_epochs, s.settings.batch_size) == (
        AppConfig().client_lr, AppConfig().local_epochs, AppConfig().batch_size)
