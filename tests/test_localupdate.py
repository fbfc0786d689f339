"""LocalUpdate / LocalUpdateDecay (paper 003): reference equivalence, §4.7 special cases, controller, protocol."""

from __future__ import annotations

import io
import random
import time
from itertools import pairwise

import numpy as np
import pytest
import torch

import flower_strategies  # noqa: F401
import flower_strategies.methods.localupdate as LU
from flower_strategies.analysis import quadratic as QT
from flower_strategies.methods.baselines import FedAvg
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.registry import METHODS, parse_run_config

from app_common.task import build_model, half_mse
from flower_strategies.core.client import batch_indices, train_reply
from flower_strategies.core.loop import own_loop_config
from simulations.engine.inprocess import LoopbackGrid, simulate
from tests.reference import localupdate_ref as ref

from flwr.app import Array, ArrayRecord, Message, MessageType, Metadata, MetricRecord, RecordDict

DIM = 5
RC = {"task": "synthetic-linear", "seed": 0, "precision": "float64", "synthetic-dim": DIM}


def start_model(offset: float = 0.0):
    model = build_model("synthetic-linear", 0, DIM, "float64")
    if offset:
        with torch.no_grad():
            model.w.weight.copy_(torch.linspace(-offset, offset, DIM, dtype=torch.float64)[None, :])
    return model


def w_of(snapshot) -> np.ndarray:
    return snapshot["w.weight"][0]


class Recording:
    """Mixin: remember the partition ids of each round's valid replies."""

    def server_update(self, inputs, state):
        self.sampled = getattr(self, "sampled", [])
        self.sampled.append(sorted(int(m["partition-id"]) for m in inputs.reply_metrics))
        return super().server_update(inputs, state)


class RecLU(Recording, LU.LocalUpdate):
    pass


class RecLUD(Recording, LU.LocalUpdateDecay):
    pass


def run(strategy, rounds, nodes, offset=0.5):
    snaps, _ = simulate(strategy, ArrayRecord(start_model(offset).state_dict()), rounds, nodes, RC)
    return snaps


# ------------------------------------------------------------------------------------------ reference equivalence
CASES = {
    "fedavg-K3": dict(hp=dict(theta="fedavg", theta_steps=3, server_lr=0.3), gamma=0.1, theta=(1, 1, 1)),
    "custom-theta-examples": dict(hp=dict(theta="0.5,0,2", server_lr=0.2), gamma=0.05, weighting="examples",
                                  theta=(0.5, 0, 2)),
    "fomaml-yogi": dict(hp=dict(theta="fomaml", theta_steps=3, server_lr=0.05, server_opt="yogi"), gamma=0.1,
                        theta=(0, 0, 1)),
    "decay-paper": dict(
        hp=dict(theta="fedavg", theta_steps=3, server_lr=0.3, window=2, patience=2, cooldown=1, min_delta=0.05),
        gamma=0.1, decay="paper", theta=(1, 1, 1),
    ),
    "decay-tff-examples": dict(
        hp=dict(theta="1,0.5,1", server_lr=0.3, window=2, patience=1, cooldown=1, min_delta=0.02,
                plateau_rule="tff", loss_weighting="examples", client_decay=0.5, server_decay=0.8),
        gamma=0.1, decay="tff", theta=(1, 0.5, 1),
    ),
    "decay-partial-yogi": dict(
        hp=dict(theta="fedavg", theta_steps=2, server_lr=0.1, server_opt="yogi", window=1, patience=1, cooldown=2,
                min_delta=0.02),
        gamma=0.2, decay="paper", fraction=0.5, nodes=6, theta=(1, 1),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    case = CASES[name]
    rounds, nodes = 12, case.get("nodes", 4)
    decay = case.get("decay")
    hp_cls, cls = (LU.LocalUpdateDecayHParams, RecLUD) if decay else (LU.LocalUpdateHParams, RecLU)
    hp = hp_cls(**case["hp"])
    strategy = cls(hp, client_lr=case["gamma"], batch_size=8, seed=0, fraction_train=case.get("fraction", 1.0),
                   weighting=case.get("weighting"))
    snaps = run(strategy, rounds, nodes)
    assert len(snaps) == rounds + 1
    if "fraction" in case:
        assert all(len(s) == nodes // 2 for s in strategy.sampled)
        assert len({tuple(s) for s in strategy.sampled}) > 1
    else:
        assert strategy.sampled == [list(range(nodes))] * rounds
    dec = None
    if decay:
        dec = dict(W=hp.window, P=hp.patience, C=hp.cooldown, delta=hp.min_delta, rule=decay,
                   client_decay=hp.client_decay, server_decay=hp.server_decay, loss_weighting=hp.loss_weighting)
    ws, trace = ref.outer_loop(
        w_of(snaps[0]), strategy.sampled, gamma=case["gamma"], eta=hp.server_lr, theta=case["theta"], batch_size=8,
        dim=DIM, weighting=case.get("weighting", "uniform"), server=hp.server_opt, eps=hp.eps, decay=dec,
    )
    for t in range(rounds + 1):
        np.testing.assert_allclose(w_of(snaps[t]), ws[t], rtol=0, atol=1e-6, err_msg=f"round {t}")
    assert np.linalg.norm(ws[-1] - ws[0]) > 0.1  # it trained
    if decay:
        fired = [t for t, (_, _, d) in enumerate(trace, start=1) if d]
        assert fired, "the test case must exercise a decay"
        assert [int(r["round"]) for r in strategy.decay_trace if r["decayed"]] == fired
        for row, (g, e, _) in zip(strategy.decay_trace, trace, strict=True):
            assert row["client-lr"] == pytest.approx(g, rel=1e-12) and row["server-lr"] == pytest.approx(e, rel=1e-12)
        # the decided γ reaches the clients in the next round's config
        next_lr = strategy.decay_trace[-1]["next-client-lr"]
        assert strategy.round_config(rounds + 1)["client-lr"] == pytest.approx(next_lr)


# ------------------------------------------------------------------------------------------ §4.7 special cases
def test_theta_one_is_independent_of_gamma():
    hp = LU.LocalUpdateHParams(theta="sgd", server_lr=0.3)
    a = run(LU.LocalUpdate(hp, client_lr=0.01, batch_size=8), 10, 4)
    b = run(LU.LocalUpdate(hp, client_lr=0.7, batch_size=8), 10, 4)
    for sa, sb in zip(a, b, strict=True):
        np.testing.assert_array_equal(sa["w.weight"], sb["w.weight"])
    assert np.linalg.norm(w_of(a[-1]) - w_of(a[0])) > 0.1
    # and it is distributed mini-batch SGD: x_{t+1} = x_t − η·mean_i g_i(x_t) on one batch of B per client
    w0 = w_of(a[0])
    g = []
    for pid in range(4):
        x, y = ref.client_data(pid, DIM)
        idx = ref.batch_indices(len(y), 8, 1, 0, 1, pid)[0]
        g.append(ref.grad(w0, x[idx], y[idx]))
    np.testing.assert_allclose(w_of(a[1]), w0 - 0.3 * np.mean(g, axis=0), atol=1e-12)


@pytest.mark.parametrize("gamma,eta", [(0.1, 0.1), (0.05, 0.2), (0.2, 0.05)])
def test_ones_theta_is_fedavg_with_server_lr_eta_over_gamma(gamma, eta):
    lu = run(LU.LocalUpdate(LU.LocalUpdateHParams(theta="fedavg", theta_steps=4, server_lr=eta),
                            client_lr=gamma, batch_size=8, seed=0), 10, 4)
    fa = run(FedAvg(FedAvg.make_hparams(server_lr=eta / gamma), client_lr=gamma, local_steps=4, batch_size=8, seed=0,
                    weighting="uniform"), 10, 4)
    for t, (sa, sb) in enumerate(zip(lu, fa, strict=True)):
        np.testing.assert_allclose(sa["w.weight"], sb["w.weight"], rtol=0, atol=1e-10, err_msg=f"round {t}")
    assert np.linalg.norm(w_of(lu[-1]) - w_of(lu[0])) > 0.1


def test_gamma_zero_sums_gradients_at_round_start():
    theta = (0.5, 1.0, 2.0)
    strategy = LU.LocalUpdate(LU.LocalUpdateHParams(theta="0.5,1,2", server_lr=0.2), client_lr=0.0, batch_size=8)
    snaps = run(strategy, 1, 4)
    w0 = w_of(snaps[0])
    qs = []
    for pid in range(4):
        x, y = ref.client_data(pid, DIM)
        batches = ref.batch_indices(len(y), 8, 3, 0, 1, pid)
        qs.append(sum(th * ref.grad(w0, x[b], y[b]) for th, b in zip(theta, batches, strict=True)))
    np.testing.assert_allclose(w_of(snaps[1]), w0 - 0.2 * np.mean(qs, axis=0), rtol=0, atol=1e-12)


def _quadratic_params(d=3, seed=0):
    rng = np.random.default_rng(seed)
    m = rng.normal(size=(d, d))
    a = m @ m.T / d + 0.5 * np.eye(d)
    return a, rng.normal(size=d), rng.normal(size=d)


def _run_optimizer(theta, gamma, a, c, x0, grads=None):
    """Drive LocalUpdateOptimizer on f(x) = ½(x−c)ᵀA(x−c) (exact gradients) or on scripted gradients."""
    p = torch.nn.Parameter(torch.tensor(x0, dtype=torch.float64))
    theta = LU.normalize_theta(theta)
    opt = LU.LocalUpdateOptimizer([("p", p)], lr=gamma, theta=",".join(map(repr, theta)), planned_steps=len(theta))
    for k in range(len(theta)):
        opt.zero_grad()
        if grads is None:
            diff = p - torch.tensor(c)
            (0.5 * diff @ torch.tensor(a) @ diff).backward()
        else:
            p.grad = torch.tensor(grads[k], dtype=torch.float64)
        opt.step()
    return opt.uplink()["q"]["p"].numpy(), p.detach().numpy()


def test_optimizer_step_on_scripted_gradients():
    g = [np.array([1.0, -2.0]), np.array([0.5, 4.0]), np.array([3.0, 1.0])]
    q, x = _run_optimizer((0.5, 0.0, 2.0), 0.1, None, None, [1.0, 1.0], grads=g)
    np.testing.assert_allclose(q, 0.5 * g[0] + 2.0 * g[2], atol=1e-15)
    np.testing.assert_allclose(x, np.array([1.0, 1.0]) - 0.1 * (g[0] + g[1] + g[2]), atol=1e-15)
    # Θ travels as a comma-separated string of repr floats: exact round trip
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    theta = (0.1 + 0.2, 1 / 3, 0.0, 2.0)
    assert LU.LocalUpdateOptimizer([("p", p)], 0.1, theta=",".join(map(repr, theta)),
                                   planned_steps=4).hparams.weights == theta


def test_fomaml_uploads_gradient_at_last_iterate_and_matches_surrogate():
    a, c, x0 = _quadratic_params()
    q, _ = _run_optimizer(QT.theta_preset("fomaml", 3), 0.2, a, c, x0)
    x2 = x0.copy()
    for _ in range(2):
        x2 = x2 - 0.2 * a @ (x2 - c)
    np.testing.assert_allclose(q, a @ (x2 - c), atol=1e-12)
    # Theorem 3 for several Θ: deterministic clients upload exactly Q(γ,Θ)A(x − c)
    for theta in [(1.0,), (1.0,) * 4, (0.3, 0.0, 1.2), QT.theta_preset("kmaml", 2)]:
        q, _ = _run_optimizer(theta, 0.2, a, c, x0)
        np.testing.assert_allclose(q, QT.expected_update(x0, a, c, 0.2, theta), atol=1e-12)


def test_optimizer_enforces_K_steps():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    p.grad = torch.ones(2, dtype=torch.float64)
    opt = LU.LocalUpdateOptimizer([("p", p)], lr=0.1, theta="1,1", planned_steps=3)
    with pytest.raises(ValueError, match="exactly K"):
        opt.step()
    opt = LU.LocalUpdateOptimizer([("p", p)], lr=0.1, theta="1,1", planned_steps=2)
    opt.step()
    with pytest.raises(RuntimeError, match="took 1 steps"):
        opt.uplink()
    opt.step()
    with pytest.raises(RuntimeError, match="exceeds"):
        opt.step()
    with pytest.raises(ValueError, match=">= 0"):
        LU.LocalUpdateOptimizer([("p", p)], lr=0.1, theta="1,-1", planned_steps=2)


# ------------------------------------------------------------------------------------------ quadratic tools
@pytest.mark.parametrize("gamma", [0.0, 0.1, 0.3, 0.5, 0.9, 1.1])
def test_two_client_closed_form_in_gamma(gamma):
    mats, cs = QT.two_client_example()
    x = QT.surrogate_minimizer(mats, cs, gamma, QT.theta_preset("fedavg", 2))[0]
    assert x == pytest.approx((4 - 3 * gamma) / (6 - 5 * gamma), abs=1e-13)
    assert abs(x - QT.true_minimizer(mats, cs)[0]) == pytest.approx(gamma / (3 * (6 - 5 * gamma)), abs=1e-13)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 10, 20])
def test_two_client_closed_form_in_K(k):
    mats, cs = QT.two_client_example()
    x = QT.surrogate_minimizer(mats, cs, 0.5, QT.theta_preset("fedavg", k))[0]
    assert x == pytest.approx((3 * 2**k - 2) / (2 ** (k + 2) - 2), abs=1e-13)
    assert x - 2 / 3 == pytest.approx((2**k - 2) / (6 * (2 ** (k + 1) - 1)), abs=1e-13)


def test_iterating_localupdate_reaches_surrogate_minimizer():
    rng = np.random.default_rng(1)
    mats, cs = [], []
    for i in range(3):
        m = rng.normal(size=(3, 3))
        mats.append(m @ m.T / 3 + (0.5 + i) * np.eye(3))
        cs.append(rng.normal(size=3))
    theta = QT.theta_preset("fedavg", 5)
    xs = QT.run_deterministic(np.zeros(3), mats, cs, 0.1, theta, eta=0.05, rounds=3000)
    xstar = QT.surrogate_minimizer(mats, cs, 0.1, theta)
    np.testing.assert_allclose(xs[-1], xstar, atol=1e-9)
    assert np.linalg.norm(xstar - QT.true_minimizer(mats, cs)) > 1e-3
    np.testing.assert_allclose(QT.expected_round_update(xstar, mats, cs, 0.1, theta), 0.0, atol=1e-12)
    # Lemma 5: γ = 0 (or K = 1) only rescales the loss, so the fixed point is the true minimiser
    np.testing.assert_allclose(QT.distortion(mats[0], 0.0, (0.5, 1.0, 2.0)), 3.5 * np.eye(3), atol=1e-15)
    np.testing.assert_allclose(QT.surrogate_minimizer(mats, cs, 0.0, theta), QT.true_minimizer(mats, cs), atol=1e-12)


def test_kmaml_is_theta_2k_plus_1_and_fd_gradient():
    a, c, x = _quadratic_params(seed=3)
    for k in (1, 2, 3):
        gm = QT.kmaml_gradient(x, a, c, 0.15, k)
        np.testing.assert_allclose(QT.gd_inner_loop(x, a, c, 0.15, QT.theta_preset("kmaml", k)), gm, atol=1e-12)

        def mk(z, k=k):  # m_K(z) = f(X_K(z)), K plain GD steps
            for _ in range(k):
                z = z - 0.15 * a @ (z - c)
            return 0.5 * (z - c) @ a @ (z - c)

        fd = np.array([(mk(x + 1e-6 * e) - mk(x - 1e-6 * e)) / 2e-6 for e in np.eye(3)])
        np.testing.assert_allclose(gm, fd, atol=1e-7)


def test_condition_number_bound_and_continuum_example():
    rng = np.random.default_rng(2)
    for _ in range(5):
        m = rng.normal(size=(4, 4))
        a = m @ m.T + 0.1 * np.eye(4)
        ev = np.linalg.eigvalsh(a)
        gamma, k = 0.5 / ev[-1], 6
        bound = (1 - (1 - gamma * ev[-1]) ** k) / (1 - (1 - gamma * ev[0]) ** k)
        kappa = QT.surrogate_condition_number([a], gamma, QT.theta_preset("fedavg", k))
        assert kappa == pytest.approx(bound, rel=1e-9) and kappa < ev[-1] / ev[0]
        assert QT.surrogate_condition_number([a], 0.0, (1.0,) * k) == pytest.approx(ev[-1] / ev[0], rel=1e-9)
    assert QT.continuum_minimizer(0.0, 20) == pytest.approx(1 / 1.4, abs=1e-6)
    assert QT.continuum_minimizer(0.5, 1) == pytest.approx(1 / 1.4, abs=1e-6)
    assert QT.continuum_minimizer(0.5, 2000) == pytest.approx(0.8, abs=1e-6)
    xs = [QT.continuum_minimizer(0.5, k) for k in (1, 2, 5, 10, 20)]
    assert all(b > a for a, b in pairwise(xs))


def _least_squares(pid):
    x, y = ref.client_data(pid, DIM)
    a = x.T @ x / len(y)
    return a, np.linalg.solve(a, x.T @ y / len(y))


def test_real_strategy_fixed_point_is_surrogate_minimizer():
    """Full-batch clients (B >= n_i) are deterministic quadratics: one real round moves x by −η∇f̃ and
    x*(γ, Θ) from the analysis tools is a fixed point of the real strategy."""
    theta, gamma, eta = QT.theta_preset("fedavg", 4), 0.3, 0.5
    mats, cs = zip(*[_least_squares(pid) for pid in range(4)], strict=True)
    xstar = QT.surrogate_minimizer(mats, cs, gamma, theta)
    xtrue = QT.true_minimizer(mats, cs)
    assert np.linalg.norm(xstar - xtrue) > 1e-2
    for start in (xstar, xtrue, np.linspace(-1, 1, DIM)):
        model = start_model()
        with torch.no_grad():
            model.w.weight.copy_(torch.tensor(start)[None, :])
        s = LU.LocalUpdate(LU.LocalUpdateHParams(theta="fedavg", theta_steps=4, server_lr=eta), client_lr=gamma,
                           batch_size=1000)
        snaps, _ = simulate(s, ArrayRecord(model.state_dict()), 1, 4, RC)
        expected = start - eta * QT.expected_round_update(start, mats, cs, gamma, theta)
        np.testing.assert_allclose(w_of(snaps[1]), expected, atol=1e-10)
    np.testing.assert_allclose(QT.expected_round_update(xstar, mats, cs, gamma, theta), 0.0, atol=1e-10)


def test_theta_parsing():
    assert LU.parse_theta("fedavg", 3) == (1.0, 1.0, 1.0)
    assert LU.parse_theta("reptile", 2) == (1.0, 1.0)
    assert LU.parse_theta("fomaml", 3) == (0.0, 0.0, 1.0)
    assert LU.parse_theta("kmaml", 2) == (0.0, 0.0, 0.0, 0.0, 1.0)
    assert LU.parse_theta("sgd", 7) == (1.0,)
    assert LU.parse_theta("0.5, 0, 2, 0, 0", 9) == (0.5, 0.0, 2.0)
    for bad in ("1,-1", "0,0", "abc", "1,nan"):
        with pytest.raises(ValueError):
            LU.parse_theta(bad, 3)


# ------------------------------------------------------------------------------------------ plateau controller
def _fired(losses, rule, **kw):
    ctl = LU.PlateauController(rule=rule, **kw)
    state, fired = ctl.init(), []
    for t, ell in enumerate(losses, start=1):
        state, decay = ctl.update(state, ell)
        if decay:
            fired.append(t)
    return fired


SPEC_SEQUENCES = [  # hand-derived controller sequences (1-based decay rounds)
    ((5, 4, 3.5, 3.4999, 3.4999, 3.4999, 3, 3, 3, 3, 3, 3), dict(window=1, patience=2, cooldown=1, min_delta=0.01),
     [5, 9, 12], [5, 9, 11]),
    (tuple(5 - 0.006 * (t - 1) for t in range(1, 13)), dict(window=1, patience=1, cooldown=0, min_delta=0.01),
     list(range(2, 13)), [2, 4, 6, 8, 10, 12]),
    ((3.0,) * 10, dict(window=1, patience=1, cooldown=2, min_delta=0.01), [3, 6, 9], [2, 4, 6, 8, 10]),
    # hand-derived (see docs/methods/localupdate.md): W = 3, P = 2, C = 2, Δ = 0.5
    ((10, 8, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6), dict(window=3, patience=2, cooldown=2, min_delta=0.5), [7, 11], [7, 10]),
    # hand-derived: W = 2, P = 1, C = 0, Δ = 0.1 (tff's +inf window fires in round 1)
    ((4, 2, 2, 2, 2, 2, 2), dict(window=2, patience=1, cooldown=0, min_delta=0.1), [4, 5, 6, 7], [1, 4, 5, 6, 7]),
    # hand-derived, exact in binary: a drop of exactly Δ is progress for paper (<=), not for tff (<)
    ((2.0, 1.5, 1.0), dict(window=1, patience=1, cooldown=0, min_delta=0.5), [], [2]),
]


@pytest.mark.parametrize("losses,kw,paper,tff", SPEC_SEQUENCES)
def test_controller_scripted_sequences(losses, kw, paper, tff):
    assert _fired(losses, "paper", **kw) == paper
    assert _fired(losses, "tff", **kw) == tff
    # the line-by-line transcription in tests/reference agrees
    args = (kw["window"], kw["patience"], kw["cooldown"], kw["min_delta"])
    assert ref.decay_rounds(losses, *args, rule="paper") == paper
    assert ref.decay_rounds(losses, *args, rule="tff") == tff


def test_controller_flags():
    # W = P = 1, C = 0, paper = Algorithm 3: decay iff ℓ_t > min_{j<t} ℓ_j − Δ
    ells = [3, 2, 2.5, 1.95, 1.0, 1.0, 0.5]
    alg3 = [t for t in range(2, len(ells) + 1) if ells[t - 1] > min(ells[: t - 1]) - 0.1]
    assert _fired(ells, "paper", window=1, patience=1, cooldown=0, min_delta=0.1) == alg3 == [3, 4, 6]
    # window fill swapped between the rules
    seq = (4, 2, 2, 2, 2, 2, 2)
    kw = dict(window=2, patience=1, cooldown=0, min_delta=0.1)
    assert _fired(seq, "paper", window_fill="inf", **kw) == [1, 4, 5, 6, 7]
    assert _fired(seq, "tff", window_fill="partial", **kw) == [4, 5, 6, 7]
    # best-loss reset after a decay
    kw1 = dict(window=1, patience=1, cooldown=0, min_delta=0.1)
    assert _fired((3, 2, 2, 2), "paper", **kw1) == [3, 4]
    assert _fired((3, 2, 2, 2), "paper", reset_best_on_decay=True, **kw1) == [3]
    assert _fired((3, 2, 2, 2, 2), "tff", window_fill="partial", **kw1) == [3, 4, 5]
    assert _fired((3, 2, 2, 2, 2), "tff", window_fill="partial", reset_best_on_decay=True, **kw1) == [3, 5]


@pytest.mark.parametrize("seed", range(5))
def test_paper_rule_never_decays_during_cooldown(seed):
    rng = random.Random(seed)
    losses = [rng.choice([1.0, 1.0, 0.9, 1.1]) for _ in range(60)]
    c = rng.randint(1, 4)
    fired = _fired(losses, "paper", window=rng.randint(1, 3), patience=1, cooldown=c, min_delta=0.01)
    assert fired and fired[0] > c
    assert all(b - a > c for a, b in pairwise(fired))


def test_decay_factors_one_is_localupdate():
    base = dict(theta="fedavg", theta_steps=3, server_lr=0.3)
    lu = run(LU.LocalUpdate(LU.LocalUpdateHParams(**base), client_lr=0.1, batch_size=8), 10, 4)
    s = LU.LocalUpdateDecay(
        LU.LocalUpdateDecayHParams(**base, client_decay=1.0, server_decay=1.0, window=1, patience=1, cooldown=0,
                                   min_delta=10.0),
        client_lr=0.1, batch_size=8,
    )
    lud = run(s, 10, 4)
    assert sum(r["decayed"] for r in s.decay_trace) >= 9  # it fired, with factor 1
    for sa, sb in zip(lu, lud, strict=True):
        np.testing.assert_array_equal(sa["w.weight"], sb["w.weight"])


# ------------------------------------------------------------------------------------------ protocol (mocked replies)
def _reply(node: int, q: np.ndarray | None, n: int, loss_before: float, extra: dict | None = None) -> Message:
    md = Metadata(run_id=1, message_id=f"r{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="x",
                  group_id="", created_at=time.time(), ttl=3600.0, message_type=MessageType.TRAIN)
    content = RecordDict({"metrics": MetricRecord({"num-examples": n, "train-loss-before": loss_before})})
    if q is not None:
        content["q"] = ArrayRecord({"w.weight": Array(q)})
    for name, arr in (extra or {}).items():
        content[name] = ArrayRecord({"w.weight": Array(arr)})
    return Message(content=content, metadata=md)


def test_protocol_config_and_aggregation():
    hp = LU.LocalUpdateHParams(theta="0.5,1,0", server_lr=0.5)
    s = LU.LocalUpdate(hp, client_lr=0.2, local_steps=7, local_epochs=3)
    grid = LoopbackGrid(None, 3)
    x0 = np.array([[1.0, 2.0]])
    msgs = list(s.configure_train(1, ArrayRecord({"w.weight": Array(x0)}), own_loop_config(), grid))
    assert len(msgs) == 3
    cfg = msgs[0].content["config"]
    assert cfg["method"] == "localupdate" and cfg["local-steps"] == 2 and cfg["client-lr"] == 0.2
    assert cfg["localupdate.theta"] == "0.5,1,0" and cfg["localupdate.theta-steps"] == 10
    q = [np.array([[1.0, 0.0]]), np.array([[3.0, 2.0]]), np.array([[2.0, 2.0]])]
    replies = [
        _reply(1, q[0], 10, 1.0),
        _reply(2, q[1], 30, 1.0),
        _reply(3, None, 10, 1.0, extra={"arrays": x0}),  # a model instead of q: rejected
    ]
    arrays, metrics = s.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w.weight"].numpy(), x0 - 0.5 * (q[0] + q[1]) / 2)  # uniform mean
    assert metrics["replies-rejected"] == 1 and "missing ArrayRecord 'q'" in str(s.history[-1].rejections[0])
    assert metrics["server-lr"] == 0.5 and metrics["client-lr"] == 0.2
    assert s.history[-1].round_metrics == {"client-lr": 0.2, "server-lr": 0.5}
    bad = np.array([[np.nan, 0.0]])
    s2 = LU.LocalUpdate(hp, client_lr=0.2, weighting="examples")
    s2.configure_train(1, ArrayRecord({"w.weight": Array(x0)}), own_loop_config(), grid)
    arrays, metrics = s2.aggregate_train(1,
                                         [_reply(1, q[0], 10, 1.0), _reply(2, q[1], 30, 1.0), _reply(3, bad, 5, 1.0)])
    np.testing.assert_allclose(arrays["w.weight"].numpy(), x0 - 0.5 * (10 * q[0] + 30 * q[1]) / 40)
    assert metrics["replies-rejected"] == 1


def test_protocol_decay_reaches_next_round_config():
    hp = LU.LocalUpdateDecayHParams(theta="sgd", server_lr=1.0, window=1, patience=1, cooldown=0, min_delta=0.1,
                                    loss_weighting="examples")
    s = LU.LocalUpdateDecay(hp, client_lr=0.4)
    grid = LoopbackGrid(None, 2)
    x = ArrayRecord({"w.weight": Array(np.zeros((1, 2)))})
    g = np.array([[0.1, 0.1]])
    # per-round client losses (n = 10 and 30): example-weighted means 2.0, 1.95, 3.0 → decay in rounds 2 and 3
    losses = [(2.0, 2.0), (1.8, 2.0), (3.0, 3.0)]
    lrs = []
    for t, (l1, l2) in enumerate(losses, start=1):
        msgs = list(s.configure_train(t, x, own_loop_config(), grid))
        lrs.append(msgs[0].content["config"]["client-lr"])
        # (q differs per round, as an honest client's does: the same bytes again would be rejected as a replay)
        x, metrics = s.aggregate_train(t, [_reply(1, g * t, 10, l1), _reply(2, g * t, 30, l2)])
        assert metrics["decayed"] == (1.0 if t > 1 else 0.0)
        assert {"plateau-loss", "plateau-estimate", "plateau-best", "plateau-counter", "plateau-cooldown", "decayed",
                "client-lr", "server-lr", "next-client-lr", "next-server-lr"} <= set(metrics.keys())
        assert s.history[-1].train_metrics["next-client-lr"] == s.server_state["client-lr"]
    assert s.decay_trace[1]["plateau-loss"] == pytest.approx(1.95)
    assert lrs == pytest.approx([0.4, 0.4, 0.04])
    assert s.server_state["client-lr"] == pytest.approx(0.004) and s.server_state["server-lr"] == pytest.approx(0.81)
    # round 3 stepped with η = 0.9 (decayed after round 2)
    np.testing.assert_allclose(x["w.weight"].numpy(), -(1.0 * 1 + 1.0 * 2 + 0.9 * 3) * g)  # server lr × round-t q


def test_registry_and_run_config():
    assert {"localupdate", "localupdatedecay"} <= set(METHODS)
    assert METHODS["localupdate"].local_optimizer is LU.LocalUpdateOptimizer
    _, spec, hp = parse_run_config({"method": "localupdatedecay", "localupdatedecay.theta": "kmaml",
                                    "localupdatedecay.theta-steps": 2, "localupdatedecay.plateau-rule": "tff"})
    assert spec.strategy is LU.LocalUpdateDecay and hp.plateau_rule == "tff"
    assert spec.strategy(hp).theta == (0.0, 0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ConfigError, match="localupdate.theta"):
        parse_run_config({"method": "localupdate", "localupdate.theta": "1,-2"})
    with pytest.raises(ConfigError, match="plateau-rule"):
        parse_run_config({"method": "localupdatedecay", "localupdatedecay.plateau-rule": "keras"})


def test_surrogate_plot_script(tmp_path):
    from simulations.tools import surrogate_plot

    out = tmp_path / "fp.png"
    surrogate_plot.main([str(out)])
    assert out.exists() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_server_app_path(tmp_path):
    """Registry → ServerApp logic → ClientApp in-process: K(Θ) overrides the common local-epochs/steps."""
    from simulations.engine.inprocess import run_inprocess

    summary = run_inprocess(
        {"method": "localupdatedecay", "task": "synthetic-linear", "synthetic-clients": 3, "synthetic-dim": DIM,
         "num-server-rounds": 4, "output-dir": str(tmp_path), "client-lr": 0.05, "local-steps": 9,
         "localupdatedecay.theta": "1,1", "localupdatedecay.server-lr": 0.05, "localupdatedecay.window": 1,
         "localupdatedecay.patience": 1, "localupdatedecay.cooldown": 1, "localupdatedecay.min-delta": 100.0},
        3,
    )
    assert summary["status"] == "completed" and summary["rounds_without_update"] == []
    rows = summary["final"]
    assert rows["round"] == 4 and rows["replies-used"] == 3 and rows["replies-rejected"] == 0
    assert rows["test-loss"] < 10.0


# ------------------------------------------------------------------------------------------ the optimizer in any loop
def _tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).double()


def _tiny_data(n=20):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, 1, generator=g, dtype=torch.float64)


def _round_content(name, **hp):
    """The RecordDict a client receives in round 1 of ``name`` (built by the real strategy)."""
    spec = METHODS[name]
    strategy = spec.build(spec.default_hparams().replace(**hp), client_lr=0.05, batch_size=6)
    return spec, strategy.prepare_round(1, ArrayRecord(_tiny_model().state_dict()), own_loop_config(), num_sampled=1)


def _optimizer_from(spec, content, model):
    """The client optimizer built by hand from a train message (what train_reply does)."""
    config = dict(content.config_records["config"])
    model.load_state_dict(content.array_records["arrays"].to_torch_state_dict())
    downlink = {k: r.to_torch_state_dict() for k, r in content.array_records.items() if k != "arrays"}
    return LU.LocalUpdateOptimizer(
        model.named_parameters(), lr=config["client-lr"], downlink=downlink, planned_steps=config["local-steps"],
        **spec.hparams.client_kwargs_from_wire(config, spec.name),
    )


def _steps(opt, model, x, y, batches):
    for idx in batches:
        idx = torch.from_numpy(idx)
        opt.zero_grad()
        half_mse(model(x[idx]), y[idx]).backward()
        opt.step()


@pytest.mark.parametrize("name", ["localupdate", "localupdatedecay"])
def test_plain_torch_loop_matches_train_reply(name):
    spec, content = _round_content(name, theta="0.5,0,2,1")
    config = content.config_records["config"]
    assert config["local-steps"] == 4 and config[f"{name}.theta"] == "0.5,0,2,1"
    x, y = _tiny_data()
    model = _tiny_model()
    opt = _optimizer_from(spec, content, model)
    _steps(opt, model, x, y, batch_indices(len(x), config["batch-size"], 4, 0, 1, 3))
    ours = opt.uplink()

    other = _tiny_model()
    reply = train_reply(other, content, x, y, half_mse, seed=0, client_key=3)
    assert set(reply.array_records) == {"q"}  # q replaces the model
    q = reply.array_records["q"].to_torch_state_dict()
    assert set(q) == set(ours["q"]) == {n for n, _ in model.named_parameters()}
    for k in q:
        assert torch.equal(q[k], ours["q"][k]), k
    for k, v in other.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    assert reply.metric_records["metrics"]["num-steps"] == 4.0
    assert any(float(v.abs().max()) > 1e-3 for v in q.values())


def test_state_dict_mid_round_resumes_identically():
    spec, content = _round_content("localupdate", theta="1,0.5,0,2,1")
    x, y = _tiny_data()
    batches = batch_indices(len(x), 6, 5, 0, 1, 0)
    model = _tiny_model()
    opt = _optimizer_from(spec, content, model)
    _steps(opt, model, x, y, batches[:2])
    buf = io.BytesIO()  # state_dict() holds references (torch's contract): save it, as a checkpoint would
    torch.save({"opt": opt.state_dict(), "model": model.state_dict()}, buf)
    _steps(opt, model, x, y, batches[2:])  # uninterrupted

    model2 = _tiny_model()
    opt2 = _optimizer_from(spec, content, model2)
    buf.seek(0)
    saved = torch.load(buf)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    assert opt2.steps_taken == 2
    _steps(opt2, model2, x, y, batches[2:])
    for k, v in opt.uplink()["q"].items():
        assert torch.equal(v, opt2.uplink()["q"][k]), k
    for k, v in model.state_dict().items():
        assert torch.equal(v, model2.state_dict()[k]), k


def test_optimizer_misuse_raises_clear_errors():
    model = _tiny_model()
    params = lambda: model.named_parameters()  # noqa: E731
    with pytest.raises(ValueError, match="planned_steps"):
        LU.LocalUpdateOptimizer(params(), lr=0.1, theta="1,1")
    with pytest.raises(RuntimeError, match="no local step"):
        LU.LocalUpdateOptimizer(params(), lr=0.1, theta="1,1", planned_steps=2).uplink()
    with pytest.raises(TypeError, match="unknown hyper-parameter.*theta, theta_steps"):
        LU.LocalUpdateOptimizer(params(), lr=0.1, planned_steps=10, thetta="1,1")
    with pytest.raises(ValueError, match="theta_steps"):
        LU.LocalUpdateOptimizer(params(), lr=0.1, planned_steps=1, theta="fedavg", theta_steps=0)
    with pytest.raises(ValueError, match="neither a preset"):
        LU.LocalUpdateOptimizer(params(), lr=0.1, planned_steps=1, theta="maml")
    with pytest.raises(ValueError, match="lr"):
        LU.LocalUpdateOptimizer(params(), lr=-0.1, planned_steps=2, theta="1,1")
    with pytest.raises(TypeError, match="named_parameters"):
        LU.LocalUpdateOptimizer(model.parameters(), lr=0.1, planned_steps=2, theta="1,1")
    with pytest.raises(ConfigError, match="localupdate.theta-steps"):
        parse_run_config({"method": "localupdate", "localupdate.theta-steps": 0})


# ------------------------------------------------------------------------------------------ server state = data
def _drive(strategy, arrays, rounds, grid):
    for t in rounds:
        replies = grid.send_and_receive(list(strategy.configure_train(t, arrays, own_loop_config(), grid)))
        new, _ = strategy.aggregate_train(t, replies)
        arrays = new if new is not None else arrays
    return arrays


def test_decay_resumes_from_state_dict_identically():
    """The controller's state is plain data in the server state: a pickled state_dict() taken after round 8 and
    loaded into a fresh strategy continues exactly like the uninterrupted run (decays before and after the cut)."""
    import pickle

    from client_app.app import app as client_app

    hp = LU.LocalUpdateDecayHParams(theta="fedavg", theta_steps=3, server_lr=0.3, window=2, patience=2, cooldown=1,
                                    min_delta=0.05, server_opt="yogi")
    make = lambda: LU.LocalUpdateDecay(hp, client_lr=0.1, batch_size=8, seed=0)  # noqa: E731
    start = ArrayRecord(start_model(0.5).state_dict())
    full = make()
    end_full = _drive(full, start, range(1, 13), LoopbackGrid(client_app, 4, RC))

    first = make()
    mid = _drive(first, start, range(1, 9), LoopbackGrid(client_app, 4, RC))
    sd = pickle.loads(pickle.dumps(first.state_dict()))
    plateau = {k: v for k, v in sd["server_state"].items() if k.startswith("plateau-")}
    assert set(plateau) == {"plateau-losses", "plateau-best", "plateau-counter", "plateau-cooldown"}
    assert all(isinstance(v, (int, float, list)) for v in plateau.values())
    second = make()
    second.load_state_dict(sd)
    end_resumed = _drive(second, mid, range(9, 13), LoopbackGrid(client_app, 4, RC))

    fired = [int(r["round"]) for r in full.decay_trace if r["decayed"]]
    assert any(t <= 8 for t in fired) and any(t > 8 for t in fired), fired
    assert [int(r["round"]) for r in second.decay_trace if r["decayed"]] == fired
    np.testing.assert_array_equal(end_resumed["w.weight"].numpy(), end_full["w.weight"].numpy())
    assert second.server_state["client-lr"] == full.server_state["client-lr"] < 0.1


def test_only_localupdatedecay_declares_it_needs_train_loss_before():
    """The ServerApp refuses ``train-loss-before = false`` for a strategy that declares it needs the metric."""
    from flower_strategies.core.registry import METHODS

    assert {n for n, spec in METHODS.items() if spec.strategy.needs_train_loss_before} == {"localupdatedecay"}
    assert LU.LocalUpdateDecay.needs_train_loss_before and not LU.LocalUpdate.needs_train_loss_before
