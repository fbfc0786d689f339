"""NodeSampler on its own: seeded draws in node order, liveness from heartbeats, silent nodes, checkpoint state."""

from __future__ import annotations

import random

import pytest
from flwr.app import Error, Message
from flwr.common.constant import HEARTBEAT_INTERVAL_INF, HEARTBEAT_PATIENCE, ErrorCode
from flwr.proto.node_pb2 import NodeInfo

from flower_strategies.core.sampler import NodeSampler
from tests.helpers import NodesGrid, metadata, reply


class BeatGrid(NodesGrid):
    """A grid with heartbeat information: ``beats[node]`` = wall time of its last heartbeat."""

    def __init__(self, beats: dict[int, float], interval: float = 30.0) -> None:
        super().__init__(list(beats))
        self.beats, self.interval = beats, interval

    def get_nodes(self):
        return [NodeInfo(node_id=n, online_until=t + HEARTBEAT_PATIENCE * self.interval,
                         heartbeat_interval=self.interval) for n, t in self.beats.items()]


def test_pick_is_seeded_sized_and_in_node_order():
    a, b = NodeSampler(seed=7), NodeSampler(seed=7)
    nodes = [40, 10, 30, 20, 50]
    picks = [a.pick(nodes, 0.4, 1) for _ in range(5)]
    assert picks == [b.pick(list(reversed(nodes)), 0.4, 1) for _ in range(5)]  # input order does not matter
    assert all(len(p) == 2 and p == sorted(p) for p in picks)  # int(0.4·5) = 2, returned in node-id order
    assert len(set(map(tuple, picks))) > 1  # the RNG moves on
    ref = random.Random(7)
    assert picks[0] == sorted(ref.sample(sorted(nodes), 2))  # exactly random.Random(seed).sample over sorted nodes
    assert NodeSampler(seed=8).pick(nodes, 0.4, 1) != picks[0] or NodeSampler(seed=9).pick(nodes, 0.4, 1) != picks[0]


def test_pick_minimum_cap_and_nodes_seen():
    s = NodeSampler()
    assert len(s.pick(range(10), 0.1, 3)) == 3  # minimum wins over fraction
    assert len(s.pick(range(2), 1.0, 5)) == 2  # never more than there are
    assert s.nodes_seen == 10  # the most ever seen, not the last


def test_node_order_decides_draw_not_node_ids():
    a, b = NodeSampler(seed=3), NodeSampler(seed=3)
    a.order_nodes({101: 0, 55: 1, 999: 2, 7: 3})
    b.order_nodes({8: 0, 3: 1, 12: 2, 1: 3})
    pa = [a.node_order[n] for n in a.pick([7, 55, 101, 999], 0.5, 2)]
    pb = [b.node_order[n] for n in b.pick([1, 3, 8, 12], 0.5, 2)]
    assert pa == pb and pa == sorted(pa)



def test_repeated_draws_reuse_the_order_and_follow_a_new_one():
    """The sorted node list is kept between draws over the same nodes (a population of 100,000 sorts in ~40 ms):
    the draws equal a sampler that sorts every time; a new node order or another node list is sorted afresh."""
    nodes = list(range(1000, 0, -1))
    order = {n: (n * 7919) % 1009 for n in nodes}
    a, b = NodeSampler(seed=5), NodeSampler(seed=5)
    a.order_nodes(order)
    b.order_nodes(order)
    for _ in range(4):
        first = a.pick(nodes, 0.01, 1)
        b._last_order = None  # noqa: SLF001 - b sorts anew every time
        assert first == b.pick(nodes, 0.01, 1)
    assert a.ordered(nodes) == sorted(nodes, key=order.__getitem__)
    a.ordered(nodes).reverse()  # the caller's list is its own copy
    assert a.ordered(nodes) == sorted(nodes, key=order.__getitem__)
    a.order_nodes({n: -v for n, v in order.items()})
    assert a.ordered(nodes) == sorted(nodes, key=lambda n: -order[n])
    assert a.ordered(nodes[:10]) == sorted(nodes[:10], key=lambda n: -order[n])


def test_receive_orders_replies_drops_stand_ins_and_marks_silent():
    s = NodeSampler()
    s.order_nodes({3: 0, 1: 1, 2: 2})
    s.expect([1, 2, 3, 4])
    lost = Message(error=Error(code=ErrorCode.MESSAGE_UNAVAILABLE, reason="expired"), metadata=metadata(2))
    got = s.receive(1, [reply(1, {}), lost, reply(3, {}), reply(9, {})])
    assert [m.metadata.src_node_id for m in got] == [3, 1, 9]  # node order, unknown nodes last
    assert set(s.silent_since) == {2, 4}  # the stand-in's node and the node that sent nothing
    assert s.receive(2, []) == [] and set(s.silent_since) == {2, 4}  # nothing awaited any more


def test_live_nodes_skips_silent_until_a_new_heartbeat():
    now = 1_000_000.0
    grid = BeatGrid({1: now, 2: now, 3: now})
    s = NodeSampler()
    s.silent_since[2] = now + 1.0  # missed a reply after its last heartbeat
    assert s.live_nodes(grid) == [1, 3]
    grid.beats[2] = now + 5.0  # heartbeat after the missed reply: back
    assert s.live_nodes(grid) == [1, 2, 3] and 2 not in s.silent_since


def test_live_nodes_without_heartbeat_information():
    s = NodeSampler()
    s.silent_since[2] = 0.0
    assert s.live_nodes(NodesGrid([1, 2])) == [1, 2]  # a grid without get_nodes lists every node
    sim = BeatGrid({1: 0.0, 2: 0.0}, interval=HEARTBEAT_INTERVAL_INF)
    s.silent_since[2] = 1.0
    assert s.live_nodes(sim) == [1, 2]  # simulation nodes (infinite interval) are never presumed lost


def test_sample_waits_then_times_out():
    s = NodeSampler()
    assert s.sample(NodesGrid([1, 2, 3]), 1.0, 2, min_available=3, wait_s=0.0) == [1, 2, 3]
    with pytest.raises(TimeoutError, match="only 1 live nodes.*need 2"):
        s.sample(NodesGrid([1]), 1.0, 2, min_available=1, wait_s=0.0)


def test_state_dict_round_trip_continues_the_draws():
    s = NodeSampler(seed=5)
    s.pick(range(8), 0.5, 1)
    state = s.state_dict()
    assert set(state) == {"rng", "nodes_seen"} and state["nodes_seen"] == 8
    ahead = [s.pick(range(8), 0.5, 1) for _ in range(3)]
    fresh = NodeSampler(seed=5)
    fresh.load_state_dict(state)
    assert [fresh.pick(range(8), 0.5, 1) for _ in range(3)] == ahead and fresh.nodes_seen == 8


@pytest.mark.parametrize("missing", [False, True])
def test_ordered_equals_the_sort_by_sort_key(missing):
    """:meth:`NodeSampler.ordered` (two C-level sorts when every node has an order) gives the list the plain
    ``sorted(nodes, key=sort_key)`` gives: ties in the order broken by node id, nodes without one last."""
    rng = random.Random(3)
    nodes = rng.sample(range(1, 10**6), 300)
    sampler = NodeSampler()
    sampler.order_nodes({n: rng.randrange(50) for n in nodes[: 250 if missing else 300]})  # many ties
    assert sampler.ordered(iter(nodes)) == sorted(nodes, key=sampler.sort_key)
