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
from simulations.engine.inprocess import LoopbackGrid

APP = Path(__file__).resolve().parent.parent / "examples" / "pytorch_app"
sys.path.insert(0, str(APP))
from pytorchapp import client_app as user_client  # noqa: E402
from pytorchapp import server_app as user_server  # noqa: E402
from pytorchapp.task import Net  # noqa: E402

from tests.helpers import client_keys, read_digits_once  # noqa: E402



@pytest.fixture(autouse=True)
def _digits_once(monkeypatch):
    read_digits_once(monkeypatch, sys.modules["pytorchapp.task"])


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
    fix = r"Fix: build the reply with rnd.reply\(\.\.\.\): .*ClientRound\(msg.content, .*flower_strategies.train_reply"
    with pytest.raises(ClientHalfMissing, match=fix):
        run_user_app(tmp_path, method, client_app=_stock_client(), nodes=2, **{"fraction-evaluate": 0.0})


def test_server_only_method_accepts_a_stock_client(tmp_path):
    final, _ = run_user_app(tmp_path, "fedadam", client_app=_stock_client(), nodes=2, **{"fraction-evaluate": 0.0})
    assert np.isfinite(np.concatenate([v.numpy().ravel() for v in final.values()])).all()


# ------------------------------------------------------------------ one client loop: tensor partitions and loaders
class _Batches(list):
    """A minimal loader: a list of ``(x, y)`` batches with a ``.dataset`` to count."""

    def __init__(self, batches, n: int) -> None:
        super().__init__(batches)
        self.dataset = range(n)


def _linear_round(extra: dict | None = None):
    from flwr.app import ConfigRecord

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(40, 1, generator=gen, dtype=torch.float64)
    model = torch.nn.Linear(3, 1, bias=False).double()
    config = {"server-round": 2, "method": "fedavg", "client-lr": 0.1, "local-steps": 0, "local-epochs": 1,
              "batch-size": 8, **client_keys("fedavg"), **(extra or {})}
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": ConfigRecord(config)})
    return model, x, y, content, config


def _mse(pred, target):
    return torch.mean((pred - target) ** 2)


def _reply_metrics(model, content, *data, seed=4, client_key=7):
    import copy

    trained = copy.deepcopy(model)
    reply = fs.train_reply(trained, content, *data, _mse, seed=seed, client_key=client_key)
    return dict(reply["metrics"]), trained


def test_tensors_and_a_loader_with_the_same_batches_train_identically():
    """train_reply on whole-partition tensors and on a loader yielding the same seeded batches: the same loop, the
    same bits (model, train-loss, num-steps)."""
    from flower_strategies.core.client import batch_indices

    model, x, y, content, cfg = _linear_round()
    loader = _Batches([(x[i], y[i]) for i in map(torch.from_numpy, batch_indices(40, 8, 5, 4, 2, 7))], 40)
    m_t, model_t = _reply_metrics(model, content, x, y)
    m_l, model_l = _reply_metrics(model, content, loader)
    assert torch.equal(model_t.weight, model_l.weight)
    assert m_t["train-loss"] == m_l["train-loss"] and m_t["num-steps"] == m_l["num-steps"] == 5.0
    assert m_t["train-loss-before"] == pytest.approx(m_l["train-loss-before"], rel=1e-12)  # other summation order


def test_loss_before_max_examples_applies_to_tensors_and_loaders():
    """``loss-before-max-examples = m``: both paths average the received model's loss over the same seeded positions
    of one pass over their data (tensors: the partition's order; a loader: the order it yields)."""
    from flower_strategies.core.client import loss_before_sample

    model, x, y, content, cfg = _linear_round({"loss-before-max-examples": 6})
    sample = loss_before_sample(40, cfg, 4, 7)
    assert sample is not None and len(sample) == 6
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    xs, ys = x[perm], y[perm]
    loader = _Batches([(xs[s : s + 16], ys[s : s + 16]) for s in range(0, 40, 16)], 40)
    idx = torch.from_numpy(sample)
    with torch.no_grad():
        want_tensors = float(_mse(model(x[idx]), y[idx]))
        want_loader = float(_mse(model(xs[idx]), ys[idx]))
        everything = float(_mse(model(x), y))
    m_t, _ = _reply_metrics(model, content, x, y)
    m_l, _ = _reply_metrics(model, content, loader)
    assert m_t["train-loss-before"] == pytest.approx(want_tensors, rel=1e-12)
    assert m_l["train-loss-before"] == pytest.approx(want_loader, rel=1e-12)
    assert want_tensors != pytest.approx(everything, rel=1e-6) and want_loader != pytest.approx(everything, rel=1e-6)
    # the user's own loop gets the same estimate from ClientRound.loss_before
    rnd = fs.ClientRound(content, seed=4, client_key=7)
    assert rnd.loss_before(model, loader, _mse) == m_l["train-loss-before"]


def test_a_sampled_loss_before_stops_after_the_last_sampled_batch():
    from flower_strategies.core.client import loss_before_sample

    model, x, y, content, cfg = _linear_round({"loss-before-max-examples": 2})
    sample = loss_before_sample(40, cfg, 4, 7)
    pulled = []

    class Counting(_Batches):
        def __iter__(self):
            for i, b in enumerate(list.__iter__(self)):
                pulled.append(i)
                yield b

    loader = Counting([(x[s : s + 4], y[s : s + 4]) for s in range(0, 40, 4)], 40)
    fs.ClientRound(content, seed=4, client_key=7).loss_before(model, loader, _mse)
    assert max(pulled) == int(sample[-1]) // 4
