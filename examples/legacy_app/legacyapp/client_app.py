"""The user's legacy ClientApp: client_fn returns fedadapt's NumPyClient around the user's model, DataLoaders,
training loop and test."""

import torch
from flwr.app import Context
from flwr.client import ClientApp

from flower_strategies import FedAdaptNumPyClient

from .task import Net, load_data, test, train


def client_fn(context: Context):
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    trainloader, testloader = load_data(pid, n, int(context.run_config["batch-size"]))
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    epochs = int(context.run_config["local-epochs"])

    def evaluate(model):
        loss, accuracy = test(model, testloader, device)
        return loss, len(testloader.dataset), {"accuracy": accuracy}

    return FedAdaptNumPyClient(
        Net(), trainloader, torch.nn.functional.cross_entropy, state=context.state, client_key=pid,
        train=lambda model, loader, lr, optimizer: train(model, loader, epochs, lr, device, optimizer),
        evaluate_fn=evaluate,
    ).to_client()


app = ClientApp(client_fn=client_fn)
