"""Large populations (``simulations.engine.population``) and the ``leaf-synthetic`` task (Synthetic(α, β)).

* the generator: shapes, determinism, each client made on its own from (seed, id), power-law sizes;
* the out-of-core row store: round trip (dtypes and bits), replacement, reopening, sparse files;
* runs with the store equal runs without it bit for bit (float64, both in-process engines), a resumed run with the
  store equals the uninterrupted one, and at N = 2,000 with 1 % sampled only the sampled nodes ever get a context.
"""

from __future__ import annotations

import numpy as np
import pytest

from app_common import task as T
from client_app.app import app as client_app
from flower_strategies.core.records import STATE_PREFIX
from flower_strategies.methods.scaffold import CLIENT_CONTROL
from simulations.engine.inprocess import make_grid, simulate
from simulations.engine.population import NodeContexts, RowStore


# ------------------------------------------------------------------------------------------ Synthetic(α, β)
def test_leaf_synthetic_clients_are_made_on_demand_deterministically():
    x, y, xt, yt = T.leaf_synthetic_client(7, 0.5, 0.5, 3)
    n = T.leaf_synthetic_size(7, 3)
    assert x.shape == (int(0.9 * n), 60) and xt.shape == (n - int(0.9 * n), 60)
    assert y.shape == (len(x),) and y.dtype == np.int64 and y.min() >= 0 and y.max() < 10
    T.leaf_synthetic_client.cache_clear()
    for i in range(7):  # generating others first changes nothing: client 7 depends on (seed, 7) only
        T.leaf_synthetic_client(i, 0.5, 0.5, 3)
    again = T.leaf_synthetic_client(7, 0.5, 0.5, 3)
    assert all(np.array_equal(a, b) for a, b in zip((x, y, xt, yt), again, strict=True))
    other = T.leaf_synthetic_client(7, 0.5, 0.5, 4)
    assert not np.array_equal(other[0][:1], x[:1])
    # Σ = diag(j^-1.2): the spread of feature j around the client's mean falls with j
    x0 = T.leaf_synthetic_client(0, 0.0, 0.0, 0)[0]
    assert x0[:, 0].std() > 3 * x0[:, -1].std()


def test_leaf_synthetic_sizes_are_power_law_and_capped():
    sizes = np.array([T.leaf_synthetic_size(i, 0) for i in range(20_000)])
    assert sizes.min() >= 50 and sizes.max() == T.LEAF_MAX_EXAMPLES
    assert 95 <= np.median(sizes) <= 115  # int(lognormal(4, 2)) + 50: median e^4 + 50 ≈ 105
    assert sizes.mean() > 2 * np.median(sizes)  # a heavy tail
    assert 0.03 < np.mean(sizes == T.LEAF_MAX_EXAMPLES) < 0.15


def test_alpha_and_beta_control_heterogeneity():
    def label_skew(alpha, beta):  # mean over clients of the share of the client's most common label
        ys = [T.leaf_synthetic_client(i, alpha, beta, 1)[1] for i in range(40)]
        return np.mean([np.bincount(y, minlength=10).max() / len(y) for y in ys])

    def input_spread(beta):  # spread of the clients' mean inputs
        return np.std([T.leaf_synthetic_client(i, 0.0, beta, 1)[0].mean() for i in range(40)])

    assert input_spread(4.0) > 2 * input_spread(0.0)
    assert label_skew(0.0, 0.0) > 0.1 and label_skew(1.0, 1.0) > label_skew(0.0, 0.0)


def test_leaf_synthetic_model_and_test_set():
    model = T.build_model("leaf-synthetic", 0)
    assert [tuple(p.shape) for p in model.parameters()] == [(10, 60), (10,)]
    x, y = T.load_test_data("leaf-synthetic", seed=0, synthetic_alpha=0.5, synthetic_beta=0.5)
    parts = [T.leaf_synthetic_client(i, 0.5, 0.5, 0) for i in range(T.LEAF_TEST_CLIENTS)]
    assert len(x) == sum(len(p[2]) for p in parts) and x.dtype.is_floating_point
    xc, yc = T.load_client_data("leaf-synthetic", 99_999, 100_000, partitioner="iid", seed=0, alpha=0.3,
                                classes_per_client=2, synthetic_alpha=0.5, synthetic_beta=0.5, precision="float64")
    assert xc.shape[1] == 60 and str(xc.dtype) == "torch.float64" and len(yc) == len(xc)


# ------------------------------------------------------------------------------------------ the row store
def test_row_store_round_trip_replacement_and_reopening(tmp_path):
    store = RowStore(tmp_path / "s", 100_000)
    a = {"fedadapt.c": {"w": np.random.default_rng(0).normal(size=(64, 64)), "b": np.arange(3, dtype=np.float32)},
         "fedadapt.n": {"k": np.array([4], dtype=np.int64)}}
    store.write(99_999, a)
    store.write(3, {"fedadapt.c": a["fedadapt.c"]})
    got = store.read(99_999)
    assert got.keys() == a.keys()
    for name in a:
        for key, arr in a[name].items():
            assert got[name][key].dtype == arr.dtype and np.array_equal(got[name][key], arr)
    assert store.read(0) == {} and store.rows_held() == 2
    # a write replaces the client's whole state: records it no longer has, or in another layout, are gone
    store.write(99_999, {"fedadapt.c": {"w": np.zeros((2, 2))}})
    assert set(store.read(99_999)) == {"fedadapt.c"} and store.read(99_999)["fedadapt.c"]["w"].shape == (2, 2)
    store.flush()
    again = RowStore(tmp_path / "s", 100_000)  # reopened: the same rows
    assert np.array_equal(again.read(3)["fedadapt.c"]["w"], a["fedadapt.c"]["w"])
    with pytest.raises(ValueError, match="100000 clients"):
        RowStore(tmp_path / "s", 10)
    # sparse: the rows never written take no disk (apparent size 100,000 × 33 KB ≈ 3.3 GB)
    assert store.disk_bytes() < 2**20


def test_node_contexts_are_made_on_demand_and_released_to_the_store(tmp_path):
    store = RowStore(tmp_path, 1000)
    contexts = NodeContexts(range(1, 1001), {"task": "x"}, store)
    assert len(contexts) == 1000 and 1000 in contexts and 0 not in contexts and contexts.made == 0
    ctx = contexts[500]
    assert ctx.node_config == {"partition-id": 499, "num-partitions": 1000}
    from flower_strategies.core.records import to_record

    ctx.state[STATE_PREFIX + "m"] = to_record({"w": np.ones(3)})
    contexts.release()
    assert not contexts.live and store.rows_held() == 1
    assert np.array_equal(contexts[500].state[STATE_PREFIX + "m"]["w"].numpy(), np.ones(3))
    assert contexts.made == 2


# ------------------------------------------------------------------------------------------ runs with the store
def _scaffold(**over):
    from flower_strategies.methods.scaffold import Scaffold, ScaffoldHParams
    from tests.helpers import SYNTH_NODES, SYNTH_RC, synthetic_initial_arrays

    return Scaffold, ScaffoldHParams(), SYNTH_NODES, SYNTH_RC, synthetic_initial_arrays


@pytest.mark.parametrize("engine", ["inprocess", "vectorized"])
def test_runs_with_the_store_equal_runs_without_it_bit_for_bit(tmp_path, engine):
    cls, hp, nodes, rc, initial = _scaffold()

    def one(**grid_kwargs):
        strat = cls(hp, client_lr=0.05, local_steps=5, local_epochs=1, batch_size=8, fraction_train=0.5, seed=0)
        snaps, grid = simulate(strat, initial(), 8, nodes, rc, engine=engine, **grid_kwargs)
        return [s["w.weight"] for s in snaps], grid

    ref, ref_grid = one()
    got, grid = one(state_dir=str(tmp_path / "rows"))
    assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True)) and np.abs(ref[-1] - ref[0]).max() > 0.01
    assert not grid.contexts.live  # every context went back to the store
    key = STATE_PREFIX + CLIENT_CONTROL
    held = {n for n, c in ref_grid.contexts.items() if key in c.state.array_records}
    assert grid.store is not None and grid.store.rows_held() == len(held) > 0
    for n in held:
        assert np.array_equal(grid.contexts[n].state[key]["w.weight"].numpy(),
                              ref_grid.contexts[n].state[key]["w.weight"].numpy())


def test_resume_with_the_store_continues_exactly(tmp_path, monkeypatch):
    from server_app.app import run
    from tests.test_checkpoint import BASE, NODES, Crash, assert_same_run, crash_in_round

    monkeypatch.setenv("FEDADAPT_CLIENT_STATE_DIR", str(tmp_path / "disk"))  # contexts come and go: no node config
    cfg = {**BASE, "method": "scaffold"}
    out = {"output-dir": str(tmp_path), "checkpoint-every": 1}
    run(make_grid(client_app, NODES, cfg), {**cfg, **out, "run-name": "ref"})
    with pytest.raises(Crash):
        run(make_grid(client_app, NODES, cfg, state_dir=str(tmp_path / "rows1"), intercept=crash_in_round(4)),
            {**cfg, **out, "run-name": "ck"})
    summary = run(make_grid(client_app, NODES, cfg, state_dir=str(tmp_path / "rows2")),
                  {**cfg, **out, "run-name": "ck", "resume": str(tmp_path / "ck" / "checkpoint.npz")})
    assert_same_run(tmp_path / "ref", tmp_path / "ck")
    assert summary["client_state_after_resume"].get("disk", 0) > 0


def test_a_population_of_2000_makes_contexts_only_for_the_sampled_clients(tmp_path, monkeypatch):
    """1 % of 2,000 per round through the real ServerApp (vectorized engine): the contexts made are the sampled
    clients' (none for the other ~1,940), none stays alive between rounds, and the sampled set and results are
    those of the same run with every context kept in memory (the partition-id query of all nodes skipped)."""
    from simulations.engine.inprocess import run_inprocess

    cfg = {"task": "leaf-synthetic", "method": "scaffold", "fraction-train": 0.01, "num-server-rounds": 3,
           "local-steps": 3, "output-dir": str(tmp_path), "learning-curve": False, "client-lr": 0.05}
    grids = []

    def capture(*args, **kwargs):
        grids.append(make_grid(*args, **kwargs))
        return grids[-1]

    import simulations.engine.inprocess as E

    monkeypatch.setattr(E, "make_grid", capture)
    with_store = run_inprocess({**cfg, "run-name": "store"}, 2000, engine="vectorized",
                               state_dir=str(tmp_path / "rows"))
    plain = run_inprocess({**cfg, "run-name": "plain"}, 2000, engine="vectorized")
    drop = ("seconds",)
    assert {k: v for k, v in with_store["final"].items() if k not in drop} == \
        {k: v for k, v in plain["final"].items() if k not in drop}
    assert with_store["final"]["updated"]
    store_grid = grids[0]
    assert store_grid.contexts.made == 3 * 20 and not store_grid.contexts.live
    assert store_grid.store.rows_held() == len({n for n, c in grids[1].contexts.live.items()
                                                if STATE_PREFIX + CLIENT_CONTROL in c.state.array_records})
