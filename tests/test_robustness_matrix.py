"""The attack matrix of docs/robustness.md, each case asserting its measured outcome.

Every case is one run of the real ServerApp logic against the real ClientApp in-process
(:func:`simulations.bench.robustness.run_case`: digits-mlp, 5 clients, 10 rounds × 2 local epochs); the attackers
(partition 0, or partitions 0 and 1) rewrite their train replies with the attacks of
:data:`simulations.bench.robustness.ATTACKS`.  A case is ``(partition, aggregator, attack, expectation)``:

* ``NEAR_CLEAN`` — within :data:`NOISE` of the clean run with the default settings on the same partition;
* ``(">=", a)`` / ``("<=", a)`` — the measured accuracy's side of ``a`` (a held cell stays held; a broken cell, kept
  to show what a defence is for, stays broken);
* every case completes: no attack crashes the server or fails the run.

More cases (reply-level ones: malformed payloads, replays, oversized replies, metric lies) join :data:`CASES` as
rows with their own attack; the table in docs/robustness.md is ``python -m simulations.bench.robustness``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from simulations.bench.robustness import run_case
from tests.test_attacks import one_thread  # noqa: F401 - the same module-wide autouse fixture (1 thread, quiet logs)

pytestmark = pytest.mark.slow  # 41 short federated runs (40 s on the loaded 2-core VM); the full suite (CI) runs them

NOISE = 0.05
ROUNDS = 10
NEAR_CLEAN = ("near-clean", NOISE)

#: ``(partition, aggregator, attack, expectation)``; aggregators and attacks as in simulations.bench.robustness.
CASES: list[tuple[str, str, str | None, tuple[str, float]]] = [
    # the mean with the update clip at 1× the round's median norm: one attacker of 5
    ("iid", "mean-clip1", "flip-1e4x", NEAR_CLEAN),  # rejected (update-norm-ratio 100)
    ("iid", "mean-clip1", "boost-50x", NEAR_CLEAN),
    ("iid", "mean-clip1", "noise-50x", NEAR_CLEAN),
    ("iid", "mean-clip1", "flip-1x", (">=", 0.80)),  # 0.839: 1/5 of an update against the 4 others, every round
    ("iid", "mean-clip1", "flip-50x", (">=", 0.80)),  # clipped onto the median norm: the same as flip-1x
    ("non-iid", "mean-clip1", "boost-50x", NEAR_CLEAN),
    ("non-iid", "mean-clip1", "flip-1e4x", (">=", 0.70)),  # 0.742: the attacker's classes are missing
    ("non-iid", "mean-clip1", "flip-50x", (">=", 0.66)),  # 0.700
    ("non-iid", "mean-clip1", "flip-1x", (">=", 0.60)),  # 0.639
    ("non-iid", "mean-clip1", "noise-50x", (">=", 0.67)),  # 0.711
    # the mean with the update clip at 1×: two coordinated attackers of 5
    ("iid", "mean-clip1", "alie-2of5", NEAR_CLEAN),
    ("iid", "mean-clip1", "flip-2of5-99x", (">=", 0.84)),  # 0.872
    ("iid", "mean-clip1", "flip-2of5-1x", ("<=", 0.50)),  # 0.425: beyond what a mean can take
    ("non-iid", "mean-clip1", "flip-2of5-1x", ("<=", 0.45)),  # 0.403
    # the defaults: the methods' own mean, no clip (update-clip-ratio 0), only the 100× rejection
    ("iid", "mean", None, NEAR_CLEAN),
    ("iid", "mean", "flip-50x", ("<=", 0.15)),  # 0.100
    ("iid", "mean", "boost-50x", ("<=", 0.15)),  # 0.100
    ("non-iid", "mean", "flip-50x", ("<=", 0.15)),  # 0.097
    ("iid", "mean", "flip-2of5-99x", ("<=", 0.15)),  # 0.097
    ("iid", "mean", "boost-9x", ("<=", 0.70)),  # 0.650: a boost inside every norm bound (not directional)
    # the opt-in direction screen (update-cosine-floor 0), alone and with the update clip at 1×
    ("iid", "mean-cos0", "flip-2of5-1x", NEAR_CLEAN),  # both flips rejected every round
    ("non-iid", "mean-cos0", "flip-1x", ("<=", 0.74)),  # 0.711: a label-skewed flip is only weakly opposed
    ("iid", "mean-cos0-clip1", "flip-50x", NEAR_CLEAN),
    ("iid", "mean-cos0-clip1", "boost-9x", NEAR_CLEAN),
    ("iid", "mean-cos0-clip1", "noise-50x", NEAR_CLEAN),
    ("non-iid", "mean-cos0-clip1", None, NEAR_CLEAN),  # no honest cost on the label-skewed clean run
    ("non-iid", "mean-cos0-clip1", "flip-50x", (">=", 0.68)),  # 0.711 (clip alone: 0.700)
    # robust aggregators (byzantine-fraction 0.2: one of 5; update clip at 1×), iid
    ("iid", "trimmed-mean", "flip-50x", NEAR_CLEAN),
    ("iid", "trimmed-mean", "flip-2of5-1x", ("<=", 0.70)),  # 0.617: two attackers, one tolerated
    ("iid", "median", "flip-2of5-1x", NEAR_CLEAN),
    ("iid", "krum", "flip-2of5-1x", NEAR_CLEAN),
    ("iid", "krum", "flip-1e4x", NEAR_CLEAN),  # the rejected attacker counts against the tolerated one
    ("iid", "multi-krum", "flip-1x", NEAR_CLEAN),
    ("iid", "multi-krum", "flip-50x", NEAR_CLEAN),
    ("iid", "multi-krum", "flip-2of5-99x", (">=", 0.84)),  # 0.872
    # robust aggregators on label-skewed (non-iid) data: the clean run itself pays
    ("non-iid", "trimmed-mean", None, ("<=", 0.62)),  # 0.567
    ("non-iid", "median", None, ("<=", 0.55)),  # 0.486
    ("non-iid", "krum", None, ("<=", 0.50)),  # 0.444
    ("non-iid", "multi-krum", "flip-1x", (">=", 0.70)),  # 0.750
    ("non-iid", "multi-krum", "flip-50x", (">=", 0.70)),  # 0.753
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")

    @cache
    def run(partition: str, aggregator: str, attack: str | None) -> dict:
        return run_case(Path(out), partition, aggregator, attack, ROUNDS)
    return run


def case_id(case) -> str:
    partition, aggregator, attack, _ = case
    return f"{partition}-{aggregator}-{attack or 'clean'}"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_case(runs, case):
    partition, aggregator, attack, (kind, value) = case
    got = runs(partition, aggregator, attack)
    assert got["status"] == "completed", got
    accuracy = got["accuracy"]
    if kind == "near-clean":
        clean = runs(partition, "mean", None)["accuracy"]
        assert abs(accuracy - clean) <= value, (accuracy, clean)
    elif kind == ">=":
        assert accuracy >= value, accuracy
    else:
        assert accuracy <= value, accuracy
