"""The worked example of docs/architecture.md: a new method is one module (declaration, optimizer, strategy, register).

The module below is what a contributor writes; the tests show that the registry, the generated run-config keys, the
wire, the real ClientApp and the in-process engine pick it up with no other edit, and that it reduces exactly to FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

import flower_strategies as fs
from app_common.task import build_model
from simulations.engine.inprocess import simulate

# ------------------------------------------------------------------ the contributor's module (methods/clipped.py)
from flower_strategies.core.hparams import HParams, param
from flower_strategies.core.local import LocalOptimizer
from flower_strategies.core.ops import averaging_step
from flower_strategies.core.strategy import FedAdaptStrategy


@dataclass(frozen=True)
class ClippedFedAvgHParams(HParams):
    """FedAvg whose clients clip every local gradient to an L2 norm (one flag = one line)."""

    max_grad_norm: float = param(1.0, lo=0.0, lo_open=True, client=True,
                                 help="clip each local gradient to this L2 norm")
    server_lr: float = param(1.0, lo=0.0, help="server learning rate η_g (1 = model averaging)")


class ClippedSGDOptimizer(LocalOptimizer):
    """``g ← g·min(1, C/‖g‖)`` over the group's parameters, then ``x ← x − η_l·g``."""

    hparams_class = ClippedFedAvgHParams

    def apply_step(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, group["max_grad_norm"])
            for p in params:
                p.add_(p.grad, alpha=-group["lr"])


class ClippedFedAvg(FedAdaptStrategy):
    method = "clipped-fedavg"
    hparams_class = ClippedFedAvgHParams
    local_optimizer = ClippedSGDOptimizer

    def server_update(self, inputs, state):
        mean = inputs.aggregates["arrays"]
        new, _ = averaging_step(inputs.current, mean, inputs.trainable, self.hparams.server_lr)
        return self.merge_buffers(new, inputs.current, mean), state, {}


# (the module ends with:  register(ClippedFedAvg, paper="…", summary="FedAvg with clipped local gradients"))
# ------------------------------------------------------------------ end of the contributor's module


@pytest.fixture()
def registered():
    spec = fs.register(ClippedFedAvg, paper="example", summary="FedAvg with clipped local gradients")
    yield spec
    fs.METHODS.pop(spec.name)


RUN_CONFIG = {"task": "synthetic-linear", "seed": 0, "precision": "float64", "synthetic-dim": 5}
PLAN = dict(client_lr=0.05, local_steps=3, batch_size=8)


def _run(strategy):
    model = build_model("synthetic-linear", 0, 5, "float64")
    snaps, _ = simulate(strategy, ArrayRecord(model.state_dict()), 4, 4, RUN_CONFIG)
    return snaps[-1]["w.weight"]


def test_the_declaration_gives_run_config_and_wire_keys(registered):
    assert registered.defaults() == {"clipped-fedavg.max-grad-norm": 1.0, "clipped-fedavg.server-lr": 1.0}
    strategy, _ = fs.build_strategy({"method": "clipped-fedavg", "clipped-fedavg.max-grad-norm": 0.5})
    cfg = strategy.round_config(1)
    assert cfg["clipped-fedavg.max-grad-norm"] == 0.5 and "clipped-fedavg.server-lr" not in cfg  # server-only field
    with pytest.raises(fs.ConfigError, match="max-grad-norm"):
        fs.build_strategy({"method": "clipped-fedavg", "clipped-fedavg.max-grad-norm": 0.0})


def test_runs_through_the_real_client_app_and_reduces_to_fedavg(registered):
    no_clip = _run(registered.build(registered.hparams(max_grad_norm=1e9), **PLAN))
    fedavg = _run(fs.FedAvg(**PLAN))
    np.testing.assert_array_equal(no_clip, fedavg)  # a bound never reached: exactly FedAvg
    clipped = _run(registered.build(registered.hparams(max_grad_norm=1e-3), **PLAN))
    assert np.abs(clipped - fedavg).max() > 1e-3  # and a tight bound really changes the run
