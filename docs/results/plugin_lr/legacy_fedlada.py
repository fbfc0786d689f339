"""Legacy-API fedlada on examples/legacy_app through the whole-partition tensor path (the pre-loader way:
FedAdaptNumPyClient(model, x, y, loss_fn), the app's DataLoader and train() unused), 3 clients, 3 rounds.

    python docs/results/plugin_lr/legacy_fedlada.py SCALE LR     # SCALE multiplies the inputs (16 = raw pixels)
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import torch
from flwr.app import Context, RecordDict
from flwr.client import ClientApp
from flwr.server.compat import start_grid

from flower_strategies import FedAdaptNumPyClient
from simulations.engine.inprocess import LoopbackGrid

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "legacy_app"))
from legacyapp import server_app  # noqa: E402
from legacyapp.task import Net, load_data, test  # noqa: E402

SCALE, LR = float(sys.argv[1]), float(sys.argv[2])


def client_fn(context: Context):
    pid = int(context.node_config["partition-id"])
    pairs = load_data(pid, 3, 32)[0].dataset
    x = torch.stack([pairs[i][0] for i in range(len(pairs))]) * SCALE
    y = torch.stack([pairs[i][1] for i in range(len(pairs))])
    return FedAdaptNumPyClient(Net(), x, y, torch.nn.functional.cross_entropy, state=context.state,
                               client_key=pid).to_client()


logging.getLogger("flwr").setLevel(logging.WARNING)
cfg = {"num-server-rounds": 3, "method": "fedlada", "output": "", "local-epochs": 1, "learning-rate": LR,
       "batch-size": 32, "fraction-evaluate": 0.0}
parts = server_app.server_fn(Context(run_id=1, node_id=0, state=RecordDict(), run_config=cfg, node_config={}))
final = []
parts.strategy.evaluate_fn = lambda server_round, arrays: final.append(arrays) or None
start_grid(grid=LoopbackGrid(ClientApp(client_fn=client_fn), 3, cfg), strategy=parts.strategy, config=parts.config)
model = Net()
model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in final[-1].items()})
held_out = [[(xb * SCALE, yb) for xb, yb in load_data(p, 3, 64)[1]] for p in range(3)]
print(f"scale {SCALE:g} lr {LR:g}: accuracy {np.mean([test(model, d, 'cpu')[1] for d in held_out]):.3f}")
