"""The user's ServerApp: the fedadapt strategy is used as-is (switch methods on the one marked line)."""

import json

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from flower_strategies import get_method

from .task import new_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    net = new_model()
    trainable = [n for n, _ in net.named_parameters()]
    method = str(context.run_config["method"])  # the one line that picks the method: any name in flower_strategies.METHODS
    strategy = get_method(method).build(client_lr=0.1, local_epochs=1, batch_size=32, seed=0, trainable_keys=trainable)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()),
                            num_rounds=int(context.run_config["num-server-rounds"]))
    out = str(context.run_config.get("output", ""))
    if out:
        losses = {r: float(m["train-loss"]) for r, m in result.train_metrics_clientapp.items()}
        with open(out, "w") as fh:
            json.dump({"method": strategy.method, "train-loss": losses}, fh)
