"""The user's ClientApp: one call to fedadapt's client half inside the usual @app.train()."""

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from flower_strategies import train_reply

from .task import load_partition, new_model

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    x, y = load_partition(pid, n)
    content = train_reply(new_model(), msg.content, x, y, torch.nn.functional.cross_entropy,
                          state=context.state, seed=0, client_key=pid)
    return Message(content=content, reply_to=msg)
