"""SecAgg+ through Flower's own workflow and mod: equivalence with the plain server math within the derived
quantisation bound, eligibility and refusals (docs/privacy.md section 4)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

import flower_strategies as fs
from client_app.app import app as client_app
from flower_strategies.compat import secagg
from flower_strategies.compat.legacy import LegacyStrategy
from flower_strategies.compat.secagg import SecAggStrategy, error_bound, run_secagg, secaggplus_workflow
from flower_strategies.core import records as R
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.policy import RunFailed
from flower_strategies.core.registry import METHODS
from flower_strategies.core.validation import RecordSpec
from server_app.app import build
from simulations.engine import LoopbackGrid

RUN_CONFIG = {"task": "synthetic-linear", "seed": 2, "precision": "float64", "synthetic-dim": 4}
C, Q, MAX_WEIGHT = 8.0, 4194304, 1000.0


class _Proxy:
    def __init__(self, node_id: int) -> None:
        self.node_id, self.cid = node_id, str(node_id)


def _adam_lipschitz(ref: LegacyStrategy, eps: float) -> float:
    """|∂x'/∂D| of one server-Adam step (bias-correction none): x' = x + lr·m/(√v+τ), m = β1·m₀ + (1−β1)·D,
    v = β2·v₀ + (1−β2)·D².  ∂x'/∂D = lr·[(1−β1)/(√v+τ) − m·(1−β2)·D/(√v·(√v+τ)²)], and (1−β2)·D² ≤ v gives
    |∂x'/∂D| ≤ lr·[(1−β1)/τ + √(1−β2)·|m|/τ²]; |m| on the segment between the exact and the SecAgg+ mean is at most
    the reference's max |m| + (1−β1)·eps."""
    hp = ref.inner.hparams
    m = max(float(np.abs(a).max()) for a in ref.inner.server_state["m_t"].values()) + (1 - hp.beta1) * eps
    return hp.server_lr * ((1 - hp.beta1) / hp.tau + math.sqrt(1 - hp.beta2) * m / hp.tau**2)


#: The method, its settings beyond the defaults, and the Lipschitz constant of its server map (aggregate → model).
CASES = {
    "fedadam": ({}, _adam_lipschitz),  # server-only: local SGD, server Adam on the mean update
    # client half (client momentum mixing the broadcast global update), example-weighted; x' = x − η_g·(x − mean)
    "fedcm": ({"weighting": "examples"}, lambda ref, eps: ref.inner.hparams.server_lr),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_secaggplus_equals_the_plain_server_math_within_the_quantisation_bound(name, monkeypatch):
    """Every round, in-process (Flower's DefaultWorkflow + SecAggPlusWorkflow over the real ClientApp with
    secaggplus_mod): (1) the mean SecAgg+ hands to aggregate_fit is within ``error_bound`` of the exact float64
    example-weighted mean of the clients' unmasked replies (and not equal: it was quantised); (2) the new global model
    is within L·bound of the plain server math run on those same replies (a copy of the strategy before the round)."""
    extra, lipschitz = CASES[name]
    strategy = METHODS[name].build(client_lr=0.02, local_steps=3, batch_size=8, seed=5, **extra)
    initial = {"w.weight": np.array([[0.3, -0.2, 0.1, 0.5]])}
    clean: list[tuple[int, FitRes]] = []
    seen: list[tuple[float, float, float, float]] = []
    original = secagg.count_clipped

    def record(fitres: RecordDict, state):
        arrays = [a.numpy().copy() for a in fitres.array_records["fitres.parameters"].values()]
        metrics = dict(fitres.config_records["fitres.metrics"])
        n = int(fitres.metric_records["fitres.num_examples"]["num_examples"])
        clean.append((int(state["nid"]), FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, metrics)))
        return original(fitres, state)

    class Checked(SecAggStrategy):
        def aggregate_fit(self, server_round, results, failures):
            replies = sorted(clean)
            clean.clear()
            assert not failures and [p.node_id for p, _ in sorted(results, key=lambda r: r[0].node_id)] == [
                nid for nid, _ in replies]
            ns = [res.num_examples for _, res in replies]
            assert max(ns) <= MAX_WEIGHT and all(np.abs(a).max() <= C for _, res in replies
                                                 for a in parameters_to_ndarrays(res.parameters))  # bound's premise
            exact = [sum(n * parameters_to_ndarrays(res.parameters)[j] for n, (_, res) in zip(ns, replies)) / sum(ns)
                     for j in range(len(parameters_to_ndarrays(replies[0][1].parameters)))]
            secure = parameters_to_ndarrays(results[0][1].parameters)
            err = max(float(np.abs(s - e).max()) for s, e in zip(secure, exact))
            bound = error_bound(ns, C, Q, MAX_WEIGHT)
            ref = LegacyStrategy(copy.deepcopy(self.inner), self.initial)
            ref_out, _ = ref.aggregate_fit(server_round, [(_Proxy(nid), res) for nid, res in replies], [])
            out, metrics = super().aggregate_fit(server_round, results, failures)
            model_err = max(float(np.abs(a - b).max()) for a, b in
                            zip(parameters_to_ndarrays(out), parameters_to_ndarrays(ref_out)))
            seen.append((err, bound, model_err, lipschitz(ref, bound) * bound))
            assert metrics["replies-used"] == 3 and metrics[secagg.CLIPPED] == 0
            return out, metrics

    monkeypatch.setattr(secagg, "count_clipped", record)
    grid = LoopbackGrid(client_app, 3, RUN_CONFIG)
    run_secagg(grid, Checked(strategy, initial, num_rounds=2), 2, secaggplus_workflow(3, 2))
    assert len(seen) == 2 and strategy.num_updates == 2
    for err, bound, model_err, model_bound in seen:
        assert 0 < err <= bound, (err, bound)
        assert model_err <= model_bound, (model_err, model_bound)


def test_a_halted_round_counts_as_failed_and_the_run_fails():
    """Every client's SecAgg+ setup reply lost: the workflow halts each round without calling aggregate_fit; the
    round counts as one whose every reply failed, and the run-failure policy ends the run."""
    def lose(request, reply, pid):
        return Message(Error(code=0, reason="lost"), reply_to=request)

    strategy = METHODS["fedavg"].build(client_lr=0.02, local_steps=3, batch_size=8, seed=5)
    grid = LoopbackGrid(client_app, 3, RUN_CONFIG, intercept=lose)
    with pytest.raises(RunFailed, match="every"):
        run_secagg(grid, SecAggStrategy(strategy, {"w.weight": np.zeros((1, 4))}, num_rounds=2), 2,
                   secaggplus_workflow(3, 2))
    assert strategy.history[0].replies_used == 0 and "SecAgg+ protocol halted" in strategy.history[0].rejections[0]


#: Eligible with their default settings (every uplink record a "mean" under weighting = examples by default).
ELIGIBLE = {"fedadagrad", "fedadam", "fedavg", "fedavgm", "fedda", "fedda-adagrad", "fedda-adam", "fedda-sgdm",
            "fedlocal", "fedlocal-sync", "fedprox", "fedyogi", "mimelite"}
#: Refused by default, eligible with weighting = examples (their paper's uniform mean).
UNIFORM = {"adpfed", "fedcm", "localupdate", "localupdatedecay"}
#: Refused whatever the weighting: a second-moment record (v, v̂) below SecAgg+'s fixed-point resolution.
MOMENTS = {"fedams": "'v'", "fedlada": "'v-hat'", "fedlamb": "'v'", "localadam": "'v-hat'"}


def _build(**changes):
    return build({"secure-aggregation": "secaggplus", **{k.replace("_", "-"): v for k, v in changes.items()}})


def test_every_method_is_eligible_or_refused_naming_the_reason():
    refused = {}
    for name in sorted(METHODS):
        try:
            _build(method=name)
        except ConfigError as err:
            refused[name] = str(err)
    assert set(METHODS) - set(refused) == ELIGIBLE and set(refused) == UNIFORM | set(MOMENTS) | {"scaffold"}
    for name, record in MOMENTS.items():
        for weighting in ("uniform", "examples"):
            with pytest.raises(ConfigError, match=f"second-moment record.*{record}.*secure-aggregation = off"):
                _build(method=name, weighting=weighting)
    for name in UNIFORM:
        assert "weighting = uniform" in refused[name] and "set weighting = examples" in refused[name]
        _build(method=name, weighting="examples")  # then eligible
    assert "'control-delta' (sum)" in refused["scaffold"]
    with pytest.raises(ConfigError, match=r"'control-delta' \(sum\).*secure-aggregation = off"):
        _build(method="scaffold", weighting="examples")


@pytest.mark.parametrize("rule", ["max", "sum", "umean"])
def test_a_record_aggregated_by_another_rule_is_refused(rule):
    class MaxRecord(fs.FedAvg):
        def uplink_specs(self):
            return (RecordSpec(R.MODEL, "mean", "model"), RecordSpec("stat", rule, "params"))

    with pytest.raises(ConfigError, match=f"'stat' \\({rule}\\) by another rule than the example-weighted mean"):
        SecAggStrategy(MaxRecord(), {"w": np.zeros(2)})


@pytest.mark.parametrize("changes, match", [
    ({"aggregator": "median"}, "aggregator need"),
    ({"aggregator": "krum"}, "aggregator need"),
    ({"update_clip_ratio": 1.0}, "update-clip-ratio need"),
    ({"max_update_norm": 5.0}, "max-update-norm need"),
    ({"update_cosine_floor": 0.0}, "update-cosine-floor need"),
    ({"dp_clip": 1.0}, "dp-clip > 0 .*native DP"),
    ({"checkpoint_every": 1}, "checkpoint-every and resume"),
    ({"min_train_nodes": 1}, "at least 2 clients"),
    ({"secagg_num_shares": 2.0}, "num_shares"),
    ({"secagg_num_shares": 3.0, "secagg_reconstruction_threshold": 3.0}, "less than `num_shares`"),
])
def test_settings_that_need_individual_replies_are_refused(changes, match):
    with pytest.raises(ConfigError, match=f"secure-aggregation = secaggplus: .*{match}"):
        _build(method="fedavg", **changes)


def test_void_screens_are_switched_off_and_plain_runs_keep_them():
    _, _, strategy = _build(method="fedavg", update_norm_ratio=3.0, max_weight_ratio=2.0)
    assert strategy.update_norm_ratio == 0.0 and strategy.max_weight_ratio == 0.0
    _, _, plain = build({"method": "fedavg", "update-norm-ratio": 3.0, "max-weight-ratio": 2.0})
    assert plain.update_norm_ratio == 3.0 and plain.max_weight_ratio == 2.0


def test_clipped_values_are_counted_with_the_weight_flower_applies():
    # weight w = round(0.6·Q)/Q ≈ 0.6; clipped where |value·w| > 8: 13.4·w ≈ 8.04 and 20·w = 12 (clipped), 13.3·w ≈ 7.98
    fitres = RecordDict({"fitres.parameters": ArrayRecord([np.array([13.4, -13.4, 13.3, 0.0]),
                                                           np.array([[-20.0]])]),
                         "fitres.num_examples": MetricRecord({"num_examples": 600}),
                         "fitres.metrics": ConfigRecord({})})
    state = {"target_range": Q, "max_weight": MAX_WEIGHT, "clipping_range": C}
    assert secagg.count_clipped(fitres, state) == 3
    assert fitres.config_records["fitres.metrics"][secagg.CLIPPED] == 3


def test_ordinary_messages_pass_the_mod_unchanged():
    msg = Message(RecordDict({"config": ConfigRecord({"a": 1})}), dst_node_id=1, message_type=MessageType.TRAIN)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    assert secagg.secagg_mod(msg, ctx, lambda m, c: m) is msg and not secagg.is_secagg(msg)


def test_error_bound_closed_form():
    # 3 clients of 200, 300, 500 examples: quantized weights sum to 1 within 1.5 levels
    w = sum(round(n / MAX_WEIGHT * Q) / Q for n in (200, 300, 500))
    assert error_bound([200, 300, 500], C, Q, MAX_WEIGHT) == pytest.approx(3 * 3 * C / (Q * w), rel=1e-15)
    assert abs(w - 1.0) <= 1.5 / Q
