"""The node sampler: which nodes are live (heartbeats), which of them a round asks (a seeded draw in a fixed node
order), and which sampled nodes never answered.

:class:`NodeSampler` owns the sampling RNG (its state goes in the checkpoint, :meth:`NodeSampler.state_dict`) and
knows nothing of models, records or the method.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

from flwr.app import Message
from flwr.common import log
from flwr.common.constant import HEARTBEAT_INTERVAL_INF, HEARTBEAT_PATIENCE, ErrorCode
from flwr.serverapp import Grid

#: Error replies the SuperLink makes up for a node that never answered (offline node, expired message or reply):
#: counted as missing replies, not as rejected client replies.
NO_REPLY_CODES = frozenset(
    {ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE, ErrorCode.NODE_UNAVAILABLE})


class NodeSampler:
    """Seeded node sampling over the live nodes of a grid.

    Attributes
    ----------
    rng
        The sampling RNG (``random.Random(seed)``); checkpointed.
    node_order
        ``{node_id: sort_key}`` ordering nodes before sampling and replies before folding (fallback: node id), so
        that a run does not depend on the node ids a runtime assigns (see :meth:`order_nodes`).
    nodes_seen
        Most nodes ever seen available when sampling (SCAFFOLD's N); checkpointed.
    silent_since
        ``{node_id: wall time}`` of sampled nodes that sent no reply (see :meth:`live_nodes`); runtime only.
    """

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.node_order: dict[int, Any] = {}
        self.nodes_seen = 0
        #: Live nodes the last draw chose from (native DP's population N).
        self.population = 0
        self.silent_since: dict[int, float] = {}
        self._awaiting: list[int] = []
        #: The last :meth:`ordered` call's nodes and result (a population of 100,000 takes ~40 ms to sort; its
        #: node list is the same every round).
        self._last_order: tuple[list[int], list[int]] | None = None

    def order_nodes(self, order: Mapping[int, Any]) -> None:
        """Order nodes by ``order[node_id]`` (e.g. their partition id) before sampling (fallback: node id)."""
        self.node_order = dict(order)
        self._last_order = None

    def sort_key(self, node: int) -> tuple[Any, int]:
        return (self.node_order.get(node, float("inf")), node)

    def ordered(self, nodes: Iterable[int]) -> list[int]:
        """``nodes`` sorted by :meth:`sort_key`.  When every node has an order (the usual case), by id first and then,
        stably, by ``node_order`` alone: the same list without a Python key call per node."""
        nodes = list(nodes)
        if self._last_order is not None and self._last_order[0] == nodes:
            return list(self._last_order[1])
        if self.node_order.keys() >= set(nodes):
            out = sorted(sorted(nodes), key=self.node_order.__getitem__)
        else:
            out = sorted(nodes, key=self.sort_key)
        self._last_order = (nodes, out)
        return list(out)

    def live_nodes(self, grid: Grid) -> list[int]:
        """Nodes the grid lists, less the silent ones: a node that sent no reply in a round it was sampled for is
        left out until the grid reports a heartbeat from it after that round (Flower's ``NodeInfo.online_until`` =
        last heartbeat + ``HEARTBEAT_PATIENCE`` × ``heartbeat_interval``).  A dead node is thus never sampled again
        (the SuperLink drops it from the list once its heartbeat expires), a live straggler is back after its next
        heartbeat, and a node that restarts is sampled again.  Grids without heartbeat information (in-process
        engine; Ray simulation, whose virtual nodes have an infinite heartbeat interval) list every node."""
        get_nodes = getattr(grid, "get_nodes", None)  # a Grid without node information (test doubles, custom grids)
        if get_nodes is None:
            return list(grid.get_node_ids())
        if not self.silent_since:  # the common case: nothing to check per node, so no NodeInfo per node either
            return list(grid.get_node_ids())
        live = []
        for info in get_nodes():
            since = self.silent_since.get(info.node_id)
            if since is not None and 0 < info.heartbeat_interval < HEARTBEAT_INTERVAL_INF:  # simulation: INF
                if info.online_until - HEARTBEAT_PATIENCE * info.heartbeat_interval <= since:
                    continue  # no heartbeat since it missed its reply: presumed lost
                log(INFO, "Node %s is alive again (heartbeat after its missing reply)", info.node_id)
            self.silent_since.pop(info.node_id, None)
            live.append(info.node_id)
        return live

    def sample(self, grid: Grid, fraction: float, minimum: int, *, min_available: int, wait_s: float) -> list[int]:
        """Wait (at most ``wait_s`` seconds) until ``max(min_available, minimum)`` live nodes are connected, then
        :meth:`pick` from them."""
        deadline = time.monotonic() + wait_s
        need = max(min_available, minimum)
        while len(nodes := self.live_nodes(grid)) < need:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(nodes)} live nodes connected after waiting {wait_s:g}s "
                                   f"(wait-for-nodes); need {need} (min-available-nodes / min-train-nodes)")
            log(INFO, "Waiting for nodes: %d live (need %d)", len(nodes), need)
            time.sleep(1.0)
        return self.pick(nodes, fraction, minimum)

    def pick(self, nodes: Iterable[int], fraction: float, minimum: int) -> list[int]:
        """``max(int(fraction·len), minimum)`` nodes drawn with :attr:`rng`, in :attr:`node_order`."""
        ordered = self.ordered(nodes)
        self.nodes_seen = max(self.nodes_seen, len(ordered))
        self.population = len(ordered)
        k = min(len(ordered), max(int(len(ordered) * fraction), minimum))
        picked = self.rng.sample(ordered, k)
        return sorted(picked, key=self.sort_key)  # the order of ``ordered`` (its keys are distinct)

    def expect(self, nodes: Iterable[int]) -> None:
        """The nodes a round's messages went to (a node among them without a reply becomes silent)."""
        self._awaiting = list(nodes)

    def receive(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The replies in :attr:`node_order` (float sums depend on the fold order), less the SuperLink's stand-ins
        for nodes that never answered (they count as missing); the awaited nodes without a real reply are marked
        silent (:meth:`live_nodes`)."""
        ordered = sorted(replies, key=lambda m: self.sort_key(m.metadata.src_node_id))
        real = [m for m in ordered if not (m.has_error() and m.error.code in NO_REPLY_CODES)]
        answered = {m.metadata.src_node_id for m in real}
        now = time.time()
        for node in self._awaiting:
            if node not in answered:
                self.silent_since[node] = now
                log(WARNING, "Round %d: no reply from node %s (lost or too slow for round-timeout); it is not sampled "
                    "again until it sends a heartbeat", server_round, node)
        self._awaiting = []
        return real

    def state_dict(self) -> dict[str, Any]:
        """The RNG state and :attr:`nodes_seen`, as data."""
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss], "nodes_seen": self.nodes_seen}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
        self.nodes_seen = int(state["nodes_seen"])
