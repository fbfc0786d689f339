"""Client state kept on the nodes' disks (``client_app.client_state``): exact resume with fresh ``Context.state``.

In Flower 1.42 a resumed run is a new run: every node's ``Context.state`` starts empty.  Here the resumed run gets
a fresh :class:`LoopbackGrid` (fresh Contexts, as on SuperNodes after a new ``flwr run``) whose nodes keep the same
client-state directories; the run must equal the uninterrupted one bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from client_app import client_state as cs
from client_app.app import app as client_app
from flower_strategies.core import checkpoint as ckpt
from flower_strategies.core import records as R
from server_app.app import run
from simulations.engine.inprocess import LoopbackGrid
from tests.test_checkpoint import BASE, NODES, Crash, assert_same_run, crash_in_round, rows


def grid_with_state_dirs(root, cfg, **kw) -> LoopbackGrid:
    """Nodes started with ``--node-config "... client-state-dir='<root>/node<i>'"``."""
    grid = LoopbackGrid(client_app, NODES, cfg, **kw)
    for n, ctx in grid.contexts.items():
        ctx.node_config[cs.NODE_CONFIG_KEY] = str(root / f"node{n}")
    return grid


@pytest.mark.parametrize("method", ["scaffold", "fedlamb"])
def test_resume_with_fresh_contexts_continues_the_saved_client_state_exactly(tmp_path, method):
    cfg = {**BASE, "method": method}
    out = {"output-dir": str(tmp_path), "checkpoint-every": 1}
    run(LoopbackGrid(client_app, NODES, cfg), {**cfg, **out, "run-name": "ref"})
    # the server dies in round 4 after its first client trained: that client's round-4 state is on its disk
    # (written by the interrupted run after the checkpoint) and must not be used by the resumed run
    with pytest.raises(Crash):
        run(grid_with_state_dirs(tmp_path / "disks", cfg, intercept=crash_in_round(4)),
            {**cfg, **out, "run-name": "ck"})
    path = tmp_path / "ck" / "checkpoint.npz"
    token = ckpt.load(path)["app"]["run-token"]
    assert any(p.name.startswith("round-4.") for p in (tmp_path / "disks").rglob(f"{token}/*/*"))
    summary = run(grid_with_state_dirs(tmp_path / "disks", cfg), {**cfg, **out, "run-name": "ck", "resume": str(path)})
    assert_same_run(tmp_path / "ref", tmp_path / "ck")
    assert summary["client_state_after_resume"].get("disk", 0) > 0
    assert "fresh" not in summary["client_state_after_resume"]
    assert ckpt.load(path)["app"]["run-token"] == token
    # files no resume can need are deleted: per client, nothing older than the last checkpointed round it trained in
    for client_dir in (tmp_path / "disks").rglob(f"{token}/client-*"):
        assert len(list(client_dir.iterdir())) <= 2


def test_fresh_run_with_the_same_run_name_does_not_pick_up_stale_state(tmp_path):
    cfg = {**BASE, "method": "scaffold", "num-server-rounds": 3}
    out = {"output-dir": str(tmp_path), "checkpoint-every": 1}
    run(LoopbackGrid(client_app, NODES, cfg), {**cfg, **out, "run-name": "ref"})
    for _ in range(2):  # the second run (told to overwrite) finds the first one's files on the disks, ignores them
        run(grid_with_state_dirs(tmp_path / "disks", cfg), {**cfg, **out, "run-name": "again", "overwrite": True})
        assert rows(tmp_path / "again") == rows(tmp_path / "ref")
    assert len(list((tmp_path / "disks").glob("node1/*"))) == 2  # one token per run


def test_nodes_restarted_with_empty_disks_report_fresh_state(tmp_path):
    cfg = {**BASE, "method": "scaffold", "fraction-train": 1.0}
    run_cfg = {**cfg, "output-dir": str(tmp_path), "run-name": "ck", "checkpoint-every": 1}
    with pytest.raises(Crash):
        run(grid_with_state_dirs(tmp_path / "disks", cfg, intercept=crash_in_round(4)), run_cfg)
    summary = run(grid_with_state_dirs(tmp_path / "empty", cfg),
                  {**run_cfg, "resume": str(tmp_path / "ck" / "checkpoint.npz")})
    assert summary["client_state_after_resume"] == {"fresh": NODES}


def test_without_checkpoints_nothing_is_written(tmp_path):
    cfg = {**BASE, "method": "scaffold", "num-server-rounds": 2}
    run(grid_with_state_dirs(tmp_path / "disks", cfg), {**cfg, "output-dir": str(tmp_path), "run-name": "plain"})
    assert not (tmp_path / "disks").exists()


def _state(value: float) -> RecordDict:
    state = RecordDict()
    state["fedadapt.c"] = R.to_record({"w": np.full(3, value)})
    return state


def test_store_rounds_pruning_and_stale_futures(tmp_path):
    store = cs.ClientStateStore(tmp_path, "00ff00ff00ff00ff", 3)
    for r in (1, 2, 3, 4):
        store.save(_state(r), r, keep=2, run_id=11)
    assert store.rounds() == [2, 3, 4]  # round 1 is older than the newest checkpointed one (2)
    ctx = Context(run_id=22, node_id=1, node_config={}, state=RecordDict(), run_config={})
    # a new Flower run resumed after round 2 trains round 3: run 11's files of rounds 3 and 4 are stale
    assert store.load(ctx.state, 3, run_id=22, base=2) == "disk"
    assert store.rounds() == [2]
    assert np.array_equal(ctx.state["fedadapt.c"]["w"].numpy(), np.full(3, 2.0))
    store.save(_state(30), 3, keep=2, run_id=22, base=2)
    store.save(_state(99), 4, keep=2, run_id=11)  # a late write of the interrupted run's in-flight round 4
    state = RecordDict()
    assert store.load(state, 6, run_id=22, base=2) == "disk"  # run 22's own round 3, not run 11's late round 4
    assert np.array_equal(state["fedadapt.c"]["w"].numpy(), np.full(3, 30.0))
    assert store.rounds() == [2, 3]
    empty = cs.ClientStateStore(tmp_path / "other", "00ff00ff00ff00ff", 3)
    assert empty.load(RecordDict(), 5) == "fresh" and empty.load(_state(1), 5) == "memory"


def test_store_refuses_bad_tokens_pickles_and_foreign_files(tmp_path):
    with pytest.raises(ValueError, match="hex"):
        cs.ClientStateStore(tmp_path, "../../etc", 0)
    store = cs.ClientStateStore(tmp_path, "abcdef0123456789", 0)
    store.dir.mkdir(parents=True)
    np.save(store.dir / "x.npy", np.array([object()], dtype=object), allow_pickle=True)
    (store.dir / "x.npy").rename(store.path(1))
    state = _state(7)
    assert store.load(state, 2) == "memory"  # unreadable: ignored (logged), the in-memory state is kept
    assert np.array_equal(state["fedadapt.c"]["w"].numpy(), np.full(3, 7.0))
    other = cs.ClientStateStore(tmp_path, "abcdef0123456789", 1)
    other.save(_state(1), 1, keep=0)
    store.path(1).write_bytes(other.path(1).read_bytes())  # another client's file
    with pytest.raises(ValueError, match="another run or client"):
        store.read(store.path(1))
