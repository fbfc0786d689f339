"""In-process engines: the real Strategy drives the real ClientApp without Ray or a SuperLink.

``inprocess`` trains the sampled clients one after another through a :class:`~simulations.engine.grid.LoopbackGrid`,
``vectorized`` all of a round's together (:mod:`simulations.engine.vectorized`).  Deterministic and fast: used for the
exactness tests and for sweeps.  They complement – never replace – the Ray simulation and the deployment, which
the test suite also runs for real.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Mapping
from typing import Any

from .grid import LoopbackGrid

__all__ = ["ENGINES", "LoopbackGrid", "make_grid", "run_inprocess", "simulate", "simulate_legacy"]


#: In-process engines: ``inprocess`` trains the sampled clients one after another (:class:`LoopbackGrid`),
#: ``vectorized`` all of a round's together (:class:`simulations.engine.vectorized.VectorGrid`).
ENGINES = ("inprocess", "vectorized")


def make_grid(client_app: Any, num_nodes: int, run_config: Mapping[str, Any] | None, engine: str = "inprocess",
              **grid_kwargs: Any) -> LoopbackGrid:
    """The in-process grid of ``engine`` (one of :data:`ENGINES`); ``engine = "vectorized"`` with ``actors=N``
    (N ≥ 1): its chunks train on N Ray actors (:class:`simulations.engine.vectorized_ray.RayVectorGrid`)."""
    if engine == "vectorized" and grid_kwargs.get("actors"):
        from simulations.engine.vectorized_ray import RayVectorGrid

        return RayVectorGrid(client_app, num_nodes, run_config, **grid_kwargs)
    if engine == "vectorized":
        from simulations.engine.vectorized import VectorGrid

        return VectorGrid(client_app, num_nodes, run_config, **grid_kwargs)
    if engine != "inprocess":
        raise ValueError(f"unknown in-process engine {engine!r}; valid: {', '.join(ENGINES)}")
    return LoopbackGrid(client_app, num_nodes, run_config, **grid_kwargs)


def run_inprocess(run_config: Mapping[str, Any], num_nodes: int, *, engine: str = "inprocess",
                  **grid_kwargs: Any) -> dict[str, Any]:
    """Run the real ServerApp logic against the real ClientApp in this process; returns the run summary.
    ``engine = "vectorized"`` trains each round's clients together (:mod:`simulations.engine.vectorized`).

    The process then ends without one last walk of every object: at exit, :func:`gc.freeze` hides the ~0.4 million
    objects that torch (with ``torch._dynamo``) and Flower leave from the collector's final passes, which take ~0.8 s
    on a 2-core machine.  Frozen objects are still freed by reference counting; only cycles among them are left to
    the process's end (the test suite's ``conftest.py`` does the same)."""
    from client_app.app import app as client_app
    from server_app.app import run

    atexit.unregister(gc.freeze)  # registered once per process, whatever the number of runs
    atexit.register(gc.freeze)

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
