"""The user's legacy ClientApp: client_fn returns fedadapt's NumPyClient around the user's model and data."""

import torch
from flwr.app import Context
from flwr.client import ClientApp

from flower_strategies import FedAdaptNumPyClient

from .task import load_partition, new_model


def client_fn(context: Context):
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    x, y = load_partition(pid, n)
    return FedAdaptNumPyClient(new_model(), x, y, torch.nn.functional.cross_entropy,
                               state=context.state, seed=0, client_key=pid).to_client()


app = ClientApp(client_fn=client_fn)
