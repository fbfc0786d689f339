"""The same client as ``client_app.app`` for the legacy API: ``ClientApp(client_fn=…)`` returning a NumPyClient.

Every fedadapt method works through it (with :class:`flower_strategies.compat.legacy.LegacyStrategy` on the server);
the local optimizer and the round driver are the same code as in the Message-API ClientApp.
"""

from __future__ import annotations

from flwr.app import Context
from flwr.client import Client, ClientApp

from app_common.task import TASK_SPECS, build_model
from flower_strategies.compat.legacy import FedAdaptNumPyClient

from .node import client_data


def client_fn(context: Context) -> Client:
    fed, pid, x, y = client_data(context)
    model = build_model(fed.task, fed.seed, fed.synthetic_dim, fed.precision)
    return FedAdaptNumPyClient(
        model, x, y, TASK_SPECS[fed.task].loss_fn(), state=context.state, seed=fed.seed, client_key=pid
    ).to_client()


app = ClientApp(client_fn=client_fn)
