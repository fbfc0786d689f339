"""The user's ClientApp."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from pytorchapp.task import Net, load_data
from pytorchapp.task import test as test_fn
from pytorchapp.task import train as train_fn

app = ClientApp()


@app.train()
def train(msg: Message, context: Context):
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    pid, n = context.node_config["partition-id"], context.node_config["num-partitions"]
    trainloader, _ = load_data(pid, n, context.run_config["batch-size"])
    train_loss = train_fn(model, trainloader, context.run_config["local-epochs"], msg.content["config"]["lr"], device)
    model_record = ArrayRecord(model.state_dict())
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(trainloader.dataset)})
    content = RecordDict({"arrays": model_record, "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    pid, n = context.node_config["partition-id"], context.node_config["num-partitions"]
    _, testloader = load_data(pid, n, context.run_config["batch-size"])
    loss, acc = test_fn(model, testloader, device)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": acc, "num-examples": len(testloader.dataset)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
