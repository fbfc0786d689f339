"""FedOpt baselines: reference equivalence (real Strategy + real ClientApp), Flower built-in equivalence, reductions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from flwr.serverapp import strategy as flwr_strategy

import flower_strategies as fs
from app_common.task import build_model
from flower_strategies.core.server_opt import ServerOptimizer
from simulations.engine.inprocess import simulate
from tests.helpers import NodesGrid, config, record, reply
from tests.reference import fedopt_ref

DIM, CLIENTS, ROUNDS = 5, 4, 10
RUN_CONFIG = {"task": "synthetic-linear", "seed": 0, "precision": "float64", "synthetic-dim": DIM}
W0 = 0.1 * np.arange(1, DIM + 1, dtype=np.float64)[None, :]


def initial_arrays() -> ArrayRecord:
    model = build_model("synthetic-linear", 0, DIM, "float64")
    with torch.no_grad():
        model.w.weight.copy_(torch.from_numpy(W0))
    return ArrayRecord(model.state_dict())


def run_ours(strategy, rounds=ROUNDS):
    snaps, _ = simulate(strategy, initial_arrays(), rounds, CLIENTS, RUN_CONFIG)
    return [s["w.weight"] for s in snaps]


PLAN = dict(client_lr=0.05, local_steps=3, batch_size=8)

CASES = [
    ("fedavg", fs.FedAvg(fs.FedAvg.make_hparams(server_lr=1.0), **PLAN), {}),
    ("fedavg", fs.FedAvg(fs.FedAvg.make_hparams(server_lr=0.7), **PLAN, weighting="uniform"),
     {"server_lr": 0.7, "weighting": "uniform"}),
    ("fedavgm", fs.FedAvgM(fs.FedAvgM.make_hparams(server_lr=0.5, beta1=0.9), **PLAN),
     {"server_lr": 0.5, "momentum": 0.9}),
    ("fedadagrad", fs.FedAdagrad(fs.FedAdagrad.make_hparams(server_lr=0.05, tau=1e-2), **PLAN),
     {"server_lr": 0.05, "tau": 1e-2}),
    ("fedadam", fs.FedAdam(fs.FedAdam.make_hparams(server_lr=0.05, tau=1e-2), **PLAN),
     {"server_lr": 0.05, "tau": 1e-2}),
    ("fedyogi", fs.FedYogi(fs.FedYogi.make_hparams(server_lr=0.05, tau=1e-2, initial_v=0.5), **PLAN),
     {"server_lr": 0.05, "tau": 1e-2, "v0": 0.5}),
    ("fedprox", fs.FedProx(fs.FedProx.make_hparams(mu=0.5), **PLAN), {"mu": 0.5}),
    ("fedadam", fs.FedAdam(fs.FedAdam.make_hparams(server_lr=0.05, tau=1e-2), **PLAN, fraction_train=0.5),
     {"server_lr": 0.05, "tau": 1e-2, "fraction": 0.5}),
]


@pytest.mark.parametrize("kind,strategy,ref_kwargs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_matches_float64_reference_over_10_rounds(kind, strategy, ref_kwargs):
    ours = run_ours(strategy)
    ref = fedopt_ref.run(kind, rounds=ROUNDS, num_clients=CLIENTS, dim=DIM, seed=0, w0=W0, **PLAN, **ref_kwargs)
    assert len(ours) == len(ref) == ROUNDS + 1
    moved = np.abs(ref[-1] - ref[0]).max()
    assert moved > 1e-2, "the test must exercise real updates"
    for t, (a, b) in enumerate(zip(ours, ref, strict=True)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=f"round {t}")


def test_fedavgm_momentum_zero_is_fedavg():
    a = run_ours(fs.FedAvgM(fs.FedAvgM.make_hparams(beta1=0.0), **PLAN))
    b = run_ours(fs.FedAvg(**PLAN))
    np.testing.assert_allclose(a[-1], b[-1], rtol=0, atol=1e-12)


def test_fedprox_mu_zero_is_fedavg():
    a = run_ours(fs.FedProx(fs.FedProx.make_hparams(mu=0.0), **PLAN))
    b = run_ours(fs.FedAvg(**PLAN))
    np.testing.assert_allclose(a[-1], b[-1], rtol=0, atol=1e-12)
    c = run_ours(fs.FedProx(fs.FedProx.make_hparams(mu=1.0), **PLAN))
    assert np.abs(c[-1] - b[-1]).max() > 1e-4  # and μ > 0 really changes the run


# ------------------------------------------------------------------ Flower built-ins on identical replies
def _replies(rng, keys, rnd):
    out = []
    for node in (1, 2, 3):
        arrays = {k: rng.normal(size=s).astype(np.float32) for k, s in keys.items()}
        out.append(reply(node, {"arrays": arrays}, num_examples=10 * node + rnd))
    return out


BUILTIN = [
    (lambda: flwr_strategy.FedAvg(), lambda: fs.FedAvg()),
    (lambda: flwr_strategy.FedAvgM(server_learning_rate=0.7, server_momentum=0.9),
     lambda: fs.FedAvgM(fs.FedAvgM.make_hparams(server_lr=0.7, beta1=0.9))),
    (lambda: flwr_strategy.FedAdagrad(eta=0.1, tau=1e-3),
     lambda: fs.FedAdagrad(fs.FedAdagrad.make_hparams(server_lr=0.1, tau=1e-3, beta1=0.0, initial_v=0.0))),
    (lambda: flwr_strategy.FedAdam(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3),
     lambda: fs.FedAdam(fs.FedAdam.make_hparams(server_lr=0.1, tau=1e-3, initial_v=0.0, bias_correction="flower"))),
    (lambda: flwr_strategy.FedYogi(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3),
     lambda: fs.FedYogi(fs.FedYogi.make_hparams(server_lr=0.01, tau=1e-3, initial_v=0.0))),
]


@pytest.mark.parametrize("make_flwr,make_ours", BUILTIN, ids=["fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi"])
def test_same_global_model_as_flower_builtin(make_flwr, make_ours):
    keys = {"w": (3, 4), "b": (4,)}
    rng = np.random.default_rng(1)
    start = {k: rng.normal(size=s).astype(np.float32) for k, s in keys.items()}
    grid = NodesGrid([1, 2, 3])
    theirs, ours = make_flwr(), make_ours()
    arr_t = arr_o = record(start)
    for rnd in range(1, 5):
        replies = _replies(np.random.default_rng(rnd), keys, rnd)
        list(theirs.configure_train(rnd, arr_t, config(), grid))
        list(ours.configure_train(rnd, arr_o, config(), grid))
        arr_t, _ = theirs.aggregate_train(rnd, replies)
        arr_o, _ = ours.aggregate_train(rnd, replies)
        for k in keys:
            np.testing.assert_allclose(arr_o[k].numpy(), arr_t[k].numpy(), rtol=0, atol=1e-6,
                                       err_msg=f"round {rnd} {k}")
        assert np.abs(arr_o["w"].numpy() - start["w"]).max() > 1e-3


# ------------------------------------------------------------------ server optimizer closed forms
def test_adam_first_step_is_lr_times_sign_with_bias_correction_and_no_eps():
    opt = ServerOptimizer("adam", lr=0.3, beta1=0.9, beta2=0.999, tau=0.0, initial_v=0.0, bias_correction="adam")
    x = {"w": np.array([1.0, -2.0, 0.5])}
    d = {"w": np.array([0.2, -5.0, 1e-3])}
    new, state = opt.step(x, d, opt.init(x), step=1, server_round=1)
    np.testing.assert_allclose(new["w"], x["w"] - 0.3 * np.sign(d["w"]), atol=1e-12)
    np.testing.assert_allclose(state["v_t"]["w"], 0.001 * d["w"] ** 2, atol=1e-15)


def test_yogi_and_adam_agree_on_first_step_from_zero_v():
    x = {"w": np.array([1.0, 2.0])}
    d = {"w": np.array([0.5, -0.25])}
    outs = []
    for kind in ("adam", "yogi"):
        opt = ServerOptimizer(kind, lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3, initial_v=0.0)
        outs.append(opt.step(x, d, opt.init(x), step=1, server_round=1)[0]["w"])
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-15)
    expected = x["w"] - 0.1 * 0.1 * d["w"] / (np.sqrt(0.01) * np.abs(d["w"]) + 1e-3)
    np.testing.assert_allclose(outs[0], expected, atol=1e-12)


def test_default_v0_is_tau_squared():
    opt = ServerOptimizer("adagrad", tau=0.02)
    assert opt.init({"w": np.zeros(2)})["v_t"]["w"].tolist() == [0.02**2] * 2


def test_server_math_only_on_trainable_floats_buffers_averaged_ints_kept():
    strat = fs.FedAdam(fs.FedAdam.make_hparams(server_lr=0.1), trainable_keys=["w"])
    start = {"w": np.ones(3, np.float32), "bn.running_mean": np.zeros(3, np.float32),
             "bn.num_batches_tracked": np.array(7, np.int64)}
    grid = NodesGrid([1, 2])
    list(strat.configure_train(1, record(start), config(), grid))
    replies = [
        reply(1, {"arrays": {"w": np.full(3, 2.0, np.float32), "bn.running_mean": np.full(3, 1.0, np.float32),
                             "bn.num_batches_tracked": np.array(100, np.int64)}}, num_examples=1),
        reply(2, {"arrays": {"w": np.full(3, 3.0, np.float32), "bn.running_mean": np.full(3, 4.0, np.float32),
                             "bn.num_batches_tracked": np.array(200, np.int64)}}, num_examples=3),
    ]
    out, _ = strat.aggregate_train(1, replies)
    np.testing.assert_allclose(out["bn.running_mean"].numpy(), np.full(3, 3.25), atol=1e-6)  # (1·1 + 3·4)/4
    assert int(out["bn.num_batches_tracked"].numpy()) == 7
    d = 1.0 - 2.75  # descent-positive pseudo-gradient, weighted mean of w = 2.75
    m, v = 0.1 * d, 0.99 * 1e-6 + 0.01 * d * d
    np.testing.assert_allclose(out["w"].numpy(), np.full(3, 1.0 - 0.1 * m / (np.sqrt(v) + 1e-3)), atol=1e-6)


# ------------------------------------------------------------------ the server step is pure
@pytest.mark.parametrize("kind", ["sgd", "sgdm", "adagrad", "adam", "yogi"])
def test_step_leaves_its_inputs_untouched_even_when_a_key_overflows(kind):
    """float32 D̄² overflows in the last key: the step returns the non-finite values (for the strategy base to
    refuse) in new arrays; the model, the pseudo-gradient and every state array stay as they were."""
    opt = ServerOptimizer(kind, lr=0.1, beta1=0.9)
    x = {"a": np.ones(70_000, np.float32), "z": np.ones(4, np.float32)}
    state = opt.init(x)
    d = {"a": np.full(70_000, 0.5, np.float32), "z": np.array([1.0, 3e20, 1.0, 1.0], np.float32)}
    before = [{k: v.copy() for k, v in arrs.items()} for arrs in (x, d, *state.values())]
    new, new_state = opt.step(x, d, state, step=1, server_round=1)
    for was, now in zip(before, (x, d, *state.values()), strict=True):
        for k in was:
            assert np.array_equal(was[k], now[k]), k
    if "v_t" in new_state:
        assert not np.isfinite(new_state["v_t"]["z"]).all()
    assert all(new[k].dtype == np.float32 for k in x)


def test_strategy_keeps_model_and_state_when_the_server_update_overflows():
    strat = fs.FedAdam(fs.FedAdam.make_hparams(server_lr=0.1), update_norm_ratio=0.0, min_available_nodes=1,
                       min_train_nodes=2)
    grid = NodesGrid([1, 2])
    start = {"w": np.ones(3, np.float32)}
    list(strat.configure_train(1, record(start), config(), grid))
    ok = [reply(n, {"arrays": {"w": np.full(3, 0.5, np.float32)}}) for n in (1, 2)]
    out1, _ = strat.aggregate_train(1, ok)
    assert out1 is not None
    saved = {name: {k: v.copy() for k, v in arrs.items()} for name, arrs in strat.server_state.items()}
    list(strat.configure_train(2, out1, config(), grid))
    huge = [reply(n, {"arrays": {"w": np.array([1.0, -3e20, 1.0], np.float32)}}) for n in (1, 2)]  # finite, D̄² = inf
    out2, metrics = strat.aggregate_train(2, huge)
    assert out2 is None and metrics["replies-used"] == 2  # refused: the previous model stays
    for name, arrs in saved.items():
        for k, v in arrs.items():
            assert np.array_equal(strat.server_state[name][k], v)  # and the previous state, bit for bit
    assert strat.num_updates == 1
