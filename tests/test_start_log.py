"""``FedAdaptStrategy.start`` logs what Flower's ``Strategy.start`` logs, line for line (the run's head, each round's
aggregated train and client evaluate MetricRecords, the central ``evaluate_fn`` MetricRecord, the final results):
both strategies run the same in-process app (a stock client with train and evaluate) and their loop's lines are
compared modulo numbers and timings."""

from __future__ import annotations

import logging
import re

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

import flower_strategies as fs
from simulations.engine.inprocess import LoopbackGrid

NODES, ROUNDS = 3, 2


def _client() -> ClientApp:
    """A stock Flower client: one gradient step towards its partition's target; evaluate replies loss and accuracy."""
    app = ClientApp()

    def target(context: Context) -> np.ndarray:
        return np.full(4, float(context.node_config["partition-id"]), np.float32)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        w = msg.content["arrays"]["w"].numpy()
        w = w - float(msg.content["config"]["lr"]) * (w - target(context))
        metrics = MetricRecord({"train_loss": float(np.mean((w - target(context)) ** 2)), "num-examples": 10})
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(w)}), "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        w = msg.content["arrays"]["w"].numpy()
        loss = float(np.mean((w - target(context)) ** 2))
        metrics = MetricRecord({"eval_loss": loss, "eval_acc": 1.0 / (1.0 + loss), "num-examples": 10})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def _central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    return MetricRecord({"central_loss": float(np.mean(arrays["w"].numpy() ** 2))})


def _loop_lines(caplog, strategy, files: tuple[str, ...]) -> list[str]:
    """The lines ``strategy.start`` logs from ``files`` (the round loop's modules), numbers masked."""
    caplog.clear()
    grid = LoopbackGrid(_client(), NODES, {})
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.start(grid=grid, initial_arrays=ArrayRecord({"w": Array(np.zeros(4, np.float32))}), num_rounds=ROUNDS,
                       train_config=ConfigRecord({"lr": 0.5}), evaluate_fn=_central)
    lines = [r.getMessage() for r in caplog.records if r.pathname.replace("\\", "/").endswith(files)]
    return [re.sub(r"\d+(\.\d+)?(e[-+]\d+)?", "#", line) for line in lines]


def _shape(lines: list[str]) -> tuple[list[str], list[set[str]]]:
    """The lines with every MetricRecord's contents cut (``{…}``), and each MetricRecord's keys in order; the final
    results' pretty-printed dicts (one or several lines each) count as one ``{…}`` line."""
    shape: list[str] = []
    keys: list[set[str]] = []
    for line in lines:
        inside = line.startswith(("\t{", "\t  "))
        if inside and line.startswith("\t  ") and shape and shape[-1] == "\t{…}":
            keys[-1] |= set(re.findall(r"'([^']+)': '?#", line))
            continue
        found = re.search(r"\{.*", line)
        if found and ("MetricRecord" in line or "results:" in line or inside):
            shape.append(line[:found.start()] + "{…}")
            keys.append(set(re.findall(r"'([^']+)': '?#", line)))
        else:
            shape.append(line)
    return shape, keys


def test_start_logs_flowers_lines(caplog):
    flower = _loop_lines(caplog, FedAvg(fraction_evaluate=1.0),
                         ("flwr/serverapp/strategy/strategy.py", "flwr/serverapp/strategy/strategy_utils.py"))
    ours = _loop_lines(caplog, fs.FedAvg(fraction_evaluate=1.0), ("flower_strategies/core/loop.py",))
    (flower_shape, flower_keys), (our_shape, our_keys) = _shape(flower), _shape(ours)
    assert our_shape == flower_shape
    # every MetricRecord Flower shows, with its keys (fedadapt's train record adds its counters: replies-used, …)
    assert len(our_keys) == len(flower_keys) == 1 + 3 * ROUNDS + 3  # initial, per round 3, final 3
    for theirs, mine in zip(flower_keys, our_keys, strict=True):
        assert theirs <= mine, (theirs, mine)
    for line in ("\t└──> Aggregated MetricRecord: {…}", "Global evaluation", "\t└──> MetricRecord: {…}",
                 "Final results:", "\tAggregated ClientApp-side Evaluate Metrics:"):
        assert our_shape.count(line) >= 1, line
    assert {"eval_loss", "eval_acc"} <= our_keys[2] and {"central_loss"} == our_keys[3]  # round 1's evaluations


def test_the_settings_line_says_the_apps_clients_decide(caplog):
    """Under ``start`` or any loop of a user's (a user's ServerApp, the user's ClientApp) the summary does not show
    fedadapt's client defaults as if they applied; fedadapt's ServerApp (its ClientApp trains as the settings say)
    shows the values."""
    from flower_strategies.core.loop import run_rounds

    def settings_line(run) -> str:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="flwr"):
            run(fs.FedAvg(fraction_evaluate=0.0), LoopbackGrid(_client(), NODES, {}),
                ArrayRecord({"w": Array(np.zeros(4, np.float32))}))
        (line,) = [r.getMessage() for r in caplog.records if "weighting" in r.getMessage()]
        return line

    apps = settings_line(lambda s, g, a: s.start(grid=g, initial_arrays=a, num_rounds=1,
                                                   train_config=ConfigRecord({"lr": 0.5})))
    assert apps == ("\t│\t└── client-side (the app decides): client-lr 0.5 sent as rnd.lr; rnd.loader yields "
                    "local-epochs 5 × ⌈n / batch-size 16⌉ batches of the app's loader; the clients' num-steps and "
                    "train-loss follow in each round's MetricRecord | weighting examples | seed 0")
    assert "| local-epochs 5 | batch-size 16" not in apps
    # a library user's own loop over the same strategy: still the app's clients (the default)
    assert settings_line(lambda s, g, a: run_rounds(s, g, a, 1, 60.0, train_config=ConfigRecord({"lr": 0.5}))) == apps

    def fedadapts_app(s, g, a):  # fedadapt's ServerApp (server_app.app.build) runs fedadapt's ClientApp
        s.apps_clients = False
        run_rounds(s, g, a, 1, 60.0, train_config=ConfigRecord({"lr": 0.5}))

    own = settings_line(fedadapts_app)
    assert own == ("\t│\t└── client-lr 0.5 | local-steps 0 | local-epochs 5 | batch-size 16 | weighting examples | "
                   "seed 0")


def test_fedadapts_serverapp_marks_its_clients_as_its_own():
    from server_app.app import build

    _, _, strategy = build({"method": "fedavg", "num-server-rounds": 1})
    assert strategy.apps_clients is False  # its summary shows client-lr / epochs / batch size as applied
    assert fs.FedAvg().apps_clients is True  # a library user's strategy: the app's clients decide
