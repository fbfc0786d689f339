"""FedCM (paper 002's client-level-momentum baseline): exactness against its float64 transcription, reductions
(α = 1 ⇒ FedAvg; FedLADA's client with an SGD base ⇒ the FedCM client), unit tests and a mocked-reply protocol test."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, Metadata, MetricRecord, RecordDict

import flower_strategies  # noqa: F401
import flower_strategies.methods.fedcm  # noqa: F401  (registers fedcm)
import flower_strategies.methods.fedlada  # noqa: F401
from flower_strategies.methods.baselines import FedAvg
from flower_strategies.methods.fedcm import GLOBAL_UPDATE, FedCM, FedCMHParams, FedCMOptimizer
from flower_strategies.methods.fedlada import GLOBAL_OFFSET, VHAT, FedLADAOptimizer
from flower_strategies.core.ops import averaging_step
from flower_strategies.core.registry import METHODS, parse_run_config
from flower_strategies.core.strategy import weighted_mean
from flower_strategies.core.loop import own_loop_config
from tests.helpers import (
    set_task_identity,
    SYNTH_DIM, SYNTH_NODES, SYNTH_RC, SYNTH_X0, assert_same_round, mlp_task, named_randn, plain_loop_round,
    recorded_run,
    synthetic_initial_arrays, with_server_state,
)
from tests.reference.fedcm_ref import CMConfig, run_fedcm
from tests.reference.fedlada_ref import load_clients

DIM, NODES, RC, X0 = SYNTH_DIM, SYNTH_NODES, SYNTH_RC, SYNTH_X0
CLIENTS = load_clients(range(NODES), DIM, seed=0)


initial_arrays = synthetic_initial_arrays


def run_engine(cls, hp, rounds, **kwargs):
    def capture(state):
        return state[GLOBAL_UPDATE]["w.weight"].copy() if GLOBAL_UPDATE in state else None

    weights, schedule, updates, strat, _ = recorded_run(cls, hp, rounds, capture, **kwargs)
    return weights, schedule, [u for u in updates if u is not None], strat


VARIANTS = {
    "paper-defaults": (FedCMHParams(), {}),
    "examples-unequal-K": (FedCMHParams(amend_weight=0.3),
                           {"weighting": "examples", "local_steps": 0, "batch_size": 16}),
    "server-lr-no-decay-no-wd": (FedCMHParams(server_lr=0.6, client_lr_decay=1.0, weight_decay=0.0), {}),
    "strong-decay-alpha-half": (FedCMHParams(amend_weight=0.5, client_lr_decay=0.8), {"client_lr": 0.08}),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_engine_matches_reference(name):
    hp, over = VARIANTS[name]
    setup = {"client_lr": 0.05, "local_steps": 5, "local_epochs": 1, "batch_size": 8, "weighting": "uniform", **over}
    xs, schedule, updates, _ = run_engine(FedCM, hp, 12, **setup)
    assert len({tuple(s) for s in schedule}) > 1 and all(len(s) == 5 for s in schedule)
    ref = run_fedcm(X0, CLIENTS, schedule, CMConfig(
        client_lr=setup["client_lr"], server_lr=hp.server_lr, amend_weight=hp.amend_weight,
        weight_decay=hp.weight_decay,
        client_lr_decay=hp.client_lr_decay, weighting=setup["weighting"], local_steps=setup["local_steps"],
        local_epochs=setup["local_epochs"], batch_size=setup["batch_size"]))
    for t in range(1, 13):
        np.testing.assert_allclose(xs[t], ref.xs[t], rtol=0, atol=1e-6, err_msg=f"x after round {t}")
        np.testing.assert_allclose(updates[t - 1], ref.updates[t], rtol=1e-6, atol=1e-9)
    assert np.abs(xs[-1] - X0).max() > 0.05


def test_amend_weight_one_is_fedavg():
    """α = 1 ⇒ d = g + λx: FedCM with constant lr is FedAvg with the same weight decay and uniform weights."""
    hp = FedCMHParams(amend_weight=1.0, client_lr_decay=1.0, weight_decay=1e-3)
    xs, sched_cm, _, _ = run_engine(FedCM, hp, 8)
    xs_avg, sched_avg, _, _ = run_engine(FedAvg, FedAvg.make_hparams(weight_decay=1e-3), 8, weighting="uniform")
    assert sched_cm == sched_avg
    for a, b in zip(xs, xs_avg, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)


def test_broadcast_update_is_normalised_global_change():
    """Δ_{t+1} = (x_t − x_{t+1})/(η_g·η_l^{(t)}·K) with the decayed lr of the producing round."""
    hp = FedCMHParams(server_lr=0.5, client_lr_decay=0.9)
    xs, _, updates, _ = run_engine(FedCM, hp, 6, local_steps=4)
    for t, upd in enumerate(updates):
        eta_l = 0.05 * 0.9**t
        np.testing.assert_allclose(upd, (xs[t] - xs[t + 1]) / (0.5 * eta_l * 4), rtol=1e-10)


def test_fedlada_client_with_sgd_base_is_fedcm_client():
    """§3.7 case 5: replacing m⊙ϑ by the raw gradient (SGD base, β1 = 0) gives exactly the FedCM client."""
    torch.manual_seed(3)
    x_t = torch.randn(2, 3, dtype=torch.float64)
    offset = torch.randn(2, 3, dtype=torch.float64)
    grads = [torch.randn(2, 3, dtype=torch.float64) for _ in range(6)]
    finals = []
    downlink = {GLOBAL_UPDATE: {"w": offset}, GLOBAL_OFFSET: {"w": offset},
                VHAT: {"w": torch.ones(2, 3, dtype=torch.float64)}}
    for make in (
        lambda ps: FedCMOptimizer(ps, lr=0.07, amend_weight=0.3, weight_decay=0.01, downlink=downlink),
        lambda ps: FedLADAOptimizer(ps, lr=0.07, amend_weight=0.3, weight_decay=0.01, beta1=0.0, second_moment="sgd",
                                    downlink=downlink),
    ):
        p = torch.nn.Parameter(x_t.clone())
        opt = make([("w", p)])
        for g in grads:
            p.grad = g.clone()
            opt.step()
        finals.append(p.detach().clone())
    torch.testing.assert_close(finals[0], finals[1], rtol=0, atol=1e-14)
    # and by hand for the first step: x − lr·(α(g + λx) + (1−α)Δ)
    p = torch.nn.Parameter(x_t.clone())
    opt = FedCMOptimizer([("w", p)], lr=0.07, amend_weight=0.3, weight_decay=0.01,
                         downlink={GLOBAL_UPDATE: {"w": offset}})
    p.grad = grads[0].clone()
    opt.step()
    torch.testing.assert_close(p.detach(), x_t - 0.07 * (0.3 * (grads[0] + 0.01 * x_t) + 0.7 * offset), rtol=0,
                               atol=1e-15)


def test_pure_helpers():
    steps = [(2.0, 10), (6.0, 30)]  # (num-steps, num-examples): K̄ as the base computes RoundInputs.mean_steps
    assert weighted_mean(steps, "uniform") == 4.0
    assert weighted_mean(steps, "examples") == 5.0
    x = {"w": np.array([1.0, 2.0])}
    mean = {"w": np.array([0.0, 4.0])}  # Δ̄ = [1, −2]
    offset = {"w": np.array([9.0, 9.0])}
    new, off = averaging_step(x, mean, ["w"], 0.5, offset, 0.1, 5)
    np.testing.assert_array_equal(new["w"], [0.5, 3.0])
    np.testing.assert_allclose(off["w"], [2.0, -4.0])  # Δ̄ / (η_l·K̄)
    assert mean["w"].tolist() == [0.0, 4.0] and offset["w"].tolist() == [9.0, 9.0]  # pure: inputs untouched
    _, off = averaging_step(x, {"w": np.array([0.0, 4.0])}, ["w"], 0.5, offset, 0.0, 5)
    np.testing.assert_array_equal(off["w"], [0.0, 0.0])  # η_l·K̄ = 0: no direction
    # a read-only offset (e.g. a view) is not written: new arrays instead
    frozen = np.array([7.0, 7.0])
    frozen.flags.writeable = False
    _, off = averaging_step(x, {"w": np.array([0.0, 4.0])}, ["w"], 0.5, {"w": frozen}, 0.1, 5)
    np.testing.assert_allclose(off["w"], [2.0, -4.0])
    assert frozen.tolist() == [7.0, 7.0]
    # an offset that would overflow is returned, not written (the base then refuses the non-finite result)
    state = {"w": np.array([1.0, 1.0])}
    _, off = averaging_step(x, {"w": np.array([0.0, 4.0])}, ["w"], 0.5, state, 1e-308, 1e-10)
    assert state["w"].tolist() == [1.0, 1.0] and not np.isfinite(off["w"]).all()


class FakeGrid:
    def get_node_ids(self):
        return [1, 2]


def _reply(node, model, n, steps):
    md = Metadata(run_id=1, message_id=f"r{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="q",
                  group_id="1", created_at=time.time(), ttl=3600.0, message_type=MessageType.TRAIN)
    return Message(content=RecordDict({"arrays": ArrayRecord({"w": Array(np.asarray(model, np.float64))}),
                                       "metrics": MetricRecord({"num-examples": n, "num-steps": steps}),
                                       "fedadapt": ConfigRecord({"method": "fedcm"})}), metadata=md)


def test_protocol_mocked_replies():
    set_task_identity()
    s = FedCM(FedCMHParams(client_lr_decay=0.5), client_lr=0.2, local_steps=5)
    x = np.array([1.0, 1.0])
    msgs = list(s.configure_train(1, ArrayRecord({"w": Array(x)}), own_loop_config(), FakeGrid()))
    c = msgs[0].content
    assert set(c.array_records) == {"arrays", GLOBAL_UPDATE}
    np.testing.assert_array_equal(c[GLOBAL_UPDATE]["w"].numpy(), [0.0, 0.0])
    assert c["config"]["fedcm.amend-weight"] == 0.1 and c["config"]["fedcm.weight-decay"] == 1e-3
    arrays, metrics = s.aggregate_train(1, [_reply(1, [0.0, 1.0], 10, 5), _reply(2, [1.0, 0.0], 30, 5)])
    np.testing.assert_allclose(arrays["w"].numpy(), [0.5, 0.5])  # uniform by default
    np.testing.assert_allclose(s.server_state[GLOBAL_UPDATE]["w"], [0.5, 0.5])  # Δ̄/(0.2·5)
    msgs = list(s.configure_train(2, arrays, own_loop_config(), FakeGrid()))
    assert msgs[0].content["config"]["client-lr"] == pytest.approx(0.1)
    np.testing.assert_allclose(msgs[0].content[GLOBAL_UPDATE]["w"].numpy(), [0.5, 0.5])
    # communication: 2× download, 1× upload
    assert s.history[0].bytes_down == 2 * 2 * x.nbytes and s.history[0].bytes_up == 2 * x.nbytes


def test_run_config():
    assert "fedcm" in METHODS
    _, spec, hp = parse_run_config({"method": "fedcm", "fedcm.amend-weight": 0.2, "fedcm.client-lr-decay": 1.0})
    assert spec.strategy is FedCM and hp.amend_weight == 0.2 and hp.client_lr_decay == 1.0


# ----------------------------------------------------------------------------------- the optimizer as a torch optimizer
def _plain_strategy(make_model, amend_weight=0.3):
    s = FedCM(FedCMHParams(amend_weight=amend_weight), client_lr=0.05, local_steps=5, batch_size=4)
    return with_server_state(s, {GLOBAL_UPDATE: named_randn(make_model(), 1)})  # a non-trivial Δ_t


@pytest.mark.parametrize("amend_weight", [0.3, 1.0])
def test_plain_torch_loop_matches_train_reply(amend_weight):
    """(a) The optimizer built by hand from the prepared message, driven by an ordinary loop = train_reply, exactly
    (α = 1: no Δ_t is sent and none is needed)."""
    make_model, x, y, loss = mlp_task()
    strategy = _plain_strategy(make_model, amend_weight)
    out = plain_loop_round(strategy, make_model, x, y, loss, server_round=2, client_key=1)
    assert_same_round(out)
    assert (GLOBAL_UPDATE in strategy.downlink(2)) == (amend_weight < 1.0)
    moved = max(float((out[2][k] - v).abs().max()) for k, v in make_model().state_dict().items())
    assert moved > 1e-3


@pytest.mark.parametrize("at", [1, 4])
def test_state_dict_round_trip_mid_round(at):
    """(b) state_dict() → new optimizer on a new model → load_state_dict() mid-round: identical to the
    uninterrupted run."""
    make_model, x, y, loss = mlp_task()
    whole = plain_loop_round(_plain_strategy(make_model), make_model, x, y, loss, server_round=2, client_key=1)
    resumed = plain_loop_round(_plain_strategy(make_model), make_model, x, y, loss, server_round=2, client_key=1,
                               interrupt_at=at)
    assert_same_round(resumed, whole)


def test_misuse_raises_clear_errors():
    """(c) Missing record / key, reply before any step, unknown or server-only keywords, out-of-range values."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    down = {GLOBAL_UPDATE: {"w": torch.ones(2, dtype=torch.float64)}}
    with pytest.raises(ValueError, match=GLOBAL_UPDATE):
        FedCMOptimizer([("w", p)], lr=0.1)
    FedCMOptimizer([("w", p)], lr=0.1, amend_weight=1.0)  # α = 1 needs no Δ_t
    opt = FedCMOptimizer([("w", p)], lr=0.1, downlink={GLOBAL_UPDATE: {"other": torch.ones(2)}})
    p.grad = torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="'w'"):
        opt.step()
    with pytest.raises(RuntimeError, match="no local step"):
        FedCMOptimizer([("w", p)], lr=0.1, downlink=down).uplink()
    with pytest.raises(TypeError, match="momentum"):
        FedCMOptimizer([("w", p)], lr=0.1, momentum=0.9, downlink=down)
    with pytest.raises(TypeError, match="server_lr"):
        FedCMOptimizer([("w", p)], lr=0.1, server_lr=0.5, downlink=down)
    with pytest.raises(ValueError, match="amend_weight"):
        FedCMOptimizer([("w", p)], lr=0.1, amend_weight=-0.1, downlink=down)
    with pytest.raises(ValueError, match="weight_decay"):
        FedCMOptimizer([("w", p)], lr=0.1, weight_decay=-1.0, downlink=down)
    with pytest.raises(ValueError, match="lr"):
        FedCMOptimizer([("w", p)], lr=float("nan"), downlink=down)
