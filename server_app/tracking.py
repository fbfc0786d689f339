"""Optional experiment tracking: the run-config key ``tracking = "none" | "tensorboard" | "mlflow" | "wandb"``.

The ServerApp talks to one interface, :class:`Tracker`:

* :func:`check_available` when the run-config is validated (before any file is written: a missing package is a
  :class:`~flower_strategies.core.hparams.ConfigError` naming the ``pip install`` to run, never a half-started run);
* :func:`start` once the run directory exists — records the resolved configuration;
* :meth:`Tracker.log_round` with every row the ServerApp appends to ``metrics.jsonl`` (numeric values as scalars
  at step = the row's ``round``; booleans as 0/1; text and null values are skipped);
* :meth:`Tracker.close` at the end, on failure too (``status`` "completed" or "failed"): flushes and closes.

Where each backend writes (``<run dir>`` = ``<output-dir>/<run-name>``):

* ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` event files in ``<run dir>/tensorboard/`` (scalars
  tagged with the metrics' column names, the configuration as the text ``config``);
  ``tensorboard --logdir <output-dir>`` compares runs.
* ``mlflow``: ``mlflow.log_params`` / ``mlflow.log_metrics`` into the experiment ``fedadapt`` (or
  ``MLFLOW_EXPERIMENT_NAME``) of a local file store ``<run dir>/mlruns/``, or of ``MLFLOW_TRACKING_URI`` when set;
  ``mlflow ui --backend-store-uri <run dir>/mlruns`` shows it.
* ``wandb``: ``wandb.init(mode=WANDB_MODE or "offline", dir=<run dir>)``, project ``WANDB_PROJECT`` (default
  ``fedadapt``): offline runs land in ``<run dir>/wandb/`` (``wandb sync`` uploads them); ``WANDB_MODE=online``
  logs live.

A tracker that fails while the run trains is switched off with one warning: tracking never ends a training run.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Mapping
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common import log

from flower_strategies.core.hparams import ConfigError

#: backend → (module that must import, what to install)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"),
            "wandb": ("wandb", "wandb")}


def check_available(backend: str) -> None:
    """Raise :class:`ConfigError` when ``backend``'s package cannot be imported (``none``: nothing to check)."""
    if backend == "none":
        return
    if backend not in PACKAGES:
        raise ConfigError(f"tracking = {backend!r}: choose one of none, {', '.join(PACKAGES)}")
    module, package = PACKAGES[backend]
    try:
        importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"tracking = {backend!r} needs the {package!r} package, which cannot be imported here "
                          f"({err}); install it with `pip install {package}` where the ServerApp runs, "
                          f"or set tracking = \"none\"") from None


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric values of a metrics row (booleans as 0/1), without ``round`` (the step)."""
    return {k: float(v) for k, v in row.items() if k != "round" and isinstance(v, (int, float))}


def flat_config(config: Mapping[str, Any]) -> dict[str, str | int | float | bool]:
    """The configuration with every value a scalar (``None`` → ``""``, sequences → JSON text)."""
    out: dict[str, str | int | float | bool] = {}
    for k, v in config.items():
        out[k] = "" if v is None else v if isinstance(v, (str, int, float, bool)) else json.dumps(v, default=str)
    return out


class Tracker:
    """``tracking = "none"``, and the base of the backends: every call does nothing."""

    backend = "none"

    def log_round(self, row: Mapping[str, Any]) -> None:
        """Record one metrics row (the dict the ServerApp appends to metrics.jsonl)."""

    def close(self, status: str = "completed") -> None:
        """Flush and close (``status``: "completed" or "failed")."""


class SafeTracker(Tracker):
    """Wraps a backend: a per-round failure warns once and switches tracking off; close runs at most once."""

    def __init__(self, inner: Tracker) -> None:
        self.inner, self.backend, self.active = inner, inner.backend, True

    def log_round(self, row: Mapping[str, Any]) -> None:
        if not self.active:
            return
        try:
            self.inner.log_round(row)
        except Exception as err:  # noqa: BLE001 - a tracker must not end the training run
            log(WARNING, "fedadapt: tracking (%s) failed at round %s and is switched off: %r",
                self.backend, row.get("round"), err)
            self.close("failed")

    def close(self, status: str = "completed") -> None:
        if not self.active:
            return
        self.active = False
        try:
            self.inner.close(status)
        except Exception as err:  # noqa: BLE001
            log(WARNING, "fedadapt: closing the %s tracker failed: %r", self.backend, err)


class TensorBoardTracker(Tracker):
    backend = "tensorboard"

    def __init__(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        text = "\n".join(f"    {k} = {v!r}" for k, v in flat_config(config).items())  # markdown code block
        self.writer.add_text("config", text, global_step=0)
        self.writer.flush()

    def log_round(self, row: Mapping[str, Any]) -> None:
        step = int(row["round"])
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self, status: str = "completed") -> None:
        self.writer.add_text("status", status)
        self.writer.close()


class MLflowTracker(Tracker):
    backend = "mlflow"

    def __init__(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME") or "fedadapt")
        mlflow.start_run(run_name=run_dir.name)
        mlflow.log_params(flat_config(config))

    def log_round(self, row: Mapping[str, Any]) -> None:
        self.mlflow.log_metrics(scalars(row), step=int(row["round"]))

    def close(self, status: str = "completed") -> None:
        self.mlflow.end_run(status="FINISHED" if status == "completed" else "FAILED")


class WandbTracker(Tracker):
    backend = "wandb"

    def __init__(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "fedadapt", name=run_dir.name,
                              dir=str(run_dir), config=dict(flat_config(config)),
                              mode=os.environ.get("WANDB_MODE") or "offline")

    def log_round(self, row: Mapping[str, Any]) -> None:
        self.run.log(scalars(row), step=int(row["round"]))

    def close(self, status: str = "completed") -> None:
        self.run.finish(exit_code=0 if status == "completed" else 1)


BACKENDS: dict[str, Callable[[Path, Mapping[str, Any]], Tracker]] = {
    "tensorboard": TensorBoardTracker, "mlflow": MLflowTracker, "wandb": WandbTracker}


def start(backend: str, run_dir: Path, config: Mapping[str, Any]) -> Tracker:
    """The run's tracker (records ``config`` now); ``none`` → a :class:`Tracker` that does nothing."""
    if backend == "none":
        return Tracker()
    check_available(backend)
    return SafeTracker(BACKENDS[backend](run_dir, config))
