"""fedadapt's robust aggregators against Flower's own classes on the same replies (issue 36: Flower's Krum /
Multi-Krum / Bulyan / FedMedian / FedTrimmedAvg are the reference rows of docs/robustness.md's matrix).

Each case feeds the same mocked train replies (an ``arrays`` ArrayRecord of three float64 arrays and a ``metrics``
MetricRecord with ``num-examples``, n = 5 … 9 replies) to a ``flwr.serverapp.strategy`` class's ``aggregate_train``
and to fedadapt's :class:`~flower_strategies.core.screen.ReplyScreen` (the screen and aggregation the strategy runs
each round) under the matching ``aggregator``.  The parameters map as follows, t = ⌈f·n⌉ (``byzantine-fraction`` f,
no reply rejected before):

==========================  ==============================================================================
fedadapt ``aggregator``     Flower class
==========================  ==============================================================================
``krum``, f                 ``Krum(num_malicious_nodes=t)``
``multi-krum``, f           ``MultiKrum(num_malicious_nodes=t, num_nodes_to_select=n − t)``
``median``                  ``FedMedian()``
``trimmed-mean``, f         ``FedTrimmedAvg(beta=t/n)`` (Flower cuts ``int(beta·n)`` per side, fedadapt ⌈f·n⌉)
(none)                      ``Bulyan(num_malicious_nodes=f)``: checked against fedadapt's Krum scores + numpy
==========================  ==============================================================================

All five classes are in the compatibility leg's Flower 1.23.0 with the same ``aggregate_train`` (only typing and
import paths differ from 1.42), so these tests run on both.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.serverapp.strategy import Bulyan, FedMedian, FedTrimmedAvg, Krum, MultiKrum

from flower_strategies.core import records as R
from flower_strategies.core.rejections import Kind
from flower_strategies.core.robust import byzantine_count, krum_scores
from flower_strategies.core.screen import ReplyScreen, ScreenPolicy
from flower_strategies.core.validation import RecordSpec
from tests.helpers import RoundScreen, reply

SHAPES = {"fc.weight": (4, 3), "fc.bias": (4,), "out.weight": (2, 4)}
MODEL = (RecordSpec(R.MODEL, "mean", "model"),)


def current(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s) for k, s in SHAPES.items()}


def models(n: int, seed: int) -> tuple[list[dict[str, np.ndarray]], list[float]]:
    """n replies' models around :func:`current`: honest updates of scale 0.1, reply 0 sign-flipped at 5×, reply 1
    boosted 10× (below the default 100× norm rejection); ``num-examples`` 10 … 99."""
    rng = np.random.default_rng(seed)
    cur = current()
    out = []
    for i in range(n):
        scale = -5.0 if i == 0 else 10.0 if i == 1 else 1.0
        out.append({k: cur[k] + scale * 0.1 * rng.normal(size=s) for k, s in SHAPES.items()})
    return out, [float(rng.integers(10, 100)) for _ in range(n)]


def messages(items, weights):
    """Fresh replies (Flower's FedMedian / FedTrimmedAvg pop the arrays out of the messages they aggregate)."""
    return [reply(i + 1, {R.MODEL: m}, num_examples=w) for i, (m, w) in enumerate(zip(items, weights, strict=True))]


def fedadapt(aggregator: str, fraction: float, items, weights):
    policy = ScreenPolicy(aggregator=aggregator, byzantine_fraction=fraction)
    out = RoundScreen(ReplyScreen(current(), MODEL, list(SHAPES), policy)).run(1, messages(items, weights))
    return out, out.aggregates.get(R.MODEL)


def flower(strategy, items, weights):
    arrays, _ = strategy.aggregate_train(1, messages(items, weights))
    return None if arrays is None else {k: v.numpy() for k, v in arrays.items()}


def assert_same(a, b):
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-12)


FLOWER = {
    "krum": lambda n, t: Krum(num_malicious_nodes=t),
    "multi-krum": lambda n, t: MultiKrum(num_malicious_nodes=t, num_nodes_to_select=n - t),
    "median": lambda n, t: FedMedian(),
    "trimmed-mean": lambda n, t: FedTrimmedAvg(beta=t / n),
}


@pytest.mark.parametrize("n", [5, 6, 7, 8, 9])
@pytest.mark.parametrize("fraction", [0.2, 0.3])
@pytest.mark.parametrize("aggregator", list(FLOWER))
def test_fedadapt_aggregators_equal_flowers_classes(aggregator, fraction, n):
    items, weights = models(n, seed=100 * n + int(10 * fraction))
    t = byzantine_count(fraction, n)
    out, ours = fedadapt(aggregator, fraction, items, weights)
    assert not out.rejections or aggregator in ("krum", "multi-krum")  # only Krum's left-out replies
    theirs = flower(FLOWER[aggregator](n, t), items, weights)
    if aggregator == "trimmed-mean":
        assert int(t / n * n) == t  # Flower's beta floors back to fedadapt's t
    assert_same(ours, theirs)
    if aggregator in ("krum", "multi-krum"):  # the ones left out: both attackers (nodes 1, 2), or one when t = 1
        left_out = {r.node for r in out.rejections if r.kind is Kind.LEFT_OUT}
        assert len(left_out) == (n - 1 if aggregator == "krum" else t)
        assert {1, 2} <= left_out if t >= 2 else left_out & {1, 2}


def test_trimmed_mean_cut_differs_flower_floors_beta_n_fedadapt_rounds_f_n_up():
    """6 replies, fraction 0.2: fedadapt trims ⌈1.2⌉ = 2 per side (its ``byzantine-fraction`` is an upper bound on
    the attackers, rounded up), Flower's ``FedTrimmedAvg(beta=0.2)`` int(1.2) = 1.  Per coordinate 0, 1, 2, 3, 10,
    100: fedadapt (2 + 3) / 2 = 2.5, Flower (1 + 2 + 3 + 10) / 4 = 4.0 — the same as fedadapt at t = 1."""
    values = [0.0, 1.0, 2.0, 3.0, 10.0, 100.0]
    items = [{k: np.full(s, v) for k, s in SHAPES.items()} for v in values]
    weights = [10.0] * 6
    out, ours = fedadapt("trimmed-mean", 0.2, items, weights)
    assert not out.rejections  # the 100 reply is within the defaults' 100× norm rejection
    theirs = flower(FedTrimmedAvg(beta=0.2), items, weights)
    assert all(np.all(ours[k] == 2.5) for k in SHAPES) and all(np.all(theirs[k] == 4.0) for k in SHAPES)
    _, ours_t1 = fedadapt("trimmed-mean", 1 / 6, items, weights)
    assert_same(ours_t1, theirs)


def test_krum_refuses_fewer_than_2t_plus_1_replies_flowers_runs_on_any_number():
    """5 replies, fraction 0.45: t = ⌈2.25⌉ = 3 needs 7; fedadapt rejects every reply (the round keeps its model, and
    a run whose sample is that small fails at start), Flower's ``Krum(num_malicious_nodes=3)`` still picks one (its
    score sums max(1, 5 − 3 − 2) = 1 nearest distance) — whichever of two colluders is nearest its twin."""
    items, weights = models(5, seed=7)
    items[2] = {k: v + 1e-9 for k, v in items[1].items()}  # a colluder one hair from the 10× boost
    out, ours = fedadapt("krum", 0.45, items, weights)
    assert ours is None and [r.kind for r in out.rejections] == [Kind.TOO_FEW] * 5
    theirs = flower(Krum(num_malicious_nodes=3), items, weights)
    assert any(all(np.array_equal(theirs[k], items[i][k]) for k in SHAPES) for i in (1, 2))  # a boost wins


@pytest.mark.parametrize(("n", "f"), [(7, 1), (9, 1), (11, 2)])
def test_flowers_bulyan_is_one_pass_multi_krum_then_the_mean_of_the_values_nearest_the_median(n, f):
    """fedadapt has no Bulyan (its matrix row runs Flower's class).  What Flower's does, in fedadapt's pieces: keep
    the θ = n − 2f replies of best Krum score (one pass of :func:`krum_scores` with f, not the paper's Krum
    repeated θ times on the shrinking set), then per coordinate the mean of the β = θ − 2f kept values nearest the
    kept values' median (unweighted: ``num-examples`` is ignored).  Below 4f + 3 replies it returns no arrays."""
    items, weights = models(n, seed=n)
    theirs = flower(Bulyan(num_malicious_nodes=f), items, weights)
    cur = current()
    vectors = np.stack([np.concatenate([m[k].reshape(-1) - cur[k].reshape(-1) for k in SHAPES]) for m in items])
    scores = krum_scores(vectors, f)
    theta = n - 2 * f
    beta = theta - 2 * f
    kept = sorted(range(n), key=lambda i: (scores[i], i))[:theta]
    assert {0, 1} - set(kept) == {0, 1}  # the flip and the boost are out
    for k in SHAPES:
        stack = np.stack([items[i][k] for i in kept])
        near = np.argsort(np.abs(stack - np.median(stack, axis=0)), axis=0, kind="stable")[:beta]
        np.testing.assert_allclose(theirs[k], np.take_along_axis(stack, near, axis=0).mean(axis=0), rtol=0, atol=1e-12)
    assert flower(Bulyan(num_malicious_nodes=f), items[:4 * f + 2], weights[:4 * f + 2]) is None
