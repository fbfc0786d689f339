"""The attackers who know the defence (issue 48's matrix, simulations/bench/robustness.py), checked on their own:
each builds what its docstring says, numbers asserted; and the measured targets of docs/robustness.md's
"Attackers who know the defence" table where they are met (1 seed here, the table's first)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from simulations.bench.robustness import TRIGGER, Adaptive, FullKnowledge, flat, shejwalkar, triggered, unflat
from tests.helpers import metadata, record, set_task_identity


def reply(model: dict[str, np.ndarray], src: int) -> Message:
    return Message(RecordDict({"arrays": record(model), "metrics": MetricRecord({"num-examples": 10})}),
                   metadata=metadata(src))


def request(cur: dict[str, np.ndarray]) -> Message:
    set_task_identity()
    return Message(RecordDict({"arrays": record(cur), "config": ConfigRecord({})}), metadata=metadata(0))


def model_of(rep: Message) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in rep.content.array_records["arrays"].items()}


CUR = {"w": np.array([1.0, -2.0, 0.5, 3.0], np.float32), "b": np.array([0.25], np.float32)}


def test_flat_and_unflat_are_inverse_around_the_round_model():
    vec = np.array([0.5, 1.0, -1.0, 2.0, 0.125])
    assert np.array_equal(flat(unflat(vec, CUR), CUR), vec)


def test_the_in_gate_update_has_its_cosine_with_the_colluders_mean_and_three_times_their_norm():
    rng = np.random.default_rng(0)
    honest = {p: {k: v + rng.normal(size=v.shape).astype(np.float32) * 0.1 for k, v in CUR.items()} for p in (0, 1)}
    attack = Adaptive((0, 1), {}, 5, weight=1e12)
    req = request(CUR)
    replies = {p: reply(m, p + 1) for p, m in honest.items()}
    for p, rep in replies.items():
        attack(req, rep, p)
    updates = [flat(m, CUR) for m in honest.values()]
    mean = np.mean(updates, axis=0)
    for rep in replies.values():
        u = flat(model_of(rep), CUR)
        assert float(u @ mean / (np.linalg.norm(u) * np.linalg.norm(mean))) == pytest.approx(0.2, abs=1e-5)
        assert np.linalg.norm(u) == pytest.approx(3 * np.mean([np.linalg.norm(x) for x in updates]), rel=1e-5)
        # the rest of u pulls towards the zero model: a negative inner product with x_t beyond the benign part
        assert float(u @ flat(CUR, {k: np.zeros_like(v) for k, v in CUR.items()})) < 0
        assert rep.content.metric_records["metrics"]["num-examples"] == 1e12


@pytest.mark.parametrize("rule", ["min-max", "min-sum"])
def test_min_max_and_min_sum_take_the_largest_gamma_their_bound_allows(rule):
    benign = np.random.default_rng(1).normal(size=(5, 20))
    m = shejwalkar(benign, rule)
    mu, sigma = benign.mean(0), benign.std(0)
    gamma = float(np.mean((mu - m) / sigma))
    assert np.allclose(m, mu - gamma * sigma) and gamma > 0
    pair = np.linalg.norm(benign[:, None] - benign[None], axis=2)

    def within(g: float) -> bool:
        d = np.linalg.norm(benign - (mu - g * sigma), axis=1)
        return d.max() <= pair.max() if rule == "min-max" else (d ** 2).sum() <= (pair ** 2).sum(1).max()
    assert within(gamma) and not within(gamma * 1.001)


def test_full_knowledge_rewrites_the_attackers_once_every_reply_of_the_round_is_in():
    models = {p: {k: v + 0.1 * (p + 1) * np.ones_like(v) for k, v in CUR.items()} for p in range(4)}
    attack = FullKnowledge((0,), 4, "min-max")
    req = request(CUR)
    replies = {p: reply(m, p + 1) for p, m in models.items()}
    for p in (0, 1, 2):
        attack(req, replies[p], p)
        assert np.array_equal(model_of(replies[0])["w"], models[0]["w"])  # not yet: the round is not complete
    attack(req, replies[3], 3)
    expected = unflat(shejwalkar(np.stack([flat(models[p], CUR) for p in range(4)]), "min-max"), CUR)
    assert all(np.array_equal(model_of(replies[0])[k], expected[k]) for k in CUR)
    assert all(np.array_equal(model_of(replies[p])["w"], models[p]["w"]) for p in (1, 2, 3))


def test_the_trigger_is_the_bottom_right_2x2_corner_set_to_ink():
    x = np.zeros((2, 64), np.float32)
    out = triggered(x)
    assert sorted(np.flatnonzero(out[0])) == [54, 55, 62, 63] == list(TRIGGER)
    assert out[:, list(TRIGGER)].min() == 1.0 and x.max() == 0.0  # a copy
    assert [divmod(i, 8) for i in TRIGGER] == [(6, 6), (6, 7), (7, 6), (7, 7)]


# ------------------------------------------------------------------------------------------ the met targets
#: Item 4's targets that ``defence = "robust"`` meets in docs/robustness.md's table (3-seed means there; the first
#: seed here): ``(data, attack, attackers of 5)``.  The misses stay in the table, not here.
MET = [("iid", "in-gate", 1), ("iid", "min-max", 1), ("iid", "min-sum", 1), ("non-iid", "in-gate", 1),
       ("non-iid", "in-gate-weight-lie", 1), ("non-iid", "min-max", 1), ("non-iid", "min-sum", 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from functools import cache

    from simulations.bench.robustness import DIGITS, run_case
    out = tmp_path_factory.mktemp("adaptive")

    @cache
    def run(partition: str, profile: str, attack: str | None, attackers: int = 0, method: str = "fedavg") -> float:
        before = DIGITS.get("method")
        DIGITS["method"] = method
        try:
            got = run_case(out, partition, profile, attack, 10, 5, attackers, "vectorized")
        finally:
            DIGITS.pop("method") if before is None else DIGITS.update(method=before)
        assert got["status"] == "completed", got
        return got["accuracy"]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("partition,attack,attackers", MET)
def test_robust_meets_the_target_against_an_attacker_who_knows_it(runs, partition, attack, attackers):
    """iid: within 0.05 of the clean ``off`` run; label-skewed: at or above the attackers-absent run − 0.05."""
    clean = runs(partition, "off", None)
    floor = clean if partition == "iid" else min(clean, runs(partition, "off", "absent", attackers))
    assert runs(partition, "robust", attack, attackers) >= floor - 0.05


@pytest.mark.slow
def test_robust_holds_scaffolds_poisoned_control_delta_on_iid_data(runs):
    """One of 5 SCAFFOLD clients sends its honest model with its control delta ×(−3): ``off`` loses 0.42 (3-seed
    mean), ``robust`` rejects the reply every round (the record gate) and stays within 0.05 of clean."""
    clean = runs("iid", "off", None, 0, "scaffold")
    assert runs("iid", "robust", "record-0", 1, "scaffold") >= clean - 0.05
    assert runs("iid", "off", "record-0", 1, "scaffold") < clean - 0.2
