"""Atomic, bit-exact checkpoints of a federated run (server side).

A checkpoint is one pickle file holding

* ``arrays``: the global arrays after round ``round`` (``{key: np.ndarray}``, dtypes preserved),
* ``strategy_state``: :meth:`FedAdaptStrategy.checkpoint_state` – every attribute of the strategy
  (server optimizer moments, momentum buffers, controllers, ``num_updates``, the per-round history, …),
* ``rng_state``: the state of the strategy's client-sampling ``random.Random`` (also inside the strategy
  state; kept separately so that it is visible and checked),
* ``metrics_rows``: the metrics rows written so far (round 0 … ``round``),
* ``run_config``, ``method``, ``strategy_class``, ``round``, ``num_rounds``, ``format``/``version``.

It is written atomically (temporary file in the same directory, ``fsync``, ``os.replace``), so a crash or a
``kill -9`` at any moment leaves either the previous or the new checkpoint, never a torn one.

**Checkpoints are pickles: load only files you trust** (loading a pickle can execute code).

Client-side persistent state (``Context.state`` of each node, e.g. Fed-LAMB's local momentum) is *not* in the
server checkpoint: it lives on the nodes.  If the SuperNodes keep running while the ServerApp is restarted they
keep it, and the resumed run is identical to an uninterrupted one; if the nodes restart too, each client starts
again from its method's initial state the next time it is sampled (as a client sampled for the first time).
"""

from __future__ import annotations

import itertools
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "fedadapt-checkpoint"
VERSION = 1

#: Run-config keys that may differ between the checkpointed run and the resumed one.
RESUMABLE_CHANGES = frozenset({"num-server-rounds", "resume", "checkpoint-every", "round-timeout", "output-dir", "run-name"})

_counter = itertools.count()


class CheckpointError(ValueError):
    """A checkpoint cannot be read or does not belong to this run."""


def make_payload(
    *, server_round: int, num_rounds: int, arrays: Mapping[str, np.ndarray], strategy: Any,
    metrics_rows: list[dict[str, Any]], run_config: Mapping[str, Any],
) -> dict[str, Any]:
    cls = type(strategy)
    return {
        "format": FORMAT,
        "version": VERSION,
        "round": int(server_round),
        "num_rounds": int(num_rounds),
        "method": getattr(strategy, "method", ""),
        "strategy_class": f"{cls.__module__}.{cls.__qualname__}",
        "arrays": {k: np.array(v, copy=True) for k, v in arrays.items()},
        "strategy_state": strategy.checkpoint_state(),
        "rng_state": strategy.rng.getstate(),
        "metrics_rows": [dict(r) for r in metrics_rows],
        "run_config": dict(run_config),
    }


def dumps(payload: Mapping[str, Any]) -> bytes:
    return pickle.dumps(dict(payload), protocol=pickle.HIGHEST_PROTOCOL)


def write_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file in the same directory + fsync + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(_counter)}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # pragma: no cover - e.g. filesystems without directory fsync
        pass
    return path


def save(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> Path:
    return write_atomic(path, dumps(payload))


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint (a trusted pickle) and check its format."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"resume = {str(path)!r}: no such checkpoint file")
    with open(path, "rb") as fh:
        try:
            payload = pickle.load(fh)  # noqa: S301 - checkpoints are trusted files (documented)
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"resume = {str(path)!r}: not a readable checkpoint ({err})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"resume = {str(path)!r}: not a fedadapt checkpoint")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"resume = {str(path)!r}: checkpoint version {payload.get('version')}, expected {VERSION}")
    return payload


def check_compatible(payload: Mapping[str, Any], run_config: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Raise :class:`CheckpointError` naming every run-config key that differs from the checkpointed run
    (except :data:`RESUMABLE_CHANGES`)."""
    old = {**defaults, **payload["run_config"]}
    new = {**defaults, **run_config}
    diff = sorted(k for k in set(old) | set(new) if k not in RESUMABLE_CHANGES and old.get(k) != new.get(k))
    if diff:
        pairs = ", ".join(f"{k}: checkpoint {old.get(k)!r} vs now {new.get(k)!r}" for k in diff)
        raise CheckpointError(f"the checkpoint was written by a run with other settings ({pairs}); "
                              f"only {', '.join(sorted(RESUMABLE_CHANGES))} may change on resume")


def restore_strategy(strategy: Any, payload: Mapping[str, Any]) -> None:
    cls = type(strategy)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if payload["strategy_class"] != name:
        raise CheckpointError(f"checkpoint holds the state of {payload['strategy_class']}, this run uses {name}")
    strategy.restore_state(payload["strategy_state"])
    strategy.rng.setstate(payload["rng_state"])
