"""summary.json: resolved configuration, versions, git state and host; written for failed runs too."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

import flower_strategies
import server_app.app as app_module
from app_common.config import AppConfig
from server_app import presets, provenance
from server_app.app import RunFailed
from simulations.engine.inprocess import run_inprocess

TINY = {"task": "synthetic-linear", "synthetic-dim": 4, "synthetic-clients": 3, "local-steps": 2, "batch-size": 8,
        "num-server-rounds": 2, "learning-curve": False}


def read_summary(path):
    return json.loads((path / "summary.json").read_text())


def test_completed_run_records_resolved_config_versions_git_and_host(tmp_path, monkeypatch):
    monkeypatch.setitem(presets.PRESETS, "synthetic-linear", {"fedadam": {"fedadam.server-lr": 0.05}})
    cfg = {**TINY, "method": "fedadam", "output-dir": str(tmp_path), "run-name": "ok", "seed": 3}
    returned = run_inprocess(cfg, 2)
    summary = read_summary(tmp_path / "ok")
    assert summary == json.loads(json.dumps(returned, default=str))
    assert summary["status"] == "completed" and summary["failure"] is None
    config = summary["config"]
    method_keys = {f"fedadam.{k}" for k in ("server-opt", "server-lr", "beta1", "beta2", "tau", "initial-v")}
    assert set(AppConfig.keys(None)) | method_keys <= set(config)
    assert not any(k.startswith("fedavg.") for k in config)  # only the run's method
    assert config["seed"] == 3 and config["fedadam.server-lr"] == 0.05  # set by the user / by the preset
    assert config["client-lr"] == AppConfig.client_lr and config["tracking"] == "none"  # defaults
    assert config["fedadam.initial-v"] is None  # "" in the run-config: None, as the method sees it
    assert "client-lr" not in summary["run_config"]  # run_config stays the keys as given (presets applied)
    assert summary["run_config"]["fedadam.server-lr"] == 0.05
    v = summary["versions"]
    assert set(v) == {"python", "torch", "flwr", "numpy", "fedadapt"}
    assert v["fedadapt"] == flower_strategies.__version__ and v["flwr"] and v["torch"] and v["numpy"]
    git = summary["git"]
    assert set(git) == {"commit", "dirty"}
    assert git["commit"] is None or (re.fullmatch("[0-9a-f]{40}", git["commit"]) and isinstance(git["dirty"], bool))
    assert summary["host"]["cpu_count"] >= 1 and summary["host"]["platform"]


def test_a_run_whose_clients_all_fail_writes_a_failed_summary(tmp_path):
    def no_arrays(request, reply, partition_id):
        del reply.content["arrays"]
        return reply

    cfg = {**TINY, "output-dir": str(tmp_path), "run-name": "rej", "max-idle-rounds": 0}
    with pytest.raises(RunFailed):
        run_inprocess(cfg, 3, intercept=no_arrays)
    summary = read_summary(tmp_path / "rej")
    assert summary["status"] == "failed" and "no round of the run updated the model" in summary["failure"]
    assert summary["config"]["task"] == "synthetic-linear" and summary["versions"]["fedadapt"]


def test_a_crash_after_the_output_dir_exists_writes_a_failed_summary(tmp_path, monkeypatch):
    evaluate = app_module.evaluate
    calls = []

    def evaluate_then_crash(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # round 1's central evaluation
            raise ValueError("evaluation broke")
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(app_module, "evaluate", evaluate_then_crash)
    with pytest.raises(ValueError, match="evaluation broke"):
        run_inprocess({**TINY, "output-dir": str(tmp_path), "run-name": "crash"}, 3)
    summary = read_summary(tmp_path / "crash")
    assert summary["status"] == "failed" and summary["failure"] == "ValueError: evaluation broke"
    assert summary["final"]["round"] == 0 and summary["config"]["num-server-rounds"] == 2


def test_git_state_is_null_outside_a_checkout_of_the_project(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "APP_ROOT", tmp_path)  # like an unpacked FAB: no .git
    assert provenance.git_state() == {"commit": None, "dirty": None}
    monkeypatch.setenv("PATH", "")  # no git executable at all
    assert provenance.git_state() == {"commit": None, "dirty": None}


def test_git_state_of_this_checkout_agrees_with_git_itself():
    """The one ``git status --porcelain=v2 --branch`` call gives the commit ``git rev-parse HEAD`` names and the dirty
    flag ``git status --porcelain`` implies (whatever this checkout's state)."""
    git = shutil.which("git")
    if git is None or not (provenance.APP_ROOT / ".git").exists():
        pytest.skip("not a git checkout with git on PATH")
    ask = lambda *args: subprocess.run([git, "-C", str(provenance.APP_ROOT), *args], capture_output=True,  # noqa: E731
                                       text=True, check=True).stdout.strip()
    state = provenance.git_state()
    dirty = bool(ask("status", "--porcelain", "--untracked-files=no"))
    assert state == {"commit": ask("rev-parse", "HEAD"), "dirty": dirty}
