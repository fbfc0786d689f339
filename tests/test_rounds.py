"""RoundBook and the metric means on their own: round logs, the finite commit, the update counter, outliers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flower_strategies.core.rejections import Kind, Rejection
from flower_strategies.core.rounds import (
    METRIC_OUTLIER_RATIO, RoundBook, RoundLog, mean_reply_metrics, nonfinite_state, weighted_mean,
)


def test_open_take_close_builds_the_history():
    book = RoundBook()
    opened = book.open(3, sampled=4, bytes_down=400)
    round_log = book.pop_open_log(3)
    assert round_log is opened and (round_log.server_round, round_log.sampled, round_log.bytes_down) == (3, 4, 400)
    assert book.pop_open_log(4) == RoundLog(4)  # popped once: a later pop starts a fresh log
    book.close(round_log, {"train-loss": 0.5})
    assert book.history == [round_log] and round_log.train_metrics == {"train-loss": 0.5} and round_log.seconds >= 0.0



def test_lowest_train_loss_reads_each_round_once_and_follows_a_restored_history():
    """The lowest positive finite mean train-loss of the history (the divergence warning's reference), kept as rounds
    close: equal to a scan of the whole history after every round, and after load_state_dict replaces it."""
    book = RoundBook()
    assert book.lowest_train_loss() is None
    losses = [None, 2.0, float("nan"), 0.0, 1.5, float("inf"), -1.0, 1.7, 0.9, 3.0]
    for r, loss in enumerate(losses, start=1):
        book.close(book.pop_open_log(r), {} if loss is None else {"train-loss": loss})
        finite = [v for v in losses[:r] if v is not None and np.isfinite(v) and v > 0]
        assert book.lowest_train_loss() == (min(finite) if finite else None)
    restored = RoundBook()
    restored.lowest_train_loss()
    state = book.state_dict()
    state["history"] = state["history"][:2]  # rounds 1–2: only 2.0 is usable
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.lowest_train_loss() == 2.0
    book.load_state_dict(json.loads(json.dumps(state)))  # a shorter history than the one already read
    assert book.lowest_train_loss() == 2.0


def test_commit_only_finite_and_counts_updates():
    book = RoundBook()
    good = {"w": np.ones(3, np.float32)}
    assert book.commit(1, good, {"m": {"w": np.zeros(3)}, "lr": 0.1}) and book.num_updates == 1
    assert not book.commit(2, {"w": np.array([1.0, np.nan])}, {})
    assert not book.commit(2, good, {"m": {"w": np.array([np.inf])}})
    assert not book.commit(2, good, {"lr": float("nan")})
    assert book.num_updates == 1


def test_nonfinite_state_names_the_culprit():
    assert nonfinite_state({"m": {"a": np.zeros(2), "b": np.array([np.nan])}}) == "m/b"
    assert nonfinite_state({"lr": float("inf")}) == "lr"
    assert nonfinite_state({"steps": 3, "names": ["x"], "m": {"a": np.zeros(1)}}) is None


def test_state_dict_round_trip():
    book = RoundBook()
    book.commit(1, {"w": np.zeros(1)}, {})
    round_log = book.pop_open_log(1)
    round_log.rejections.append(Rejection(3, Kind.CLIENT_ERROR, "client error: boom"))
    book.close(round_log, {"train-loss": 1.0})
    state = book.state_dict()
    assert set(state) == {"num_updates", "history"}
    assert state["history"][0]["rejections"] == [{"node": 3, "kind": "client-error", "detail": "client error: boom"}]
    assert json.loads(json.dumps(state)) == state  # plain data (the checkpoint's JSON)
    fresh = RoundBook()
    fresh.load_state_dict(state)
    assert fresh.num_updates == 1 and fresh.history == book.history
    # a checkpoint written before rejections were typed kept their text: read back as such
    older = {**state, "history": [{**state["history"][0], "rejections": ["node 3: client error: boom"]}]}
    fresh.load_state_dict(older)
    assert fresh.history[0].rejections == [Rejection(None, Kind.RESTORED, "node 3: client error: boom")]
    assert str(fresh.history[0].rejections[0]) == str(book.history[0].rejections[0])


def test_mean_reply_metrics_weights_and_filters():
    rows = [{"num-examples": 10.0, "loss": 1.0, "node-id": 5, "flag": True},
            {"num-examples": 30.0, "loss": 3.0, "node-id": 6, "acc": float("nan")}]
    out = mean_reply_metrics(rows)
    assert out == {"loss": (10 * 1.0 + 30 * 3.0) / 40, "num-examples": 40.0}  # ids, bools and NaN left out
    poisoned = [{"num-examples": 1.0, "loss": v} for v in (1.0, 2.0, 3.0, 1e300)]
    assert mean_reply_metrics(poisoned)["loss"] == pytest.approx(2.0)  # outlier above 1e3 × median dropped
    two = [{"num-examples": 1.0, "loss": v} for v in (1.0, 1e300)]
    assert mean_reply_metrics(two)["loss"] == pytest.approx(5e299)  # fewer than 3 values: no outlier test
    assert METRIC_OUTLIER_RATIO == 1e3


def test_weighted_mean():
    pairs = [(2.0, 1.0), (5.0, 3.0)]
    assert weighted_mean(pairs, "uniform") == 3.5 and weighted_mean(pairs, "examples") == 4.25
    assert np.isnan(weighted_mean([], "examples"))


def test_a_rounds_report_is_its_closed_log_with_an_adapters_notes_joined_at_close():
    """Readers take RoundBook.report(round); an adapter's findings (SecAgg+'s) join the round's log when it closes,
    for that round only, and nothing edits the history afterwards."""
    from flower_strategies.core.rejections import Kind, Rejection

    book = RoundBook()
    book.open(1, sampled=3)
    assert book.report(1) is None  # not closed yet
    found = Rejection(None, Kind.SECURE_AGGREGATE, "secure aggregate of 3 replies rejected: x")
    book.note(1, rejections=[found], replies_rejected=3, round_metrics={"secagg-used": 3.0})
    book.note(7, round_metrics={"stale": 1.0})  # another round's note: dropped
    log = book.pop_open_log(1)
    log.round_metrics = {"server-lr": 0.5}
    book.close(log, {"train-loss": 0.5})
    report = book.report(1)
    assert report is log and report.rejections == [found] and report.replies_rejected == 3
    assert report.round_metrics == {"server-lr": 0.5, "secagg-used": 3.0}
    book.open(2)
    book.close(book.pop_open_log(2), {})
    assert book.report(1) is None and book.report(2).rejections == [] and book.report(2).round_metrics == {}


def _history(losses):
    from flower_strategies.core import records as R

    return [RoundLog(i + 1, train_metrics={R.TRAIN_LOSS: v}) for i, v in enumerate(losses)]


@pytest.mark.parametrize("losses, fires", [
    # measured (simulations/tools/plugin_factors.py, the quickstart shape): localadam at ×0.3, collapsed to one class
    ([2.3198, 2.296, 2.2953, 2.2948, 2.2947], 5),
    ([2.2927, 2.2963, 2.2944, 2.2933, 2.2927], 5),       # localadam at ×0.1, 5 × 5, seed 1: one class
    ([3.0, 2.999, 2.998, 2.998, 2.997], 5),              # an lr far too low: the loss barely moves
    ([2.2911, 2.2854, 2.2797, 2.2733, 2.2651], None),    # stock FedAvg, 10 × 10, seed 0: slow but moving
    ([2.283, 2.2918, 2.1868, 1.9645, 1.7972], None),     # localadam at ×0.1: learns
    # scaffold at ×3, 10 × 10, seed 1: a slow start (flat for 3 rounds) that goes on to hold against stock FedAvg
    ([2.2899, 2.3071, 2.3067, 2.3046, 2.3013, 2.2972, 2.2914, 2.2833], None),
    ([2.3, 1.2, 1.199, 1.199, 1.198], None),             # flat, but far below round 1: converged, not stalled
    ([2.3, 2.0, 2.3, 2.3, 2.3, 2.3], 6),                 # back at round 1's level and flat: stalled since round 3
])
def test_stall_alarm_fires_on_a_flat_loss_at_round_1s_level(losses, fires):
    from flower_strategies.core.rounds import stall_alarm

    fired = [r for r in range(1, len(losses) + 1) if stall_alarm(_history(losses[:r]))]
    assert (fired[0] if fired else None) == fires
    if fires:
        assert "stayed at round 1's level" in str(stall_alarm(_history(losses[:fires])))
    assert stall_alarm(_history([2.3, 2.3, float("nan"), 2.3])) is None  # a round without a usable loss: no verdict
