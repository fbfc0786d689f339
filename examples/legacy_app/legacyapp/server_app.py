"""The user's legacy ServerApp: the fedadapt strategy named by the run-config's `method` key, wrapped in
LegacyStrategy; every client also evaluates the global model on its own test split each round."""

import json

import torch
from flwr.app import Context
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

from flower_strategies import LegacyStrategy, strategy_from_run_config

from .task import Net


def server_fn(context: Context) -> ServerAppComponents:
    torch.manual_seed(0)
    net = Net()
    inner = strategy_from_run_config(context.run_config, names={"learning-rate": "client-lr"})
    out = str(context.run_config.get("output", ""))

    def record(server_round, arrays):
        if out and server_round > 0:
            with open(out, "w") as fh:
                json.dump({"method": inner.method, "round": server_round,
                           "train-loss": inner.history[-1].train_metrics.get("train-loss")}, fh)
        return None

    rounds = int(context.run_config["num-server-rounds"])
    initial = {k: v.numpy() for k, v in net.state_dict().items()}
    strategy = LegacyStrategy(inner, initial, evaluate_fn=record, num_rounds=rounds)
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))


app = ServerApp(server_fn=server_fn)
