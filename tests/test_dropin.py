"""Drop-in use from an existing Flower app (examples/pytorch_app: its own model, DataLoader, momentum SGD, device and
run-config names), driven in-process by the real ServerApp/ClientApp functions of that app; and the loud failure
when a method's client half is missing."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import flower_strategies as fs
from flower_strategies.core.strategy import ClientHalfMissing
from simulations.engine import LoopbackGrid

APP = Path(__file__).resolve().parent.parent / "examples" / "pytorch_app"
sys.path.insert(0, str(APP))
from pytorchapp import client_app as user_client  # noqa: E402
from pytorchapp import server_app as user_server  # noqa: E402
from pytorchapp.task import Net  # noqa: E402

RUN = {"num-server-rounds": 2, "fraction-train": 1.0, "local-epochs": 1, "learning-rate": 0.05, "batch-size": 32}


def run_user_app(tmp_path, method: str, client_app=user_client.app, nodes: int = 3, **extra):
    cfg = {**RUN, "method": method, "output": str(tmp_path / f"{method}.pt"), **extra}
    grid = LoopbackGrid(client_app, nodes, cfg)
    torch.manual_seed(0)  # the user's server builds its initial Net() from torch's global RNG
    user_server.main(grid, Context(run_id=1, node_id=0, state=RecordDict(), run_config=cfg, node_config={}))
    return torch.load(cfg["output"]), grid


@pytest.mark.parametrize("method", ["fedadam", "fedlada", "scaffold", "fedlamb"])
def test_user_app_trains_with_its_own_loader_and_loop(tmp_path, method):
    final, grid = run_user_app(tmp_path, method)
    torch.manual_seed(0)
    start = Net().state_dict()
    assert set(final) == set(start)
    moved = max(float((final[k] - start[k]).abs().max()) for k in final)
    assert moved > 1e-3 and all(bool(torch.isfinite(v).all()) for v in final.values())
    if method == "scaffold":  # the client control variate persisted in the node's Context.state
        assert any(k.startswith("fedadapt.") for k in grid.contexts[1].state.array_records)


def _stock_client() -> ClientApp:
    """A client that trains nothing special: returns its model and num-examples (what a stock Flower client does)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": 10})})
        return Message(content=content, reply_to=msg)

    return app


CLIENT_HALF = sorted(name for name, spec in fs.METHODS.items() if spec.build().needs_client_half)


def test_client_half_methods_are_the_expected_ones():
    expected = {"fedprox", "fedcm", "fedlada", "scaffold", "fedlamb", "fedda", "localupdate", "mimelite"}
    assert expected <= set(CLIENT_HALF)
    assert not {"fedavg", "fedadam", "fedyogi", "fedadagrad", "fedavgm", "adpfed"} & set(CLIENT_HALF)


@pytest.mark.parametrize("method", CLIENT_HALF)
def test_stock_client_makes_the_run_fail_with_the_fix(tmp_path, method):
    with pytest.raises(ClientHalfMissing, match="Fix: build the reply with flower_strategies.train_reply"):
        run_user_app(tmp_path, method, client_app=_stock_client(), nodes=2, **{"fraction-evaluate": 0.0})


def test_server_only_method_accepts_a_stock_client(tmp_path):
    final, _ = run_user_app(tmp_path, "fedadam", client_app=_stock_client(), nodes=2, **{"fraction-evaluate": 0.0})
    assert np.isfinite(np.concatenate([v.numpy().ravel() for v in final.values()])).all()
