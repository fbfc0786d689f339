"""The recipe inside a real (quickstart-shaped) app, unchanged: ``len(rnd.loader)`` for loops that divide by it;
the legacy ``train`` callback returning a dict; client-side evaluate failures and empty evaluate metrics logged by
the server; a forgotten ``rnd.reply`` named in the error."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import Code, EvaluateRes, Status

import flower_strategies as fs
from flower_strategies.compat.legacy import TRAIN_CONTRACT, LegacyStrategy, train_result
from flower_strategies.core.client import RoundLoader, TensorPartition
from flower_strategies.core.strategy import ClientHalfMissing
from flower_strategies.core.loop import own_loop_config
from simulations.engine.inprocess import LoopbackGrid
from tests.helpers import error_reply, metadata, set_task_identity

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "pytorch_app"))
from pytorchapp import server_app as user_server  # noqa: E402
from pytorchapp.task import Net, load_data  # noqa: E402
from pytorchapp.task import train as quickstart_train  # noqa: E402

from tests.helpers import DictLoader, read_digits_once  # noqa: E402


class Flat(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def _content(method: str, model: torch.nn.Module, server_round: int = 1, num_rounds: int = 3, **settings):
    strategy = fs.get_method(method).build(**settings)
    strategy.num_rounds = num_rounds
    return strategy.prepare_round(server_round, ArrayRecord(model.state_dict()), own_loop_config(), 1)


def _quickstart_loop(net, trainloader, epochs, lr, optimizer=None):
    """Flower quickstart-pytorch's train(): dict batches, momentum SGD unless given one, summed loss / (epochs *
    len(trainloader))."""
    optimizer = optimizer or torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    running, seen = 0.0, []
    for _ in range(epochs):
        for batch in trainloader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(batch["img"]), batch["label"])
            loss.backward()
            optimizer.step()
            running += loss.item()
            seen.append(loss.item())
    return running / (epochs * len(trainloader)), seen


# ------------------------------------------------------------------ 1. rnd.loader behaves like the app's DataLoader
@pytest.mark.parametrize("method", sorted(fs.METHODS))
def test_quickstart_train_dividing_by_len_trainloader_works_for_every_method(method):
    """The quickstart's own loop over rnd.loader for every method: len(rnd.loader) is the number of batches the
    round iterates (all its epochs) until the loop's second pass, then that over the passes, so the quickstart's
    ``running_loss / (epochs * len(trainloader))`` is the mean per step; the reply is accepted by the method's
    strategy screen, and the batches are the app's dict objects."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(45, 2, 4, generator=gen), torch.randint(0, 4, (45,), generator=gen)
    model = Flat()
    content = _content(method, model, batch_size=8, local_epochs=2)
    rnd = fs.ClientRound(content, RecordDict(), DictLoader(x, y, 8), torch.nn.functional.cross_entropy)
    planned = int(content["config"]["local-steps"]) or 2 * math.ceil(45 / 8)  # LocalUpdate fixes its K
    assert len(rnd.loader) == planned == rnd.num_steps(45)
    opt = rnd.optimizer(model) if rnd.needs_client_half else None
    loss, seen = _quickstart_loop(model, rnd.loader, 2, rnd.lr, opt)  # the app's 2 epochs: 1 pass yields all
    assert len(seen) == planned == rnd.batches_yielded and len(rnd.loader) == round(planned / 2)
    if planned % 2 == 0:  # exact when the loop's epochs divide the round's steps
        assert loss == pytest.approx(np.mean(seen), rel=1e-12)
    reply = rnd.reply(model, opt, train_loss=loss)
    assert reply["metrics"]["num-steps"] == planned and math.isfinite(reply["metrics"]["train-loss"])
    strategy = fs.get_method(method).build(batch_size=8, local_epochs=2)
    strategy.num_rounds = 3
    strategy.prepare_round(1, ArrayRecord(Flat().state_dict()), own_loop_config(), 1)
    set_task_identity()
    arrays, metrics = strategy.aggregate_train(1, [Message(content=reply, metadata=metadata(1))])
    assert metrics["replies-used"] == 1 and metrics["train-loss"] == pytest.approx(loss)


def test_len_of_the_round_loader_in_full_batch_steps_and_tensor_rounds():
    x, y = torch.randn(30, 8), torch.randint(0, 4, (30,))
    model = Flat()
    full = fs.ClientRound(_content("fedda", model, server_round=2, num_rounds=2), None, DictLoader(x, y, 8))
    assert full.full_batch and len(full.loader) == 1 == len(list(full.loader))
    steps = fs.ClientRound(_content("fedavg", model, local_steps=7, batch_size=8), None, DictLoader(x, y, 8))
    assert len(steps.loader) == 7 == len(list(steps.loader))
    tensors = fs.ClientRound(_content("fedavg", model, batch_size=8, local_epochs=1), None, TensorPartition(x, y))
    assert len(tensors.loader) == 4 == len(list(tensors.loader))
    assert isinstance(tensors.loader, RoundLoader)
    with pytest.raises(TypeError, match=r"len\(ClientRound.loader\) .* no \.dataset"):
        len(fs.ClientRound(_content("fedavg", model), None, [(x, y)]).loader)


def test_the_example_app_is_quickstart_shaped_and_its_train_divides_by_len(monkeypatch):
    """examples/pytorch_app's task.py is the quickstart's (CNN, dict batches, summed loss / (epochs *
    len(trainloader))) and its train() runs unchanged on rnd.loader."""
    read_digits_once(monkeypatch, sys.modules["pytorchapp.task"])
    loader, _ = load_data(0, 10, 32)
    batch = next(iter(loader))
    assert set(batch) == {"img", "label"} and batch["img"].shape[1:] == (1, 8, 8)
    assert any(isinstance(m, torch.nn.Conv2d) for m in Net().modules())
    torch.manual_seed(0)
    model = Net()
    rnd = fs.ClientRound(_content("fedlada", model, batch_size=32, local_epochs=2), RecordDict(), loader,
                         torch.nn.functional.cross_entropy)
    opt = rnd.optimizer(model)
    loss = quickstart_train(model, rnd.loader, 2, rnd.lr, torch.device("cpu"), optimizer=opt)
    assert opt.steps_taken == 2 * len(rnd.loader) == 2 * len(loader) and 0 < loss < 3


@pytest.mark.parametrize("epochs", [1, 3])
def test_the_quickstart_divisor_reports_the_true_mean_train_loss(epochs):
    """E local epochs through the recipe: the quickstart's ``running_loss / (epochs * len(trainloader))`` over
    rnd.loader is the mean of the E·⌈n/B⌉ batch losses the loop computed — what the reply's train-loss carries and
    the server's warnings read (a divisor E× too large would hide a divergence)."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(45, 2, 4, generator=gen), torch.randint(0, 4, (45,), generator=gen)
    model = Flat()
    rnd = fs.ClientRound(_content("fedavg", model, batch_size=8, local_epochs=epochs), RecordDict(),
                         DictLoader(x, y, 8), torch.nn.functional.cross_entropy)
    loss, seen = _quickstart_loop(model, rnd.loader, epochs, rnd.lr)
    assert len(seen) == epochs * math.ceil(45 / 8) == rnd.batches_yielded
    assert loss == pytest.approx(float(np.mean(seen)), rel=1e-12)
    assert rnd.reply(model, None, train_loss=loss)["metrics"]["train-loss"] == pytest.approx(np.mean(seen), rel=1e-12)


# ------------------------------------------------------------------ 2. the legacy train callback's contract
def test_train_result_contract():
    assert train_result(None) == (None, {})
    assert train_result(0.5) == (0.5, {}) and train_result(np.float32(0.25)) == (0.25, {})
    assert train_result(torch.tensor(1.5)) == (1.5, {})
    assert train_result({"train_loss": 0.4}) == (0.4, {})  # Flower quickstart's
    assert train_result({"loss": 0.3, "acc": 0.9, "n": 3}) == (0.3, {"acc": 0.9, "n": 3.0})
    assert train_result({"train_loss": 0.4, "loss": 9.0}) == (0.4, {"loss": 9.0})
    assert train_result({"acc": 0.9}) == (None, {"acc": 0.9})
    for bad in ((0.5, {}), "0.5", True, {"train_loss": "x"}, {"train_loss": [1.0, 2.0]}, {1: 0.5}):
        with pytest.raises(TypeError, match=r"must return None, the train loss \(a number\), or a dict"):
            train_result(bad)
    assert "'train_loss'" in TRAIN_CONTRACT


def test_legacy_client_accepts_the_quickstart_dict_and_the_server_snippet_runs(monkeypatch):
    """FedAdaptNumPyClient(train=...) with a train returning {"train_loss": ..., "acc": ...}: the loss becomes the
    reply's train-loss and the other entries reply metrics; LegacyStrategy takes a state_dict as initial arrays,
    num_rounds and the app's evaluate_metrics_aggregation_fn (the docs' server snippet)."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 8, generator=gen), torch.randint(0, 4, (40,), generator=gen)

    def train(model, loader, lr, optimizer):
        loss, _ = _quickstart_loop(model, loader, 1, lr, optimizer)
        return {"train_loss": loss, "acc": 0.5}

    def evaluate(model):
        return 1.0, 40, {"accuracy": 0.75}

    client = fs.FedAdaptNumPyClient(Flat(), DictLoader(x, y, 8), torch.nn.functional.cross_entropy,
                                    state=RecordDict(), train=train, evaluate_fn=evaluate)
    seen = []
    legacy = LegacyStrategy(fs.get_method("fedlada").build(batch_size=8, local_epochs=1), Flat().state_dict(),
                            num_rounds=2,
                            evaluate_metrics_aggregation_fn=lambda pairs: seen.append(pairs) or {"acc": 1.0})
    assert all(isinstance(v, np.ndarray) for v in legacy.initial.values())
    from flwr.common import parameters_to_ndarrays

    params = legacy.initialize_parameters(None)
    cfg = legacy.inner.prepare_round(1, ArrayRecord(Flat().state_dict()), own_loop_config(), 1)
    from flower_strategies.compat.legacy import LAYOUT, pack

    arrays, layout = pack({n: fs.core.records.to_numpy(r) for n, r in cfg.array_records.items()})
    config = {k: v for k, v in cfg["config"].items()} | {LAYOUT: layout}
    _, n, metrics = client.fit(arrays, config)
    assert n == 40 and metrics["acc"] == 0.5 and math.isfinite(metrics["train-loss"]) and metrics["num-steps"] == 5
    res = EvaluateRes(Status(Code.OK, ""), *client.evaluate(parameters_to_ndarrays(params), {}))
    loss, agg = legacy.aggregate_evaluate(1, [(None, res)], [])
    assert loss == 1.0 and agg == {"acc": 1.0} and seen == [[(40, {"accuracy": 0.75})]]
    client.train = lambda *a: (0.5, {"acc": 1.0})  # a tuple: not in the contract
    with pytest.raises(TypeError, match="FedAdaptNumPyClient\\(train=...\\) must return None"):
        client.fit(arrays, config)


# ------------------------------------------------------------------ 3. client-side evaluate failures are logged
def _evaluate_reply(src: int, content: RecordDict) -> Message:
    return Message(content=content, metadata=metadata(src))


def test_evaluate_failures_are_logged_and_empty_metrics_warned(caplog):
    set_task_identity()
    s = fs.FedAvg()
    with caplog.at_level(logging.INFO, logger="flwr"):
        assert s.aggregate_evaluate(4, [error_reply(1, "ValueError: no testloader"),
                                        error_reply(2, "ValueError:  no   testloader")]) is None
    text = [r.getMessage() for r in caplog.records]
    assert "aggregate_evaluate: Received 0 results and 2 failures" in text
    assert "\t> 2 failures from nodes 1, 2: ValueError: no testloader" in text
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warn == ["Round 4: no client-side evaluate metrics: all 2 client evaluations failed (2 failures from "
                    "nodes 1, 2: ValueError: no testloader)"]
    caplog.clear()
    # replies without a usable MetricRecord: warned, naming the reply to build
    no_metrics = [_evaluate_reply(1, RecordDict({"metrics": MetricRecord({"eval_acc": 0.5})})),
                  _evaluate_reply(2, RecordDict({"other": ConfigRecord({"a": 1})}))]
    with caplog.at_level(logging.INFO, logger="flwr"):
        assert s.aggregate_evaluate(5, no_metrics) is None
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warn) == 1 and "2 client evaluation reply(ies) carried no usable metrics" in warn[0]
    assert "'num-examples' > 0" in warn[0]
    caplog.clear()
    # one failure, one good reply (its metrics under another record name): aggregated, the failure logged, no warning
    good = _evaluate_reply(2, RecordDict({"eval": MetricRecord({"eval_acc": 0.5, "num-examples": 10})}))
    with caplog.at_level(logging.INFO, logger="flwr"):
        out = s.aggregate_evaluate(6, [error_reply(1, "boom"), good])
    assert dict(out) == {"eval_acc": 0.5, "num-examples": 10.0}
    assert "aggregate_evaluate: Received 1 results and 1 failures" in [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_legacy_evaluate_failures_are_logged_and_empty_metrics_warned(caplog):
    legacy = LegacyStrategy(fs.FedAvg(), Flat().state_dict())
    with caplog.at_level(logging.INFO, logger="flwr"):
        assert legacy.aggregate_evaluate(2, [], [RuntimeError("no test split"), RuntimeError("no test split")]) \
            == (None, {})
    text = [r.getMessage() for r in caplog.records]
    assert "\t> 2 evaluate failures: RuntimeError('no test split')" in text
    assert "Round 2: no client-side evaluate metrics: all 2 client evaluations failed" in text


# ------------------------------------------------------------------ 4. a forgotten rnd.reply is named
def test_forgetting_rnd_reply_names_rnd_reply(tmp_path, monkeypatch):
    """An app that builds ClientRound and trains with its optimizer but returns a reply of its own (model + metrics,
    without fedadapt's records): the run stops naming rnd.reply(...) as the fix."""
    read_digits_once(monkeypatch, sys.modules["pytorchapp.task"])
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        loader, _ = load_data(context.node_config["partition-id"], context.node_config["num-partitions"], 32)
        rnd = fs.ClientRound(msg.content, context.state, loader, torch.nn.functional.cross_entropy)
        opt = rnd.optimizer(model) if rnd.needs_client_half else None
        loss = quickstart_train(model, rnd.loader, 1, rnd.lr, torch.device("cpu"), optimizer=opt)
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                              "metrics": MetricRecord({"train_loss": loss, "num-examples": len(loader.dataset)})})
        return Message(content=content, reply_to=msg)

    for method in ("fedlada", "fedprox"):  # an extra uplink record missing; a model-only client half
        cfg = {"num-server-rounds": 1, "fraction-train": 1.0, "local-epochs": 1, "learning-rate": 0.1,
               "batch-size": 32, "method": method, "output": str(tmp_path / "m.pt"), "fraction-evaluate": 0.0}
        torch.manual_seed(0)
        with pytest.raises(ClientHalfMissing) as err:
            user_server.main(LoopbackGrid(app, 2, cfg),
                             Context(run_id=1, node_id=0, state=RecordDict(), run_config=cfg, node_config={}))
        msg = str(err.value)
        assert "Fix: build the reply with rnd.reply(...)" in msg and "flower_strategies.ClientRound(" in msg
        assert "return rnd.reply(...)'s content, not a RecordDict of your own" in msg


# ------------------------------------------------------------------ 6. a run whose training loss explodes says so
START = {"w": np.zeros((2, 3), np.float32)}


def _round(s, server_round, losses, **metrics):
    from tests.helpers import NodesGrid, config, record, reply

    list(s.configure_train(server_round, record(START), config(), NodesGrid((1, 2, 3))))
    replies = [reply(i + 1, {"arrays": {"w": np.full((2, 3), 0.1, np.float32)}}, **{"train-loss": loss, **metrics})
               for i, loss in enumerate(losses)]
    return s.aggregate_train(server_round, replies)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "diverging" in r.getMessage()]


def test_exploding_training_loss_is_warned_naming_the_learning_rates(caplog):
    """The rule (flower_strategies.core.rounds.loss_alarm): in the first round, a mean client train loss above
    1.5 × the loss the clients started from; in any round, one above 10 × the lowest mean of an earlier round, or a
    non-finite train loss — warned with the client lr (and the server lr of methods that have one)."""
    set_task_identity()
    s = fs.FedAdam(client_lr=1.0)
    _round(s, 1, [12.0, 11.0, 13.0], **{"train-loss-first-batch": 2.3})  # local steps made the initial model worse
    (warn,) = _warnings(caplog)
    assert warn.startswith("Round 1: training is diverging: the clients' mean train loss 12 is 5.22 × the loss "
                           "they started from (train-loss-first-batch 2.3): local training made the initial model "
                           "worse. The learning rate is likely too high: client lr 1 (run-config client-lr")
    assert "server lr 0.01 (fedadam.server-lr)" in warn
    caplog.clear()
    _round(s, 2, [2.2, 2.1, 2.25], **{"train-loss-first-batch": 2.3})  # healthy
    _round(s, 3, [0.6, 0.7, 0.65], **{"train-loss-first-batch": 0.25})  # a rise within a later round: not judged
    assert _warnings(caplog) == []
    _round(s, 4, [7.0, 6.5, 7.5])  # 10 × the lowest earlier round's mean (0.65)
    (warn,) = _warnings(caplog)
    assert "mean train loss 7 is 10.8 × the lowest of the earlier rounds (0.65)" in warn
    caplog.clear()
    _round(s, 5, [2.0, float("nan"), 2.1])
    (warn,) = _warnings(caplog)
    assert "1 of 3 clients reported a non-finite train loss" in warn
    caplog.clear()
    from tests.helpers import NodesGrid, config, record, reply

    nan = fs.FedAdam(client_lr=1.0)  # a reply whose model holds NaN is rejected by the screen, and named here
    list(nan.configure_train(1, record(START), config(), NodesGrid((1, 2, 3))))
    nan.aggregate_train(1, [reply(i + 1, {"arrays": {"w": np.full((2, 3), v, np.float32)}}, **{"train-loss": 2.0})
                            for i, v in enumerate((0.1, float("nan"), 0.1))])
    (warn,) = _warnings(caplog)
    assert "1 replies were rejected for non-finite values (node 2: record 'arrays' key 'w' holds NaN/Inf)" in warn
    caplog.clear()
    plain = fs.FedAvg(client_lr=0.5)
    _round(plain, 1, [3.0, 3.2, 3.1], **{"train-loss-before": 1.9})  # fedadapt's own app reports loss-before
    (warn,) = _warnings(caplog)
    assert "train-loss-before 1.9" in warn and "client lr 0.5" in warn and "server lr 1 (fedavg.server-lr)" in warn


def test_a_diverging_quickstart_run_warns_and_a_sound_one_does_not(caplog, monkeypatch, tmp_path):
    """The quickstart-shaped app through the recipe: fedams at 10 × the app's lr blows up in round 1 (its replies
    carry the received model's first-batch loss) and the server warns naming the client lr; at its table factor
    it does not."""
    from pytorchapp import client_app as user_client

    read_digits_once(monkeypatch, sys.modules["pytorchapp.task"])
    for lr, diverges in ((1.0, True), (0.1 * fs.get_method("fedams").client_lr_factor, False)):
        caplog.clear()
        cfg = {"num-server-rounds": 1, "fraction-train": 1.0, "local-epochs": 1, "learning-rate": lr,
               "batch-size": 32, "method": "fedams", "output": str(tmp_path / "m.pt"), "fraction-evaluate": 0.0}
        grid = LoopbackGrid(user_client.app, 3, cfg)
        torch.manual_seed(0)
        user_server.main(grid, Context(run_id=1, node_id=0, state=RecordDict(), run_config=cfg, node_config={}))
        warned = _warnings(caplog)
        assert bool(warned) == diverges, warned
        if diverges:
            assert "train-loss-first-batch" in warned[0] and f"client lr {lr:g}" in warned[0]


def test_the_docs_legacy_server_snippet_runs_with_the_legacy_twin(monkeypatch):
    """docs/plugin.md's legacy server_fn (state_dict as initial arrays, num_rounds, the app's
    evaluate_metrics_aggregation_fn) runs under Flower's start_grid with examples/legacy_app's clients."""
    import re

    from flwr.server.compat import start_grid

    sys.path.insert(0, str(ROOT / "examples" / "legacy_app"))
    from legacyapp import client_app as legacy_client

    read_digits_once(monkeypatch, sys.modules["legacyapp.task"])
    doc = (ROOT / "docs" / "plugin.md").read_text()
    code = re.search(r"<!-- snippet: legacy server_fn -->\n```python\n(.*?)```", doc, re.S).group(1)
    namespace: dict = {}
    exec(compile(code.replace("from .task import Net", "from legacyapp.task import Net"), "plugin.md", "exec"),
         namespace)
    cfg = {"num-server-rounds": 2, "local-epochs": 1, "batch-size": 32, "method": "fedlada", "learning-rate": 0.05}
    parts = namespace["server_fn"](Context(run_id=1, node_id=0, state=RecordDict(), run_config=cfg, node_config={}))
    strategy = parts.strategy
    assert strategy.inner.num_rounds == 2 and parts.config.num_rounds == 2
    evaluations = []
    aggregate = strategy.aggregate_evaluate
    strategy.aggregate_evaluate = lambda *a: evaluations.append(aggregate(*a)) or evaluations[-1]
    start_grid(grid=LoopbackGrid(legacy_client.app, 2, cfg), strategy=strategy, config=parts.config)
    assert len(evaluations) == 2 and set(evaluations[-1][1]) == {"accuracy"}
    assert evaluations[-1][1]["accuracy"] > 0.5


def test_the_reply_carries_the_received_models_first_batch_loss_only_on_the_loader_path():
    """rnd.reply adds train-loss-first-batch (the received model's loss on the first batch rnd.loader yielded, on a
    copy: the trained model is untouched) when the loop iterated rnd.loader and gave train_loss; not otherwise."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 8, generator=gen), torch.randint(0, 4, (24,), generator=gen)
    model = Flat()
    with torch.no_grad():
        want = float(torch.nn.functional.cross_entropy(model(x[:8]), y[:8]))
    content = _content("fedavg", model, batch_size=8)
    rnd = fs.ClientRound(content, None, DictLoader(x, y, 8), torch.nn.functional.cross_entropy)
    loss, _ = _quickstart_loop(model, rnd.loader, 1, 0.5)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = rnd.reply(model, None, train_loss=loss)["metrics"]
    assert metrics["train-loss-first-batch"] == pytest.approx(want, rel=1e-6)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in trained.items())
    assert "train-loss-first-batch" not in rnd.reply(model, None)["metrics"]  # no train loss: nothing to compare
    own = fs.ClientRound(content, None, DictLoader(x, y, 8), torch.nn.functional.cross_entropy)
    list(own.batches())  # the app's own pass, not rnd.loader
    assert "train-loss-first-batch" not in own.reply(Flat(), None, train_loss=1.0)["metrics"]
    reply = fs.train_reply(Flat(), content, x, y, torch.nn.functional.cross_entropy)  # fedadapt's own loop
    assert "train-loss-first-batch" not in reply["metrics"] and "train-loss-before" in reply["metrics"]
