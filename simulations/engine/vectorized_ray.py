"""The vectorized engine spread over Ray actors: each round's chunks train stacked on ``actors`` Ray actors.

:class:`RayVectorGrid` is a :class:`~simulations.engine.vectorized.VectorGrid` whose chunks are not trained one after
another in this process: each chunk's :class:`~simulations.engine.vectorized.ChunkJob` (the round content, the clients'
state, keys and data) goes to a :class:`ChunkActor`, which runs the same
:func:`~simulations.engine.vectorized.run_chunk`
(``torch.func`` over the task's model, the method's own local optimizer) and sends back each client's reply content
and state; this process writes the states into the nodes' ``Context.state`` (:func:`~simulations.engine.vectorized.
replace_state`) and builds the replies exactly as the one-process engine does.  With the same chunks the results
are the one-process engine's, bit for bit (``tests/test_vectorized_ray.py``).  A round is split into at least one
chunk per actor; a chunk that fails on its actor is answered by the sequential ClientApp in this process.

Ray: a private local instance with ``actors`` CPUs, or an existing cluster (``address``, e.g. ``--ray-address``
or ``RAY_ADDRESS``; its nodes need this project importable at the same path).  Each actor reserves ``actor_cpus``
CPUs and runs torch with as many threads.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import Message, RecordDict

from .vectorized import (ChunkJob, NotVectorizable, VectorGrid, _chunk_failed, chunk_job, finish_chunk,
                         replace_state, run_chunk)


class ChunkActor:
    """Trains chunks (:func:`~simulations.engine.vectorized.run_chunk`); one per Ray worker process."""

    def __init__(self, threads: int) -> None:
        torch.set_num_threads(max(1, int(threads)))

    def node(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def run(self, job: ChunkJob) -> tuple[list[RecordDict], list[RecordDict]] | BaseException:
        """``(reply contents, client states)``, or the exception (sent back as a value: the engine falls back)."""
        try:
            return run_chunk(job), job.states
        except Exception as err:  # noqa: BLE001 - reported to the driver, which trains the chunk sequentially
            return err


def _portable(job: ChunkJob) -> ChunkJob:
    """``job`` as it is sent: the tensors on the CPU in storages of their own (a slice of a larger tensor would
    pickle its whole storage), without the undo records."""
    own = [t.detach().cpu().clone() for t in job.x], [t.detach().cpu().clone() for t in job.y]
    return dataclasses.replace(job, x=own[0], y=own[1], before=[])


class RayVectorGrid(VectorGrid):
    """A :class:`~simulations.engine.vectorized.VectorGrid` whose chunks train on ``actors`` Ray actors (module
    docstring).

    ``address``: an existing Ray cluster (``host:port``; default ``RAY_ADDRESS`` if set, else a private local
    instance with ``actors × actor_cpus`` CPUs).  Ray is started on the first round and left running (call
    :meth:`shutdown` or ``ray.shutdown()``)."""

    def __init__(self, client_app: Any, num_nodes: int, run_config: Mapping[str, Any] | None = None, *,
                 actors: int = 2, actor_cpus: int = 1, address: str | None = None, **kwargs: Any) -> None:
        super().__init__(client_app, num_nodes, run_config, **kwargs)
        if actors < 1 or actor_cpus < 1:
            raise ValueError(f"actors and actor_cpus must be >= 1, got {actors}, {actor_cpus}")
        self.workers, self.actor_cpus = int(actors), int(actor_cpus)
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self._actors: list[Any] = []
        #: Chunks answered by each actor so far (by actor index; for logs and tests).
        self.chunks_per_actor = [0] * self.workers

    def _pool(self) -> list[Any]:
        if not self._actors:
            import ray

            if not ray.is_initialized():
                if self.address:
                    ray.init(address=self.address, log_to_driver=False)
                else:
                    ray.init(num_cpus=self.workers * self.actor_cpus, include_dashboard=False, log_to_driver=False)
            remote = ray.remote(num_cpus=self.actor_cpus)(ChunkActor)
            self._actors = [remote.remote(self.actor_cpus) for _ in range(self.workers)]
        return self._actors

    def train_chunks(self, parts: list[list[tuple[int, tuple]]]) -> dict[int, Message]:
        """Every chunk on an actor (the next idle one, chunks in order), then each client's state and reply here."""
        import ray

        actors = self._pool()
        jobs = [_portable(chunk_job(part)) for part in parts]
        pending: dict[Any, tuple[int, int]] = {}  # object ref → (chunk, actor)
        results: dict[int, Any] = {}
        queue = list(range(len(parts)))
        idle = list(range(len(actors)))
        while queue or pending:
            while queue and idle:
                c, a = queue.pop(0), idle.pop(0)
                pending[actors[a].run.remote(jobs[c])] = (c, a)
            done, _ = ray.wait(list(pending), num_returns=1)
            c, a = pending.pop(done[0])
            results[c] = ray.get(done[0])
            self.chunks_per_actor[a] += 1
            idle.append(a)
        replies: dict[int, Message] = {}
        for c, part in enumerate(parts):
            out = results[c]
            if isinstance(out, NotVectorizable):
                raise out
            if isinstance(out, BaseException):
                _chunk_failed(len(part), out)
                continue
            contents, states = out
            for (_, (_, ctx, *_)), state in zip(part, states, strict=True):
                replace_state(ctx.state, state)
            replies.update(finish_chunk(part, contents))
        return replies

    def actor_nodes(self) -> list[str]:
        """The Ray node of each actor (for logs and the cluster benchmark)."""
        import ray

        return [str(n) for n in ray.get([a.node.remote() for a in self._pool()])]

    def shutdown(self) -> None:
        """Stop the actors (Ray itself stays up)."""
        import ray

        for actor in self._actors:
            ray.kill(actor)
        self._actors = []


__all__ = ["ChunkActor", "RayVectorGrid"]
