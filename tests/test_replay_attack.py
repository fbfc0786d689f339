"""Replay, end to end (the attack-matrix setting of tests/test_attacks.py: digits-mlp, 5 clients,
10 rounds, iid seed 0).  Before reply binding, one client re-sending its round-1 reply every round cost 0.908 → 0.842
and all clients doing so 0.908 → 0.431, every round "updated".  Now the replays are rejected and counted: one
replaying client leaves the run within noise of clean (4 honest clients), and all replaying fail the run after
``max-idle-rounds`` instead of publishing round 1's model as trained."""

from __future__ import annotations

import pytest
from flwr.app import Message

from server_app.app import RunFailed
from tests.test_attacks import IID, NODES, NOISE, acc, go, one_thread, out  # noqa: F401 - fixtures used here

pytestmark = pytest.mark.slow


def replay(partitions):
    """``intercept``: ``partitions`` answer every round after the first with their round-1 reply's content."""
    first: dict[int, Message] = {}

    def intercept(request, reply, p):
        if p not in partitions or reply.has_error():
            return reply
        if int(request.content["config"]["server-round"]) == 1:
            first[p] = reply
            return reply
        return Message(content=first[p].content, reply_to=request)

    return intercept


def test_replayed_replies_are_rejected_end_to_end(out):  # noqa: F811 - the fixture
    clean = go(out, "replay-clean", IID)
    one = go(out, "replay-one", IID, replay({0}))
    assert abs(acc(one) - acc(clean)) <= NOISE, (acc(one), acc(clean))
    assert all(r["replies-rejected"] == 1 and r["replies-used"] == NODES - 1 for r in one[2:]), one[2:]
    with pytest.raises(RunFailed, match=r"the last 3 rounds updated nothing \(max-idle-rounds = 3\); round 4: "
                                        r"5 replies rejected \(node \d+: replay: byte-identical"):
        go(out, "replay-all", IID, replay(set(range(NODES))))
