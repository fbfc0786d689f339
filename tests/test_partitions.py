"""Partitions that scale (app_common/partitions.py): the default partitioner at every documented client count.

The docs run the default job (Dirichlet(0.3) over the digits' 1,437 training examples) with 3, 5, 10 and 20 SuperNodes,
docs/vectorized.md and docs/deployment.md with 100; 1,000 is the scale a researcher tries next.  Every count must give
non-empty partitions that cover the training split exactly once, the same ones for the same seed; where the configured
Dirichlet cannot be drawn a WARNING says what was done instead.  Splits that worked before are pinned bit for bit (the
golden metrics of tests/test_perf.py and every recorded result depend on them).
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest

from app_common import task
from app_common.partitions import fit_partitioner

#: sha256 (first 16 hex digits) of every (x, y) of the digits Dirichlet partitions, in partition order, as made before
#: the fallback existed (git 9f9757e): n/seed/alpha → hash.  Unchanged = the same examples in the same order.
PINNED = {
    "10/0/0.3": "5a914f3e987003b9", "10/1/0.3": "a24058a5a98b733e", "5/0/0.3": "49a27c0237a0b1df",
    "20/0/0.3": "1581c509be15d015", "3/2/1.0": "ebbed49670ba23de",
}


def digest(parts) -> str:
    h = hashlib.sha256()
    for x, y in parts:
        h.update(x.numpy().tobytes())
        h.update(y.numpy().tobytes())
    return h.hexdigest()[:16]


def partitions(n: int, seed: int = 0, alpha: float = 0.3, fresh: bool = True):
    if fresh:
        task._digits_partitions.cache_clear()
    return [task.digits_partition(i, n, partitioner="dirichlet", seed=seed, alpha=alpha) for i in range(n)]


@pytest.fixture
def flwr_warnings(caplog: pytest.LogCaptureFixture):
    """Flower's logger (which fedadapt's log lines go through) captured at WARNING."""
    logger = logging.getLogger("flwr")
    logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.WARNING)
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.mark.parametrize("key", sorted(PINNED))
def test_splits_that_worked_before_are_unchanged(key: str, flwr_warnings) -> None:
    n, seed, alpha = key.split("/")
    assert digest(partitions(int(n), int(seed), float(alpha))) == PINNED[key]
    assert not [r for r in flwr_warnings.records if "fedadapt" in r.getMessage()]  # no fallback was taken


@pytest.mark.parametrize("n", [3, 5, 10, 20, 100, pytest.param(1000, marks=pytest.mark.slow)])  # 1000: ~12 s
def test_every_documented_client_count_gives_valid_deterministic_partitions(n: int) -> None:
    x_tr, y_tr, _, _ = task.digits_split(0)
    parts = partitions(n)
    assert len(parts) == n and min(len(y) for _, y in parts) >= 1
    # exactly the training split, each example once
    x_all = np.concatenate([x.numpy() for x, _ in parts])
    y_all = np.concatenate([y.numpy() for _, y in parts])
    assert len(y_all) == len(y_tr) == 1437
    key = lambda x, y: sorted(map(bytes, np.column_stack([x, y.astype(np.float32)])))  # noqa: E731
    assert key(x_all, y_all) == key(x_tr, y_tr)
    # deterministic per seed (recomputed from scratch), different for another seed
    assert digest(partitions(n)) == digest(parts)
    if n < 1000:  # (1000: IID shards of a split that the seed shuffles; 6 s per computation)
        assert digest(partitions(n, seed=1)) != digest(parts)


def test_fallbacks_are_logged_and_say_what_was_done(flwr_warnings) -> None:
    parts = partitions(100, seed=0, alpha=0.3)  # min size 5 unreachable: the same Dirichlet draws, min size 1
    msgs = [r.getMessage() for r in flwr_warnings.records]
    assert any("gave no 100 partitions of 1437 examples with at least 5" in m and "at least 1 example" in m
               for m in msgs), msgs
    sizes = sorted(len(y) for _, y in parts)
    assert sizes[0] >= 1 and sizes[-1] > 2 * sizes[len(sizes) // 2]  # still label-skewed (uneven), not IID (14-15)
    flwr_warnings.clear()
    parts = partitions(700, seed=0, alpha=0.3)  # not even one example each in 10 draws: IID, said as such
    msgs = [r.getMessage() for r in flwr_warnings.records]
    assert any("cannot give 700 non-empty partitions of 1437 examples" in m and "using IID partitions" in m
               for m in msgs), msgs
    assert {len(y) for _, y in parts} == {2, 3}


def test_more_partitions_than_examples_names_what_to_change() -> None:
    from datasets import Dataset

    ds = Dataset.from_dict({"x": np.zeros(4, dtype=np.float32), "label": np.arange(4) % 2})
    with pytest.raises(ValueError, match=r"cannot split 4 training examples into 5 'dirichlet' partitions.*"
                                         r"raise dirichlet-alpha"):
        fit_partitioner("dirichlet", lambda m: task.make_partitioner("dirichlet", 5, 0, 0.3, 2, m), ds, 5, 0.3, 5)


def test_hub_data_falls_back_too(flwr_warnings) -> None:
    from app_common import hub_data as H
    from tests.test_hub_data import local_copy

    src = local_copy("mnist", n_train=60)
    data = H.HubData("mnist", 40, partitioner="dirichlet", seed=0, alpha=0.1, source=src)
    parts = [data.partition(i) for i in range(40)]
    assert min(len(y) for _, y in parts) >= 1 and sum(len(y) for _, y in parts) == 60
    assert any("fedadapt: Dirichlet(0.1)" in r.getMessage() for r in flwr_warnings.records)
