"""Forged checkpoints: every malformed field or member is a CheckpointError naming the problem, raised before round 1
and before an oversized member is inflated."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest

from flower_strategies.core import checkpoint as ckpt
from simulations.engine.inprocess import run_inprocess
from tests.helpers import rewrite_checkpoint

CFG = {"task": "synthetic-linear", "synthetic-dim": 4, "precision": "float64", "local-steps": 2,
       "method": "fedadam", "num-server-rounds": 2, "checkpoint-every": 1}
NODES = 3


def never_called(request, reply, partition_id):
    raise AssertionError("a forged checkpoint must be refused before anything is sent")


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("good")
    run_inprocess({**CFG, "output-dir": str(out), "run-name": "a"}, NODES)
    return out / "a" / "checkpoint.npz"


def resume(tmp_path: Path, path: Path, **extra):
    return run_inprocess({**CFG, "output-dir": str(tmp_path), "run-name": "b", "num-server-rounds": 3,
                          "resume": str(path), **extra}, NODES, intercept=never_called)


@pytest.mark.parametrize("edit,message", [
    (lambda m, meta: meta.update(round="3"), r"'round' must be an integer in 0\.\.num_rounds \(2\), not '3'"),
    (lambda m, meta: meta.update(round=1e6), r"'round' must be an integer"),
    (lambda m, meta: meta.update(round=-1), r"'round' must be an integer in 0\.\.num_rounds"),
    (lambda m, meta: meta.update(round=True), r"'round' must be an integer"),
    (lambda m, meta: meta.update(num_rounds=None), r"'num_rounds' must be an integer >= 1"),
    (lambda m, meta: meta.update(method=5), r"'method' must be a string"),
    (lambda m, meta: meta.update(strategy_class=["x"]), r"'strategy_class' must be a string"),
    (lambda m, meta: meta.update(run_config=[1]), r"'run_config' must be a JSON object"),
    (lambda m, meta: meta.update(metrics_rows={}), r"'metrics_rows' must be a list"),
    (lambda m, meta: meta.update(metrics_rows=[1, 2]), r"'metrics_rows' must be rows with increasing rounds"),
    (lambda m, meta: meta.update(metrics_rows=[{"round": 0}, {"round": 0}]), r"increasing rounds in 0\.\.2"),
    (lambda m, meta: meta.update(app="token"), r"'app' must be a JSON object"),
    (lambda m, meta: meta.update(arrays="w.weight"), r"'arrays' must be a list of array keys"),
    (lambda m, meta: meta.update(arrays=[1]), r"'arrays' must be a list of distinct array keys"),
    (lambda m, meta: meta.pop("strategy_state"), r"incomplete checkpoint metadata \(no 'strategy_state'\)"),
    (lambda m, meta: meta.update(strategy_state=[]), r"'strategy_state' must be a JSON object"),
    (lambda m, meta: meta["strategy_state"].update(x={"__array__": 7}), r"'strategy_state' is malformed"),
    (lambda m, meta: meta["strategy_state"].update(rng="junk"), r"strategy state does not fit"),
    (lambda m, meta: meta["strategy_state"].update(history=[{"x": 1}]), r"strategy state does not fit"),
    (lambda m, meta: meta["strategy_state"].update(num_updates="two"), r"strategy state does not fit"),
    (lambda m, meta: meta["strategy_state"].clear(), r"strategy state does not fit|members do not match"),
], ids=["round-str", "round-1e6", "round-negative", "round-bool", "num-rounds", "method", "class", "run-config",
        "rows-type", "rows-items", "rows-order", "app", "arrays-str", "arrays-int", "no-state", "state-list",
        "state-ref", "state-rng", "state-history", "state-counter", "state-empty"])
def test_forged_metadata_is_a_checkpoint_error(tmp_path, good, edit, message):
    bad = rewrite_checkpoint(good, tmp_path / "bad.npz", edit)
    with pytest.raises(ckpt.CheckpointError, match=message):
        resume(tmp_path, bad)


def test_a_round_beyond_num_server_rounds_is_refused(tmp_path, good):
    with pytest.raises(ckpt.CheckpointError, match=r"round 2, beyond this run's num-server-rounds = 1"):
        resume(tmp_path, good, **{"num-server-rounds": 1})


def test_an_oversized_member_is_refused_before_it_is_inflated(tmp_path, good, monkeypatch):
    """A highly compressible member (zeros) far larger than the model: refused from the zip entry's size; the
    member is never read (reading it would fail the test)."""
    big = tmp_path / "big.npz"
    with np.load(good, allow_pickle=False) as z:
        members = {n: z[n] for n in z.files}
    key = next(n for n in members if n.startswith("arrays/"))
    members[key] = np.zeros(8 * 2**20)  # 64 MiB uncompressed, ~64 KiB compressed
    np.savez_compressed(big, **members)
    assert big.stat().st_size < 2**20

    def no_read(*args, **kwargs):
        raise AssertionError("an oversized member was inflated")

    monkeypatch.setattr(np.lib.format, "read_array", no_read)
    with pytest.raises(ckpt.CheckpointError, match=rf"member '{key}' is 67108992 bytes uncompressed, more than"):
        resume(tmp_path, big)


def test_a_header_claiming_more_data_than_the_member_holds_is_refused(tmp_path, good):
    """A tiny member whose .npy header declares 800 GB: refused from the header, nothing allocated."""
    with np.load(good, allow_pickle=False) as z:
        members = {n: z[n] for n in z.files}
    key = next(n for n in members if n.startswith("arrays/"))
    forged = tmp_path / "forged.npz"
    np.savez(forged, **{n: v for n, v in members.items() if n != key})
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f8", "fortran_order": False, "shape": (10**11,)})
    with zipfile.ZipFile(forged, "a") as zf:
        zf.writestr(f"{key}.npy", buf.getvalue() + bytes(64))
    with pytest.raises(ckpt.CheckpointError, match=rf"member '{key}' declares shape \(100000000000,\) float64"):
        resume(tmp_path, forged)


def test_a_good_checkpoint_still_resumes(tmp_path, good):
    summary = run_inprocess({**CFG, "output-dir": str(tmp_path), "run-name": "b", "num-server-rounds": 3,
                             "resume": str(good)}, NODES)
    assert summary["status"] == "completed" and summary["resumed_after_round"] == 2
