"""One straight round: the order of ``aggregate_train``'s steps and of the screen's stages, as docs/architecture.md
states them, and stages that never edit what they are given."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from flower_strategies.core import ops
from flower_strategies.core import records as R
from flower_strategies.core.binding import ReplyBinder
from flower_strategies.core.screen import Kept, Reply, ReplyScreen, ScreenPolicy
from flower_strategies.core.strategy import FedAdaptStrategy
from flower_strategies.core.validation import RecordSpec
from tests.helpers import reply

ROOT = Path(__file__).resolve().parent.parent
CURRENT = {"w": np.zeros(4, np.float32)}
MODEL = (RecordSpec(R.MODEL, "mean", "model"),)


def model_reply(src, value, n=10):
    return reply(src, {R.MODEL: {"w": np.full(4, value, np.float32)}}, num_examples=n)


def test_docs_quote_the_screens_stages_in_the_codes_order():
    text = (ROOT / "docs" / "architecture.md").read_text()
    quoted = re.search(r"<!-- stages:begin -->(.*?)<!-- stages:end -->", text, re.S)
    assert quoted is not None
    assert re.findall(r"`(\w+)`", quoted.group(1)) == list(ReplyScreen.STAGES)
    for name in ReplyScreen.STAGES:  # each stage has its own line in the list below the quote
        assert f"* `{name}`:" in text


def test_run_applies_the_stages_in_order_and_none_edits_its_input(monkeypatch):
    calls: list[str] = []
    for name in ReplyScreen.STAGES:
        own = getattr(ReplyScreen, name)

        def spy(self, kept, _own=own, _name=name):
            before = (kept.replies, [dict(r.records) for r in kept.replies], kept.provisional)
            out, refused = _own(self, kept)
            assert isinstance(out, Kept) and all(isinstance(r, Reply) for r in out.replies)
            assert (kept.replies, [dict(r.records) for r in kept.replies], kept.provisional) == before, _name
            calls.append(_name)
            return out, refused

        monkeypatch.setattr(ReplyScreen, name, spy)
    policy = ScreenPolicy(update_clip_ratio=1.5, update_cosine_floor=0.0, aggregator="trimmed-mean")
    replies = [model_reply(i, 1.0 + 0.1 * i) for i in range(1, 6)] + [model_reply(9, 50.0), model_reply(8, math.nan)]
    out = ReplyScreen(CURRENT, MODEL, ["w"], policy).run(1, replies)
    assert calls == list(ReplyScreen.STAGES)
    assert {r.node for r in out.kept} | {r.node for r in out.rejections} == {1, 2, 3, 4, 5, 8, 9}


def test_aggregate_train_is_check_screen_aggregate_commit(monkeypatch):
    from flower_strategies.methods.baselines import FedAvg

    calls: list[str] = []
    for cls, name, label in ((ReplyBinder, "check", "check"), (ReplyScreen, "run", "screen"),
                             (ReplyScreen, "aggregate", "aggregate"), (ReplyBinder, "remember", "remember"),
                             (FedAdaptStrategy, "_update", "update and commit")):
        own = getattr(cls, name)

        def spy(self, *args, _own=own, _label=label, **kw):
            calls.append(_label)
            return _own(self, *args, **kw)

        monkeypatch.setattr(cls, name, spy)
    s = FedAvg()
    s.current = R.views(R.to_record(CURRENT))
    s.server_state = s.init_server_state(s.current)
    new, metrics = s.aggregate_train(1, [model_reply(1, 1.0), model_reply(2, 3.0)])
    assert calls == ["check", "screen", "aggregate", "remember", "update and commit"]
    assert new is not None and metrics["replies-used"] == 2


@pytest.mark.parametrize("rule", ["wmean", "umean", "sum", "max"])
def test_norms_and_fold_read_in_chunks_equal_the_whole_array_results(rule):
    """Across chunk boundaries: the norms agree with float64 norms, the fold with the textbook fold."""
    rng = np.random.default_rng(0)
    size = 2 * ops.CHUNK + 3
    reference = {"w": rng.standard_normal(size), "n": np.array(4, np.int64)}
    items = [{"w": reference["w"] + rng.standard_normal(size), "n": np.array(i, np.int64)} for i in range(3)]
    weights = [1.0, 2.0, 5.0]
    norms, sums = ops.norms_and_fold(items, reference, weights, rule)
    want = [float(np.linalg.norm(it["w"] - reference["w"])) for it in items]
    np.testing.assert_allclose(norms, want, rtol=1e-12)
    out = ops.finish_fold(sums, items[0], weights, rule, len(items))
    ws = weights if rule == "wmean" else [1.0] * 3
    stack = np.stack([it["w"] for it in items])
    expect = {"wmean": np.average(stack, axis=0, weights=ws), "umean": stack.mean(axis=0), "sum": stack.sum(axis=0),
              "max": stack.max(axis=0)}[rule]
    np.testing.assert_allclose(out["w"], expect, rtol=1e-13, atol=1e-13)
    assert out["n"].dtype == np.int64
    assert ops.update_norms(items, reference) == norms  # the same pass without the fold
    assert ops.fold(items, weights, rule)["w"].tobytes() == out["w"].tobytes()  # and the fold without norms
