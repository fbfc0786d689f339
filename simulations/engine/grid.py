"""The in-process grid: the real Strategy drives the real ClientApp without Ray or a SuperLink.

A :class:`LoopbackGrid` hands each message straight to ``client_app(message, context)`` (one persistent
``Context`` per node, so ``context.state`` works as on a SuperNode; made when the node is first addressed, and
with a population store released after each exchange: :mod:`simulations.engine.population`).  Deterministic and fast:
used for the exactness tests and for sweeps.  It complements – never replaces – the Ray simulation and the deployment,
which the test suite also runs for real.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import Context, Error, Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from flower_strategies.core import records as R

from .population import NodeContexts, population_store

# Outside a Flower runtime, Flower >= 1.38 builds a message only once a task identity is set (``TaskIdentity``);
# older releases have no such step.  ``Run`` moved from ``flwr.common.typing`` to ``flwr.supercore.run``.
try:
    from flwr.supercore.task_identity import TaskIdentity
except ImportError:  # flwr < 1.38
    TaskIdentity = None  # type: ignore[misc, assignment]
try:
    from flwr.supercore.run import Run
except ImportError:  # flwr < 1.4x
    from flwr.common.typing import Run  # type: ignore[no-redef, attr-defined]

Interceptor = Callable[[Message, Message, int], Message]


class LoopbackGrid(Grid):
    """Deliver each message to ``client_app`` in-process.

    ``node_ids`` defaults to ``1..num_nodes``; node ``i`` gets ``partition-id = i-1``.  ``intercept`` (optional)
    may replace a reply (fault-injection in tests): ``intercept(request, reply, partition_id) -> reply``.
    ``state_dir``: keep the clients' state out of core there (:class:`simulations.engine.population.RowStore`); by
    default a temporary store above :data:`~simulations.engine.population.RESIDENT_LIMIT` nodes, else none.
    """

    def __init__(
        self,
        client_app: Any,
        num_nodes: int,
        run_config: Mapping[str, Any] | None = None,
        *,
        node_ids: Iterable[int] | None = None,
        intercept: Interceptor | None = None,
        state_dir: str | None = None,
    ) -> None:
        if TaskIdentity is not None:
            TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
        ids = list(node_ids) if node_ids is not None else range(1, num_nodes + 1)
        self._app = client_app
        self._run: Run | None = Run.create_empty(1)
        self._inbox: dict[str, Message] = {}
        self.intercept = intercept
        self.store, self._store_dir = population_store(len(ids), state_dir)
        self.contexts = NodeContexts(ids, run_config or {}, self.store)

    def partition_order(self) -> dict[int, int] | None:
        """``{node id: partition id}`` without asking every node (``server_app.app.discover_partitions``), for a
        population kept out of core (a query message per node would make every node's context); None otherwise."""
        if self.store is None:
            return None
        return {n: p for p, n in enumerate(self.contexts.ids)}

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run  # type: ignore[return-value]

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    #: Every reply exists once ``push_messages`` returns (a dropped one never comes): nothing to poll for
    #: (``flower_strategies.core.loop.exchange``).
    answers_at_push = True

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        msgs = list(messages)
        ids = []
        for msg in msgs:  # as the SuperLink does: replies name the message id in reply_to_message_id
            ids.append(uuid.uuid4().hex)
            R.set_message_id(msg, ids[-1])
        ready = self.prepared_replies(msgs)
        for i, (msg, mid) in enumerate(zip(msgs, ids, strict=True)):
            ctx = self.contexts[msg.metadata.dst_node_id]
            reply = ready[i] if i in ready else self.call_app(msg, ctx)
            if self.intercept is not None:
                reply = self.intercept(msg, reply, int(ctx.node_config["partition-id"]))
            self._inbox[mid] = reply
        self.contexts.release()
        return ids

    def prepared_replies(self, messages: list[Message]) -> dict[int, Message]:
        """Replies produced for several of ``messages`` at once (by position); the others go one by one to the
        ClientApp.  None here; the vectorized engine (:class:`simulations.engine.vectorized.VectorGrid`) trains them."""
        return {}

    def call_app(self, msg: Message, ctx: Context) -> Message:
        """The ClientApp's reply to ``msg``; as in Ray and on a SuperNode, an exception becomes an error reply."""
        try:
            return self._app(msg, ctx)
        except Exception as err:
            error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(err).__name__}: {err}")
            return Message(error, reply_to=msg)

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self._inbox.pop(i) for i in message_ids if i in self._inbox]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))
