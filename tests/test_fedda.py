"""FedDA (paper 001): real Strategy + real ClientApp vs the float64 reference of Algorithms 1–2, the §2.7 special
cases (centralized SGDM/Adam/AdaGrad, FedOpt reductions, the P̄ identity), unit tests of the pure server math and
of the client optimizer, and mocked-reply protocol tests."""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MessageType, Metadata, MetricRecord, RecordDict

from flower_strategies.core.strategy import ClientHalfMissing
import flower_strategies  # noqa: F401  (registers the core methods)
import flower_strategies.methods.fedda as fd
from app_common.task import build_model, half_mse, synthetic_client
from flower_strategies.core import records as R
from flower_strategies.core.client import batch_indices, train_reply
from flower_strategies.methods.baselines import FedAdagrad, FedAdam, FedAvg
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.records import to_record
from flower_strategies.core.registry import METHODS, build_strategy
from flower_strategies.core.loop import own_loop_config
from simulations.engine.inprocess import LoopbackGrid, simulate
from tests.reference import fedda_ref as ref

DIM = 5
SEED = 0
NODES = 4
ROUNDS = 10
RUN_CONFIG = {"task": "synthetic-linear", "seed": SEED, "precision": "float64", "synthetic-dim": DIM}
W0 = np.random.default_rng(123).normal(size=(1, DIM))
CLIENT_LR = 0.05
STEPS = 3
BATCH = 8
ALPHA = {"sgdm": 1.0, "adam": 0.5, "adagrad": 0.5}
CLASSES = {"sgdm": fd.FedDASGDM, "adam": fd.FedDAAdam, "adagrad": fd.FedDAAdagrad}


# ------------------------------------------------------------------------------------------ helpers
def client_data(nodes: int = NODES) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    return {i: tuple(np.asarray(a, np.float64) for a in synthetic_client(i, DIM, 1.0, SEED)[:2]) for i in range(nodes)}


def initial_arrays(w0: np.ndarray = W0) -> ArrayRecord:
    model = build_model("synthetic-linear", SEED, DIM, "float64")
    with torch.no_grad():
        model.w.weight.copy_(torch.from_numpy(np.asarray(w0, np.float64)))
    return ArrayRecord(model.state_dict())


def run_sim(strategy, rounds: int = ROUNDS, nodes: int = NODES, w0: np.ndarray = W0):
    """Run in-process; return (list of w after each round incl. round 0, sampled partition ids per round)."""
    sampled: list[list[int]] = []
    orig = strategy.configure_train

    def configure_train(*args, **kwargs):
        msgs = list(orig(*args, **kwargs))
        sampled.append([m.metadata.dst_node_id - 1 for m in msgs])  # partition id = node id − 1
        return msgs

    strategy.configure_train = configure_train
    snaps, _ = simulate(strategy, initial_arrays(w0), rounds, nodes, RUN_CONFIG)
    return [s["w.weight"] for s in snaps], sampled


def max_err(a, b) -> float:
    assert len(a) == len(b)
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b, strict=True))


def ref_cfg(variant: str, **kw) -> dict:
    cfg = dict(variant=variant, client_lr=CLIENT_LR, server_lr=ALPHA[variant], beta1=0.9, beta2=0.99, eps=0.1, mu=0.0,
               local_steps=STEPS, batch_size=BATCH, seed=SEED, full_batch_rounds=set())
    cfg.update(kw)
    return cfg


def hp_for(variant: str, **kw):
    kw.setdefault("server_lr", ALPHA[variant])
    kw.setdefault("full_batch_last", 0.0)
    if variant == "sgdm":
        for k in ("beta2", "eps", "bias_correction", "v_hat", "initial_v"):
            kw.pop(k, None)
    return CLASSES[variant].make_hparams(**kw)


# ------------------------------------------------------------------------------------------ equivalence vs reference
MODES = {
    "plain": ({}, {}, 1.0),
    "full-batch-phase": ({"full_batch_from": 7}, {"full_batch_rounds": set(range(7, ROUNDS + 1))}, 1.0),
    "prox": ({"prox_mu": 0.3}, {"mu": 0.3}, 1.0),
    "full-batch+prox": ({"full_batch_from": 5, "prox_mu": 0.3},
                        {"mu": 0.3, "full_batch_rounds": set(range(5, ROUNDS + 1))}, 1.0),
    "partial": ({"full_batch_from": 9}, {"full_batch_rounds": {9, 10}}, 0.5),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("variant", ["sgdm", "adam", "adagrad"])
def test_matches_reference(variant, mode):
    hkw, rkw, frac = MODES[mode]
    strategy = CLASSES[variant](hp_for(variant, **hkw), client_lr=CLIENT_LR, local_steps=STEPS, batch_size=BATCH,
                                fraction_train=frac, seed=SEED)
    got, sampled = run_sim(strategy)
    if frac < 1.0:
        assert all(len(s) == 2 for s in sampled) and len({tuple(s) for s in sampled}) > 1
    else:
        assert all(s == list(range(NODES)) for s in sampled)
    want = ref.fedda_reference(W0, client_data(), sampled, ref_cfg(variant, **rkw))
    assert max_err(got, want) < 1e-6
    assert np.abs(want[-1] - want[0]).max() > 1e-2  # the trajectory actually moves
    # the full-batch phase is really one step per client (num-steps metric), the other rounds STEPS steps
    full = rkw.get("full_batch_rounds", set())
    for h in strategy.history:
        assert h.replies_used == len(sampled[h.server_round - 1])
        assert h.train_metrics["num-steps"] == (1.0 if h.server_round in full else STEPS)


FLAG_CASES = [
    ("adam", {"v_hat": "stale"}, {"v_hat": "stale"}),
    ("adam", {"bias_correction": "none"}, {"bias_correction": "none"}),
    ("adam", {"bias_correction": "round", "eta_in_momentum": True}, {"eta_in_momentum": True}),
    ("adagrad", {"eta_in_server": False, "server_lr": 0.02, "initial_v": 0.5},
     {"eta_in_server": False, "server_lr": 0.02, "initial_v": 0.5}),
    ("sgdm", {"eta_in_momentum": True, "eta_in_server": False, "beta1": 0.8},
     {"eta_in_momentum": True, "eta_in_server": False, "beta1": 0.8}),
]


@pytest.mark.parametrize("variant,hkw,rkw", FLAG_CASES)
@pytest.mark.parametrize("weighting", ["examples", "uniform"])
def test_flags_match_reference(variant, hkw, rkw, weighting):
    strategy = CLASSES[variant](hp_for(variant, **hkw), client_lr=CLIENT_LR, local_steps=STEPS, batch_size=BATCH,
                                seed=SEED, weighting=weighting)
    got, sampled = run_sim(strategy)
    want = ref.fedda_reference(W0, client_data(), sampled, ref_cfg(variant, weighting=weighting, **rkw))
    assert max_err(got, want) < 1e-6


def test_generic_fedda_equals_fixed_variant():
    hp = fd.FedDAHParams(variant="adam", server_lr=0.5, full_batch_last=0.0)
    got, _ = run_sim(fd.FedDA(hp, client_lr=CLIENT_LR, local_steps=STEPS, batch_size=BATCH, seed=SEED), rounds=4)
    want, _ = run_sim(fd.FedDAAdam(hp_for("adam"), client_lr=CLIENT_LR, local_steps=STEPS, batch_size=BATCH, seed=SEED),
                      rounds=4)
    assert max_err(got, want) == 0.0


def test_default_full_batch_schedule_runs_last_rounds():
    # default full-batch-last = 0.05 of 20 rounds -> round 20 only; compare with the reference
    hp = fd.FedDASGDM.make_hparams(server_lr=1.0)
    strategy = fd.FedDASGDM(hp, client_lr=CLIENT_LR, local_steps=STEPS, batch_size=BATCH, seed=SEED)
    got, sampled = run_sim(strategy, rounds=20)
    assert [h.train_metrics["num-steps"] for h in strategy.history] == [STEPS] * 19 + [1.0]
    want = ref.fedda_reference(W0, client_data(), sampled, ref_cfg("sgdm", full_batch_rounds={20}))
    assert max_err(got, want) < 1e-6


# ------------------------------------------------------------------------------------------ §2.7 special cases
@pytest.mark.parametrize("variant", ["sgdm", "adam", "adagrad"])
def test_one_full_batch_step_equals_centralized(variant):
    """§2.7 (2)–(4): T = 1, full batch, all clients ⇒ centralized SGDM / Adam / AdaGrad with lr η·α."""
    eps = 0.0 if variant == "sgdm" else 1e-3
    hkw = {} if variant == "sgdm" else {"eps": eps}
    strategy = CLASSES[variant](hp_for(variant, full_batch_from=1, **hkw), client_lr=CLIENT_LR, local_steps=STEPS,
                                batch_size=BATCH, seed=SEED)
    got, _ = run_sim(strategy, rounds=12)
    want = ref.centralized(variant, W0, client_data(), 12, lr=CLIENT_LR * ALPHA[variant], beta1=0.9, beta2=0.99,
                           eps=eps)
    assert max_err(got, want) < 1e-6
    assert np.abs(want[-1] - want[0]).max() > 1e-2


def _fedopt_pair(fedda, fedopt, rounds=ROUNDS):
    got, _ = run_sim(fedda, rounds=rounds)
    want, _ = run_sim(fedopt, rounds=rounds)
    return max_err(got, want), float(np.abs(want[-1] - want[0]).max())


def test_sgdm_beta0_is_fedopt_server_sgd():
    """§2.7 (1): β1 = 0 ⇒ W ← W − α·wmean(Δ_i): FedAvg with server lr α (α = 1: FedAvg)."""
    kw = dict(client_lr=CLIENT_LR, local_steps=STEPS, batch_size=BATCH, seed=SEED, fraction_train=0.5)
    for alpha in (1.0, 1.7):
        err, moved = _fedopt_pair(fd.FedDASGDM(hp_for("sgdm", beta1=0.0, server_lr=alpha), **kw),
                                  FedAvg(FedAvg.make_hparams(server_lr=alpha), **kw))
        assert err < 1e-9 and moved > 1e-2


def test_adagrad_beta0_is_fedadagrad():
    """§2.7 (5): AdaGrad, β1 = 0 ⇒ FedAdagrad (server β1 = 0, v₀ = 0) with lr α·η and τ = η·ε."""
    alpha, eps = 0.5, 0.1
    kw = dict(client_lr=CLIENT_LR, local_steps=STEPS, batch_size=BATCH, seed=SEED)
    err, moved = _fedopt_pair(
        fd.FedDAAdagrad(hp_for("adagrad", beta1=0.0, server_lr=alpha, eps=eps), **kw),
        FedAdagrad(FedAdagrad.make_hparams(server_lr=alpha * CLIENT_LR, beta1=0.0, tau=CLIENT_LR * eps, initial_v=0.0),
                   **kw),
    )
    assert err < 1e-9 and moved > 1e-2


def test_adam_beta0_is_bias_corrected_fedadam():
    """§2.7 (6): Adam, β1 = 0 ⇒ FedAdam (server β1 = 0, v bias-corrected) with lr α·η; exact with ε = τ = 0."""
    alpha = 0.5
    kw = dict(client_lr=CLIENT_LR, local_steps=STEPS, batch_size=BATCH, seed=SEED)
    err, moved = _fedopt_pair(
        fd.FedDAAdam(hp_for("adam", beta1=0.0, server_lr=alpha, eps=0.0), **kw),
        FedAdam(FedAdam.make_hparams(server_lr=alpha * CLIENT_LR, beta1=0.0, beta2=0.99, tau=0.0, initial_v=0.0,
                               bias_correction="adam"), **kw),
    )
    assert err < 1e-9 and moved > 1e-2


def recover_gradient(p_bar: np.ndarray, m_prev: np.ndarray, beta1: float) -> np.ndarray:
    """``G = (P̄ − β1·m_r)/(1−β1)`` (Algorithm 2, line 11), written out: the server step does it chunk by chunk."""
    return (np.asarray(p_bar) - beta1 * np.asarray(m_prev)) / (1.0 - beta1)


def test_recovered_gradient_identity():
    """§2.7 (7): β1·m_r + (1−β1)·G == P̄."""
    rng = np.random.default_rng(0)
    for beta1 in (0.0, 0.5, 0.9, 0.99):
        p, m = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
        g = recover_gradient(p, m, beta1)
        np.testing.assert_allclose(beta1 * m + (1 - beta1) * g, p, rtol=1e-12, atol=1e-12)


def test_adam_m_hat_is_bias_corrected_p_bar():
    rng = np.random.default_rng(1)
    w, p, m = ({"a": rng.normal(size=4)} for _ in range(3))
    v = {"a": np.zeros(4)}
    for s in (1, 3):
        new, v_new = fd.fedda_server_step("adam", w, p, m, v, client_lr=0.1, server_lr=2.0, beta1=0.9, beta2=0.99,
                                          eps=0.1, bias_step=s)
        g = (p["a"] - 0.9 * m["a"]) / 0.1
        np.testing.assert_allclose(v_new["a"], 0.01 * g * g)
        expect = w["a"] - 0.2 * (p["a"] / (1 - 0.9**s)) / (np.sqrt(v_new["a"] / (1 - 0.99**s)) + 0.1)
        np.testing.assert_allclose(new["a"], expect, rtol=1e-12)


def test_adagrad_one_step_gradient_independent_of_momentum():
    """§2.7 (4): with T = 1 the recovered G is the client's gradient whatever m_r is."""
    torch.manual_seed(0)
    for m_r in (torch.zeros(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)):
        p = torch.nn.Parameter(torch.randn(2, 3, dtype=torch.float64))
        opt = fd.FedDAOptimizer([("p", p)], lr=0.1, beta1=0.9, downlink={fd.MOMENTUM: {"p": m_r}})
        g = torch.randn(2, 3, dtype=torch.float64)
        p.grad = g.clone()
        opt.step()
        up = opt.uplink()
        G = recover_gradient(up[fd.MOMENTUM_SUM]["p"].numpy(), m_r.numpy(), 0.9)
        np.testing.assert_allclose(G, g.numpy(), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------ unit tests
def test_optimizer_steps_by_hand():
    x0 = torch.tensor([1.0, -2.0], dtype=torch.float64)
    p = torch.nn.Parameter(x0.clone())
    m0 = torch.tensor([0.5, 0.25], dtype=torch.float64)
    opt = fd.FedDAOptimizer([("w", p)], lr=0.1, beta1=0.8, prox_mu=0.5, downlink={fd.MOMENTUM: {"w": m0}})
    g1, g2 = torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([-1.0, 3.0], dtype=torch.float64)
    p.grad = g1.clone()
    opt.step()
    # step 1: prox term is zero at W_r
    x1 = x0 - 0.1 * g1
    m1 = 0.8 * m0 + 0.2 * g1
    assert torch.allclose(p.data, x1)
    p.grad = g2.clone()
    opt.step()
    d2 = g2 + 0.5 * (x1 - x0)
    x2 = x1 - 0.1 * d2
    m2 = 0.8 * m1 + 0.2 * d2
    up = opt.uplink()
    assert torch.allclose(p.data, x2)
    assert torch.allclose(up[fd.MOMENTUM]["w"], m2)
    assert torch.allclose(up[fd.MOMENTUM_SUM]["w"], m1 + m2)
    assert torch.equal(m0, torch.tensor([0.5, 0.25], dtype=torch.float64))  # downlink tensor untouched
    assert fd.FedDAOptimizer.sends_model is False


def test_optimizer_eta_in_momentum():
    p = torch.nn.Parameter(torch.tensor([1.0, 1.0], dtype=torch.float64))
    zeros = {fd.MOMENTUM: {"w": torch.zeros(2, dtype=torch.float64)}}  # round 1: the server sends m_0 = 0
    opt = fd.FedDAOptimizer([("w", p)], lr=0.5, beta1=0.5, eta_in_momentum=True, downlink=zeros)
    p.grad = torch.tensor([2.0, -4.0], dtype=torch.float64)
    opt.step()
    up = opt.uplink()
    assert torch.allclose(up[fd.MOMENTUM]["w"], torch.tensor([0.5, -1.0], dtype=torch.float64))  # 0.5·(0.5·g)
    assert torch.allclose(p.data, torch.tensor([0.0, 3.0], dtype=torch.float64))


def test_server_step_by_hand():
    w = {"a": np.array([1.0, 2.0])}
    p = {"a": np.array([0.5, -0.5])}
    m = {"a": np.array([0.1, 0.2])}
    v = {"a": np.array([0.0, 1.0])}
    new, _ = fd.fedda_server_step("sgdm", w, p, m, {}, client_lr=0.1, server_lr=3.0)
    np.testing.assert_allclose(new["a"], [1.0 - 0.15, 2.0 + 0.15])
    new, _ = fd.fedda_server_step("sgdm", w, p, m, {}, client_lr=0.1, server_lr=3.0, eta_in_server=False)
    np.testing.assert_allclose(new["a"], [1.0 - 1.5, 2.0 + 1.5])
    new, v_new = fd.fedda_server_step("adagrad", w, p, m, v, client_lr=0.1, server_lr=2.0, beta1=0.5, eps=0.1)
    g = np.array([(0.5 - 0.05) / 0.5, (-0.5 - 0.1) / 0.5])
    np.testing.assert_allclose(v_new["a"], v["a"] + g**2)
    np.testing.assert_allclose(new["a"], w["a"] - 0.2 * g / (np.sqrt(v["a"] + g**2) + 0.1))
    # stale V̂ (Eq. 35) without bias correction uses V_r
    new, v_new = fd.fedda_server_step("adam", w, p, m, v, client_lr=0.1, server_lr=2.0, beta1=0.5, beta2=0.9, eps=0.1,
                                      bias_step=None, v_hat="stale")
    np.testing.assert_allclose(v_new["a"], 0.9 * v["a"] + 0.1 * g**2)
    np.testing.assert_allclose(new["a"], w["a"] - 0.2 * p["a"] / (np.sqrt(v["a"]) + 0.1))
    assert new["a"].dtype == np.float64
    new32, _ = fd.fedda_server_step("sgdm", {"a": w["a"].astype(np.float32)}, p, m, {}, client_lr=0.1, server_lr=1.0)
    assert new32["a"].dtype == np.float32


def test_full_batch_schedule():
    def rounds(hp, total):
        s = fd.FedDASGDM(hp, num_rounds=total)
        return [r for r in range(1, total + 1) if s.full_batch(r)]

    assert rounds(fd.FedDASGDM.make_hparams(), 20) == [20]
    assert rounds(fd.FedDASGDM.make_hparams(), 60) == [58, 59, 60]
    assert rounds(fd.FedDASGDM.make_hparams(), 1500) == list(range(1426, 1501))
    assert rounds(fd.FedDASGDM.make_hparams(full_batch_last=0.0), 60) == []
    assert rounds(fd.FedDASGDM.make_hparams(full_batch_from=7), 10) == [7, 8, 9, 10]


def test_registry_and_run_config():
    for name in ("fedda", "fedda-sgdm", "fedda-adam", "fedda-adagrad"):
        assert METHODS[name].local_optimizer is fd.FedDAOptimizer
    s, _ = build_strategy({"method": "fedda", "fedda.variant": "adagrad", "fedda.prox-mu": 0.01})
    assert isinstance(s, fd.FedDA) and s.hparams.variant == "adagrad"
    assert s.hparams.alpha == 0.1 and s.hparams.prox_mu == 0.01
    s, _ = build_strategy({"method": "fedda-sgdm", "fedda-sgdm.full-batch-from": 3})
    assert s.hparams.variant == "sgdm" and s.hparams.alpha == 1.0 and s.full_batch(3) and not s.full_batch(2)
    with pytest.raises(ConfigError, match="sgdm"):
        build_strategy({"method": "fedda", "fedda.variant": "yogi"})
    with pytest.raises(ConfigError):
        build_strategy({"method": "fedda-adam", "fedda-adam.beta1": 1.0})


# ------------------------------------------------------------------------------------------ protocol (mocked replies)
class _NoApp:
    def __call__(self, msg, ctx):  # pragma: no cover - never called
        raise AssertionError


def _reply(node: int, n: int, records: dict[str, dict[str, np.ndarray]]) -> Message:
    md = Metadata(run_id=1, message_id=f"r{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="x",
                  group_id="1", created_at=time.time(), ttl=3600.0, message_type=MessageType.TRAIN)
    content = RecordDict({k: to_record(v) for k, v in records.items()})
    content["metrics"] = MetricRecord({"num-examples": n, "num-steps": 3.0})
    return Message(content=content, metadata=md)


def test_protocol_with_mocked_replies():
    grid = LoopbackGrid(_NoApp(), 4)
    hp = fd.FedDAAdam.make_hparams(server_lr=2.0, beta1=0.5, beta2=0.9, eps=0.1, full_batch_from=2)
    s = fd.FedDAAdam(hp, client_lr=0.1, seed=0)
    w = np.array([[1.0, -1.0, 0.5]], dtype=np.float32)
    msgs = list(s.configure_train(1, to_record({"w": w}), own_loop_config(), grid))
    assert len(msgs) == 4
    c = msgs[0].content
    np.testing.assert_array_equal(c.array_records[fd.MOMENTUM]["w"].numpy(), np.zeros((1, 3), np.float32))
    cfg = c.config_records["config"]
    assert cfg["method"] == "fedda-adam" and cfg["fedda-adam.beta1"] == 0.5 and cfg[R.FULL_BATCH] is False
    assert cfg["fedda-adam.prox-mu"] == 0.0 and cfg["fedda-adam.eta-in-momentum"] is False

    p1, m1 = np.array([[1.0, 2.0, 3.0]], np.float32), np.array([[0.5, 0.5, 0.5]], np.float32)
    p2, m2 = np.array([[-1.0, 0.0, 1.0]], np.float32), np.array([[0.0, 1.0, 2.0]], np.float32)
    bad = p1.copy()
    bad[0, 1] = np.nan
    replies = [
        _reply(1, 10, {fd.MOMENTUM_SUM: {"w": p1}, fd.MOMENTUM: {"w": m1}}),
        _reply(2, 30, {fd.MOMENTUM_SUM: {"w": p2}, fd.MOMENTUM: {"w": m2}}),
        _reply(3, 50, {fd.MOMENTUM_SUM: {"w": bad}, fd.MOMENTUM: {"w": m1}}),  # NaN → rejected
        _reply(4, 50, {fd.MOMENTUM_SUM: {"w": p1}}),  # missing momentum → rejected
    ]
    arrays, metrics = s.aggregate_train(1, replies)
    assert metrics["replies-used"] == 2 and metrics["replies-rejected"] == 2
    p_bar = (10 * p1.astype(np.float64) + 30 * p2) / 40
    m_bar = (10 * m1.astype(np.float64) + 30 * m2) / 40
    g = p_bar / 0.5  # m_r = 0
    v = 0.1 * g * g
    expect = w - 0.2 * (p_bar / 0.5) / (np.sqrt(v / 0.1) + 0.1)
    new = arrays["w"].numpy()
    assert new.dtype == np.float32
    np.testing.assert_allclose(new, expect, rtol=1e-5)
    np.testing.assert_allclose(s.server_state["m_t"]["w"], m_bar, rtol=1e-6)

    msgs = list(s.configure_train(2, arrays, own_loop_config(), grid))
    c = msgs[0].content
    np.testing.assert_allclose(c.array_records[fd.MOMENTUM]["w"].numpy(), m_bar, rtol=1e-6)
    assert c.config_records["config"][R.FULL_BATCH] is True
    # a round whose only reply carries the model instead of P (a stock client) stops the run, naming the fix
    with pytest.raises(ClientHalfMissing, match="Fix: build the reply"):
        s.aggregate_train(2, [_reply(1, 10, {"arrays": {"w": w}})])


# ---------------------------------------------------------------------------------------- the optimizer outside the app
NAMES = ("fedda", "fedda-sgdm", "fedda-adam", "fedda-adagrad")
PID = 1  # the client whose data and batch order the tests below use


def _round_content(name: str, server_round: int) -> RecordDict:
    """The RecordDict a client receives in ``server_round`` of a ``ROUNDS``-round run, after one real round (so the
    broadcast momentum is not zero); FedDA+Prox so that the round start ``W_r`` matters."""
    spec = METHODS[name]
    hp = spec.default_hparams().replace(prox_mu=0.3)
    kw = dict(client_lr=CLIENT_LR, local_steps=STEPS, batch_size=BATCH, seed=SEED)
    warm = spec.build(hp, **kw)
    snaps, _ = simulate(warm, initial_arrays(), 1, NODES, RUN_CONFIG)
    strategy = spec.build(hp, num_rounds=ROUNDS, **kw)
    strategy.load_state_dict(warm.state_dict())
    content = strategy.prepare_round(server_round, to_record(snaps[-1]), own_loop_config(), num_sampled=1)
    assert np.abs(content.array_records[fd.MOMENTUM]["w.weight"].numpy()).max() > 1e-3
    return content


def _client_tensors():
    a, y = client_data()[PID]
    return torch.from_numpy(a), torch.from_numpy(y)


def _optimizer(name: str, content: RecordDict, model: torch.nn.Module) -> fd.FedDAOptimizer:
    """The client optimizer built by hand from a train message (downlink = every record but the model)."""
    spec = METHODS[name]
    config = dict(content.config_records["config"])
    downlink = {k: rec.to_torch_state_dict() for k, rec in content.array_records.items() if k != "arrays"}
    return spec.local_optimizer(model.named_parameters(), lr=config["client-lr"], downlink=downlink,
                                **spec.hparams.client_kwargs_from_wire(config, name))


def _model_from(content: RecordDict) -> torch.nn.Module:
    model = build_model("synthetic-linear", SEED, DIM, "float64")
    model.load_state_dict(content.array_records["arrays"].to_torch_state_dict())
    return model


def _batches(content: RecordDict, n: int) -> list[np.ndarray]:
    config = content.config_records["config"]
    full = bool(config[R.FULL_BATCH])
    return batch_indices(n, n if full else BATCH, 1 if full else STEPS, SEED, int(config[R.SERVER_ROUND]), PID)


@pytest.mark.parametrize("server_round", [2, ROUNDS])  # a mini-batch round and a full-batch round (A8)
@pytest.mark.parametrize("name", NAMES)
def test_plain_torch_loop_equals_train_reply(name, server_round):
    content = _round_content(name, server_round)
    assert content.config_records["config"][R.FULL_BATCH] is (server_round == ROUNDS)
    x, y = _client_tensors()
    model = _model_from(content)
    opt = _optimizer(name, content, model)
    for idx in _batches(content, len(x)):
        i = torch.from_numpy(idx)
        opt.zero_grad()
        half_mse(model(x[i]), y[i]).backward()
        opt.step()
    uplink = opt.uplink()

    app_model = build_model("synthetic-linear", SEED, DIM, "float64")
    reply = train_reply(app_model, content, x, y, half_mse, seed=SEED, client_key=PID)
    assert "arrays" not in reply.array_records  # FedDA's reply carries P and m, not the model
    assert set(reply.array_records) == set(uplink) == {fd.MOMENTUM_SUM, fd.MOMENTUM}
    for record, arrays in uplink.items():
        for key, t in arrays.items():
            assert np.array_equal(reply.array_records[record][key].numpy(), t.numpy()), (record, key)
    for (k, p), (k2, q) in zip(model.named_parameters(), app_model.named_parameters(), strict=True):
        assert k == k2 and torch.equal(p, q)
    assert reply.metric_records["metrics"]["num-steps"] == opt.steps_taken == (1 if server_round == ROUNDS else STEPS)
    assert not torch.equal(model.w.weight, content.array_records["arrays"].to_torch_state_dict()["w.weight"])


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_mid_round(name):
    content = _round_content(name, 2)
    x, y = _client_tensors()
    batches = [torch.from_numpy(i) for i in _batches(content, len(x))]

    def run(model, opt, idx):
        for i in idx:
            opt.zero_grad()
            half_mse(model(x[i]), y[i]).backward()
            opt.step()

    straight = _model_from(content)
    opt = _optimizer(name, content, straight)
    run(straight, opt, batches)

    first = _model_from(content)
    opt1 = _optimizer(name, content, first)
    run(first, opt1, batches[:2])
    saved_opt, saved_model = copy.deepcopy(opt1.state_dict()), copy.deepcopy(first.state_dict())
    resumed = build_model("synthetic-linear", SEED, DIM, "float64")
    resumed.load_state_dict(saved_model)
    opt2 = _optimizer(name, content, resumed)
    opt2.load_state_dict(saved_opt)
    assert opt2.steps_taken == 2
    run(resumed, opt2, batches[2:])

    assert opt2.steps_taken == opt.steps_taken == STEPS
    assert torch.equal(resumed.w.weight, straight.w.weight)
    want, got = opt.uplink(), opt2.uplink()
    for record in want:
        for key in want[record]:
            assert torch.equal(got[record][key], want[record][key]), (record, key)


@pytest.mark.parametrize("name", NAMES)
def test_misuse_raises_clear_errors(name):
    spec = METHODS[name]
    model = build_model("synthetic-linear", SEED, DIM, "float64")
    momentum = {fd.MOMENTUM: {k: torch.zeros_like(p) for k, p in model.named_parameters()}}
    opt_cls = spec.local_optimizer
    with pytest.raises(ValueError, match="downlink record.*'momentum'"):
        opt_cls(model.named_parameters(), lr=0.1)
    with pytest.raises(ValueError, match="has no tensor 'w.weight'"):  # a record that lacks a parameter
        opt = opt_cls(model.named_parameters(), lr=0.1, downlink={fd.MOMENTUM: {}})
        model(torch.zeros(1, DIM, dtype=torch.float64)).sum().backward()
        opt.step()
    opt = opt_cls(model.named_parameters(), lr=0.1, downlink=momentum)
    with pytest.raises(RuntimeError, match="no local step"):
        opt.uplink()
    with pytest.raises(TypeError, match="unknown hyper-parameter.*'mu'.*prox_mu"):
        opt_cls(model.named_parameters(), lr=0.1, downlink=momentum, mu=0.1)
    with pytest.raises(TypeError, match="unknown hyper-parameter.*'variant'"):  # a server field
        opt_cls(model.named_parameters(), lr=0.1, downlink=momentum, variant="adam")
    with pytest.raises(ValueError, match="beta1 = 1.0 is out of range"):
        opt_cls(model.named_parameters(), lr=0.1, downlink=momentum, beta1=1.0)
    with pytest.raises(ValueError, match="prox_mu = -0.1 is out of range"):
        opt_cls(model.named_parameters(), lr=0.1, downlink=momentum, prox_mu=-0.1)
    with pytest.raises(TypeError, match="named_parameters"):
        opt_cls(model.parameters(), lr=0.1, downlink=momentum)
    # server side
    with pytest.raises(ConfigError, match="server_lr = 0.0 is out of range"):
        spec.default_hparams().replace(server_lr=0.0)
    with pytest.raises(ConfigError, match="full_batch_from = 0 is out of range"):
        spec.default_hparams().replace(full_batch_from=0)
    with pytest.raises(ConfigError, match=f"{name}.full-batch-from = 0 is out of range"):
        build_strategy({"method": name, f"{name}.full-batch-from": 0})
    other = "adam" if spec.default_hparams().variant != "adam" else "sgdm"
    if spec.strategy is not fd.FedDA:  # a variant class refuses hyper-parameters of another variant
        with pytest.raises(ConfigError, match="make_hparams"):
            spec.strategy(fd.FedDAHParams(variant=other))
    # full-batch-last needs the run's number of rounds (Strategy.start sets it; a bare driver passes num_rounds=)
    with pytest.raises(ConfigError, match="num_rounds="):
        spec.build().prepare_round(1, initial_arrays(), own_loop_config(), num_sampled=1)
