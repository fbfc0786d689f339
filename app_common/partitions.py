"""Partitions that scale: the Dirichlet partitioner at any federation size, with a logged fallback.

flwr-datasets' ``DirichletPartitioner`` draws the label proportions again (10 draws) until every partition holds at
least ``min_partition_size`` examples, and raises once the draws are spent.  With a small training split and many
clients (the digits' 1,437 training examples over 100 SuperNodes: ~14 each) that minimum is out of reach and the
run used to stop.  :func:`fit_partitioner` makes the assignment at once and, for ``dirichlet``, walks down a ladder:

1. the configured partitioner (same seed, same minimum size): whenever it succeeds, the partitions are exactly the
   ones fedadapt always made (the default 10-client job included);
2. the same Dirichlet(α) draws with ``min_partition_size = 1``: label skew as configured, no client empty;
3. IID partitions (``IidPartitioner``: sizes ⌊n/N⌋ or ⌈n/N⌉, never empty while N ≤ n).

Steps 2 and 3 log one WARNING saying what was done and how to choose for oneself.  Other partitioners are not
changed: their failure names what to change (:func:`partition_hint`).

:func:`disk_cached` keeps what such a computation gives (the digits' split, a partitioning's row indices) on disk per
configuration, so that a run does not pay the import of ``datasets``/scikit-learn and the partitioning again.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import warnings
from collections.abc import Callable, Mapping
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np

#: min_partition_size of the second rung (the first is the task's own: 5 for the digits, 2 for hub data).
NON_EMPTY = 1


def partition_hint(kind: str, num_partitions: int, num_examples: int, alpha: float, err: Exception) -> str:
    """A partitioner failure, with what the user can change."""
    fix = {"dirichlet": f"raise dirichlet-alpha (now {alpha}), use fewer partitions, or partitioner = 'iid'",
           "classes": "lower classes-per-client or use fewer partitions"}.get(kind, "use fewer partitions")
    return (f"cannot split {num_examples} training examples into {num_partitions} '{kind}' partitions "
            f"({err}); {fix}")


def _assign(part: Any, dataset: Any) -> Any:
    """``part`` with ``dataset`` and its assignment of every partition made now (the partitioners are lazy: the first
    ``load_partition`` makes it), so a failure shows here rather than at some client's first round."""
    with warnings.catch_warnings():  # flwr-datasets warns on every unsuccessful Dirichlet draw
        warnings.simplefilter("ignore", UserWarning)
        part.dataset = dataset
        part.load_partition(0)
    return part


def fit_partitioner(kind: str, make: Callable[[int], Any], dataset: Any, num_partitions: int,
                    alpha: float, min_size: int) -> Any:
    """The partitioner ``make(min_size)`` on ``dataset``, its assignment made; for ``dirichlet`` the ladder above.

    ``make(m)``: the task's partitioner of kind ``kind`` with ``min_partition_size = m`` (ignored by other kinds).
    Raises ``ValueError`` (:func:`partition_hint`) when no rung works (more partitions than examples)."""
    from flwr.common import log

    rungs = [min_size] + ([NON_EMPTY] if kind == "dirichlet" and min_size > NON_EMPTY else [])
    err: Exception | None = None
    for m in rungs:
        try:
            part = _assign(make(m), dataset)
        except ValueError as e:
            err = e
            continue
        if m != min_size:
            log(WARNING, "fedadapt: Dirichlet(%s) gave no %d partitions of %d examples with at least %d each in 10 "
                "draws; using the same Dirichlet(%s) draws with at least %d example each (set partitioner = 'iid' or "
                "a larger dirichlet-alpha to choose otherwise)", alpha, num_partitions, len(dataset), min_size, alpha,
                m)
        return part
    if kind == "dirichlet" and num_partitions <= len(dataset):
        from flwr_datasets.partitioner import IidPartitioner

        log(WARNING, "fedadapt: Dirichlet(%s) cannot give %d non-empty partitions of %d examples (%s); using IID "
            "partitions instead (%d-%d examples each, as partitioner = 'iid' would; fewer clients or a larger "
            "dirichlet-alpha keep the label skew)", alpha, num_partitions, len(dataset), err,
            len(dataset) // num_partitions, -(-len(dataset) // num_partitions))
        return _assign(IidPartitioner(num_partitions=num_partitions), dataset)
    assert err is not None
    raise ValueError(partition_hint(kind, num_partitions, len(dataset), alpha, err)) from None


#: Bump when what a cached computation gives changes (the key also names the package versions it depends on).
CACHE_FORMAT = 1


def disk_cached(data_dir: str | None, name: str, key: Mapping[str, Any],
                compute: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``compute()`` (a dict of arrays), kept in ``<data_dir>/cache/<name>-<hash of key>.npz``: read from there when
    present (data only, never unpickled), else computed and written (atomically; a directory that cannot be written
    only costs the cache).  The WARNINGs ``compute`` logs are stored with it and logged again on every read, so a
    cached run says what an uncached one says.  ``data_dir`` None: no cache."""
    from flwr.common import log
    from flwr.common.logger import FLOWER_LOGGER

    if data_dir is None:
        return compute()
    digest = hashlib.sha256(json.dumps({"format": CACHE_FORMAT, **key}, sort_keys=True).encode()).hexdigest()[:20]
    path = Path(data_dir).expanduser() / "cache" / f"{name}-{digest}.npz"
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                out = {k: z[k] for k in z.files}
            for note in json.loads(out.pop("_warnings").tobytes().decode("utf-8")):
                log(WARNING, "%s", note)
            return out
        except (OSError, ValueError, KeyError, EOFError) as err:
            log(WARNING, "fedadapt: ignoring the unreadable cache file %s (%s)", path, err)
    notes: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= WARNING:
                notes.append(record.getMessage())

    handler = Collect()
    FLOWER_LOGGER.addHandler(handler)
    try:
        out = compute()
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    buf = io.BytesIO()
    np.savez(buf, _warnings=np.frombuffer(json.dumps(notes).encode("utf-8"), dtype=np.uint8),
             **out)  # type: ignore[arg-type]  # numpy's stub reads **kwds as its allow_pickle flag
    try:
        from flower_strategies.core.checkpoint import write_atomic

        write_atomic(path, buf.getvalue())
    except OSError:
        pass
    return out


def package_version(name: str) -> str:
    """The installed version of distribution ``name`` (without importing it)."""
    from importlib.metadata import version

    return version(name)


# ------------------------------------------------------------------------------------------ per-round allocation
#: Paper 004's allocations (Fed-LAMB, §5 / Appendix A.2): the whole training set is divided anew every round among
#: that round's active (sampled) devices.
ROUND_PARTITIONERS = ("round-iid", "round-class")


def round_allocation(labels: np.ndarray, kind: str, seed: int, server_round: int, k: int) -> list[np.ndarray]:
    """The training rows of each of the round's ``k`` active devices (slot ``j`` = the j-th of the round's sampled
    devices in sampling order), drawn from ``numpy.random.default_rng([seed, 47, server_round])``:

    * ``round-iid``: a random permutation of all rows cut into ``k`` consecutive shards (``np.array_split``: sizes
      differ by at most one);
    * ``round-class``: the classes in a random order ``perm`` (one draw per round); slot ``j`` gets class
      ``perm[j mod C]`` (C classes), and each class's rows, permuted, are cut into as many near-equal shards as it
      has devices (in slot order).  With ``k`` a multiple of C every class has ``k / C`` devices; otherwise the first
      ``k mod C`` classes of ``perm`` have one device more; with ``k < C`` only ``k`` classes are trained that round.

    Every row of the training set (``round-iid``) or of each assigned class (``round-class``) is in exactly one
    shard.  Each shard is sorted (the client's own seeded mini-batch order shuffles it)."""
    if k < 1:
        raise ValueError(f"a round needs at least one active device, got {k}")
    rng = np.random.default_rng([seed, 47, server_round])
    if kind == "round-iid":
        return [np.sort(s) for s in np.array_split(rng.permutation(len(labels)), k)]
    if kind != "round-class":
        raise ValueError(f"unknown per-round partitioner {kind!r}; valid: {', '.join(ROUND_PARTITIONERS)}")
    classes = np.unique(labels)
    perm = rng.permutation(classes)
    assigned = perm[np.arange(k) % len(classes)]
    out: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * k
    for c in perm:  # a fixed order of draws: the class order of this round
        slots = np.flatnonzero(assigned == c)
        if not len(slots):
            continue
        rows = rng.permutation(np.flatnonzero(labels == c))
        for j, part in zip(slots, np.array_split(rows, len(slots)), strict=True):
            out[j] = np.sort(part)
    return out
