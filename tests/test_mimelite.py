"""MimeLite (baseline of paper 001): real Strategy + real ClientApp vs the float64 reference, a FedAvg reduction,
unit tests of the frozen-statistics step and the server math, and a mocked-reply protocol test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord

import flower_strategies  # noqa: F401
import flower_strategies.methods.mimelite as ml
from flower_strategies.methods.baselines import FedAvg, FedAvgHParams
from flower_strategies.core.records import to_record
from flower_strategies.core.registry import METHODS, build_strategy
from simulations.engine import LoopbackGrid
from tests.reference import fedda_ref as ref
from tests.test_fedda import BATCH, CLIENT_LR, SEED, STEPS, W0, _NoApp, _reply, client_data, max_err, run_sim


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
    want, _ = run_sim(FedAvg(FedAvgHParams(server_lr=1.3), **kw))
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
    np.testing.assert_allclose(s.m_t["w.weight"], m, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(s.v_t["w.weight"], v, rtol=1e-9, atol=1e-14)


# ------------------------------------------------------------------------------------------ unit tests
@pytest.mark.parametrize("base", ml.BASES)
def test_optimizer_step_uses_frozen_statistics(base):
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    m = torch.tensor([0.3, -0.1], dtype=torch.float64)
    v = torch.tensor([0.2, 0.5], dtype=torch.float64)
    opt = ml.MimeLiteOptimizer.from_config(
        [("w", p)], {"client-lr": 0.1, ml.CFG_BASE: base, ml.CFG_BETA1: 0.8, ml.CFG_BETA2: 0.9, ml.CFG_EPS: 0.01}
    )
    assert opt.needs_full_gradient and opt.sends_model
    opt.full_gradient = {"w": torch.tensor([9.0, 9.0], dtype=torch.float64)}
    opt.begin_round({ml.MOMENTUM: {"w": m.clone()}, ml.SECOND_MOMENT: {"w": v.clone()}})
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
    up = opt.end_round()
    assert torch.equal(up[ml.FULL_GRADIENT]["w"], torch.tensor([9.0, 9.0], dtype=torch.float64))


def test_server_step_by_hand():
    x = {"a": np.array([1.0, 2.0])}
    y = {"a": np.array([0.0, 4.0])}
    g = {"a": np.array([1.0, -2.0])}
    m = {"a": np.array([0.5, 0.5])}
    v = {"a": np.array([1.0, 1.0])}
    new, m2, v2 = ml.mimelite_server_step("adam", x, y, g, m, v, server_lr=0.5, beta1=0.9, beta2=0.99)
    np.testing.assert_allclose(new["a"], [0.5, 3.0])
    np.testing.assert_allclose(m2["a"], 0.9 * m["a"] + 0.1 * g["a"])
    np.testing.assert_allclose(v2["a"], 0.99 * v["a"] + 0.01 * g["a"] ** 2)
    _, _, v3 = ml.mimelite_server_step("adagrad", x, y, g, m, v)
    np.testing.assert_allclose(v3["a"], v["a"] + g["a"] ** 2)
    _, m4, v4 = ml.mimelite_server_step("sgdm", x, y, g, m, {}, beta1=0.5)
    np.testing.assert_allclose(m4["a"], [0.75, -0.75])
    assert v4 == {}


def test_registry():
    assert METHODS["mimelite"].local_optimizer is ml.MimeLiteOptimizer
    s, _ = build_strategy({"method": "mimelite", "mimelite.base": "adam", "mimelite.eps": 0.1})
    assert isinstance(s, ml.MimeLite) and s.hparams.base == "adam" and s.hparams.eps == 0.1


@pytest.mark.parametrize("base,records", [("sgdm", {ml.MOMENTUM}), ("adam", {ml.MOMENTUM, ml.SECOND_MOMENT}),
                                          ("adagrad", {ml.SECOND_MOMENT})])
def test_protocol_with_mocked_replies(base, records):
    grid = LoopbackGrid(_NoApp(), 3)
    s = ml.MimeLite(ml.MimeLiteHParams(base=base, beta1=0.5, beta2=0.5), client_lr=0.1, seed=0)
    w = np.array([[1.0, -1.0]], dtype=np.float32)
    msgs = list(s.configure_train(1, to_record({"w": w}), ConfigRecord(), grid))
    c = msgs[0].content
    assert set(c.array_records) == {"arrays"} | records
    assert c.config_records["config"][ml.CFG_BASE] == base
    y1, y2 = np.array([[0.0, 0.0]], np.float32), np.array([[2.0, 2.0]], np.float32)
    g1, g2 = np.array([[1.0, 1.0]], np.float32), np.array([[3.0, -1.0]], np.float32)
    replies = [
        _reply(1, 30, {"arrays": {"w": y1}, ml.FULL_GRADIENT: {"w": g1}}),
        _reply(2, 10, {"arrays": {"w": y2}, ml.FULL_GRADIENT: {"w": g2}}),
        _reply(3, 10, {"arrays": {"w": y2}}),  # no full gradient → rejected
    ]
    arrays, metrics = s.aggregate_train(1, replies)
    assert metrics["replies-used"] == 2 and metrics["replies-rejected"] == 1
    np.testing.assert_allclose(arrays["w"].numpy(), [[0.5, 0.5]])
    g_bar = np.array([[1.5, 0.5]])
    if base != "adagrad":
        np.testing.assert_allclose(s.m_t["w"], 0.5 * g_bar)
    if base != "sgdm":
        np.testing.assert_allclose(s.v_t["w"], (0.5 if base == "adam" else 1.0) * g_bar**2)
    msgs = list(s.configure_train(2, arrays, ConfigRecord(), grid))
    rec = ml.MOMENTUM if base != "adagrad" else ml.SECOND_MOMENT
    want = s.m_t["w"] if base != "adagrad" else s.v_t["w"]
    np.testing.assert_allclose(msgs[0].content.array_records[rec]["w"].numpy(), want, rtol=1e-6)
