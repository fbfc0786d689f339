"""Sampling only live nodes (``FedAdaptStrategy.live_nodes``) with Flower 1.42's heartbeat information, fast.

A grid's ``get_nodes()`` gives ``NodeInfo(online_until = last heartbeat + HEARTBEAT_PATIENCE × heartbeat_interval)``
(the SuperLink lists only nodes whose ``online_until`` has not passed).  A sampled node without a reply is skipped
until a heartbeat after its missing reply; the SuperLink's stand-in error replies count as missing, not rejected.
"""

from __future__ import annotations

import time

import pytest
from flwr.app import ArrayRecord, Error, Message
from flwr.common.constant import HEARTBEAT_INTERVAL_INF, HEARTBEAT_PATIENCE, ErrorCode
from flwr.proto.node_pb2 import NodeInfo

from client_app.app import app as client_app
from app_common.config import AppConfig
from app_common.task import build_model
from flower_strategies.core.registry import build_strategy
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.loop import own_loop_config
from simulations.engine.inprocess import LoopbackGrid

CFG = {"task": "synthetic-linear", "synthetic-dim": 3, "local-steps": 1, "num-server-rounds": 3, "seed": 0}


class HeartbeatGrid(LoopbackGrid):
    """LoopbackGrid whose nodes report heartbeats (``beats[node]`` = time of the last one) and can be dead."""

    def __init__(self, n: int, interval: float = 30.0) -> None:
        super().__init__(client_app, n, CFG)
        self.interval, self.dead = interval, set()
        self.beats = {node: time.time() for node in self.contexts}

    def get_nodes(self):
        return [NodeInfo(node_id=n, online_until=self.beats[n] + HEARTBEAT_PATIENCE * self.interval,
                         heartbeat_interval=self.interval) for n in self.contexts]

    def push_messages(self, messages):
        return super().push_messages([m for m in messages if m.metadata.dst_node_id not in self.dead])


def strategy(**cfg):
    return build_strategy({**CFG, **cfg}, trainable_keys=["weight", "bias"], settings=AppConfig)[0]


def one_round(s, grid, server_round):
    arrays = ArrayRecord(build_model("synthetic-linear", 0, 3).state_dict())
    msgs = list(s.configure_train(server_round, arrays, own_loop_config(), grid))
    s.aggregate_train(server_round, grid.send_and_receive(msgs))
    return sorted(m.metadata.dst_node_id for m in msgs), s.history[-1]


def test_a_dead_node_is_sampled_once_then_not_until_it_heartbeats():
    s, grid = strategy(**{"min-available-nodes": 2}), HeartbeatGrid(3)
    assert one_round(s, grid, 1)[0] == [1, 2, 3]
    grid.dead.add(3)
    sampled, log = one_round(s, grid, 2)
    assert sampled == [1, 2, 3] and log.replies_used == 2 and log.replies_rejected == 0  # missing, not rejected
    assert one_round(s, grid, 3)[0] == [1, 2]  # silent since round 2, no heartbeat since
    grid.dead.discard(3)
    grid.beats[3] = time.time() + 1  # it comes back: a heartbeat after its missing reply
    assert one_round(s, grid, 4)[0] == [1, 2, 3]


def test_below_min_available_nodes_waits_wait_for_nodes_then_fails():
    s, grid = strategy(**{"min-available-nodes": 3, "wait-for-nodes": 0.0}), HeartbeatGrid(3)
    grid.dead.add(1)
    one_round(s, grid, 1)
    with pytest.raises(TimeoutError, match=r"only 2 live nodes .*wait-for-nodes.*need 3"):
        one_round(s, grid, 2)
    with pytest.raises(ConfigError, match="wait-for-nodes"):
        strategy(**{"wait-for-nodes": -1.0})


def test_simulation_nodes_with_infinite_heartbeat_interval_are_always_live():
    s, grid = strategy(), HeartbeatGrid(2, interval=HEARTBEAT_INTERVAL_INF)
    grid.dead.add(2)
    one_round(s, grid, 1)
    assert one_round(s, grid, 2)[0] == [1, 2]


def test_unavailable_error_replies_count_as_missing():
    s, grid = strategy(), HeartbeatGrid(3)
    real = grid.send_and_receive

    def send_and_receive(messages, *, timeout=None):
        replies = real(messages)
        lost = replies[-1]
        stand_in = Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="Node Unavailable"), reply_to=lost)
        return replies[:-1] + [stand_in]

    grid.send_and_receive = send_and_receive
    _, log = one_round(s, grid, 1)
    assert (log.sampled, log.replies_used, log.replies_rejected) == (3, 2, 0)
