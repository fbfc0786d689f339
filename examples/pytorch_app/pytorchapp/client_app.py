"""The user's ClientApp."""

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flower_strategies import ClientRound

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
    rnd = ClientRound(msg.content, context.state, trainloader, torch.nn.functional.cross_entropy)
    opt = rnd.optimizer(model) if rnd.needs_client_half else None  # None: the app's own SGD with momentum
    train_loss = train_fn(model, rnd.loader, context.run_config["local-epochs"], rnd.lr, device, optimizer=opt)
    content = rnd.reply(model, opt, train_loss=train_loss)
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
