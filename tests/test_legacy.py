"""Legacy API (NumPyClient + flwr.server.strategy) ⇔ Message API: same math, same global model, for every method."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

import flower_strategies as fs
from app_common.task import build_model
from flower_strategies.core import records as R
from flower_strategies.compat.legacy import LAYOUT, LegacyStrategy, pack, unpack
from flower_strategies.core.registry import METHODS
from flower_strategies.core.loop import own_loop_config
from simulations.engine.inprocess import simulate, simulate_legacy
from tests.helpers import every_method

RUN_CONFIG = {"task": "synthetic-linear", "seed": 2, "precision": "float64", "synthetic-dim": 4}


def _model():
    m = build_model("synthetic-linear", 0, 4, "float64")
    with torch.no_grad():
        m.w.weight.copy_(torch.tensor([[0.3, -0.2, 0.1, 0.5]], dtype=torch.float64))
    return m


def _strategy(name):
    return METHODS[name].build(client_lr=0.02, local_steps=3, batch_size=8, fraction_train=0.5, min_train_nodes=2,
                                  seed=5)


@pytest.mark.parametrize("name", every_method())
def test_legacy_and_message_api_give_the_same_global_model(name):
    model = _model()
    s_msg, s_leg = _strategy(name), _strategy(name)
    msg, _ = simulate(s_msg, ArrayRecord(model.state_dict()), 3, 5, RUN_CONFIG)
    leg, _ = simulate_legacy(s_leg, {k: v.numpy() for k, v in model.state_dict().items()}, 3, 5, RUN_CONFIG)
    assert len(msg) == len(leg) == 4
    assert np.abs(msg[-1]["w.weight"] - msg[0]["w.weight"]).max() > 1e-4, "the model must move"
    # what each round used, for a failure's message (a known flake under heavy load is ~0.02 apart: not a rounding
    # effect, rounding-level perturbations of a reply stay at rounding level here, so a round's inputs differed)
    rounds = {path: [(h.server_round, h.sampled, h.replies_used, h.rejections) for h in s.history]
              for path, s in (("message", s_msg), ("legacy", s_leg))}
    for t, (a, b) in enumerate(zip(msg, leg, strict=True)):
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-6, err_msg=f"{name} round {t} {k}; {rounds}")


def test_layout_round_trip_and_mismatch():
    recs = {"arrays": {"w": np.ones((2, 2)), "b": np.zeros(2)}, "momentum": {"w": np.full((2, 2), 3.0)}}
    arrays, layout = pack(recs)
    assert len(arrays) == 3 and '["momentum", "w"]' in layout
    back = unpack(arrays, layout)
    assert back.keys() == recs.keys() and np.array_equal(back["momentum"]["w"], recs["momentum"]["w"])
    with pytest.raises(ValueError, match="layout lists 3 arrays but 2"):
        unpack(arrays[:2], layout)


class _Proxy:
    def __init__(self, node_id):
        self.node_id, self.cid = node_id, str(node_id)


def test_legacy_replies_without_layout_or_with_failures_are_rejected_not_fatal():
    init = {"w": np.zeros(3, np.float32)}
    strat = LegacyStrategy(fs.FedAvg(min_available_nodes=1, min_train_nodes=1), init)
    strat.inner.prepare_round(1, R.to_record(init), own_loop_config(), 3)
    good_arrays, layout = pack({"arrays": {"w": np.ones(3, np.float32)}})
    ok = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(good_arrays), 5, {LAYOUT: layout, "num-examples": 5})
    no_layout = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(good_arrays), 5, {})
    params, metrics = strat.aggregate_fit(1, [(_Proxy(1), ok), (_Proxy(2), no_layout)], [RuntimeError("lost")])
    assert metrics["replies-used"] == 1 and metrics["replies-rejected"] == 2
    assert parameters_to_ndarrays(params)[0].tolist() == [1.0, 1.0, 1.0]


def test_configure_fit_does_not_idle_when_enough_clients_are_available():
    """Under start_grid the client manager learns about nodes only when a wrapped method (num_available, all,
    sample) is called or every 5 s; configure_fit asks num_available() first, so it never idles in wait_for."""
    class Manager:
        def __init__(self):
            self.proxies = {str(i): _Proxy(i) for i in (1, 2, 3)}

        def num_available(self):
            return len(self.proxies)

        def wait_for(self, num_clients, timeout):
            raise AssertionError("wait_for called although enough clients are available")

        def all(self):
            return self.proxies

    init = {"w": np.zeros(3, np.float32)}
    strat = LegacyStrategy(fs.FedAvg(min_available_nodes=2, min_train_nodes=2), init)
    pairs = strat.configure_fit(1, strat.initialize_parameters(None), Manager())
    assert sorted(p.node_id for p, _ in pairs) == [1, 2, 3]


def test_legacy_client_side_evaluation_runs_the_numpyclients_evaluate_fn():
    """``fraction_evaluate > 0`` asks the sampled NumPyClients to evaluate; their ``evaluate_fn`` runs and the results
    are aggregated (example-weighted), as with Flower's own strategies."""
    from flwr.app import Context
    from flwr.client import ClientApp
    from flwr.server import ServerConfig
    from flwr.server.compat import start_grid

    from client_app.node import client_data
    from flower_strategies.compat.legacy import FedAdaptNumPyClient
    from simulations.engine.inprocess import LoopbackGrid

    calls: list[int] = []

    def evaluate_fn(model):
        calls.append(1)
        return 0.5, 10, {"accuracy": 0.75}

    def client_fn(context: Context):
        fed, pid, x, y = client_data(context)
        return FedAdaptNumPyClient(build_model("synthetic-linear", 0, 4, "float64"), x, y, torch.nn.functional.mse_loss,
                                   state=context.state, client_key=pid, evaluate_fn=evaluate_fn).to_client()

    strategy = METHODS["fedavg"].build(client_lr=0.02, local_steps=3, batch_size=8, fraction_evaluate=0.5,
                                       min_evaluate_nodes=2, seed=5)
    legacy = LegacyStrategy(strategy, {k: v.numpy() for k, v in _model().state_dict().items()}, num_rounds=2)
    grid = LoopbackGrid(ClientApp(client_fn=client_fn), 4, RUN_CONFIG)
    history = start_grid(grid=grid, strategy=legacy, config=ServerConfig(num_rounds=2))
    assert len(calls) == 4  # 2 of 4 clients per round, 2 rounds
    assert history.losses_distributed == [(1, 0.5), (2, 0.5)]
    assert history.metrics_distributed["accuracy"] == [(1, 0.75), (2, 0.75)]
