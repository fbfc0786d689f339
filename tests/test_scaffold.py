"""SCAFFOLD option II: exactness against its float64 transcription with partial participation (clients sampled for the
first time, and clients whose c_i comes back after rounds away), persisted c_i in the nodes' Context.state, the
c = mean of all c_i invariant, unit tests and a mocked-reply protocol test."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MessageType, Metadata, MetricRecord, RecordDict

import flower_strategies  # noqa: F401
import flower_strategies.methods.scaffold  # noqa: F401  (registers scaffold)
from flower_strategies.methods.baselines import FedAvg
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.records import STATE_PREFIX
from flower_strategies.core.registry import METHODS, parse_run_config
from flower_strategies.core.strategy import RoundInputs
from flower_strategies.methods.scaffold import (
    CLIENT_CONTROL, CONTROL_DELTA, SERVER_CONTROL, Scaffold, ScaffoldHParams, ScaffoldOptimizer,
)
from flower_strategies.core.loop import own_loop_config
from tests.helpers import (
    SYNTH_DIM, SYNTH_NODES, SYNTH_RC, SYNTH_X0, assert_same_round, mlp_task, named_randn, plain_loop_round,
    recorded_run,
    synthetic_initial_arrays, with_server_state,
)
from tests.reference.fedlada_ref import load_clients
from tests.reference.scaffold_ref import ScaffoldConfig, run_scaffold

DIM, NODES, RC, X0 = SYNTH_DIM, SYNTH_NODES, SYNTH_RC, SYNTH_X0
CLIENTS = load_clients(range(NODES), DIM, seed=0)
STATE_KEY = STATE_PREFIX + CLIENT_CONTROL


initial_arrays = synthetic_initial_arrays


def run_engine(cls, hp, rounds, **kwargs):
    def capture(state):
        return state[SERVER_CONTROL]["w.weight"].copy() if SERVER_CONTROL in state else None

    weights, schedule, controls, strat, grid = recorded_run(cls, hp, rounds, capture, **kwargs)
    return weights, schedule, [c for c in controls if c is not None], strat, grid


def returning_clients(schedule):
    """Clients sampled, then absent for ≥ 1 round, then sampled again."""
    out = set()
    for t in range(len(schedule)):
        for i in schedule[t]:
            later = [u for u in range(t + 1, len(schedule)) if i in schedule[u]]
            if later and later[0] > t + 1:
                out.add(i)
    return out


VARIANTS = {
    "defaults-N-from-grid": (ScaffoldHParams(), {}),
    "explicit-N-20-server-lr": (ScaffoldHParams(num_clients=20, server_lr=0.8), {}),
    "examples-unequal-K-decay": (ScaffoldHParams(client_lr_decay=0.95, weight_decay=0.0),
                                 {"weighting": "examples", "local_steps": 0, "batch_size": 16}),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_engine_matches_reference(name):
    hp, over = VARIANTS[name]
    setup = {"client_lr": 0.05, "local_steps": 5, "local_epochs": 1, "batch_size": 8, "weighting": "uniform", **over}
    rounds = 12
    xs, schedule, controls, strat, grid = run_engine(Scaffold, hp, rounds, **setup)
    # the schedule exercises first-time clients (every round until all were seen) and returning clients
    first_seen = {}
    for t, s in enumerate(schedule):
        for i in s:
            first_seen.setdefault(i, t)
    assert any(t > 0 for t in first_seen.values())
    assert returning_clients(schedule)
    ref = run_scaffold(X0, CLIENTS, schedule, ScaffoldConfig(
        client_lr=setup["client_lr"], server_lr=hp.server_lr, num_clients=hp.num_clients or NODES,
        weight_decay=hp.weight_decay, client_lr_decay=hp.client_lr_decay, weighting=setup["weighting"],
        local_steps=setup["local_steps"], local_epochs=setup["local_epochs"], batch_size=setup["batch_size"]))
    for t in range(1, rounds + 1):
        np.testing.assert_allclose(xs[t], ref.xs[t], rtol=0, atol=1e-6, err_msg=f"x after round {t}")
        np.testing.assert_allclose(controls[t - 1], ref.cs[t], rtol=0, atol=1e-6, err_msg=f"c after round {t}")
    assert np.abs(ref.cs[-1]).max() > 1e-3 and np.abs(xs[-1] - X0).max() > 0.05
    # persisted c_i: exactly the reference's for every client ever sampled; nothing for the others
    for node, ctx in grid.contexts.items():
        pid = node - 1
        if pid in ref.client_c:
            stored = ctx.state[STATE_KEY]["w.weight"].numpy()
            np.testing.assert_allclose(stored, ref.client_c[pid], rtol=0, atol=1e-6)
        else:
            assert STATE_KEY not in ctx.state.array_records


def test_server_control_is_mean_of_all_client_controls():
    """All c_i start at 0 and c accumulates ΣΔc_i/N ⇒ c = (1/N)·Σ_{all clients} c_i after every round."""
    xs, schedule, controls, strat, grid = run_engine(Scaffold, ScaffoldHParams(), 9)
    assert all(h.round_metrics["num-clients-total"] == NODES for h in strat.history)
    total = sum(ctx.state[STATE_KEY]["w.weight"].numpy()
                for ctx in grid.contexts.values() if STATE_KEY in ctx.state.array_records)
    np.testing.assert_allclose(controls[-1], total / NODES, rtol=1e-10, atol=1e-14)


def test_first_round_is_fedavg_and_state_absent_before_sampling():
    """Round 1 (c = c_i = 0) is a FedAvg round; a client's state exists only once it has been sampled."""
    xs, schedule, _, _, grid = run_engine(Scaffold, ScaffoldHParams(weight_decay=0.0), 1)
    xs_avg, sched_avg, _, _, _ = run_engine(FedAvg, FedAvg.make_hparams(), 1, weighting="uniform")
    assert schedule == sched_avg
    np.testing.assert_allclose(xs[1], xs_avg[1], rtol=0, atol=1e-14)
    sampled = {i + 1 for i in schedule[0]}
    assert {n for n, ctx in grid.contexts.items() if STATE_KEY in ctx.state.array_records} == sampled


def test_client_step_and_option_two_by_hand():
    x_t = torch.tensor([1.0, -1.0], dtype=torch.float64)
    c = torch.tensor([0.5, 0.0], dtype=torch.float64)
    ci = torch.tensor([0.0, 1.0], dtype=torch.float64)
    p = torch.nn.Parameter(x_t.clone())
    opt = ScaffoldOptimizer([("w", p)], lr=0.1, weight_decay=0.5, downlink={SERVER_CONTROL: {"w": c}},
                            client_state={CLIENT_CONTROL: {"w": ci}})
    g = torch.tensor([2.0, 2.0], dtype=torch.float64)
    expected = x_t.clone()
    for _ in range(2):
        p.grad = g.clone()
        expected = expected - 0.1 * (g + 0.5 * expected - ci + c)
        opt.step()
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-15)
    up = opt.uplink()
    c_plus = ci - c + (x_t - expected) / (2 * 0.1)
    torch.testing.assert_close(up[CONTROL_DELTA]["w"], c_plus - ci, rtol=0, atol=1e-14)
    torch.testing.assert_close(opt.client_state()[CLIENT_CONTROL]["w"], c_plus, rtol=0, atol=1e-14)
    # a first-time client ({} persistent state) starts from c_i = 0
    q = torch.nn.Parameter(x_t.clone())
    opt = ScaffoldOptimizer([("w", q)], lr=0.1, downlink={SERVER_CONTROL: {"w": c}}, client_state={})
    assert torch.equal(opt.param_state("w", q, opt.param_groups[0])["ci"], torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=SERVER_CONTROL):
        ScaffoldOptimizer([("w", torch.nn.Parameter(x_t.clone()))], lr=0.1, downlink={}, client_state={})


def test_server_math_by_hand():
    cur = {"w": np.array([1.0, 2.0])}
    inputs = RoundInputs(server_round=1, current=cur, aggregates={"arrays": {"w": np.array([0.0, 4.0])},
                                                                  CONTROL_DELTA: {"w": np.array([4.0, -8.0])}},
                         reply_metrics=(), mean_steps=5.0, trainable=("w",), num_updates=0, nodes_seen=7)
    new, state, metrics = Scaffold(ScaffoldHParams(server_lr=0.5, num_clients=4)).server_update(
        inputs, {SERVER_CONTROL: {"w": np.array([1.0, 1.0])}})
    c = state[SERVER_CONTROL]
    np.testing.assert_allclose(new["w"], [0.5, 3.0])
    np.testing.assert_allclose(c["w"], [2.0, -1.0])
    assert metrics["num-clients-total"] == 4  # num-clients wins over the nodes seen
    with pytest.raises(ConfigError):
        ScaffoldHParams(num_clients=0)


class FakeGrid:
    def __init__(self, n):
        self.n = n

    def get_node_ids(self):
        return list(range(1, self.n + 1))


def _reply(node, model, dc, n=10, steps=5):
    md = Metadata(run_id=1, message_id=f"r{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="q",
                  group_id="1", created_at=time.time(), ttl=3600.0, message_type=MessageType.TRAIN)
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.asarray(model, np.float64))}),
                          "metrics": MetricRecord({"num-examples": n, "num-steps": steps})})
    if dc is not None:
        content[CONTROL_DELTA] = ArrayRecord({"w": Array(np.asarray(dc, np.float64))})
    return Message(content=content, metadata=md)


def test_protocol_mocked_replies():
    s = Scaffold(ScaffoldHParams(), client_lr=0.1, fraction_train=0.5)
    x = np.array([1.0, 1.0])
    msgs = list(s.configure_train(1, ArrayRecord({"w": Array(x)}), own_loop_config(), FakeGrid(8)))
    assert len(msgs) == 4 and s.nodes_seen == 8
    c0 = msgs[0].content
    assert set(c0.array_records) == {"arrays", SERVER_CONTROL}
    np.testing.assert_array_equal(c0[SERVER_CONTROL]["w"].numpy(), [0.0, 0.0])
    assert c0["config"]["scaffold.weight-decay"] == 1e-3 and c0["config"]["method"] == "scaffold"
    replies = [_reply(1, [0.0, 1.0], [1.0, 2.0]), _reply(2, [1.0, 0.0], [3.0, 2.0], n=30), _reply(3, [5.0, 5.0], None)]
    arrays, metrics = s.aggregate_train(1, replies)
    assert metrics["replies-rejected"] == 1
    np.testing.assert_allclose(arrays["w"].numpy(), [0.5, 0.5])
    np.testing.assert_allclose(s.server_state[SERVER_CONTROL]["w"], [0.5, 0.5])  # (Δc_1 + Δc_2)/8
    assert metrics["num-clients-total"] == 8
    msgs = list(s.configure_train(2, arrays, own_loop_config(), FakeGrid(8)))
    np.testing.assert_allclose(msgs[0].content[SERVER_CONTROL]["w"].numpy(), [0.5, 0.5])
    assert s.history[0].bytes_down == 4 * 2 * x.nbytes  # 2× download per message (x, c)
    # 2× upload per valid reply (y_i, Δc_i); the rejected reply carried only its model
    assert s.history[0].bytes_up == 2 * 2 * x.nbytes + x.nbytes
    # an explicit num-clients wins over the node count
    s2 = Scaffold(ScaffoldHParams(num_clients=100), client_lr=0.1)
    list(s2.configure_train(1, ArrayRecord({"w": Array(x)}), own_loop_config(), FakeGrid(3)))
    _, metrics2 = s2.aggregate_train(1, [_reply(1, [0.0, 1.0], [1.0, 2.0]), _reply(2, [1.0, 0.0], [3.0, 2.0])])
    assert metrics2["num-clients-total"] == 100


def test_run_config():
    assert "scaffold" in METHODS
    _, spec, hp = parse_run_config({"method": "scaffold", "scaffold.num-clients": 50})
    assert spec.strategy is Scaffold and hp.num_clients == 50


# ----------------------------------------------------------------------------------- the optimizer as a torch optimizer
def _plain_strategy(make_model):
    s = Scaffold(ScaffoldHParams(weight_decay=0.01), client_lr=0.05, local_steps=5, batch_size=4)
    return with_server_state(s, {SERVER_CONTROL: named_randn(make_model(), 1)})  # a non-trivial c


def _client_state(make_model, returning):
    if not returning:
        return None
    return {CLIENT_CONTROL: {k: torch.from_numpy(v) for k, v in named_randn(make_model(), 2).items()}}


@pytest.mark.parametrize("returning", [False, True], ids=["first-time", "returning"])
def test_plain_torch_loop_matches_train_reply(returning):
    """(a) The optimizer built by hand from the prepared message (and the client's saved c_i), driven by an ordinary
    loop = train_reply, exactly: model, Δc_i and the c_i⁺ it keeps."""
    make_model, x, y, loss = mlp_task()
    ci = _client_state(make_model, returning)
    out = plain_loop_round(_plain_strategy(make_model), make_model, x, y, loss, client_state=ci, server_round=4)
    assert_same_round(out)
    _, _, _, uplink, client_state = out
    for k, delta in uplink[CONTROL_DELTA].items():  # Δc_i = c_i⁺ − c_i, with c_i = 0 for a first-time client
        before = ci[CLIENT_CONTROL][k] if ci else torch.zeros_like(delta)
        torch.testing.assert_close(delta, client_state[CLIENT_CONTROL][k] - before, rtol=0, atol=0)
        assert float(delta.abs().max()) > 1e-3


@pytest.mark.parametrize("at", [1, 4])
def test_state_dict_round_trip_mid_round(at):
    """(b) state_dict() → new optimizer on a new model → load_state_dict() mid-round: identical to the uninterrupted
    run, K included (the steps taken before the interruption count)."""
    make_model, x, y, loss = mlp_task()
    ci = _client_state(make_model, True)
    whole = plain_loop_round(_plain_strategy(make_model), make_model, x, y, loss, client_state=ci, server_round=4)
    resumed = plain_loop_round(_plain_strategy(make_model), make_model, x, y, loss, client_state=ci, server_round=4,
                               interrupt_at=at)
    assert_same_round(resumed, whole)


def test_control_uses_the_steps_taken():
    """K in c_i⁺ is the number of steps this optimizer took (not a value set from outside, never 0)."""
    x_t = torch.tensor([1.0, -1.0], dtype=torch.float64)
    for k in (1, 3):
        p = torch.nn.Parameter(x_t.clone())
        opt = ScaffoldOptimizer([("w", p)], lr=0.1, weight_decay=0.0,
                                downlink={SERVER_CONTROL: {"w": torch.zeros(2, dtype=torch.float64)}})
        for _ in range(k):
            p.grad = torch.tensor([1.0, 2.0], dtype=torch.float64)
            opt.step()
        torch.testing.assert_close(opt.uplink()[CONTROL_DELTA]["w"], torch.tensor([1.0, 2.0], dtype=torch.float64),
                                   rtol=0, atol=1e-14)  # (x_t − y)/(K·η_l) = g for a constant gradient


def test_misuse_raises_clear_errors():
    """(c) Missing record / key, reply before any step, unknown or server-only keywords, out-of-range values."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    down = {SERVER_CONTROL: {"w": torch.ones(2, dtype=torch.float64)}}
    with pytest.raises(ValueError, match=SERVER_CONTROL):
        ScaffoldOptimizer([("w", p)], lr=0.1)
    opt = ScaffoldOptimizer([("w", p)], lr=0.1, downlink={SERVER_CONTROL: {"other": torch.ones(2)}})
    p.grad = torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="'w'"):
        opt.step()
    opt = ScaffoldOptimizer([("w", p)], lr=0.1, downlink=down)
    with pytest.raises(RuntimeError, match="no local step"):
        opt.uplink()
    with pytest.raises(RuntimeError, match="no local step"):
        opt.client_state()
    with pytest.raises(TypeError, match="num_clients"):  # a server field, not an optimizer argument
        ScaffoldOptimizer([("w", p)], lr=0.1, num_clients=10, downlink=down)
    with pytest.raises(ValueError, match="weight_decay"):
        ScaffoldOptimizer([("w", p)], lr=0.1, weight_decay=-0.1, downlink=down)
    with pytest.raises(TypeError, match="named_parameters"):
        ScaffoldOptimizer([p], lr=0.1, downlink=down)
