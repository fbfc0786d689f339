"""MimeLite (baseline of paper 001): real Strategy + real ClientApp vs the float64 reference, a FedAvg reduction,
unit tests of the frozen-statistics step and the server math, a mocked-reply protocol test, the optimizer in a
plain torch loop vs ``train_reply``, a mid-round ``state_dict`` round-trip and misuse errors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

import flower_strategies.methods.mimelite as ml
from app_common.task import TASK_SPECS, build_model
from flower_strategies.core.client import batch_indices, train_reply
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.registry import METHODS, build_strategy
from flower_strategies.core.strategy import RoundInputs
from flower_strategies.methods.baselines import FedAvg
from flower_strategies.core.loop import own_loop_config
from tests.helpers import NodesGrid, record, reply
from tests.reference import fedda_ref as ref

# The paper-001 harness is shared with tests/test_fedda.py.
from tests.test_fedda import BATCH, CLIENT_LR, DIM, SEED, STEPS, W0, client_data, max_err, run_sim  # noqa: E402


def model_at(w: np.ndarray = W0) -> torch.nn.Module:
    model = build_model("synthetic-linear", SEED, DIM, "float64")
    with torch.no_grad():
        model.w.weight.copy_(torch.from_numpy(np.asarray(w, np.float64)))
    return model


def _strategy(base: str, frac: float = 1.0, weighting: str | None = None, **kw):
    hp = ml.MimeLiteHParams(base=base, **kw)
    return ml.MimeLite(hp, client_lr=CLIENT_LR, local_steps=STEPS, batch_size=BATCH, fraction_train=frac, seed=SEED,
                       weighting=weighting)


@pytest.mark.parametrize("frac,weighting", [(1.0, "examples"), (0.5, "examples"), (1.0, "uniform")])
@pytest.mark.parametrize("base,kw", [
    ("sgdm", {}),
    ("sgdm", {"server_lr": 1.5, "beta1": 0.7}),
    ("adam", {"eps": 0.01}),
    ("adagrad", {"eps": 0.01}),
])
def test_matches_reference(base, kw, frac, weighting):
    strategy = _strategy(base, frac, weighting, **kw)
    got, sampled = run_sim(strategy)
    cfg = dict(base=base, client_lr=CLIENT_LR, local_steps=STEPS, batch_size=BATCH, seed=SEED, weighting=weighting,
               beta1=kw.get("beta1", 0.9), beta2=0.99, eps=kw.get("eps", 1e-3), server_lr=kw.get("server_lr", 1.0))
    want = ref.mimelite_reference(W0, client_data(), sampled, cfg)
    assert max_err(got, want) < 1e-6
    assert np.abs(want[-1] - want[0]).max() > 1e-2
    if frac < 1.0:
        assert len({tuple(s) for s in sampled}) > 1


def test_sgdm_beta0_is_fedavg():
    """β1 = 0: the frozen momentum has no effect ⇒ FedAvg (server lr η_g)."""
    kw = dict(client_lr=CLIENT_LR, local_steps=STEPS, batch_size=BATCH, seed=SEED)
    got, _ = run_sim(ml.MimeLite(ml.MimeLiteHParams(base="sgdm", beta1=0.0, server_lr=1.3), **kw))
    want, _ = run_sim(FedAvg(FedAvg.make_hparams(server_lr=1.3), **kw))
    assert max_err(got, want) < 1e-12


def test_server_statistics_track_full_gradient():
    """The server momentum is the EMA of the clients' mean full gradients at x_t (never of local steps)."""
    s = _strategy("adam")
    got, _ = run_sim(s, rounds=3)
    data = client_data()
    m = v = np.zeros((1, W0.shape[1]))
    for x in got[:3]:
        g = ref.global_grad(x, data)
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
    np.testing.assert_allclose(s.server_state[ml.MOMENTUM]["w.weight"], m, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(s.server_state[ml.SECOND_MOMENT]["w.weight"], v, rtol=1e-9, atol=1e-14)


# ------------------------------------------------------------------------------------------ unit tests
@pytest.mark.parametrize("base", ml.BASES)
def test_optimizer_step_uses_frozen_statistics(base):
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    m = torch.tensor([0.3, -0.1], dtype=torch.float64)
    v = torch.tensor([0.2, 0.5], dtype=torch.float64)
    opt = ml.MimeLiteOptimizer(
        [("w", p)], lr=0.1, downlink={ml.MOMENTUM: {"w": m.clone()}, ml.SECOND_MOMENT: {"w": v.clone()}},
        full_gradient={"w": torch.tensor([9.0, 9.0], dtype=torch.float64)}, base=base, beta1=0.8, beta2=0.9, eps=0.01,
    )
    assert opt.needs_full_gradient and opt.sends_model
    x = p.detach().clone()
    for g in ([1.0, 2.0], [-3.0, 0.5]):  # two steps: the statistics stay frozen
        gt = torch.tensor(g, dtype=torch.float64)
        p.grad = gt.clone()
        opt.step()
        if base == "sgdm":
            d = 0.2 * gt + 0.8 * m
        elif base == "adam":
            d = (0.2 * gt + 0.8 * m) / (torch.sqrt(0.1 * gt * gt + 0.9 * v) + 0.01)
        else:
            d = gt / (torch.sqrt(v + gt * gt) + 0.01)
        x = x - 0.1 * d
        assert torch.allclose(p.data, x, rtol=1e-12)
    up = opt.uplink()
    assert torch.equal(up[ml.FULL_GRADIENT]["w"], torch.tensor([9.0, 9.0], dtype=torch.float64))


def _server_update(base: str, x, y, g, state, **hp):
    s = ml.MimeLite(ml.MimeLiteHParams(base=base, **hp))
    # the round's aggregates and the state belong to the strategy (server_update writes into them): pass copies
    copy = lambda d: {k: np.array(v) for k, v in d.items()}  # noqa: E731
    inputs = RoundInputs(server_round=1, current=x, aggregates={"arrays": copy(y), ml.FULL_GRADIENT: copy(g)},
                         reply_metrics=(), mean_steps=1.0, trainable=tuple(x), num_updates=0, nodes_seen=1)
    new, new_state, metrics = s.server_update(inputs, {r: copy(state[r]) for r in ml.STATISTICS[base]})
    assert metrics == {} and set(new_state) == set(ml.STATISTICS[base])
    return new, new_state


def test_server_step_by_hand():
    x = {"a": np.array([1.0, 2.0])}
    y = {"a": np.array([0.0, 4.0])}
    g = {"a": np.array([1.0, -2.0])}
    m = {"a": np.array([0.5, 0.5])}
    v = {"a": np.array([1.0, 1.0])}
    state = {ml.MOMENTUM: m, ml.SECOND_MOMENT: v}
    new, s2 = _server_update("adam", x, y, g, state, server_lr=0.5, beta1=0.9, beta2=0.99)
    np.testing.assert_allclose(new["a"], [0.5, 3.0])
    np.testing.assert_allclose(s2[ml.MOMENTUM]["a"], 0.9 * m["a"] + 0.1 * g["a"])
    np.testing.assert_allclose(s2[ml.SECOND_MOMENT]["a"], 0.99 * v["a"] + 0.01 * g["a"] ** 2)
    _, s3 = _server_update("adagrad", x, y, g, state)
    np.testing.assert_allclose(s3[ml.SECOND_MOMENT]["a"], v["a"] + g["a"] ** 2)
    _, s4 = _server_update("sgdm", x, y, g, state, beta1=0.5)
    np.testing.assert_allclose(s4[ml.MOMENTUM]["a"], [0.75, -0.75])


def test_registry():
    assert METHODS["mimelite"].local_optimizer is ml.MimeLiteOptimizer
    s, _ = build_strategy({"method": "mimelite", "mimelite.base": "adam", "mimelite.eps": 0.1})
    assert isinstance(s, ml.MimeLite) and s.hparams.base == "adam" and s.hparams.eps == 0.1
    with pytest.raises(ConfigError, match="mimelite.base"):
        build_strategy({"method": "mimelite", "mimelite.base": "rmsprop"})


@pytest.mark.parametrize("base", ml.BASES)
def test_protocol_with_mocked_replies(base):
    records = set(ml.STATISTICS[base])
    grid = NodesGrid([1, 2, 3])
    s = ml.MimeLite(ml.MimeLiteHParams(base=base, beta1=0.5, beta2=0.5), client_lr=0.1, seed=0)
    w = np.array([[1.0, -1.0]], dtype=np.float32)
    msgs = list(s.configure_train(1, record({"w": w}), own_loop_config(), grid))
    c = msgs[0].content
    assert set(c.array_records) == {"arrays"} | records
    cfg = c.config_records["config"]
    assert (cfg["mimelite.base"], cfg["mimelite.beta1"], cfg["mimelite.beta2"]) == (base, 0.5, 0.5)
    assert "mimelite.server-lr" not in cfg  # server-only
    y1, y2 = np.array([[0.0, 0.0]], np.float32), np.array([[2.0, 2.0]], np.float32)
    g1, g2 = np.array([[1.0, 1.0]], np.float32), np.array([[3.0, -1.0]], np.float32)
    replies = [
        reply(1, {"arrays": {"w": y1}, ml.FULL_GRADIENT: {"w": g1}}, num_examples=30),
        reply(2, {"arrays": {"w": y2}, ml.FULL_GRADIENT: {"w": g2}}, num_examples=10),
        reply(3, {"arrays": {"w": y2}}, num_examples=10),  # no full gradient → rejected
    ]
    arrays, metrics = s.aggregate_train(1, replies)
    assert metrics["replies-used"] == 2 and metrics["replies-rejected"] == 1
    np.testing.assert_allclose(arrays["w"].numpy(), [[0.5, 0.5]])
    g_bar = np.array([[1.5, 0.5]])
    if base != "adagrad":
        np.testing.assert_allclose(s.server_state[ml.MOMENTUM]["w"], 0.5 * g_bar)
    if base != "sgdm":
        np.testing.assert_allclose(s.server_state[ml.SECOND_MOMENT]["w"], (0.5 if base == "adam" else 1.0) * g_bar**2)
    msgs = list(s.configure_train(2, arrays, own_loop_config(), grid))
    for rec in records:
        got = msgs[0].content.array_records[rec]["w"].numpy()
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, s.server_state[rec]["w"], rtol=1e-6)


# ------------------------------------------------------------------------------------------ the optimizer on its own
LOSS = TASK_SPECS["synthetic-linear"].loss_fn()
PID = 1


def _round_content(base: str):
    """Round 2's train content of a MimeLite strategy whose (non-zero) statistics come from one real round."""
    s = _strategy(base, beta1=0.7, beta2=0.9, eps=0.05)
    run_sim(s, rounds=1)
    return s.prepare_round(2, ArrayRecord(model_at().state_dict()), own_loop_config(), num_sampled=1)


def _data():
    a, y = client_data()[PID]
    return torch.from_numpy(a), torch.from_numpy(y)


def _own_optimizer(model, content):
    """The optimizer built from a train message by hand (what train_reply does, spelled out)."""
    config = dict(content.config_records["config"])
    model.load_state_dict(content.array_records["arrays"].to_torch_state_dict())
    downlink = {n: r.to_torch_state_dict() for n, r in content.array_records.items() if n != "arrays"}
    x, y = _data()
    model.zero_grad()
    LOSS(model(x), y).backward()  # full-batch gradient at x_t
    full = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return ml.MimeLiteOptimizer(
        model.named_parameters(), lr=float(config["client-lr"]), downlink=downlink, full_gradient=full,
        **METHODS["mimelite"].hparams.client_kwargs_from_wire(config, "mimelite"),
    ), config


def _batches(config):
    x, y = _data()
    idx = batch_indices(len(x), BATCH, STEPS, SEED, int(config["server-round"]), PID)
    return [(x[torch.from_numpy(i)], y[torch.from_numpy(i)]) for i in idx]


def _steps(model, opt, batches):
    for xb, yb in batches:
        opt.zero_grad()
        LOSS(model(xb), yb).backward()
        opt.step()


@pytest.mark.parametrize("base", ml.BASES)
def test_plain_torch_loop_equals_train_reply(base):
    content = _round_content(base)
    assert all(np.abs(content.array_records[r]["w.weight"].numpy()).max() > 0 for r in ml.STATISTICS[base])
    model = model_at()
    opt, config = _own_optimizer(model, content)
    assert opt.hparams == ml.MimeLiteHParams(base=base, beta1=0.7, beta2=0.9, eps=0.05)
    _steps(model, opt, _batches(config))
    uplink = opt.uplink()

    x, y = _data()
    got = train_reply(model_at(), content, x, y, LOSS, seed=SEED, client_key=PID)
    assert set(got.array_records) == {"arrays", ml.FULL_GRADIENT}
    for name, mine in (("arrays", model.state_dict()), (ml.FULL_GRADIENT, uplink[ml.FULL_GRADIENT])):
        theirs = got[name].to_torch_state_dict()
        assert set(theirs) == set(mine) and all(torch.equal(theirs[k], t) for k, t in mine.items()), name
    assert got["metrics"]["num-steps"] == opt.steps_taken == STEPS


@pytest.mark.parametrize("base", ml.BASES)
def test_state_dict_round_trip_mid_round(base):
    content = _round_content(base)
    model_a = model_at()
    opt_a, config = _own_optimizer(model_a, content)
    batches = _batches(config)
    _steps(model_a, opt_a, batches[:1])
    saved_model, saved_opt = copy.deepcopy(model_a.state_dict()), copy.deepcopy(opt_a.state_dict())
    _steps(model_a, opt_a, batches[1:])

    model_b = model_at()
    opt_b, _ = _own_optimizer(model_b, content)
    model_b.load_state_dict(saved_model)
    opt_b.load_state_dict(saved_opt)
    assert opt_b.steps_taken == 1
    _steps(model_b, opt_b, batches[1:])
    assert opt_b.steps_taken == opt_a.steps_taken == STEPS
    assert torch.equal(model_a.w.weight, model_b.w.weight)
    for name, p_a in model_a.named_parameters():
        p_b = dict(model_b.named_parameters())[name]
        assert all(torch.equal(opt_a.state[p_a][k], opt_b.state[p_b][k]) for k in opt_a.state[p_a])
    for k, t in opt_a.uplink()[ml.FULL_GRADIENT].items():
        assert torch.equal(opt_b.uplink()[ml.FULL_GRADIENT][k], t)


def test_misuse_raises_clear_errors():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    m = {"w": torch.ones(2, dtype=torch.float64)}
    full = {"w": torch.ones(2, dtype=torch.float64)}
    with pytest.raises(ValueError, match="second-moment"):  # adam needs v too
        ml.MimeLiteOptimizer([("w", p)], lr=0.1, downlink={ml.MOMENTUM: m}, full_gradient=full, base="adam")
    with pytest.raises(ValueError, match="full_gradient"):
        ml.MimeLiteOptimizer([("w", p)], lr=0.1, downlink={ml.MOMENTUM: m})
    with pytest.raises(TypeError, match="unknown hyper-parameter"):
        ml.MimeLiteOptimizer([("w", p)], lr=0.1, downlink={ml.MOMENTUM: m}, full_gradient=full, momentum=0.9)
    with pytest.raises(ValueError, match="beta1"):
        ml.MimeLiteOptimizer([("w", p)], lr=0.1, downlink={ml.MOMENTUM: m}, full_gradient=full, beta1=1.0)
    with pytest.raises(ValueError, match="rmsprop"):
        ml.MimeLiteOptimizer([("w", p)], lr=0.1, downlink={ml.MOMENTUM: m}, full_gradient=full, base="rmsprop")
    with pytest.raises(ConfigError, match="server_lr"):
        ml.MimeLiteHParams(server_lr=0.0)
    opt = ml.MimeLiteOptimizer([("w", p)], lr=0.1, downlink={ml.MOMENTUM: m}, full_gradient=full)
    with pytest.raises(RuntimeError, match="no local step"):
        opt.uplink()
    opt = ml.MimeLiteOptimizer([("w", p)], lr=0.1, downlink={ml.MOMENTUM: m}, full_gradient={"v": full["w"]})
    p.grad = torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="full_gradient has no entry for parameter 'w'"):
        opt.step()
