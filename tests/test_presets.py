"""The app's per-task presets (server_app/presets.py) and the default job's learning curve.

* presets fill only the keys the user left at their declared default, and ``presets=false`` turns them off;
* every registered method has a preset entry for the default task, made of valid run-config keys;
* every method, run with only ``method=<name>`` on the default job (in-process engine, 3 rounds), learns.
"""

from __future__ import annotations

import csv

import pytest

import flower_strategies  # noqa: F401 - registers every method
from app_common.config import AppConfig
from flower_strategies.core.registry import METHODS, parse_run_config, run_config_defaults
from server_app import presets
from server_app.plots import FILENAME
from simulations.engine.inprocess import run_inprocess

TASK = AppConfig.task  # the default task
CHANCE = 0.1  # 10 digit classes
FAKE = {"client-lr": 0.3, "fedadam.server-lr": 0.05, "fedadam.beta1": 0.8}


@pytest.fixture
def fake_preset(monkeypatch):
    monkeypatch.setitem(presets.PRESETS, TASK, {**presets.PRESETS[TASK], "fedadam": dict(FAKE)})


def test_presets_fill_only_keys_left_at_their_default(fake_preset):
    # as in-process callers pass it: only the keys the user set
    got = presets.apply({"method": "fedadam", "fedadam.server-lr": 0.02})
    assert got == {"method": "fedadam", "fedadam.server-lr": 0.02, "client-lr": 0.3, "fedadam.beta1": 0.8}
    # as Flower passes it: every declared key, the user's values on top; "equal to the default" = not set
    flower = {**run_config_defaults(AppConfig), "method": "fedadam", "fedadam.beta1": 0.95}
    got = presets.apply(flower)
    assert got == {**flower, "client-lr": 0.3, "fedadam.server-lr": 0.05}
    assert got["fedadam.beta1"] == 0.95
    # the input is not modified
    assert flower["client-lr"] == AppConfig.client_lr


def test_presets_false_turns_them_off(fake_preset):
    cfg = {"method": "fedadam", "presets": False}
    assert presets.apply(cfg) == cfg
    flower = {**run_config_defaults(AppConfig), "method": "fedadam", "presets": False}
    assert presets.apply(flower) == flower


def test_presets_only_for_their_task_and_method(fake_preset):
    cfg = {"method": "fedadam", "task": "synthetic-linear"}
    assert presets.apply(cfg) == cfg
    assert presets.apply({"method": "no-such-method"}) == {"method": "no-such-method"}


def test_applied_presets_reach_the_strategy_and_are_logged(tmp_path, fake_preset, caplog):
    """Through the ServerApp: the summary's run_config holds the values used (presets applied or not)."""
    base = {"method": "fedadam", "num-server-rounds": 1, "local-steps": 1, "output-dir": str(tmp_path)}
    with caplog.at_level("INFO", logger="flwr"):  # tests/conftest.py keeps Flower's logger at WARNING
        on = run_inprocess({**base, "run-name": "on"}, 2)
    assert on["run_config"]["client-lr"] == 0.3 and on["run_config"]["fedadam.server-lr"] == 0.05
    assert any("presets for fedadam on digits-mlp applied" in r.getMessage() and "client-lr=0.3" in r.getMessage()
               for r in caplog.records)
    off = run_inprocess({**base, "run-name": "off", "presets": False}, 2)
    assert "client-lr" not in off["run_config"] and "fedadam.server-lr" not in off["run_config"]


def test_every_method_has_a_valid_preset_for_the_default_task():
    table = presets.PRESETS[TASK]
    assert set(table) == set(METHODS), "add a preset entry (possibly {}) for every registered method"
    app_keys = set(AppConfig.keys(None))
    defaults = run_config_defaults(AppConfig)
    for method, values in table.items():
        for key, value in values.items():
            assert key in app_keys or key.startswith(f"{method}."), (method, key)
            assert key not in ("method", "task", "presets"), (method, key)
            assert value != defaults[key], f"{method}: preset {key}={value!r} equals the default"
        fed, spec, hp = parse_run_config(presets.apply({"method": method}), AppConfig)  # validates every value
        assert spec.name == method


@pytest.mark.slow  # real child processes / many end-to-end runs: the full suite runs it
@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.learning_curve) if m == "fedavg" else m
                                    for m in sorted(METHODS)])  # fedavg's run also checks the png
def test_every_method_learns_on_the_default_job(tmp_path, method):
    """Only ``method`` (and a short budget) changed: ≥ 3× chance after 3 rounds and a lower test loss than the
    initial model (the README's table gives each method's accuracy after the full 10 rounds).  Measured after 3
    rounds: 0.43 (fedlocal) to 0.77 (fedams)."""
    summary = run_inprocess({"method": method, "num-server-rounds": 3, "output-dir": str(tmp_path)}, 10)
    assert summary["rounds_without_update"] == []
    (out,) = tmp_path.glob(f"{method}-{TASK}-seed0-*")  # 3 rounds, not the default 10: a hashed name of its own
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    acc = [float(r["test-accuracy"]) for r in rows]
    loss = [float(r["test-loss"]) for r in rows]
    assert acc[-1] >= 3 * CHANCE and loss[-1] < loss[0], f"{method}: test accuracy per round {acc}, loss {loss}"
    if method == "fedavg":  # the learning curve next to metrics.csv
        png = out / FILENAME
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

