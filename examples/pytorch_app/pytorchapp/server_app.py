"""The user's ServerApp."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flower_strategies import FedAdam

from pytorchapp.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    lr = context.run_config["learning-rate"]
    global_model = Net()
    strategy = FedAdam(fraction_train=context.run_config["fraction-train"])
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(global_model.state_dict()),
                            train_config=ConfigRecord({"lr": lr}), num_rounds=context.run_config["num-server-rounds"])
    torch.save(result.arrays.to_torch_state_dict(), context.run_config.get("output", "final_model.pt"))
