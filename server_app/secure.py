"""``secure-aggregation = secaggplus``: the ServerApp's rounds under Flower's SecAgg+ workflow.

The method runs through :class:`flower_strategies.compat.secagg.SecAggStrategy` (the legacy adapter) inside Flower's
``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))``; the ClientApp answers with ``secaggplus_mod``
(:func:`flower_strategies.compat.secagg.secagg_mod`).  Rows, progress lines, the run-failure policy, ``model.pt`` and
``summary.json`` are the same as in an ordinary run; checkpoints and resume are not available (Flower's workflow
always starts at round 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from app_common.config import AppConfig
from flower_strategies.compat.secagg import SecAggStrategy, check_secagg, run_secagg, secaggplus_workflow
from flower_strategies.core import records as R
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.loop import exchange
from flower_strategies.core.strategy import FedAdaptStrategy


def workflow(fed: AppConfig) -> Any:
    """The run's SecAgg+ workflow (its settings validated by Flower's own checks)."""
    return secaggplus_workflow(fed.secagg_num_shares, fed.secagg_reconstruction_threshold,
                               clipping_range=fed.secagg_clipping_range,
                               quantization_range=fed.secagg_quantization_range,
                               max_weight=fed.secagg_max_weight, timeout=fed.round_timeout)


def check(fed: AppConfig, strategy: FedAdaptStrategy) -> None:
    """Refuse, before round 1, a SecAgg+ run that cannot be right (:func:`~flower_strategies.compat.secagg.
    check_secagg`) or that asks for what its workflow cannot do."""
    if fed.checkpoint_every > 0 or fed.resume:
        raise ConfigError("secure-aggregation = secaggplus: checkpoint-every and resume are not available (Flower's "
                          "SecAgg+ workflow always runs from round 1); set checkpoint-every = 0 and resume = \"\"")
    check_secagg(strategy)
    workflow(fed)


def run_secure_rounds(fed: AppConfig, strategy: FedAdaptStrategy, grid: Grid, initial: ArrayRecord,
               evaluate_fn: Callable[[int, ArrayRecord], MetricRecord]) -> Result:
    """``fed.num_server_rounds`` SecAgg+ rounds; ``evaluate_fn`` runs after each (and on the initial model), then the
    run-failure policy.  The result's arrays are the last evaluated global arrays."""
    result = Result()

    def central(server_round: int, arrays: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        record = R.to_record(arrays)
        result.arrays = record
        metrics: dict[str, Any] = dict(evaluate_fn(server_round, record))
        return float(metrics.get("loss", 0.0)), metrics

    legacy = SecAggStrategy(strategy, R.to_numpy(initial), evaluate_fn=central, num_rounds=fed.num_server_rounds,
                            clipping_range=fed.secagg_clipping_range, quantization_range=fed.secagg_quantization_range,
                            max_weight=fed.secagg_max_weight)
    strategy.num_rounds = fed.num_server_rounds
    strategy.summary()
    run_secagg(PollingGrid(grid, fed.grid_pull_interval), legacy, fed.num_server_rounds, workflow(fed))
    return result


class PollingGrid:
    """``grid`` whose ``send_and_receive`` polls every ``interval`` s (:func:`flower_strategies.core.loop.exchange`):
    each SecAgg+ round is four exchanges, and Flower's deployment grid waits a fixed 3 s per poll."""

    def __init__(self, grid: Grid, interval: float) -> None:
        self.grid, self.interval = grid, interval

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Any]:
        return exchange(self.grid, messages, math.inf if timeout is None else timeout, self.interval)
