"""Every uplink record is screened, not only the model (issue 48, item 2).

* **Structural invariants** (declared on each method's :class:`~flower_strategies.core.validation.RecordSpec`:
  ``floor``, ``at_least``), checked under every defence — no honest client can break them: second moments and v̂
  ≥ 0 (FedLADA, Fed-LAMB / FedAMS, fedlocal-sync's v) and FedLADA's AMSGrad v̂ ≥ the v̂ the server sent.
* **The trust gate on every record** (``defence = "robust"``): a reply whose record update points against both the
  server's root-set record of that name and the round's centre of it is rejected (SCAFFOLD's control delta,
  MimeLite's full gradient, FedDA's momentum), however in-gate its model is.

Each case screens one round of 5 honest replies built by the real client half on digits partitions (and the
server's own root-set reply, as the ServerApp builds it), then the same round with partition 0's record poisoned.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message

import flower_strategies  # noqa: F401 - registers the methods
from app_common.task import TASK_SPECS, build_model, load_client_data
from flower_strategies.core.loop import own_loop_config
from flower_strategies.core.client import train_reply
from flower_strategies.core.rejections import Kind
from server_app import root
from server_app.app import build
from simulations.engine.inprocess import run_inprocess
from tests.helpers import metadata
from tests.test_attacks import IID, one_thread  # noqa: F401 - the module-wide autouse fixture (1 thread, quiet logs)

NODES = 5


def round_one(method: str, defence: str, poison=None):
    """The rejections of round 1 of ``method`` on 5 iid digits clients under ``defence``; ``poison(records, sent)``
    rewrites partition 0's reply records in place (``sent``: the round's downlink records)."""
    cfg = {**IID, "method": method, "defence": defence}
    fed, model, strategy = build(cfg)
    if defence == "robust":
        strategy.root_update = root.root_update(fed, 5)
    content = strategy.prepare_round(1, ArrayRecord(model.state_dict()), own_loop_config(), NODES)
    replies = []
    for pid in range(NODES):
        x, y = load_client_data(fed.task, pid, NODES, partitioner=fed.partitioner, seed=fed.seed,
                                alpha=fed.dirichlet_alpha, classes_per_client=fed.classes_per_client,
                                precision=fed.precision)
        reply = train_reply(build_model(fed.task, fed.seed, fed.synthetic_dim, fed.precision), content, x, y,
                            TASK_SPECS[fed.task].loss_fn(), seed=fed.seed, client_key=pid, loss_before=False)
        if pid == 0 and poison is not None:
            records = {name: {k: v.numpy().copy() for k, v in rec.items()}
                       for name, rec in reply.array_records.items()}
            poison(records, strategy.sent)
            for name, arrays in records.items():
                reply[name] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
        replies.append(Message(content=reply, metadata=metadata(pid + 1)))
    return strategy.reply_screen().run(1, replies).rejections


def scale(record: str, factor: float, absolute: bool = False):
    def fn(records, sent):
        records[record] = {k: factor * (np.abs(v) if absolute else v) for k, v in records[record].items()}
    return fn


def below_sent(record: str):
    """One value of the record halved below the value the server sent (still >= 0)."""
    def fn(records, sent):
        key = next(iter(records[record]))
        records[record][key].reshape(-1)[0] = sent[record][key].reshape(-1)[0] / 2
    return fn


#: ``(method, poison, the rejection under "off" (None: accepted), under "robust")``.
CASES = {
    "fedlada-negative-vhat": ("fedlada", scale("v-hat", -1.0), Kind.INVARIANT, Kind.INVARIANT),
    "fedlada-vhat-below-sent": ("fedlada", below_sent("v-hat"), Kind.INVARIANT, Kind.INVARIANT),
    "fedams-v-minus-3abs": ("fedams", scale("v", -3.0, absolute=True), Kind.INVARIANT, Kind.INVARIANT),
    "fedlamb-negative-v": ("fedlamb", scale("v", -1.0), Kind.INVARIANT, Kind.INVARIANT),
    "fedlocal-sync-negative-v": ("fedlocal-sync", scale("fedlocal-v", -1.0), Kind.INVARIANT, Kind.INVARIANT),
    "scaffold-control-delta-x-3": ("scaffold", scale("control-delta", -3.0), None, Kind.UNTRUSTED),
    "mimelite-gradient-x-3": ("mimelite", scale("full-gradient", -3.0), None, Kind.UNTRUSTED),
    "fedda-momentum-x-3": ("fedda", scale("momentum", -3.0), None, Kind.UNTRUSTED),
}


@pytest.mark.parametrize("defence", ["off", "robust"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_poisoned_record_is_rejected_with_its_kind(case, defence):
    method, poison, off, robust = CASES[case]
    expected = off if defence == "off" else robust
    rejections = round_one(method, defence, poison)
    if expected is None:  # only the trust gate sees a record that breaks no invariant: "off" has no reference
        assert rejections == []
        return
    assert [(r.node, r.kind) for r in rejections] == [(1, expected)], [str(r) for r in rejections]


@pytest.mark.parametrize("defence", ["off", "robust"])
@pytest.mark.parametrize("method", sorted({m for m, *_ in CASES.values()}))
def test_the_honest_replies_of_the_round_all_pass(method, defence):
    assert round_one(method, defence) == []


@pytest.mark.slow
def test_fedams_negative_second_moment_is_rejected_under_off_every_round(tmp_path):
    """The issue's case: one of 5 clients sends v = −3·|v| with its honest model (FedAMS, iid).  It used to be
    aggregated under both defences (test loss 3.8e5, accuracy 0.606); now every one of its replies is rejected as a
    record invariant and the run ends within 0.05 of the clean run."""
    def intercept(request, rep, partition_id):
        if partition_id == 0 and not rep.has_error() and "v" in rep.content.array_records:
            rep.content["v"] = ArrayRecord({k: Array(np.ascontiguousarray(-3 * np.abs(v.numpy())))
                                            for k, v in rep.content.array_records["v"].items()})
        return rep

    cfg = {**IID, "method": "fedams", "output-dir": str(tmp_path), "learning-curve": False}
    clean = run_inprocess({**cfg, "run-name": "clean"}, NODES)["final"]
    run_inprocess({**cfg, "run-name": "poisoned"}, NODES, intercept=intercept)
    rows = [json.loads(line) for line in (tmp_path / "poisoned" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["replies-rejected"] == 1 and "has values below 0" in r["rejections"] for r in rows[1:])
    assert abs(rows[-1]["test-accuracy"] - clean["test-accuracy"]) <= 0.05
    assert rows[-1]["test-loss"] < 10
