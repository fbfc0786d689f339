"""core/records.py: every record round trip gives the same objects, bytes and results through the fast paths
(Flower's fields set directly) and through their public twins (Flower's constructors, item assignment, ``.numpy()``),
so every supported Flower runs the public path too; the import probe falls back instead of crashing."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from flower_strategies.core import records as R
from flower_strategies.core.registry import METHODS
from tests.helpers import SYNTH_RC, synthetic_initial_arrays

#: The paths this Flower supports: the public one always; the fast one where the import probe accepted it.
PATHS = [False] + ([True] if R.FAST_PATH_FAILURE is None else [])

ARRAYS = {
    "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
    "f64": np.linspace(-1.0, 1.0, 7),
    "i64": np.array(7, np.int64),
    "transposed": np.arange(6.0).reshape(2, 3).T,
    "empty": np.zeros((0, 3), np.float32),
    "bool": np.array([True, False]),
    "f16": np.ones((2, 2), np.float16),
}


def round_trip(fast: bool) -> tuple[ArrayRecord, dict, dict, RecordDict]:
    prefix, dtype = R.npy_prefix(np.dtype(np.float32), (2,))  # with 8 zero bytes: array_from_buffer's payload
    with R.record_path(fast):
        assert R.FAST is fast
        record = R.to_record(ARRAYS)
        views = R.views(record)
        checked = {k: R.checked_view(v, ARRAYS[k].shape, ARRAYS[k].dtype) for k, v in record.items()}
        reply = R.filled(RecordDict(), [
            ("arrays", record),
            ("metrics", R.filled(MetricRecord({"user": 3}), [("num-examples", 7), ("train-loss", 0.25)])),
            ("fedadapt", R.filled(ConfigRecord(), [("method", "fedavg")])),
            ("buffer", R.filled(ArrayRecord(), [("w", R.array_from_buffer(prefix, dtype, (2,), bytes(8)))]))])
    return record, views, checked, reply


@pytest.mark.parametrize("fast", PATHS)
def test_record_round_trip_gives_the_arrays_back(fast):
    record, views, checked, reply = round_trip(fast)
    for key, arr in ARRAYS.items():
        assert vars(record[key]) == vars(Array(arr)), key  # Flower's own bytes (np.save), dtype, shape, stype
        for got in (views[key], checked[key], record[key].numpy()):
            assert got.dtype == arr.dtype and got.shape == arr.shape and got.tobytes() == arr.tobytes(), key
        assert not views[key].flags.writeable and not checked[key].flags.writeable, key
    assert list(reply) == ["arrays", "metrics", "fedadapt", "buffer"] and reply["arrays"] is record
    assert list(reply["metrics"].items()) == [("user", 3), ("num-examples", 7), ("train-loss", 0.25)]
    assert reply["buffer"]["w"].numpy().tolist() == [0.0, 0.0]


def test_both_paths_build_identical_records():
    """The fast path's records are the public path's: same fields, same content hash (where both run here)."""
    if len(PATHS) == 1:  # this Flower runs only the public path: it must be off, with its reason
        assert not R.FAST and R.FAST_PATH_FAILURE
        return
    public, fast = round_trip(False), round_trip(True)
    assert R.FAST  # the probe's choice is back after each forced block
    assert vars(public[3]) == vars(fast[3]) and public[3].object_id == fast[3].object_id
    for key in ARRAYS:
        assert vars(public[0][key]) == vars(fast[0][key])
        assert public[1][key].tobytes() == fast[1][key].tobytes()


@pytest.mark.parametrize("name", ["fedadam", "scaffold", "localupdate"])
def test_a_run_is_bitwise_the_same_on_both_paths(name):
    """A whole in-process run (server records, client replies, downlink extras) through each path: the same global
    arrays every round, bit for bit."""
    from simulations.engine.inprocess import simulate

    runs = []
    for fast in PATHS:
        with R.record_path(fast):
            strategy = METHODS[name].build(client_lr=0.05, local_steps=2, min_train_nodes=2, min_available_nodes=3,
                                           seed=0, fraction_train=1.0)
            runs.append(simulate(strategy, synthetic_initial_arrays(), 2, 3, SYNTH_RC)[0])
    for rounds in runs[1:]:
        for ours, theirs in zip(rounds, runs[0], strict=True):
            assert ours.keys() == theirs.keys()
            for key in ours:
                assert np.asarray(ours[key]).tobytes() == np.asarray(theirs[key]).tobytes(), key
    assert len(runs[0]) == 3 and any(not np.array_equal(runs[0][0][k], runs[0][2][k]) for k in runs[0][0])


def test_the_probe_falls_back_instead_of_crashing(monkeypatch):
    """A Flower whose records are laid out differently (a missing field, no ``_data`` dict, an attribute error)
    makes the probe return its reason — and the module then takes the public path — never raise."""
    assert R._fast_path_matches() == R.FAST_PATH_FAILURE  # the import-time answer, reproducible

    def no_dirty_flag(dtype, shape, data):
        out = Array.__new__(Array)
        out.__dict__.update(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data)
        return out

    def no_data_dict(record, items):
        raise AttributeError("'ArrayRecord' object has no attribute '_data'")

    with monkeypatch.context() as m:
        m.setattr(R, "_set_fields", no_dirty_flag)
        assert "directly built Array differs" in R._fast_path_matches()
    with monkeypatch.context() as m:
        m.setattr(R, "_fill_data", no_data_dict)
        assert R._fast_path_matches().startswith("AttributeError")
    assert R.FAST is (R.FAST_PATH_FAILURE is None)  # the probe leaves the module's choice as it was
    monkeypatch.setattr(R, "FAST_PATH_FAILURE", "simulated")
    with pytest.raises(RuntimeError, match="do not match this Flower: simulated"), R.record_path(True):
        pass
