"""Run-config ``tracking``: TensorBoard event files hold metrics.jsonl's values; MLflow and W&B get the same rows
through their own APIs (fake modules here); a missing package stops the run before anything is written."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from flower_strategies.core.hparams import ConfigError
from server_app import tracking
from simulations.engine.inprocess import run_inprocess

TINY = {"task": "synthetic-linear", "synthetic-dim": 4, "synthetic-clients": 3, "local-steps": 2, "batch-size": 8,
        "num-server-rounds": 3, "learning-curve": False}


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tensorboard_scalars_equal_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_inprocess({**TINY, "output-dir": str(tmp_path), "run-name": "tb", "tracking": "tensorboard"}, 3)
    out = tmp_path / "tb"
    rows = read_rows(out / "metrics.jsonl")
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected_tags = {k for r in rows for k, v in r.items() if k != "round" and isinstance(v, (int, float))}
    assert "test-loss" in expected_tags and "train-loss" in expected_tags and "updated" in expected_tags
    assert tags == expected_tags
    for tag in expected_tags:
        logged = {e.step: e.value for e in events.Scalars(tag)}
        wanted = {r["round"]: np.float32(float(r[tag])) for r in rows if isinstance(r.get(tag), (int, float))}
        assert logged == wanted, tag
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "tracking = 'tensorboard'" in config and "synthetic-dim = 4" in config


class FakeMlflow(types.ModuleType):
    def __init__(self):
        super().__init__("mlflow")
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


class FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.init_kwargs, self.logged, self.exit_code = None, [], None

    def init(self, **kwargs):
        self.init_kwargs = kwargs
        return types.SimpleNamespace(log=lambda data, step: self.logged.append((step, data)),
                                     finish=lambda exit_code: setattr(self, "exit_code", exit_code))


def expected_scalars(rows):
    return [(r["round"], tracking.scalars(r)) for r in rows]


def test_mlflow_gets_params_and_every_row(tmp_path, monkeypatch):
    fake = FakeMlflow()
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    run_inprocess({**TINY, "output-dir": str(tmp_path), "run-name": "ml", "tracking": "mlflow"}, 3)
    rows = read_rows(tmp_path / "ml" / "metrics.jsonl")
    names = [c[0] for c in fake.calls]
    assert names == ["set_tracking_uri", "set_experiment", "start_run", "log_params"] + ["log_metrics"] * len(rows) \
        + ["end_run"]
    assert fake.calls[0][1][0] == (tmp_path / "ml" / "mlruns").as_uri()
    params = fake.calls[3][1][0]
    assert params["tracking"] == "mlflow" and params["synthetic-dim"] == 4 and params["fedavg.server-lr"] == 1.0
    assert [(c[2]["step"], c[1][0]) for c in fake.calls if c[0] == "log_metrics"] == expected_scalars(rows)
    assert fake.calls[-1][2] == {"status": "FINISHED"}


def test_wandb_gets_config_and_every_row_offline_by_default(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_inprocess({**TINY, "output-dir": str(tmp_path), "run-name": "wb", "tracking": "wandb"}, 3)
    rows = read_rows(tmp_path / "wb" / "metrics.jsonl")
    assert fake.init_kwargs["mode"] == "offline" and fake.init_kwargs["dir"] == str(tmp_path / "wb")
    assert fake.init_kwargs["config"]["tracking"] == "wandb"
    assert fake.logged == expected_scalars(rows) and fake.exit_code == 0
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the user's environment decides
    run_inprocess({**TINY, "output-dir": str(tmp_path), "run-name": "wb2", "tracking": "wandb",
                   "num-server-rounds": 1}, 3)
    assert fake.init_kwargs["mode"] == "disabled"


@pytest.mark.parametrize("backend", ["mlflow", "wandb", "tensorboard"])
def test_missing_package_is_a_clear_error_before_the_run_starts(tmp_path, monkeypatch, backend):
    monkeypatch.setitem(sys.modules, backend, None)  # `import <backend>` raises ImportError
    with pytest.raises(ConfigError, match=rf"tracking = '{backend}' needs .*`pip install {backend}`"):
        run_inprocess({**TINY, "output-dir": str(tmp_path), "run-name": "x", "tracking": backend}, 3)
    assert not (tmp_path / "x").exists()  # nothing written: the run did not half-start


def test_unknown_backend_is_refused():
    with pytest.raises(ConfigError, match="tracking"):
        run_inprocess({**TINY, "tracking": "neptune"}, 2)


def test_a_failing_tracker_is_switched_off_not_the_run():
    class Broken(tracking.Tracker):
        backend = "broken"
        closed = None

        def log_round(self, row):
            raise OSError("disk full")

        def close(self, status="completed"):
            Broken.closed = status

    safe = tracking.SafeTracker(Broken())
    safe.log_round({"round": 1, "test-loss": 1.0})  # warns, does not raise
    safe.log_round({"round": 2, "test-loss": 1.0})
    safe.close("completed")
    assert Broken.closed == "failed" and not safe.active


def test_scalars_skip_text_and_null_and_take_booleans_as_numbers():
    row = {"round": 3, "test-loss": 0.5, "updated": True, "rejections": "x", "test-accuracy": None, "bytes-up": 7}
    assert tracking.scalars(row) == {"test-loss": 0.5, "updated": 1.0, "bytes-up": 7.0}


def test_tracking_may_change_on_resume(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = {**TINY, "output-dir": str(tmp_path), "run-name": "r", "checkpoint-every": 1, "num-server-rounds": 1}
    run_inprocess(cfg, 3)
    summary = run_inprocess({**cfg, "num-server-rounds": 2, "tracking": "tensorboard",
                             "resume": str(tmp_path / "r" / "checkpoint.npz")}, 3)
    assert summary["resumed_after_round"] == 1 and summary["status"] == "completed"
    assert list((tmp_path / "r" / "tensorboard").glob("events.out.tfevents.*"))


def test_the_tracker_is_closed_as_failed_when_the_run_fails(tmp_path, monkeypatch):
    import server_app.app as app_module

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    evaluate, calls = app_module.evaluate, []

    def evaluate_then_crash(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # round 2's central evaluation
            raise ValueError("evaluation broke")
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(app_module, "evaluate", evaluate_then_crash)
    with pytest.raises(ValueError, match="evaluation broke"):
        run_inprocess({**TINY, "output-dir": str(tmp_path), "run-name": "f", "tracking": "wandb"}, 3)
    assert [step for step, _ in fake.logged] == [0, 1] and fake.exit_code == 1
