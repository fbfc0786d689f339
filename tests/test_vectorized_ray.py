"""The vectorized engine on Ray actors (simulations.engine.vectorized_ray) equals the one-process vectorized engine
bit for bit (float64, same chunks), for a stateful method (scaffold: c_i kept per client across rounds, fresh and
returning clients) and a stateless one (fedavg), and the documented ``--ray-actors`` launch runs; the chunk split
(chunk_bounds) and the launcher option."""

from __future__ import annotations

import pytest

from simulations.engine.vectorized import chunk_bounds


@pytest.mark.parametrize(("n", "size", "workers", "expected"), [
    (10, 4, 1, [(0, 3), (3, 6), (6, 10)]),    # ceil(10/4) = 3 chunks, sizes 3, 3, 4
    (10, 100, 1, [(0, 10)]),
    (10, 100, 2, [(0, 5), (5, 10)]),           # at least one chunk per worker
    (3, 100, 4, [(0, 1), (1, 2), (2, 3)]),     # never an empty chunk
    (7, 2, 2, [(0, 1), (1, 3), (3, 5), (5, 7)]),
    (0, 5, 2, []),
])
def test_chunk_bounds(n, size, workers, expected):
    bounds = chunk_bounds(n, size, workers)
    assert bounds == expected
    assert all(b - a <= size for a, b in bounds)
    assert [i for a, b in bounds for i in range(a, b)] == list(range(n))


def test_chunk_bounds_cover_and_balance():
    for n in range(0, 40):
        for size in range(1, 12):
            for workers in (1, 2, 3):
                bounds = chunk_bounds(n, size, workers)
                lengths = [b - a for a, b in bounds]
                assert sum(lengths) == n and all(0 < x <= size for x in lengths)
                assert not lengths or max(lengths) - min(lengths) <= 1
                assert len(bounds) == (min(n, max(-(-n // size), workers)))


@pytest.mark.parametrize("bad", [(-1, 1, 1), (3, 0, 1), (3, 1, 0)])
def test_chunk_bounds_refuses_bad_arguments(bad):
    with pytest.raises(ValueError):
        chunk_bounds(*bad)


@pytest.mark.slow
def test_ray_actors_equal_the_one_process_engine_bit_for_bit(tmp_path):
    import numpy as np
    import ray

    from tests.test_vectorized import BASE, MODES, _run

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for method in ("scaffold", "fedavg"):
            rc = {**BASE, **MODES["epochs-partial"], "method": method, "fraction-train": 0.75}
            one, _ = _run(rc, "vectorized", 8, chunk=2)
            dist, grid = _run(rc, "vectorized", 8, chunk=2, actors=2)
            assert grid.stacked_clients == 6 * 10 and all(c > 0 for c in grid.chunks_per_actor)
            for a, b in zip(one, dist, strict=True):
                assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), method
            assert any(not np.array_equal(one[0][k], one[-1][k]) for k in one[0])  # the model moved
            if method == "scaffold":  # every trained node holds its c_i, as in the one-process run
                assert sum(1 for ctx in grid.contexts.values() if len(ctx.state.keys())) >= 6
            grid.shutdown()
        # the documented launcher command (docs/vectorized.md), smaller: 4 nodes, 1 round, on this Ray instance
        from simulations.launch import __main__ as cli

        rc = f"method='scaffold' num-server-rounds=1 min-available-nodes=4 output-dir='{tmp_path}'"
        assert cli.main(["sim", "--engine", "vectorized", "--ray-actors", "2", "--num-supernodes", "4",
                         "--run-config", rc]) == 0
    finally:
        ray.shutdown()


def test_launcher_ray_actors_option(monkeypatch, capsys):
    """``--ray-actors N`` goes with ``--engine vectorized`` only, and reaches the grid as ``actors``/``address``."""
    from simulations.launch import __main__ as cli
    from simulations.launch import seeds

    seen = {}
    monkeypatch.setattr(seeds, "launch_inprocess", lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs) or 0)
    assert cli.main(["sim", "--engine", "vectorized", "--ray-actors", "2", "--num-supernodes", "5"]) == 0
    assert seen["args"][0] == 5 and seen["args"][3] == "vectorized"
    assert seen["kwargs"] == {"actors": 2, "address": None}
    for bad in (["sim", "--ray-actors", "2"], ["sim", "--engine", "inprocess", "--ray-actors", "2"],
                ["sim", "--engine", "vectorized", "--ray-actors", "0"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(bad)
        assert exc.value.code == 2 and "--ray-actors" in capsys.readouterr().err
