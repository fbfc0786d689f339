"""The user's legacy ServerApp: the fedadapt strategy is wrapped in LegacyStrategy (switch methods on the marked
line)."""

import json

from flwr.app import Context
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

from flower_strategies import LegacyStrategy, get_method

from .task import new_model


def server_fn(context: Context) -> ServerAppComponents:
    net = new_model()
    trainable = [n for n, _ in net.named_parameters()]
    # the one line that picks the method: any name in flower_strategies.METHODS
    method = str(context.run_config["method"])
    inner = get_method(method).build(client_lr=0.1, local_epochs=1, batch_size=32, seed=0, trainable_keys=trainable)
    out = str(context.run_config.get("output", ""))

    def record(server_round, arrays):
        if out and server_round > 0:
            with open(out, "w") as fh:
                json.dump({"method": method, "round": server_round,
                           "train-loss": inner.history[-1].train_metrics.get("train-loss")}, fh)
        return None

    rounds = int(context.run_config["num-server-rounds"])
    initial = {k: v.numpy() for k, v in net.state_dict().items()}
    strategy = LegacyStrategy(inner, initial, evaluate_fn=record, num_rounds=rounds)
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))


app = ServerApp(server_fn=server_fn)
