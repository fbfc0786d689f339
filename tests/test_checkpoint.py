"""Checkpoint/resume: a run interrupted after round k and resumed is bit-identical to an uninterrupted run.

Everything runs the real ServerApp logic (``server_app.app.run``) against the real ClientApp in-process.
The interruption is real: an exception thrown from the grid in round k+1 (like a crash), SIGTERM sent to this
process (the ServerApp's handler writes the checkpoint), or ``kill -9`` of a subprocess running the ServerApp.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.serverapp.strategy import Strategy

import flower_strategies  # noqa: F401 - registers the methods
from client_app.app import app as client_app
from app_common.config import AppConfig
from flower_strategies.core import checkpoint as ckpt
from flower_strategies.core.registry import METHODS
from flower_strategies.core.loop import own_loop_config
from server_app.app import run
from simulations.engine.inprocess import LoopbackGrid
from tests.helpers import every_method, rewrite_checkpoint

ROOT = Path(__file__).resolve().parent.parent
NODES = 6
BASE = {
    "task": "synthetic-linear", "synthetic-dim": 4, "precision": "float64", "local-steps": 3, "batch-size": 8,
    "seed": 2, "num-server-rounds": 6, "fraction-train": 0.5, "min-train-nodes": 2, "client-lr": 0.05,
}


def round_of(msg) -> int:
    """Server round of a TRAIN/EVALUATE message (0 for the partition-id QUERY)."""
    cfg = msg.content.config_records.get("config")
    return int(cfg["server-round"]) if cfg is not None else 0


class Crash(BaseException):
    """Stands for the server process dying in the middle of a round (a BaseException, like the SystemExit of a
    killed process: the in-process engine turns a ClientApp's *Exception* into an error reply, never this)."""


def crash_in_round(k: int):
    """A grid intercept that kills the 'server' after the first client of round k trained."""
    def intercept(request, reply, partition_id):
        if round_of(request) == k:
            raise Crash(f"server died in round {k}")
        return reply
    return intercept


class CrashingApp:
    """The ClientApp behind a grid whose server dies when it sends round ``k`` – before any client trains,
    so the nodes' persistent state is exactly that after round k-1."""

    def __init__(self, k: int) -> None:
        self.k, self.armed = k, True

    def __call__(self, msg, ctx):
        if self.armed and round_of(msg) == self.k:
            raise Crash(f"server died when sending round {self.k}")
        return client_app(msg, ctx)


def rows(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "seconds"}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def model(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt")


def assert_same_run(a: Path, b: Path, rounds: int = BASE["num-server-rounds"]) -> None:
    ra, rb = rows(a), rows(b)
    assert [r["round"] for r in ra] == list(range(rounds + 1))
    assert ra == rb
    ma, mb = model(a), model(b)
    assert set(ma) == set(mb)
    for k in ma:
        assert ma[k].dtype == mb[k].dtype and torch.equal(ma[k], mb[k]), k


def straight(tmp_path: Path, cfg: dict, name: str = "straight", nodes: int = NODES) -> Path:
    run(LoopbackGrid(client_app, nodes, cfg), {**cfg, "output-dir": str(tmp_path), "run-name": name})
    return tmp_path / name


#: The every-method matrix: 4 nodes (2 train per round) and 5 rounds, the crash after round 3.  Enough for what it
#: checks (the checkpoint restores every piece of server state and the nodes keep theirs: 3 rounds of history before
#: the crash, clients that return after it) at 20 client calls per method instead of the file's 36 (6 nodes, 6 rounds).
MATRIX_NODES, MATRIX = 4, {**BASE, "num-server-rounds": 5}


@pytest.mark.parametrize("method", every_method())
def test_crash_after_round_3_then_resume_is_bit_identical(tmp_path, method):
    cfg = {**MATRIX, "method": method}
    ref = straight(tmp_path, cfg, nodes=MATRIX_NODES)
    run_cfg = {**cfg, "output-dir": str(tmp_path), "run-name": "ck", "checkpoint-every": 1}
    app = CrashingApp(4)
    grid = LoopbackGrid(app, MATRIX_NODES, cfg)
    with pytest.raises(Crash):
        run(grid, run_cfg)
    path = tmp_path / "ck" / "checkpoint.npz"
    payload = ckpt.load(path)
    assert payload["round"] == 3 and payload["method"] == method
    assert [r["round"] for r in payload["metrics_rows"]] == [0, 1, 2, 3]
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    # The nodes kept running (same grid, so each node's Context.state survives); only the server restarts.
    app.armed = False
    summary = run(grid, {**run_cfg, "resume": str(path)})
    assert summary["resumed_after_round"] == 3
    assert_same_run(ref, tmp_path / "ck", MATRIX["num-server-rounds"])
    assert ckpt.load(path)["round"] == 5  # final checkpoint


def test_three_rounds_then_resume_for_three_more_equals_six_rounds(tmp_path):
    """A finished 3-round run's final checkpoint can be extended (num-server-rounds may change on resume)."""
    for method in ("fedavgm", "fedadam"):
        cfg = {**BASE, "method": method}
        ref = straight(tmp_path, cfg, f"{method}-6")
        short = {**cfg, "num-server-rounds": 3, "checkpoint-every": 2, "output-dir": str(tmp_path), "run-name": method}
        run(LoopbackGrid(client_app, NODES, cfg), short)
        path = tmp_path / method / "checkpoint.npz"
        assert ckpt.load(path)["round"] == 3  # written at the end although 3 % 2 != 0
        run(LoopbackGrid(client_app, NODES, cfg), {**short, "num-server-rounds": 6, "resume": str(path)})
        assert_same_run(ref, tmp_path / method)


def test_checkpoint_cadence_and_resume_from_an_older_round(tmp_path):
    cfg = {**BASE, "method": "fedyogi"}
    ref = straight(tmp_path, cfg)
    run_cfg = {**cfg, "output-dir": str(tmp_path), "run-name": "ck", "checkpoint-every": 2}
    with pytest.raises(Crash):
        run(LoopbackGrid(client_app, NODES, cfg, intercept=crash_in_round(4)), run_cfg)
    path = tmp_path / "ck" / "checkpoint.npz"
    assert ckpt.load(path)["round"] == 2  # round 3 was not a checkpoint round
    # the crashed run had written metrics rows 0..3; the resumed run rewrites from the checkpoint's rows
    run(LoopbackGrid(client_app, NODES, cfg), {**run_cfg, "resume": str(path)})
    assert_same_run(ref, tmp_path / "ck")


def test_sigterm_writes_the_last_completed_round_and_resume_is_identical(tmp_path):
    cfg = {**BASE, "method": "fedadam"}
    ref = straight(tmp_path, cfg)

    def sigterm_in_round_4(request, reply, partition_id):
        if round_of(request) == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return reply

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    run_cfg = {**cfg, "output-dir": str(tmp_path), "run-name": "ck", "checkpoint-every": 10}  # no periodic write
    with pytest.raises(SystemExit) as exc:
        run(LoopbackGrid(client_app, NODES, cfg, intercept=sigterm_in_round_4), run_cfg)
    assert exc.value.code == 128 + signal.SIGTERM
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # handlers restored
    path = tmp_path / "ck" / "checkpoint.npz"
    assert ckpt.load(path)["round"] == 3
    run(LoopbackGrid(client_app, NODES, cfg), {**run_cfg, "resume": str(path)})
    assert_same_run(ref, tmp_path / "ck")


@pytest.mark.slow  # real child processes / many end-to-end runs: the full suite runs it
def test_kill_9_of_the_server_process_then_resume(tmp_path):
    """A real ``kill -9`` (SIGKILL cannot be caught): the checkpoint of round 3 on disk is intact."""
    cfg = {**BASE, "method": "fedavgm"}
    ref = straight(tmp_path, cfg)
    run_cfg = {**cfg, "output-dir": str(tmp_path), "run-name": "ck", "checkpoint-every": 1}
    script = textwrap.dedent(f"""
        import os, signal
        from simulations.engine.inprocess import run_inprocess
        def kill_in_round_4(request, reply, partition_id):
            cfg = request.content.config_records.get("config")
            if cfg is not None and int(cfg["server-round"]) == 4:
                os.kill(os.getpid(), signal.SIGKILL)
            return reply
        run_inprocess({run_cfg!r}, {NODES}, intercept=kill_in_round_4)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    path = tmp_path / "ck" / "checkpoint.npz"
    assert ckpt.load(path)["round"] == 3
    assert [r["round"] for r in rows(tmp_path / "ck")] == [0, 1, 2, 3]
    run(LoopbackGrid(client_app, NODES, cfg), {**run_cfg, "resume": str(path)})
    assert_same_run(ref, tmp_path / "ck")


def _clear_state_from_round(k: int):
    """A ClientApp wrapper that wipes every node's Context.state the first time it sees round >= k
    (what restarting the SuperNodes does)."""
    cleared: set[int] = set()

    def app(msg, ctx):
        if round_of(msg) >= k and ctx.node_id not in cleared:
            cleared.add(ctx.node_id)
            for key in list(ctx.state.keys()):
                del ctx.state[key]
        return client_app(msg, ctx)
    return app


def test_client_state_is_lost_when_the_nodes_restart_too(tmp_path):
    """Documented behaviour: client persistent state (Fed-LAMB's per-client m) is not in the server checkpoint.
    If the nodes restart with the server, the resumed run equals an uninterrupted run in which every client's
    state was reset after round 3 – and differs from the run whose nodes kept their state."""
    cfg = {**BASE, "method": "fedlamb", "fraction-train": 1.0}
    ref = straight(tmp_path, cfg)
    run(LoopbackGrid(_clear_state_from_round(4), NODES, cfg),
        {**cfg, "output-dir": str(tmp_path), "run-name": "reset"})
    run_cfg = {**cfg, "output-dir": str(tmp_path), "run-name": "ck", "checkpoint-every": 1}
    grid = LoopbackGrid(client_app, NODES, cfg, intercept=crash_in_round(4))
    with pytest.raises(Crash):
        run(grid, run_cfg)
    assert any(len(ctx.state) for ctx in grid.contexts.values())  # the method does keep client state
    fresh_nodes = LoopbackGrid(client_app, NODES, cfg)
    run(fresh_nodes, {**run_cfg, "resume": str(tmp_path / "ck" / "checkpoint.npz")})
    assert_same_run(tmp_path / "reset", tmp_path / "ck")
    assert rows(ref)[-1]["test-loss"] != rows(tmp_path / "ck")[-1]["test-loss"]


def test_resume_with_other_settings_is_refused_naming_the_keys(tmp_path):
    cfg = {**BASE, "method": "fedadam", "num-server-rounds": 2, "checkpoint-every": 1,
           "output-dir": str(tmp_path), "run-name": "a"}
    run(LoopbackGrid(client_app, NODES, cfg), cfg)
    path = str(tmp_path / "a" / "checkpoint.npz")
    with pytest.raises(ckpt.CheckpointError, match=r"fedadam.server-lr: checkpoint 0.01 vs now 0.5"):
        run(LoopbackGrid(client_app, NODES, cfg), {**cfg, "resume": path, "fedadam.server-lr": 0.5})
    with pytest.raises(ckpt.CheckpointError, match="method"):
        run(LoopbackGrid(client_app, NODES, cfg), {**cfg, "resume": path, "method": "fedyogi"})
    with pytest.raises(ckpt.CheckpointError, match="no such checkpoint"):
        run(LoopbackGrid(client_app, NODES, cfg), {**cfg, "resume": str(tmp_path / "missing.npz")})
    (tmp_path / "junk.pkl").write_bytes(pickle.dumps({"hello": 1}))
    with pytest.raises(ckpt.CheckpointError, match="not a fedadapt checkpoint"):
        run(LoopbackGrid(client_app, NODES, cfg), {**cfg, "resume": str(tmp_path / "junk.pkl")})


class _Payload:
    """Unpickling this creates ``marker`` (what a malicious checkpoint would do: run code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _crafted_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Malicious ``resume`` files, each with the message the refusal must carry."""
    marker = tmp_path / "pwned"
    pickled = tmp_path / "evil.pkl"  # the former checkpoint format, now a bare pickle with a payload
    pickled.write_bytes(pickle.dumps({"format": "fedadapt-checkpoint", "version": 1, "x": _Payload(marker)}))
    renamed = tmp_path / "evil-pickle.npz"
    renamed.write_bytes(pickled.read_bytes())
    obj_npz = tmp_path / "evil.npz"  # a genuine-looking checkpoint whose state member is an object array
    meta = json.dumps({"format": "fedadapt-checkpoint", "version": ckpt.VERSION, "round": 1, "num_rounds": 2,
                       "method": "fedadam", "strategy_class": "x", "run_config": {}, "metrics_rows": [],
                       "arrays": [], "strategy_state": {"server_state": {"__array__": "state/evil"}}})
    np.savez(obj_npz, meta=np.frombuffer(meta.encode(), np.uint8),
             **{"state/evil": np.array([_Payload(marker)], dtype=object)})
    obj_npy = tmp_path / "evil.npy"
    np.save(obj_npy, np.array([_Payload(marker)], dtype=object), allow_pickle=True)
    return {"pickle": (pickled, "not a fedadapt checkpoint"), "pickle-as-npz": (renamed, "not a fedadapt checkpoint"),
            "object-array-npz": (obj_npz, "member 'state/evil' is not plain data"),
            "object-array-npy": (obj_npy, "not a fedadapt checkpoint")}


def test_crafted_pickles_and_object_arrays_execute_nothing_and_are_refused(tmp_path):
    """``resume`` is read with np.load(allow_pickle=False): a payload that would run code on unpickling (here:
    create a marker file) is refused with a clear message and never executed."""
    marker = tmp_path / "pwned"
    files = _crafted_files(tmp_path)
    pickle.loads(pickle.dumps(_Payload(tmp_path / "control")))  # the payload does work when unpickled …
    assert (tmp_path / "control").exists()
    cfg = {**BASE, "method": "fedadam", "num-server-rounds": 2, "output-dir": str(tmp_path), "run-name": "r"}
    for name, (path, message) in files.items():
        calls = []
        grid = LoopbackGrid(lambda m, c, calls=calls: calls.append(m), NODES, cfg)
        with pytest.raises(ckpt.CheckpointError, match=message):
            run(grid, {**cfg, "resume": str(path)})
        assert not marker.exists(), name  # … but loading it as a checkpoint executed nothing
        assert calls == [], name  # refused before anything was sent


def _written(tmp_path: Path) -> Path:
    cfg = {**BASE, "method": "fedadam", "num-server-rounds": 2, "checkpoint-every": 1,
           "output-dir": str(tmp_path), "run-name": "a"}
    run(LoopbackGrid(client_app, NODES, cfg), cfg)
    return tmp_path / "a" / "checkpoint.npz"


@pytest.mark.parametrize("edit,message", [
    (lambda m, meta: meta.update(version=1), "checkpoint version 1, expected"),
    (lambda m, meta: meta.update(format="other"), "not a fedadapt checkpoint"),
    (lambda m, meta: m.pop("arrays/w.weight"), r"members do not match its metadata \(missing \['arrays/w.weight'\]"),
    (lambda m, meta: m.update({"extra": np.zeros(1)}), r"extra \['extra'\]"),
    (lambda m, meta: m.update({"arrays/w.weight": np.full((1, 4), np.nan)}), "'arrays/w.weight' holds NaN/Inf"),
    (lambda m, meta: m.update({"arrays/w.weight": np.zeros((1, 5))}),
     r"w.weight: checkpoint \(1, 5\) float64 vs model \(1, 4\)"),
    (lambda m, meta: m.update({"arrays/w.weight": np.zeros((1, 4), np.float32)}), "float32 vs model"),
    (lambda m, meta: m.update({"arrays/w.weight": np.array(["a"])}), "numeric arrays only"),
], ids=["version", "format", "missing-member", "extra-member", "nan", "shape", "dtype", "strings"])
def test_tampered_checkpoints_are_refused_before_round_1(tmp_path, edit, message):
    good = _written(tmp_path)
    bad = rewrite_checkpoint(good, tmp_path / "bad.npz", edit)
    cfg = {**BASE, "method": "fedadam", "num-server-rounds": 3, "output-dir": str(tmp_path), "run-name": "b"}
    calls = []
    with pytest.raises(ckpt.CheckpointError, match=message):
        run(LoopbackGrid(lambda m, c: calls.append(m), NODES, cfg), {**cfg, "checkpoint-every": 1, "resume": str(bad)})
    assert calls == []


def test_atomic_write_keeps_the_old_checkpoint_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "c.npz"
    ckpt.write_atomic(path, b"old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        ckpt.write_atomic(path, b"new")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]  # no temporary file left behind


def test_checkpoint_holds_arrays_strategy_state_rng_and_rows(tmp_path):
    cfg = {**BASE, "method": "fedadam", "num-server-rounds": 2, "checkpoint-every": 1,
           "output-dir": str(tmp_path), "run-name": "a"}
    run(LoopbackGrid(client_app, NODES, cfg), cfg)
    path = tmp_path / "a" / "checkpoint.npz"
    assert [p.name for p in path.parent.iterdir() if "checkpoint" in p.name] == ["checkpoint.npz"]
    p = ckpt.load(path)
    final = model(tmp_path / "a")
    assert list(p["arrays"]) == list(final)
    for k, v in p["arrays"].items():
        assert v.dtype == np.float64 and np.array_equal(v, final[k].numpy())
    state = p["strategy_state"]
    assert state["num_updates"] == 2 and len(state["history"]) == 2
    assert "node_order" not in state  # runtime node ids are re-discovered on resume
    server_state = state["server_state"]  # FedAdam's moments: named float64 arrays shaped like the model
    assert {"m_t", "v_t"} <= set(server_state) and server_state["v_t"]["w.weight"].shape == final["w.weight"].shape
    assert [r["round"] for r in p["metrics_rows"]] == [0, 1, 2]
    assert p["run_config"]["method"] == "fedadam" and p["method"] == "fedadam"
    # data only: the archive holds numeric arrays + one JSON metadata entry and loads without pickle
    with np.load(path, allow_pickle=False) as z:
        assert "meta" in z.files and all(z[n].dtype.kind in "biuf" for n in z.files)
        meta = json.loads(z["meta"].tobytes())
    assert meta["format"] == "fedadapt-checkpoint" and meta["round"] == 2
    assert meta["strategy_state"]["rng"][0] == 3  # random.Random state, as JSON


def test_loaded_state_dict_equals_the_strategys(tmp_path):
    """state_dict → checkpoint → load_state_dict → state_dict is the identity (arrays bit-exact, scalars equal)."""
    from flwr.app import ArrayRecord

    from app_common.task import build_model
    from flower_strategies.core.registry import build_strategy

    for method in sorted(METHODS):
        cfg = {**BASE, "method": method}
        strategy, _ = build_strategy(cfg, trainable_keys=["w.weight"], settings=AppConfig)
        init = build_model("synthetic-linear", 2, 4, "float64").state_dict()
        strategy.prepare_round(1, ArrayRecord(init), own_loop_config(), num_sampled=1)
        strategy.sampler.rng.random()
        arrays = {k: v.numpy() for k, v in init.items()}
        data = ckpt.encode(server_round=1, num_rounds=6, arrays=arrays, strategy=strategy, metrics_rows=[],
                           run_config=cfg)
        path = ckpt.write_atomic(tmp_path / f"{method}.npz", data)
        fresh, _ = build_strategy(cfg, trainable_keys=["w.weight"], settings=AppConfig)
        ckpt.restore_strategy(fresh, ckpt.load(path))
        assert fresh.sampler.rng.getstate() == strategy.sampler.rng.getstate()
        a, b = strategy.state_dict(), fresh.state_dict()
        assert a.keys() == b.keys() and a["server_state"].keys() == b["server_state"].keys()
        for name, value in a["server_state"].items():
            if isinstance(value, dict):
                for k, arr in value.items():
                    assert arr.dtype == b["server_state"][name][k].dtype
                    assert np.array_equal(arr, b["server_state"][name][k]), (method, name, k)
            else:
                assert value == b["server_state"][name], (method, name)


def test_start_round_loop_equals_flowers_loop():
    """flower_strategies.core.loop.run_rounds with on_round_end (our resumable loop, which FedAdaptStrategy.start
    runs) gives exactly what Flower's own Strategy.start loop gives."""
    from flwr.app import ArrayRecord

    from app_common.task import build_model
    from flower_strategies.core.records import to_numpy
    from flower_strategies.core.registry import build_strategy
    from flower_strategies.core.loop import run_rounds

    cfg = {**BASE, "method": "fedadam"}
    out = []
    for ours in (False, True):
        strategy, _ = build_strategy(cfg, trainable_keys=["w.weight"], settings=AppConfig)
        grid = LoopbackGrid(client_app, NODES, cfg)
        init = ArrayRecord(build_model("synthetic-linear", 2, 4, "float64").state_dict())
        ends: list[int] = []
        if ours:
            res = run_rounds(strategy, grid, init, 4, 60.0, on_round_end=lambda r, a, ends=ends: ends.append(r))
            assert ends == [1, 2, 3, 4]
        else:  # Flower's loop itself, not the strategy's override (the train config marked as fedadapt's loops do)
            res = Strategy.start(strategy, grid=grid, initial_arrays=init, num_rounds=4, train_config=own_loop_config())
        out.append((to_numpy(res.arrays), sorted(res.train_metrics_clientapp)))
    assert out[0][1] == out[1][1] == [1, 2, 3, 4]
    for k in out[0][0]:
        assert np.array_equal(out[0][0][k], out[1][0][k])


def test_signal_hands_over_to_the_previous_handler_after_writing(tmp_path):
    """In a deployed ServerApp Flower has its own SIGTERM handler (graceful exit): it still runs, after the write."""
    class FlowerExit(Exception):
        pass

    calls: list[int] = []

    def flower_handler(signum, frame):
        calls.append(signum)
        raise FlowerExit

    def sigterm_in_round_3(request, reply, partition_id):
        if round_of(request) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return reply

    cfg = {**BASE, "method": "fedavg", "output-dir": str(tmp_path), "run-name": "ck", "checkpoint-every": 7}
    old = signal.signal(signal.SIGTERM, flower_handler)
    try:
        with pytest.raises(FlowerExit):
            run(LoopbackGrid(client_app, NODES, cfg, intercept=sigterm_in_round_3), cfg)
        assert calls == [signal.SIGTERM]
        assert ckpt.load(tmp_path / "ck" / "checkpoint.npz")["round"] == 2
        assert signal.getsignal(signal.SIGTERM) is flower_handler
    finally:
        signal.signal(signal.SIGTERM, old)
