"""In-process engine: the real Strategy drives the real ClientApp without Ray or a SuperLink.

A :class:`LoopbackGrid` hands each message straight to ``client_app(message, context)`` (one persistent
``Context`` per node, so ``context.state`` works as on a SuperNode).  Deterministic and fast: used for the
exactness tests and for sweeps.  It complements – never replaces – the Ray simulation and the deployment,
which the test suite also runs for real.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

try:  # flwr 1.42 internals (pinned): a message factory outside a runtime needs a task identity
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity
except ImportError as err:  # pragma: no cover - only with another flwr version
    raise ImportError("simulations.engine needs flwr==1.42.0") from err

Interceptor = Callable[[Message, Message, int], Message]


class LoopbackGrid(Grid):
    """Deliver each message to ``client_app`` in-process.

    ``node_ids`` defaults to ``1..num_nodes``; node ``i`` gets ``partition-id = i-1``.  ``intercept`` (optional)
    may replace a reply (fault-injection in tests): ``intercept(request, reply, partition_id) -> reply``.
    """

    def __init__(
        self,
        client_app: Any,
        num_nodes: int,
        run_config: Mapping[str, Any] | None = None,
        *,
        node_ids: Iterable[int] | None = None,
        intercept: Interceptor | None = None,
    ) -> None:
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
        ids = list(node_ids) if node_ids is not None else list(range(1, num_nodes + 1))
        self._app = client_app
        self._run: Run | None = Run.create_empty(1)
        self._inbox: dict[str, Message] = {}
        self.intercept = intercept
        self.contexts = {
            n: Context(
                run_id=1, node_id=n, state=RecordDict(), run_config=dict(run_config or {}),
                node_config={"partition-id": p, "num-partitions": len(ids)},
            )
            for p, n in enumerate(ids)
        }

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
    #: (``server_app.loop.exchange``).
    answers_at_push = True

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        msgs = list(messages)
        ids = []
        for msg in msgs:  # as the SuperLink does: replies name the message id in reply_to_message_id
            ids.append(uuid.uuid4().hex)
            msg.metadata.__dict__["_message_id"] = ids[-1]
        ready = self.prepared_replies(msgs)
        for i, (msg, mid) in enumerate(zip(msgs, ids)):
            ctx = self.contexts[msg.metadata.dst_node_id]
            reply = ready[i] if i in ready else self.call_app(msg, ctx)
            if self.intercept is not None:
                reply = self.intercept(msg, reply, int(ctx.node_config["partition-id"]))
            self._inbox[mid] = reply
        return ids

    def prepared_replies(self, messages: list[Message]) -> dict[int, Message]:
        """Replies produced for several of ``messages`` at once (by position); the others go one by one to the
        ClientApp.  None here; the vectorized engine (:class:`simulations.vectorized.VectorGrid`) trains them."""
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


#: In-process engines: ``inprocess`` trains the sampled clients one after another (:class:`LoopbackGrid`),
#: ``vectorized`` all of a round's together (:class:`simulations.vectorized.VectorGrid`).
ENGINES = ("inprocess", "vectorized")


def make_grid(client_app: Any, num_nodes: int, run_config: Mapping[str, Any] | None, engine: str = "inprocess",
              **grid_kwargs: Any) -> LoopbackGrid:
    """The in-process grid of ``engine`` (one of :data:`ENGINES`)."""
    if engine == "vectorized":
        from simulations.vectorized import VectorGrid

        return VectorGrid(client_app, num_nodes, run_config, **grid_kwargs)
    if engine != "inprocess":
        raise ValueError(f"unknown in-process engine {engine!r}; valid: {', '.join(ENGINES)}")
    return LoopbackGrid(client_app, num_nodes, run_config, **grid_kwargs)


def run_inprocess(run_config: Mapping[str, Any], num_nodes: int, *, engine: str = "inprocess",
                  **grid_kwargs: Any) -> dict[str, Any]:
    """Run the real ServerApp logic against the real ClientApp in this process; returns the run summary.
    ``engine = "vectorized"`` trains each round's clients together (:mod:`simulations.vectorized`)."""
    from client_app.app import app as client_app
    from server_app.app import run

    return run(make_grid(client_app, num_nodes, run_config, engine, **grid_kwargs), run_config)


def simulate(
    strategy: Any,
    initial_arrays: Any,
    num_rounds: int,
    num_nodes: int,
    run_config: Mapping[str, Any],
    engine: str = "inprocess",
    **grid_kwargs: Any,
) -> tuple[list[dict[str, Any]], LoopbackGrid]:
    """Drive ``strategy`` (a real fedadapt/Flower strategy) against the real ClientApp in-process.

    Returns the global arrays after every round (``[round0, round1, …]`` as ``dict[str, np.ndarray]``) and the
    grid (whose ``contexts`` hold each node's persistent state).  ``run_config`` is what the ClientApp reads
    (task, partitioner, seed, …); ``engine``: one of :data:`ENGINES`.
    """
    from flwr.app import MetricRecord

    from client_app.app import app as client_app
    from flower_strategies.core.records import to_numpy

    grid = make_grid(client_app, num_nodes, run_config, engine, **grid_kwargs)
    snapshots: list[dict[str, Any]] = []

    def capture(server_round: int, arrays: Any) -> MetricRecord:
        snapshots.append({k: v.copy() for k, v in to_numpy(arrays).items()})
        return MetricRecord({})

    strategy.start(grid=grid, initial_arrays=initial_arrays, num_rounds=num_rounds, evaluate_fn=capture)
    return snapshots, grid


def simulate_legacy(
    strategy: Any,
    initial_arrays: Mapping[str, Any],
    num_rounds: int,
    num_nodes: int,
    run_config: Mapping[str, Any],
    **grid_kwargs: Any,
) -> tuple[list[dict[str, Any]], LoopbackGrid]:
    """Like :func:`simulate`, through the *legacy* API: ``LegacyStrategy`` under Flower's ``start_grid`` and the
    ``NumPyClient`` ClientApp (``client_app.legacy``).  Returns the global arrays after every round."""
    import numpy as np
    from flwr.server import ServerConfig
    from flwr.server.compat import start_grid

    from client_app.legacy import app as legacy_client_app
    from flower_strategies.compat.legacy import LegacyStrategy

    snapshots: list[dict[str, Any]] = []

    def capture(server_round: int, arrays: dict[str, Any]):
        snapshots.append({k: np.array(v, copy=True) for k, v in arrays.items()})
        return None

    initial = {k: np.asarray(v) for k, v in initial_arrays.items()}
    grid = LoopbackGrid(legacy_client_app, num_nodes, run_config, **grid_kwargs)
    start_grid(grid=grid, strategy=LegacyStrategy(strategy, initial, evaluate_fn=capture, num_rounds=num_rounds),
               config=ServerConfig(num_rounds=num_rounds))
    return snapshots, grid
