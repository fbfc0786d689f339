"""FedLADA / LocalAdam (paper 002): exactness against the float64 transcription of Algorithm 3, the §3.7 special
cases, unit tests of the client step and of the server math, and mocked-reply protocol tests."""

from __future__ import annotations

import dataclasses
import inspect
import time
from itertools import pairwise

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MessageType, Metadata, MetricRecord, RecordDict

import flower_strategies  # noqa: F401  (core registrations first)
import flower_strategies.methods.fedlada  # noqa: F401  (registers fedlada, localadam)
from flower_strategies.methods.baselines import FedAvg
from flower_strategies.methods.fedlada import (
    DELTA_PER_STEP, GLOBAL_OFFSET, VHAT, FedLADA, FedLADAHParams, FedLADAOptimizer,
)
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.registry import METHODS, parse_run_config, register
from flower_strategies.core.strategy import RecordSpec, RoundInputs
from flower_strategies.core.loop import own_loop_config
from tests.helpers import (
    SYNTH_DIM, SYNTH_NODES, SYNTH_RC, SYNTH_X0, assert_same_round, mlp_task, named_randn, plain_loop_round,
    recorded_run,
    synthetic_initial_arrays, with_server_state,
)
from simulations.engine.inprocess import simulate
from tests.reference.fedlada_ref import LadaConfig, load_clients, run_fedlada

DIM, NODES, RC, X0 = SYNTH_DIM, SYNTH_NODES, SYNTH_RC, SYNTH_X0
CLIENTS = load_clients(range(NODES), DIM, seed=0)
LOCALADAM = METHODS["localadam"]
DIRECTION_SUM = "direction-sum"


# ------------------------------------------------------------------------------------------ test-only debug method
class DirectionSumOptimizer(FedLADAOptimizer):
    """Test-only: FedLADA's client that also uploads ``Σ_τ m⊙ϑ`` (the Eq. (4) / Lemma B.8 identities)."""

    def update_param(self, name, p, grad, state, group):
        super().update_param(name, p, grad, state, group)
        theta = self.preconditioner(state, group)
        state.setdefault(DIRECTION_SUM, torch.zeros_like(p)).add_(state["m"] if theta is None else state["m"] * theta)

    def uplink_arrays(self):
        return {**super().uplink_arrays(),
                DIRECTION_SUM: {n: self.state[p][DIRECTION_SUM] for n, p, _ in self.named_params()}}


class DirectionSumFedLADA(FedLADA):
    """Test-only: FedLADA that also averages the clients' ``Σ_τ m⊙ϑ`` (kept in its state as ``"direction-sum"``)."""

    method = "fedlada-direction-sum"
    local_optimizer = DirectionSumOptimizer

    def uplink_specs(self):
        return super().uplink_specs() + (RecordSpec(DIRECTION_SUM, "mean", "params"),)

    def server_update(self, inputs, state):
        arrays, new_state, metrics = super().server_update(inputs, state)
        return arrays, {**new_state, DIRECTION_SUM: inputs.aggregates[DIRECTION_SUM]}, metrics


@pytest.fixture
def direction_sum_method():
    """Registers the test-only method for the in-process ClientApp, and removes it afterwards."""
    register(DirectionSumFedLADA, paper="test only", summary="FedLADA + the Σ_τ m⊙ϑ uplink")
    yield DirectionSumFedLADA
    del METHODS[DirectionSumFedLADA.method]


# ------------------------------------------------------------------------------------------ harness
initial_arrays = synthetic_initial_arrays


def run_engine(cls, hp, rounds, *, client_lr=0.01, **kwargs):
    """Real strategy + real ClientApp; returns (weights per round, sampled pids per round, per-round states,
    strategy)."""
    def capture(state):
        return {
            "vhat": state[VHAT]["w.weight"].copy(), "offset": state[GLOBAL_OFFSET]["w.weight"].copy(),
            "dir_sum": state[DIRECTION_SUM]["w.weight"].copy() if DIRECTION_SUM in state else None,
        }

    weights, schedule, states, strat, _ = recorded_run(cls, hp, rounds, capture, client_lr=client_lr, **kwargs)
    return weights, schedule, states, strat


def ref_config(hp, *, client_lr, local_steps, local_epochs, batch_size, weighting, amend_weight=None) -> LadaConfig:
    fields = {f.name for f in dataclasses.fields(LadaConfig)}
    cfg = {k: v for k, v in dataclasses.asdict(hp).items() if k in fields}
    if amend_weight is not None:
        cfg["amend_weight"] = amend_weight
    return LadaConfig(**cfg, client_lr=client_lr, local_steps=local_steps, local_epochs=local_epochs,
                      batch_size=batch_size, weighting=weighting)


VARIANTS = {
    "paper-defaults": (FedLADAHParams(), {}),
    "examples-unequal-K": (FedLADAHParams(amend_weight=0.3),
                           {"weighting": "examples", "local_steps": 0, "batch_size": 16}),
    "examples-unequal-K-per-client": (FedLADAHParams(amend_weight=0.3, offset_steps="per-client"),
                                      {"weighting": "examples", "local_steps": 0, "batch_size": 16}),
    "uniform-unequal-K-per-client-consuming": (FedLADAHParams(offset_steps="per-client", offset_lr="consuming"),
                                               {"local_steps": 0, "batch_size": 16}),
    "server-v-eps-outside-consuming": (
        FedLADAHParams(v_init="server", eps_placement="outside", eps=1e-3, offset_lr="consuming", server_lr=0.7), {}),
    "eps-inside-precond-decoupled-initial": (
        FedLADAHParams(eps_placement="inside", eps=1e-4, precondition_offset=True, decoupled_wd=True,
                       offset_lr="initial", client_lr_decay=0.9), {}),
    "K-minus-1-vhat-1e-8": (FedLADAHParams(local_updates="K-1", initial_vhat=1e-8, weight_decay=0.0), {}),
    "adam-no-max": (FedLADAHParams(second_moment="adam", v_init="server", initial_vhat=1e-4, beta1=0.5), {}),
    "sgd-base": (FedLADAHParams(second_moment="sgd", beta1=0.5, amend_weight=0.5), {"client_lr": 0.05}),
}


# ------------------------------------------------------------------------------------------ equivalence
@pytest.mark.parametrize("name", list(VARIANTS))
def test_engine_matches_algorithm3_reference(name):
    hp, over = VARIANTS[name]
    setup = {"client_lr": 0.01, "local_steps": 5, "local_epochs": 1, "batch_size": 8, "weighting": "uniform", **over}
    xs, schedule, states, strat = run_engine(FedLADA, hp, 12, **setup)
    assert len(xs) == 13 and all(len(s) == 5 for s in schedule)
    assert len({tuple(s) for s in schedule}) > 1  # partial participation really varies
    ref = run_fedlada(X0, CLIENTS, schedule, ref_config(hp, **setup))
    for t in range(1, 13):
        np.testing.assert_allclose(xs[t], ref.xs[t], rtol=0, atol=1e-6, err_msg=f"x after round {t}")
        np.testing.assert_allclose(states[t - 1]["offset"], ref.offsets[t], rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(states[t - 1]["vhat"], ref.vsrv[t], rtol=1e-6, atol=1e-15)
    assert np.abs(xs[-1] - X0).max() > 0.02  # the model moved: the comparison is not vacuous


UNEQUAL = {"client_lr": 0.01, "local_steps": 0, "local_epochs": 1, "batch_size": 16, "weighting": "uniform"}


def test_offset_steps_readings_differ_with_unequal_step_counts():
    """Epochs mode (K_i = ⌈n_i/B⌉ = 2…4 here): g_a = Δ̄/(η_l·K̄) and g_a = mean_i Δ_i/(η_l·K_i) are different numbers;
    each engine run matches its own reading of the reference and not the other one."""
    hp = {r: FedLADAHParams(amend_weight=0.3, offset_steps=r) for r in ("mean", "per-client")}
    runs = {r: run_engine(FedLADA, hp[r], 4, **UNEQUAL) for r in hp}
    schedule = runs["mean"][1]
    assert runs["per-client"][1] == schedule
    refs = {r: run_fedlada(X0, CLIENTS, schedule, ref_config(hp[r], **UNEQUAL)) for r in hp}
    for t in range(1, 5):
        for r in hp:
            np.testing.assert_allclose(runs[r][0][t], refs[r].xs[t], rtol=0, atol=1e-9)
            np.testing.assert_allclose(runs[r][2][t - 1]["offset"], refs[r].offsets[t], rtol=1e-9, atol=1e-12)
        gap = np.abs(refs["mean"].offsets[t] - refs["per-client"].offsets[t]).max()
        assert gap > 1e-2 * np.abs(refs["mean"].offsets[t]).max()  # measured ≈ 0.04 absolute, ≈ 10 % relative
        assert np.abs(runs["per-client"][2][t - 1]["offset"] - refs["mean"].offsets[t]).max() > 1e3 * 1e-9
    assert np.abs(runs["mean"][0][4] - runs["per-client"][0][4]).max() > 1e-4  # the readings lead to other models


def test_offset_steps_readings_coincide_with_equal_step_counts():
    """local-steps = K for every client: both readings are Δ̄/(η_l·K) (to rounding)."""
    setup = {**UNEQUAL, "local_steps": 5}
    hp = {r: FedLADAHParams(amend_weight=0.3, offset_steps=r) for r in ("mean", "per-client")}
    runs = {r: run_engine(FedLADA, hp[r], 4, **setup) for r in hp}
    refs = {r: run_fedlada(X0, CLIENTS, runs["mean"][1], ref_config(hp[r], **setup)) for r in hp}
    for t in range(1, 5):
        np.testing.assert_allclose(refs["per-client"].offsets[t], refs["mean"].offsets[t], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(runs["per-client"][2][t - 1]["offset"], runs["mean"][2][t - 1]["offset"],
                                   rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(runs["per-client"][0][t], runs["mean"][0][t], rtol=0, atol=1e-13)
        np.testing.assert_allclose(runs["per-client"][2][t - 1]["offset"], refs["per-client"].offsets[t],
                                   rtol=1e-9, atol=1e-12)


def test_localadam_is_fedlada_with_amend_weight_one():
    """§3.7 case 1: α = 1 ⇒ local AMSGrad (restarted m, v̂ seeded with the averaged v̂) + averaging."""
    setup = {"client_lr": 0.01, "local_steps": 5, "local_epochs": 1, "batch_size": 8}
    xs_la, sched_la, st_la, strat = run_engine(FedLADA, LOCALADAM.default_hparams(), 10, method="localadam", **setup)
    xs_fl, sched_fl, st_fl, _ = run_engine(FedLADA, FedLADAHParams(amend_weight=1.0), 10, **setup)
    assert sched_la == sched_fl
    for a, b in zip(xs_la, xs_fl, strict=True):
        np.testing.assert_array_equal(a, b)
    ref = run_fedlada(X0, CLIENTS, sched_la,
                      ref_config(LOCALADAM.default_hparams(), weighting="uniform", amend_weight=1.0, **setup))
    for t in range(1, 11):
        np.testing.assert_allclose(xs_la[t], ref.xs[t], rtol=0, atol=1e-6)
        np.testing.assert_allclose(st_la[t - 1]["vhat"], ref.vsrv[t], rtol=1e-6, atol=1e-15)
    # LocalAdam sends no global offset: download 2× (x, v̄) and upload 2× (x_i, v̂_i) the model's bytes
    model_bytes = X0.size * 8
    h = strat.history[0]
    assert h.bytes_down == 2 * model_bytes * h.sampled and h.bytes_up == 2 * model_bytes * h.replies_used
    assert GLOBAL_OFFSET not in strat.downlink(2)


def test_amend_weight_one_ignores_the_offset():
    torch.manual_seed(0)
    outs = []
    for offset in (torch.zeros(1, 4, dtype=torch.float64), torch.randn(1, 4, dtype=torch.float64) * 10):
        p = torch.nn.Parameter(torch.tensor([[0.5, -1.0, 2.0, 0.0]], dtype=torch.float64))
        opt = FedLADAOptimizer([("w", p)], lr=0.1, amend_weight=1.0, weight_decay=0.0,
                               downlink={VHAT: {"w": torch.full((1, 4), 1e-3, dtype=torch.float64)},
                                         GLOBAL_OFFSET: {"w": offset}})
        for k in range(3):
            p.grad = torch.tensor([[1.0, -2.0, 0.5, 0.1]], dtype=torch.float64) * (k + 1)
            opt.step()
        outs.append(p.detach().clone())
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ special cases
def test_amend_weight_zero_extrapolates_the_offset():
    """§3.7 case 2: α = 0 ⇒ x_K = x_t − η_l·K·g_a whatever the data; the server then reproduces g_a."""
    torch.manual_seed(1)
    g_a = torch.randn(2, 3, dtype=torch.float64)
    x_t = torch.randn(2, 3, dtype=torch.float64)
    lr, K = 0.05, 7
    finals = []
    for client in range(3):
        p = torch.nn.Parameter(x_t.clone())
        opt = FedLADAOptimizer([("w", p)], lr=lr, amend_weight=0.0, weight_decay=0.01,
                               downlink={VHAT: {"w": torch.full((2, 3), 1e-16, dtype=torch.float64)},
                                         GLOBAL_OFFSET: {"w": g_a}})
        for _ in range(K):
            p.grad = torch.randn(2, 3, dtype=torch.float64) * (client + 1)
            opt.step()
        torch.testing.assert_close(p.detach(), x_t - lr * K * g_a, rtol=0, atol=1e-14)
        finals.append(p.detach().numpy().copy())
    cur = {"w": x_t.numpy()}
    mean = {"w": np.mean(finals, axis=0)}
    _, state = server_step(FedLADA(FedLADAHParams(server_lr=1.0), client_lr=lr), cur, mean, {"w": np.ones((2, 3))}, K)
    np.testing.assert_allclose(state[GLOBAL_OFFSET]["w"], g_a.numpy(), rtol=1e-12)


@pytest.mark.parametrize("decay", [0.998, 0.9])
def test_offset_recursion_eq4(decay, direction_sum_method):
    """§3.7 case 3 / Eq. (4): g_a^{t+1} = α·mean_i (1/K)Σ_τ m⊙ϑ + (1−α)·g_a^t (equal K; lr of the producing round)."""
    hp = FedLADAHParams(amend_weight=0.2, client_lr_decay=decay)
    xs, _, states, _ = run_engine(direction_sum_method, hp, 10, local_steps=6)
    prev = np.zeros_like(X0)
    for st in states:
        expected = 0.2 * st["dir_sum"] / 6 + 0.8 * prev
        np.testing.assert_allclose(st["offset"], expected, rtol=1e-9, atol=1e-12)
        prev = st["offset"]
    assert np.abs(prev).max() > 1e-3


def test_lemma_b8_z_sequence(direction_sum_method):
    """§3.7 case 4 (constant η_l): z^t = x^t/α − (1−α)/α·x^{t−1} obeys z^{t+1} = z^t − η_g·η_l·mean_i Σ_τ m⊙ϑ."""
    a, eta_g, eta_l = 0.3, 0.7, 0.01
    hp = FedLADAHParams(amend_weight=a, client_lr_decay=1.0, server_lr=eta_g)
    xs, _, states, _ = run_engine(direction_sum_method, hp, 10, client_lr=eta_l, local_steps=4)
    xs = [xs[0]] + xs  # x^{-1} := x^0 matches g_a^0 = 0
    z = [xs[t + 1] / a - (1 - a) / a * xs[t] for t in range(len(xs) - 1)]
    for t, st in enumerate(states):
        np.testing.assert_allclose(z[t + 1], z[t] - eta_g * eta_l * st["dir_sum"], rtol=1e-9, atol=1e-12)


def test_vhat_never_decreases():
    """§3.7 case 6 and §3.4 Eq. (5): v̂ is non-decreasing within a round and across rounds, and ≥ ε_v²."""
    hp = FedLADAHParams()
    xs, schedule, states, _ = run_engine(FedLADA, hp, 10, local_steps=6)
    prev = np.full_like(X0, hp.initial_vhat)
    for st in states:
        assert (st["vhat"] >= prev).all() and (st["vhat"] >= hp.initial_vhat).all()
        prev = st["vhat"]
    assert (prev > 10 * hp.initial_vhat).all()
    ref = run_fedlada(X0, CLIENTS, schedule, ref_config(hp, client_lr=0.01, local_steps=6, local_epochs=1, batch_size=8,
                                                        weighting="uniform"))
    for t, per_client in enumerate(ref.client_vhats):
        for steps in per_client:
            seq = [ref.vsrv[t]] + steps
            assert all((b >= a).all() for a, b in pairwise(seq))
    # the real client optimizer, step by step
    p = torch.nn.Parameter(torch.zeros(1, 3, dtype=torch.float64))
    opt = FedLADAOptimizer([("w", p)], lr=0.1, amend_weight=0.5, weight_decay=0.0,
                           downlink={VHAT: {"w": torch.tensor([[1e-16, 0.5, 2.0]], dtype=torch.float64)},
                                     GLOBAL_OFFSET: {"w": torch.zeros(1, 3, dtype=torch.float64)}})
    last = opt.param_state("w", p, opt.param_groups[0])["vhat"].clone()
    torch.manual_seed(2)
    for _ in range(20):
        p.grad = torch.randn(1, 3, dtype=torch.float64) * torch.rand(1)
        opt.step()
        cur = opt.state[p]["vhat"].clone()
        assert (cur >= last).all()
        last = cur


# ------------------------------------------------------------------------------------------ unit: client step
def test_client_step_by_hand():
    """One step with β1 = 0.9, β2 = 0.99: g = (2, 0.5) ⇒ m = (0.2, 0.05), v = (0.04, 0.0025); seed v̂ = 0.01 ⇒
    v̂ = (0.04, 0.01), m⊙ϑ = (1, 0.5); α = 0.25, g_a = (4, −2), lr = 0.1 ⇒ x −= 0.1·(0.25 + 3, 0.125 − 1.5)."""
    p = torch.nn.Parameter(torch.tensor([1.0, 1.0], dtype=torch.float64))
    opt = FedLADAOptimizer([("w", p)], lr=0.1, amend_weight=0.25, weight_decay=0.0,
                           downlink={VHAT: {"w": torch.tensor([0.01, 0.01], dtype=torch.float64)},
                                     GLOBAL_OFFSET: {"w": torch.tensor([4.0, -2.0], dtype=torch.float64)}})
    p.grad = torch.tensor([2.0, 0.5], dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([1.0 - 0.325, 1.0 + 0.1375], dtype=torch.float64), rtol=0,
                               atol=1e-15)
    up = opt.uplink()
    torch.testing.assert_close(up[VHAT]["w"], torch.tensor([0.04, 0.01], dtype=torch.float64), rtol=0, atol=1e-15)


def test_client_coupled_weight_decay_and_restart():
    """Coupled L2: g ← g + λx enters the moments; a new optimizer (next round) restarts m at 0."""
    p = torch.nn.Parameter(torch.tensor([2.0], dtype=torch.float64))
    opt = FedLADAOptimizer([("w", p)], lr=0.1, amend_weight=1.0, weight_decay=0.5, beta1=0.0, beta2=0.0,
                           downlink={VHAT: {"w": torch.tensor([1e-16], dtype=torch.float64)}})
    p.grad = torch.tensor([1.0], dtype=torch.float64)  # g + λx = 2 ⇒ m = 2, v = 4 ⇒ m/√v̂ = 1
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([1.9], dtype=torch.float64))
    opt2 = FedLADAOptimizer([("w", p)], lr=0.1, downlink={
        VHAT: {"w": torch.tensor([1.0], dtype=torch.float64)}, GLOBAL_OFFSET: {"w": torch.zeros(1,
                                                                                                dtype=torch.float64)}})
    st = opt2.param_state("w", p, opt2.param_groups[0])  # the state a first step would create
    assert float(st["m"]) == 0.0 and float(st["vhat"]) == 1.0 and float(st["v"]) == 0.0


def test_client_requires_offset_when_amended():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=GLOBAL_OFFSET):
        FedLADAOptimizer([("w", p)], lr=0.1, amend_weight=0.5, downlink={VHAT: {"w": torch.ones(2)}})


# ------------------------------------------------------------------------------------------ unit: server math
def server_step(strategy, current, mean, vhat, mean_steps, server_round=1):
    """``strategy.server_update`` on explicit inputs (trainable keys = those of ``vhat``) from its initial state."""
    inputs = RoundInputs(server_round=server_round, current=current, aggregates={"arrays": mean, VHAT: vhat},
                         reply_metrics=(), mean_steps=mean_steps, trainable=tuple(vhat), num_updates=0, nodes_seen=0)
    new, state, _ = strategy.server_update(inputs, strategy.init_server_state(current))
    return new, state


def test_server_step_by_hand():
    cur = {"w": np.array([1.0, 2.0]), "b": np.array([0.0])}
    mean = {"w": np.array([0.5, 2.5]), "b": np.array([1.0])}
    vhat = {"w": np.array([0.3, 0.4])}
    new, state = server_step(FedLADA(FedLADAHParams(server_lr=2.0), client_lr=0.1), cur, mean, vhat, 5)
    v, g_a = state[VHAT], state[GLOBAL_OFFSET]
    np.testing.assert_allclose(new["w"], [0.0, 3.0])              # x − 2·(x − mean)
    np.testing.assert_allclose(v["w"], [0.3, 0.4])
    np.testing.assert_allclose(g_a["w"], [1.0, -1.0])             # (x_t − x_{t+1})/(η_g·η_l·K) = Δ̄/(0.1·5)
    assert set(v) == set(g_a) == {"w"}
    np.testing.assert_array_equal(new["b"], mean["b"])            # a non-trainable float buffer is averaged


def test_client_lr_schedule_and_offset_lr():
    s = FedLADA(FedLADAHParams(client_lr_decay=0.5), client_lr=0.8)
    assert [s.client_lr_at(r) for r in (1, 2, 3)] == [0.8, 0.4, 0.2]
    assert s.offset_lr(2) == 0.4
    assert FedLADA(FedLADAHParams(client_lr_decay=0.5, offset_lr="consuming"), client_lr=0.8).offset_lr(2) == 0.2
    assert FedLADA(FedLADAHParams(client_lr_decay=0.5, offset_lr="initial"), client_lr=0.8).offset_lr(2) == 0.8


# ------------------------------------------------------------------------------------------ protocol (mocked replies)
class FakeGrid:
    def get_node_ids(self):
        return [1, 2, 3]


def _reply(node: int, model: np.ndarray, vhat: np.ndarray, n: int, steps: int, extra: dict | None = None) -> Message:
    md = Metadata(run_id=1, message_id=f"r{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="q",
                  group_id="1", created_at=time.time(), ttl=3600.0, message_type=MessageType.TRAIN)
    content = RecordDict({"arrays": ArrayRecord({"w": _arr(model)}),
                          "metrics": MetricRecord({"num-examples": n, "num-steps": steps})})
    if vhat is not None:
        content[VHAT] = ArrayRecord({"w": _arr(vhat)})
    for name, arr in (extra or {}).items():
        content[name] = ArrayRecord({"w": _arr(arr)})
    return Message(content=content, metadata=md)


def _arr(a):
    from flwr.app import Array
    return Array(np.asarray(a, dtype=np.float64))


@pytest.mark.parametrize("weighting", ["uniform", "examples"])
def test_protocol_records_and_aggregation(weighting):
    s = FedLADA(FedLADAHParams(client_lr_decay=0.5), client_lr=0.1, local_steps=4, weighting=weighting,
                min_available_nodes=3, min_train_nodes=3)
    x = np.array([1.0, -1.0])
    msgs = list(s.configure_train(1, ArrayRecord({"w": _arr(x)}), own_loop_config(), FakeGrid()))
    assert len(msgs) == 3
    c = msgs[0].content
    assert set(c.array_records) == {"arrays", VHAT, GLOBAL_OFFSET}
    np.testing.assert_array_equal(c[VHAT]["w"].numpy(), [1e-16, 1e-16])
    np.testing.assert_array_equal(c[GLOBAL_OFFSET]["w"].numpy(), [0.0, 0.0])
    cfg = c["config"]
    assert cfg["method"] == "fedlada" and cfg["fedlada.amend-weight"] == 0.1 and cfg["client-lr"] == 0.1
    assert cfg["fedlada.weight-decay"] == 0.01 and cfg["fedlada.beta2"] == 0.99
    assert cfg["fedlada.second-moment"] == "amsgrad"
    replies = [
        _reply(1, [0.8, -0.6], [0.2, 0.1], 10, 4),
        _reply(2, [0.6, -1.0], [0.4, 0.3], 30, 4),
        _reply(3, [9.0, 9.0], None, 10, 4),           # missing v-hat → rejected
    ]
    arrays, metrics = s.aggregate_train(1, replies)
    assert metrics["replies-rejected"] == 1 and metrics["replies-used"] == 2
    w = np.array([0.5, 0.5]) if weighting == "uniform" else np.array([0.25, 0.75])
    mean = w[0] * np.array([0.8, -0.6]) + w[1] * np.array([0.6, -1.0])
    np.testing.assert_allclose(arrays["w"].numpy(), mean)
    np.testing.assert_allclose(s.server_state[VHAT]["w"], w[0] * np.array([0.2, 0.1]) + w[1] * np.array([0.4, 0.3]))
    np.testing.assert_allclose(s.server_state[GLOBAL_OFFSET]["w"], (x - mean) / (0.1 * 4))
    # round 2: the decayed lr and the new v̄ / g_a go down
    msgs = list(s.configure_train(2, arrays, own_loop_config(), FakeGrid()))
    c = msgs[0].content
    assert c["config"]["client-lr"] == pytest.approx(0.05)
    np.testing.assert_allclose(c[GLOBAL_OFFSET]["w"].numpy(), s.server_state[GLOBAL_OFFSET]["w"])
    np.testing.assert_allclose(c[VHAT]["w"].numpy(), s.server_state[VHAT]["w"])


def test_protocol_debug_record_and_unequal_steps():
    s = DirectionSumFedLADA(FedLADAHParams(), client_lr=0.1, min_available_nodes=2, min_train_nodes=3)
    x = np.array([1.0, -1.0])
    list(s.configure_train(1, ArrayRecord({"w": _arr(x)}), own_loop_config(), FakeGrid()))
    replies = [
        _reply(1, [0.8, -0.6], [0.2, 0.1], 10, 2, {DIRECTION_SUM: [1.0, 2.0]}),
        _reply(2, [0.6, -1.0], [0.4, 0.3], 30, 6, {DIRECTION_SUM: [3.0, 4.0]}),
        _reply(3, [0.6, -1.0], [0.4, 0.3], 30, 6),     # missing the debug record → rejected
    ]
    arrays, metrics = s.aggregate_train(1, replies)
    assert metrics["replies-used"] == 2
    mean = np.array([0.7, -0.8])
    # K̄ = uniform mean of (2, 6) = 4
    np.testing.assert_allclose(s.server_state[GLOBAL_OFFSET]["w"], (x - mean) / (0.1 * 4))
    np.testing.assert_allclose(s.server_state[DIRECTION_SUM]["w"], [2.0, 3.0])


def test_protocol_per_client_offset_steps():
    """offset-steps = per-client: replies carry Δ_i/K_i; g_a = mean_i(Δ_i/K_i)/η_l, not Δ̄/(η_l·K̄)."""
    s = FedLADA(FedLADAHParams(offset_steps="per-client"), client_lr=0.1, min_available_nodes=2, min_train_nodes=3)
    assert [spec.name for spec in s.uplink_specs()] == ["arrays", VHAT, DELTA_PER_STEP]
    x = np.array([1.0, -1.0])
    msgs = list(s.configure_train(1, ArrayRecord({"w": _arr(x)}), own_loop_config(), FakeGrid()))
    assert msgs[0].content["config"]["fedlada.offset-steps"] == "per-client"
    m1, m2 = np.array([0.8, -0.6]), np.array([0.6, -1.0])
    replies = [
        _reply(1, m1, [0.2, 0.1], 10, 2, {DELTA_PER_STEP: (x - m1) / 2}),
        _reply(2, m2, [0.4, 0.3], 30, 6, {DELTA_PER_STEP: (x - m2) / 6}),
        _reply(3, m2, [0.4, 0.3], 30, 6),     # missing Δ_i/K_i → rejected
    ]
    arrays, metrics = s.aggregate_train(1, replies)
    assert metrics["replies-used"] == 2
    np.testing.assert_allclose(arrays["w"].numpy(), (m1 + m2) / 2)
    want = ((x - m1) / 2 + (x - m2) / 6) / 2 / 0.1
    np.testing.assert_allclose(s.server_state[GLOBAL_OFFSET]["w"], want)          # [0.666…, −0.666…]
    assert np.abs(want - (x - (m1 + m2) / 2) / (0.1 * 4)).max() > 0.1               # the mean reading: [0.75, −0.5]


def test_client_uploads_delta_per_step_only_for_the_per_client_reading():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False).double()
    x_t = model.weight.detach().clone()
    down = {VHAT: {"weight": torch.full_like(x_t, 1e-16)}, GLOBAL_OFFSET: {"weight": torch.zeros_like(x_t)}}
    for reading in ("mean", "per-client"):
        model.weight.data.copy_(x_t)
        opt = FedLADAOptimizer(model.named_parameters(), lr=0.1, downlink=down, offset_steps=reading)
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(4, 3, dtype=torch.float64)).pow(2).mean().backward()
            opt.step()
        up = opt.uplink_arrays()
        if reading == "mean":
            assert DELTA_PER_STEP not in up
        else:
            torch.testing.assert_close(up[DELTA_PER_STEP]["weight"], (x_t - model.weight.detach()) / 3, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ config and communication
def test_run_config_keys_and_validation():
    for name in ("fedlada", "localadam"):
        assert name in METHODS
    _, spec, hp = parse_run_config({"method": "fedlada", "fedlada.amend-weight": 0.05, "fedlada.offset-lr": "initial"})
    assert spec.strategy is FedLADA and hp.amend_weight == 0.05 and hp.offset_lr == "initial"
    _, spec, hp = parse_run_config({"method": "localadam", "localadam.beta2": 0.999})
    assert spec.strategy is FedLADA and hp.beta2 == 0.999 and hp.amend_weight == 1.0
    with pytest.raises(ConfigError, match="fedlada.amend-weight"):
        parse_run_config({"method": "fedlada", "fedlada.amend-weight": 1.5})
    with pytest.raises(ConfigError, match="eps-placement"):
        parse_run_config({"method": "fedlada", "fedlada.second-moment": "adam"})
    with pytest.raises(ConfigError, match="initial-vhat"):
        parse_run_config({"method": "fedlada", "fedlada.initial-vhat": 0.0})
    assert FedLADAHParams(initial_vhat=0.0, eps_placement="outside").initial_vhat == 0.0
    _, _, hp = parse_run_config({"method": "fedlada", "fedlada.offset-steps": "per-client"})
    assert hp.offset_steps == "per-client" and FedLADAHParams().offset_steps == "mean"
    with pytest.raises(ConfigError, match="fedlada.offset-steps"):
        parse_run_config({"method": "fedlada", "fedlada.offset-steps": "median"})


def test_communication_per_round():
    """FedLADA: download x, v̄, g_a (3× FedAvg), upload x_i, v̂_i (2×)."""
    _, _, _, lada = run_engine(FedLADA, FedLADAHParams(), 2)
    avg = FedAvg(client_lr=0.01, local_steps=5, batch_size=8, fraction_train=0.5, seed=0)
    simulate(avg, initial_arrays(), 2, NODES, RC)
    for h_l, h_a in zip(lada.history, avg.history, strict=True):
        assert h_l.sampled == h_a.sampled == 5
        assert h_l.bytes_down == 3 * h_a.bytes_down
        assert h_l.bytes_up == 2 * h_a.bytes_up


# ----------------------------------------------------------------------------------- the optimizer as a torch optimizer
PLAIN = {
    "fedlada": (FedLADAHParams(), {}),
    "fedlada-K-1-adam-outside-precond-decoupled": (
        FedLADAHParams(local_updates="K-1", second_moment="adam", v_init="server", eps_placement="outside",
                       precondition_offset=True, decoupled_wd=True), {}),
    "fedlada-sgd-base-inside": (FedLADAHParams(second_moment="sgd", eps_placement="inside", amend_weight=0.4), {}),
    "localadam": (LOCALADAM.default_hparams(), {"method": "localadam"}),
}


def _plain_strategy(name, make_model):
    hp, kwargs = PLAIN[name]
    s = FedLADA(hp, client_lr=0.05, local_steps=5, batch_size=4, **kwargs)
    model = make_model()  # a non-trivial v_srv and g_a, as in a later round
    return with_server_state(s, {VHAT: named_randn(model, 1, positive=True), GLOBAL_OFFSET: named_randn(model, 2)})


@pytest.mark.parametrize("name", list(PLAIN))
def test_plain_torch_loop_matches_train_reply(name):
    """(a) The optimizer built by hand from the prepared message, driven by an ordinary loop = train_reply, exactly."""
    make_model, x, y, loss = mlp_task()
    out = plain_loop_round(_plain_strategy(name, make_model), make_model, x, y, loss, server_round=3, client_key=2)
    assert_same_round(out)
    _, _, model, uplink, client_state = out
    assert set(uplink) == {VHAT} and client_state == {}
    moved = max(float((model[k] - v).abs().max()) for k, v in make_model().state_dict().items())
    assert moved > 1e-3


@pytest.mark.parametrize("name", list(PLAIN))
@pytest.mark.parametrize("at", [1, 3])
def test_state_dict_round_trip_mid_round(name, at):
    """(b) state_dict() → new optimizer on a new model → load_state_dict() mid-round: identical to the
    uninterrupted run."""
    make_model, x, y, loss = mlp_task()
    whole = plain_loop_round(_plain_strategy(name, make_model), make_model, x, y, loss, server_round=3, client_key=2)
    resumed = plain_loop_round(_plain_strategy(name, make_model), make_model, x, y, loss, server_round=3, client_key=2,
                               interrupt_at=at)
    assert_same_round(resumed, whole)


def test_misuse_raises_clear_errors():
    """(c) Missing records, reply before any step, unknown or server-only keywords, out-of-range values, K−1
    without K."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    vhat = {VHAT: {"w": torch.ones(2, dtype=torch.float64)}}
    full = {**vhat, GLOBAL_OFFSET: {"w": torch.zeros(2, dtype=torch.float64)}}
    with pytest.raises(ValueError, match=VHAT):
        FedLADAOptimizer([("w", p)], lr=0.1, downlink={GLOBAL_OFFSET: full[GLOBAL_OFFSET]})
    with pytest.raises(ValueError, match=GLOBAL_OFFSET):
        FedLADAOptimizer([("w", p)], lr=0.1, downlink=vhat)
    FedLADAOptimizer([("w", p)], lr=0.1, amend_weight=1.0, downlink=vhat)  # α = 1 needs no offset
    opt = FedLADAOptimizer([("w", p)], lr=0.1,
                           downlink={VHAT: {"other": torch.ones(2)}, GLOBAL_OFFSET: full[GLOBAL_OFFSET]})
    p.grad = torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="'w'"):
        opt.step()
    with pytest.raises(RuntimeError, match="no local step"):
        FedLADAOptimizer([("w", p)], lr=0.1, downlink=full).uplink()
    with pytest.raises(TypeError, match="amend_wieght"):
        FedLADAOptimizer([("w", p)], lr=0.1, amend_wieght=0.2, downlink=full)
    with pytest.raises(TypeError, match="initial_vhat"):  # a server field, not an optimizer argument
        FedLADAOptimizer([("w", p)], lr=0.1, initial_vhat=1e-8, downlink=full)
    with pytest.raises(ValueError, match="amend_weight"):
        FedLADAOptimizer([("w", p)], lr=0.1, amend_weight=1.5, downlink=full)
    with pytest.raises(ValueError, match="eps-placement"):
        FedLADAOptimizer([("w", p)], lr=0.1, second_moment="adam", downlink=full)
    with pytest.raises(ValueError, match="planned_steps"):
        FedLADAOptimizer([("w", p)], lr=0.1, local_updates="K-1", downlink=full)
    opt = FedLADAOptimizer([("w", p)], lr=0.1, downlink=full)  # K updates need no planned K
    assert not opt.requires_planned_steps() and opt.needs_planned_steps is FedLADAOptimizer.needs_planned_steps is True
    k1 = FedLADAOptimizer([("w", p)], lr=0.1, local_updates="K-1", planned_steps=2, downlink=full)
    assert k1.requires_planned_steps()  # the instance's rule, a method; the class flag is one plain bool
    for spec in METHODS.values():  # no descriptor makes the flag mean one thing on the class and another on an instance
        assert type(inspect.getattr_static(spec.local_optimizer, "needs_planned_steps")) is bool, spec.name


def test_local_updates_k_minus_1_skips_the_last_planned_step():
    """A1: with K−1 the K-th step changes nothing (model and moments), and K counts the steps taken."""
    p = torch.nn.Parameter(torch.tensor([1.0, -1.0], dtype=torch.float64))
    down = {VHAT: {"w": torch.full((2,), 1e-2, dtype=torch.float64)},
            GLOBAL_OFFSET: {"w": torch.ones(2, dtype=torch.float64)}}
    opt = FedLADAOptimizer([("w", p)], lr=0.1, local_updates="K-1", planned_steps=3, downlink=down)
    seen = []
    for k in range(3):
        p.grad = torch.tensor([1.0, 2.0], dtype=torch.float64) * (k + 1)
        opt.step()
        seen.append((p.detach().clone(), opt.state[p]["m"].clone(), opt.state[p]["vhat"].clone()))
    assert opt.steps_taken == 3
    assert not torch.equal(seen[0][0], seen[1][0])
    for a, b in zip(seen[1], seen[2], strict=True):
        assert torch.equal(a, b)
