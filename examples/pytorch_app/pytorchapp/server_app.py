"""The user's ServerApp."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flower_strategies import strategy_from_run_config

from pytorchapp.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    lr = context.run_config["learning-rate"]
    global_model = Net()
    strategy = strategy_from_run_config(context.run_config, names={"learning-rate": "client-lr"})
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(global_model.state_dict()),
                            train_config=ConfigRecord({"lr": lr}), num_rounds=context.run_config["num-server-rounds"])
    torch.save(result.arrays.to_torch_state_dict(), context.run_config.get("output", "final_model.pt"))
