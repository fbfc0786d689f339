"""A library user turns ``defence = "robust"`` on in their own app (issue 48, item 6).

The apps are the project's quickstart-shaped examples (examples/pytorch_app: the user's own CNN, DataLoader of dict
batches, momentum-SGD loop; examples/legacy_app: the same under Flower's legacy NumPyClient API), run in-process
(LoopbackGrid) with the strategy's ``root_update`` built by :func:`flower_strategies.root_update_from` from the
user's model, a DataLoader of ~290 trusted digits and the clients' loss.  Every honest reply must pass the gate.

The issue's failure, reproduced on the tree before this change: ``strategy.root_update = lambda content:
train_reply(model, content, root_loader, cross_entropy)`` rejected every honest reply of every round ("FLTrust
trust 0") and the run ended ``RunFailed: the last 3 rounds updated nothing``.  The cause: ``train_reply`` returns a
``RecordDict`` of ArrayRecords, the strategy read each ``Array`` as a non-float object, compared no key and saw a
zero root update — trust 0 for every reply.  The strategy now takes any of the usual return types
(:func:`flower_strategies.core.rootset.root_records`) and refuses a wrong layout before round 1 with the contract.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.server.compat import start_grid
from torch.nn import functional as F

import flower_strategies as fs
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.policy import RunFailed
from simulations.engine.inprocess import LoopbackGrid

ROOT = Path(__file__).resolve().parent.parent
for app_dir in ("pytorch_app", "legacy_app"):
    sys.path.insert(0, str(ROOT / "examples" / app_dir))
from legacyapp import client_app as legacy_client  # noqa: E402
from legacyapp import server_app as legacy_server  # noqa: E402
from legacyapp import task as legacy_task  # noqa: E402
from pytorchapp import client_app as user_client  # noqa: E402
from pytorchapp import task as user_task  # noqa: E402

from tests.helpers import read_digits_once  # noqa: E402

NODES = 3
ROUNDS = 3
LR = 0.1  # examples/pytorch_app/pyproject.toml's learning-rate


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    read_digits_once(monkeypatch, user_task, legacy_task)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    yield
    logging.getLogger("flwr").setLevel(logging.INFO)


def root_loader(task=user_task):
    """The server's trusted examples: a slice of the digits no client holds as its partition (every 5th from 4)."""
    return task.load_data(4, 5, 32)[0]


def user_app_run(method: str, root_update) -> fs.FedAdaptStrategy:
    """examples/pytorch_app's ClientApp, its ServerApp's strategy with ``defence = "robust"`` and ``root_update``."""
    cfg = {"num-server-rounds": ROUNDS, "fraction-train": 1.0, "local-epochs": 1, "learning-rate": LR,
           "batch-size": 32, "method": method, "fraction-evaluate": 0.0, "defence": "robust"}
    strategy = fs.strategy_from_run_config(cfg, names={"learning-rate": "client-lr"})
    strategy.root_update = root_update
    torch.manual_seed(0)
    strategy.start(grid=LoopbackGrid(user_client.app, NODES, cfg), initial_arrays=ArrayRecord(
        user_task.Net().state_dict()), train_config=ConfigRecord({"lr": LR}), num_rounds=ROUNDS)
    return strategy


def user_loop(model, loader, lr, optimizer):
    """The app's own training loop, as its ClientApp calls it (one local epoch)."""
    return user_task.train(model, loader, 1, lr, torch.device("cpu"), optimizer=optimizer)


def passed(strategy: fs.FedAdaptStrategy) -> list[tuple[int, int]]:
    return [(h.replies_used, h.replies_rejected) for h in strategy.history]


@pytest.mark.parametrize("method", ["fedavg", "fedlada", "scaffold"])
def test_message_api_app_with_the_helper_passes_every_honest_reply(method):
    strategy = user_app_run(method, fs.root_update_from(user_task.Net(), root_loader(), F.cross_entropy,
                                                        train=user_loop))
    assert passed(strategy) == [(NODES, 0)] * ROUNDS


def test_the_issues_own_lambda_now_passes_every_honest_reply():
    model = user_task.Net()
    loader = root_loader()
    strategy = user_app_run("fedlada", lambda content: fs.train_reply(model, content, loader, F.cross_entropy))
    assert passed(strategy) == [(NODES, 0)] * ROUNDS


def test_the_helper_trains_a_copy_and_leaves_the_users_model_alone():
    model = user_task.Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    strategy = user_app_run("fedavg", fs.root_update_from(model, root_loader(), F.cross_entropy))
    assert passed(strategy) == [(NODES, 0)] * ROUNDS  # the library's own loop (plain SGD) passes the gate too
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_legacy_numpy_client_app_with_the_helper_passes_every_honest_reply():
    cfg = {"num-server-rounds": ROUNDS, "local-epochs": 1, "batch-size": 32, "method": "fedlada", "output": "",
           "learning-rate": LR * fs.get_method("fedlada").client_lr_factor, "defence": "robust"}
    parts = legacy_server.server_fn(Context(run_id=1, node_id=0, state=RecordDict(), run_config=cfg, node_config={}))
    inner = parts.strategy.inner
    inner.root_update = fs.root_update_from(
        legacy_task.Net(), root_loader(legacy_task), F.cross_entropy,
        train=lambda m, loader, lr, opt: legacy_task.train(m, loader, 1, lr, torch.device("cpu"), opt))
    start_grid(grid=LoopbackGrid(legacy_client.app, NODES, cfg), strategy=parts.strategy, config=parts.config)
    assert passed(inner) == [(NODES, 0)] * ROUNDS


def test_a_root_update_that_rejects_every_honest_reply_in_round_1_fails_saying_what_to_check():
    """A sign error (the model moved against its own training: x_t − (x − x_t)) rejects every honest reply."""
    helper = fs.root_update_from(user_task.Net(), root_loader(), F.cross_entropy, train=user_loop)

    def reversed_update(content):
        start = {k: v.numpy() for k, v in content["arrays"].items()}
        return {name: {k: 2 * start[k] - v if name == "arrays" else v for k, v in record.items()}
                for name, record in helper(content).items()}

    with pytest.raises(RunFailed, match=r"round 1, the run's first: every reply \(3\) was rejected for its trust .* "
                                        r"the root update, not the clients, is the likely fault\. Check that "
                                        r"root_update \(1\) loads the round's broadcast model"):
        user_app_run("fedavg", reversed_update)


@pytest.mark.parametrize("returned,message", [
    (None, r"root_update returned a NoneType; root_update\(content\) receives the round's train content"),
    ({"arrays": {"w": np.zeros(3, np.float32)}}, r"root_update's record 'arrays' does not have the layout of the "
                                                 r"clients' replies"),
    ({"model": {}}, r"root_update returned the records \['model'\], without 'arrays'"),
])
def test_a_root_update_of_the_wrong_shape_is_refused_before_any_reply_is_screened(returned, message):
    with pytest.raises(ConfigError, match=message):
        user_app_run("fedavg", lambda content: returned)
