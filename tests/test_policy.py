"""The run-failure policy (``flower_strategies.core.policy``) where a user's ServerApp runs the strategy: Flower's own
``strategy.start`` loop on an in-process grid, the legacy ``LegacyStrategy`` under ``start_grid``, and the project's
``run_rounds`` — a run that trains nothing fails with the clients' errors or the rejection reasons."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.client import ClientApp as LegacyClientApp
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp

import flower_strategies as fs
from flower_strategies.core import policy
from flower_strategies.core import records as R
from flower_strategies.core.hparams import ConfigError, StrategyConfig
from flower_strategies.core.registry import parse_run_config
from flower_strategies.core.rejections import Kind, Rejection
from flower_strategies.core.loop import own_loop_config
from simulations.engine.inprocess import LoopbackGrid

INIT = {"w": np.zeros(3, np.float32), "b": np.zeros(1, np.float32)}


def client(behaviour) -> ClientApp:
    """A stock Message-API client: ``behaviour(server_round)`` is ``"ok"`` (model + 0.1), ``"nan"`` or ``"raise"``."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        what = behaviour(int(msg.content["config"]["server-round"]))
        if what == "raise":
            raise RuntimeError("CUDA out of memory on this node")
        arrays = {k: v.numpy() + (np.nan if what == "nan" else 0.1) for k, v in msg.content["arrays"].items()}
        content = RecordDict({"arrays": R.to_record({k: np.asarray(v, np.float32) for k, v in arrays.items()}),
                              "metrics": MetricRecord({"num-examples": 10})})
        return Message(content=content, reply_to=msg)

    return app


def user_server_app(strategy, client_app, num_rounds=3, nodes=2, **start_kwargs):
    """What a user's ``@app.main()`` does: build a strategy, ``strategy.start(...)``; returns the result and the
    rounds that the user's central evaluation saw."""
    grid = LoopbackGrid(client_app, nodes, {})
    seen: list[int] = []

    def evaluate_fn(server_round, arrays):
        seen.append(server_round)
        return MetricRecord({"w0": float(arrays["w"].numpy()[0])})

    result = strategy.start(grid=grid, initial_arrays=R.to_record(INIT), num_rounds=num_rounds,
                            evaluate_fn=evaluate_fn, **start_kwargs)
    return result, seen


def fedavg(**kw):
    return fs.FedAvg(min_available_nodes=2, min_train_nodes=2, fraction_evaluate=0.0, **kw)


@pytest.mark.parametrize("make", [fedavg, lambda: fs.MimeLite(min_available_nodes=2, min_train_nodes=2)],
                         ids=["fedavg", "mimelite"])
def test_every_client_erroring_fails_the_users_run_naming_the_error(make):
    with pytest.raises(policy.RunFailed, match=r"round 1: every client failed; first error: node \d+: client error: "
                                               r"RuntimeError: CUDA out of memory on this node"):
        user_server_app(make(), client(lambda r: "raise"))


def test_every_reply_rejected_fails_at_the_end_naming_the_reason():
    with pytest.raises(policy.RunFailed, match=r"no round of the run updated the model \(2 rounds\); last round 2: "
                                               r"2 replies rejected \(node \d+: .*NaN/Inf"):
        user_server_app(fedavg(max_idle_rounds=0), client(lambda r: "nan"), num_rounds=2)


def test_max_idle_rounds_stops_the_users_run_after_that_many_idle_rounds():
    strategy = fedavg(max_idle_rounds=2)
    seen: list[int] = []

    def evaluate_fn(server_round, arrays):
        seen.append(server_round)
        return None

    grid = LoopbackGrid(client(lambda r: "ok" if r == 1 else "nan"), 2, {})
    with pytest.raises(policy.RunFailed, match=r"the last 2 rounds updated nothing \(max-idle-rounds = 2\); round 3: "
                                               r"2 replies rejected \(node \d+: .*NaN/Inf"):
        strategy.start(grid, R.to_record(INIT), 10, 60.0, None, None, evaluate_fn)  # evaluate_fn positionally
    assert seen == [0, 1, 2, 3]  # stopped at once, not after 10 rounds
    assert [h.updated for h in strategy.history] == [True, False, False]


def test_an_idle_round_is_described_by_what_happened_not_as_zero_rejections():
    """A round in which no reply arrived, or valid replies did not update, says so (not "0 replies rejected")."""
    silent = policy.RoundLog(4, sampled=5)
    with pytest.raises(policy.RunFailed, match=r"round 4: 5 of 5 sampled nodes sent no reply \(lost, or too slow "
                                               r"for round-timeout\)$"):
        policy.check_progress([silent], 1)
    mixed = policy.RoundLog(2, sampled=5, replies_used=1, replies_rejected=1,
                            rejections=[Rejection(7, Kind.BAD_RECORD, "bad")])
    assert policy.what_happened(mixed) == (
        "1 replies rejected (node 7: bad); 3 of 5 sampled nodes sent no reply (lost, or too slow for round-timeout); "
        "1 valid replies but no model update (fewer than min-replies, or the server update was not finite; see the "
        "round's warnings)")
    with pytest.raises(policy.RunFailed, match=r"\(1 rounds\); last round 2: 1 replies rejected \(node 7: bad\)"):
        policy.check_progress([mixed], 0, final=True)
    assert policy.what_happened(policy.RoundLog(1)) == "no reply arrived (0 nodes sampled)"


def test_more_than_half_rejected_for_max_rejected_rounds_in_a_row_fails_with_the_counts_by_kind():
    """A run that is mostly attack fails loudly (issue 48, item 5) instead of completing at what the attackers left:
    3 of 5 rejected (more than half) in 3 consecutive rounds; client errors do not count (their own rule)."""
    def rnd(n, gated, replayed=0, errors=0):
        rejections = ([Rejection(1, Kind.UNTRUSTED, "trust 0")] * gated + [Rejection(2, Kind.REPLAY, "replay")]
                      * replayed + [Rejection(3, Kind.CLIENT_ERROR, "boom")] * errors)
        return policy.RoundLog(n, sampled=5, replies_used=5 - len(rejections), replies_rejected=len(rejections),
                               rejections=rejections, updated=True)
    with pytest.raises(policy.RunFailed, match=r"more than half of the sampled replies in each of the last 3 rounds "
                                               r"\(max-rejected-rounds = 3\): 9 of 15 replies rejected, by kind: "
                                               r"fltrust-trust 7, replay 2\. Most clients are attacking, or the "
                                               r"server's own reference rejects honest replies"):
        policy.check_progress([rnd(1, 1), rnd(2, 3), rnd(3, 2, 1), rnd(4, 2, 1)], 3, max_rejected_rounds=3)
    policy.check_progress([rnd(1, 3), rnd(2, 3), rnd(3, 2), rnd(4, 3)], 3, max_rejected_rounds=3)  # 2 of 5: half
    policy.check_progress([rnd(1, 3), rnd(2, 3), rnd(3, 3)], 3, max_rejected_rounds=4)
    policy.check_progress([rnd(1, 3), rnd(2, 3), rnd(3, 3)], 3, max_rejected_rounds=0)  # 0 = never
    policy.check_progress([rnd(1, 1, errors=2), rnd(2, 1, errors=2), rnd(3, 1, errors=2)], 3, max_rejected_rounds=3)
    krum = [policy.RoundLog(n, sampled=5, replies_used=1, replies_rejected=4, updated=True,
                            rejections=[Rejection(1, Kind.LEFT_OUT, "left out by aggregator krum")] * 4)
            for n in (1, 2, 3)]
    policy.check_progress(krum, 3, max_rejected_rounds=3)  # Krum keeps 1 of 5 by design: not a refusal


def test_a_healthy_run_completes_with_and_without_an_evaluate_fn():
    result, seen = user_server_app(fedavg(), client(lambda r: "ok"))
    assert seen == [0, 1, 2, 3]
    np.testing.assert_allclose(result.arrays["w"].numpy(), 0.3, rtol=1e-6)
    assert result.evaluate_metrics_serverapp[3]["w0"] == pytest.approx(0.3)
    strategy = fedavg()
    result = strategy.start(grid=LoopbackGrid(client(lambda r: "ok"), 2, {}), initial_arrays=R.to_record(INIT),
                            num_rounds=2, train_config=ConfigRecord({"lr": 0.1}))
    np.testing.assert_allclose(result.arrays["b"].numpy(), 0.2, rtol=1e-6)
    assert not result.evaluate_metrics_serverapp  # the policy's hook records nothing of its own


def test_a_round_with_some_client_errors_is_no_failure():
    def first_node_fails(request, reply, partition_id):
        return Message(Error(code=0, reason="lost"), reply_to=request) if partition_id == 0 else reply

    strategy = fedavg()
    grid = LoopbackGrid(client(lambda r: "ok"), 3, {}, intercept=first_node_fails)
    strategy.start(grid=grid, initial_arrays=R.to_record(INIT), num_rounds=2)
    assert all(h.updated and h.replies_rejected == 1 for h in strategy.history)


def test_max_idle_rounds_is_one_strategy_setting_for_both_paths():
    assert StrategyConfig().max_idle_rounds == 3 and fedavg(max_idle_rounds=5).settings.max_idle_rounds == 5
    fed, _, _ = parse_run_config({"max-idle-rounds": 0})
    assert fed.max_idle_rounds == 0
    with pytest.raises(ConfigError, match="max-idle-rounds = -1 is out of range"):
        parse_run_config({"max-idle-rounds": -1})
    from app_common.config import AppConfig
    from server_app import app

    assert app.RunFailed is policy.RunFailed and "max_idle_rounds" not in AppConfig.__dict__.get("__annotations__", {})


def test_the_projects_loop_applies_the_same_policy_before_the_round_end_hook():
    from flower_strategies.core.loop import run_rounds

    ends: list[int] = []
    with pytest.raises(policy.RunFailed, match="every client failed"):
        run_rounds(fedavg(), LoopbackGrid(client(lambda r: "raise"), 2, {}), R.to_record(INIT), 3, 60.0,
                   on_round_end=lambda r, a: ends.append(r))
    assert ends == []
    with pytest.raises(policy.RunFailed, match=r"no round of the run updated the model \(2 rounds\)"):
        run_rounds(fedavg(max_idle_rounds=0), LoopbackGrid(client(lambda r: "nan"), 2, {}), R.to_record(INIT), 2, 60.0)


# ------------------------------------------------------------------------------------------ legacy
class StockNumPyClient(NumPyClient):
    """A stock Flower client: trains, returns its parameters and no fedadapt layout."""

    def fit(self, parameters, config):
        return [p + 0.1 for p in parameters], 10, {}


def test_stock_numpyclients_with_legacy_strategy_fail_loudly():
    from flwr.server import ServerConfig
    from flwr.server.compat import start_grid

    from flower_strategies.compat.legacy import LegacyStrategy

    app = LegacyClientApp(client_fn=lambda context: StockNumPyClient().to_client())
    legacy = LegacyStrategy(fedavg(), INIT, num_rounds=3)
    with pytest.raises(policy.RunFailed, match=r"round 1: every client failed; first error: node \d+: client error: "
                                               r"reply without 'fedadapt.layout' \(not a fedadapt client\?\)"):
        start_grid(grid=LoopbackGrid(app, 2, {}), strategy=legacy, config=ServerConfig(num_rounds=3))


def test_legacy_end_of_run_check_needs_num_rounds():
    from flower_strategies.compat.legacy import LegacyStrategy

    for num_rounds, fails in ((None, False), (2, True)):
        legacy = LegacyStrategy(fedavg(max_idle_rounds=0), INIT, num_rounds=num_rounds)
        for rnd in (1, 2):
            legacy.inner.prepare_round(rnd, R.to_record(INIT), own_loop_config(), 0)
            legacy.aggregate_fit(rnd, [], [])  # no reply at all: nothing updated, but no client error either
            if rnd == 2 and fails:
                with pytest.raises(policy.RunFailed, match=r"no round of the run updated the model \(2 rounds\)"):
                    legacy.evaluate(rnd, legacy.initialize_parameters(None))
            else:
                assert legacy.evaluate(rnd, legacy.initialize_parameters(None)) is None
