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
from simulations.engine.inprocess import LoopbackGrid

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
            arrays = [parameters_to_ndarrays(res.parameters) for _, res in replies]
            exact = [sum(n * a[j] for n, a in zip(ns, arrays, strict=True)) / sum(ns) for j in range(len(arrays[0]))]
            secure = parameters_to_ndarrays(results[0][1].parameters)
            # (secure may carry more arrays than the replies' parameters: compare the replies' arrays)
            err = max(float(np.abs(s - e).max()) for s, e in zip(secure[:len(exact)], exact, strict=True))
            bound = error_bound(ns, C, Q, MAX_WEIGHT)
            ref = LegacyStrategy(copy.deepcopy(self.inner), self.initial)
            ref_out, _ = ref.aggregate_fit(server_round, [(_Proxy(nid), res) for nid, res in replies], [])
            out, metrics = super().aggregate_fit(server_round, results, failures)
            model_err = max(float(np.abs(a - b).max()) for a, b in
                            zip(parameters_to_ndarrays(out), parameters_to_ndarrays(ref_out), strict=True))
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
    assert strategy.history[0].replies_used == 0 and "SecAgg+ protocol halted" in str(strategy.history[0].rejections[0])


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
    assert (strategy.settings.update_norm_ratio, strategy.settings.max_weight_ratio) == (0.0, 0.0)
    _, _, plain = build({"method": "fedavg", "update-norm-ratio": 3.0, "max-weight-ratio": 2.0})
    assert (plain.settings.update_norm_ratio, plain.settings.max_weight_ratio) == (3.0, 2.0)


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


# ------------------------------------------------------------------------------------------ a hostile or lost client
def _masking(request) -> bool:
    """Whether ``request`` asks for the masked vector (SecAgg+ stage 2; Flower's mod pops the stage key from the
    request, the ciphertexts of the shared keys stay)."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    cfg = request.content.config_records.get(RECORD_KEY_CONFIGS)
    return cfg is not None and Key.CIPHERTEXT_LIST in cfg


def _shift_masked(index: int, by: int = 2**30, pid: int = 0):
    """``intercept``: partition ``pid`` adds ``by`` (mod 2^32) to entry 0 of array ``index`` of its masked vector
    (index 0 is the weight factor Flower prepends, 1… the values)."""
    from flwr.common.secure_aggregation.ndarrays_arithmetic import parameters_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
    from flwr.common.typing import NDArray

    from flwr.common import bytes_to_ndarray, ndarray_to_bytes

    def intercept(request, reply, partition_id):
        if partition_id != pid or reply.has_error() or not _masking(request):
            return reply
        cfg = reply.content.config_records[RECORD_KEY_CONFIGS]
        vec: list[NDArray] = [bytes_to_ndarray(b) for b in cfg[Key.MASKED_PARAMETERS]]
        vec[index].reshape(-1)[0] += by
        cfg[Key.MASKED_PARAMETERS] = [ndarray_to_bytes(a) for a in parameters_mod(vec, 2**32)]
        return reply

    return intercept


SECURE = {**RUN_CONFIG, "secure-aggregation": "secaggplus", "method": "fedavg", "num-server-rounds": 2,
          "local-steps": 3, "batch-size": 8, "client-lr": 0.02, "learning-curve": False}


def _secure_run(tmp_path, name, nodes, intercept=None):
    import json

    from server_app.app import run

    cfg = {**SECURE, "output-dir": str(tmp_path), "run-name": name}
    error = None
    try:
        run(LoopbackGrid(client_app, nodes, cfg, intercept=intercept), cfg)
    except RunFailed as err:
        error = err
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return rows, error


@pytest.mark.parametrize("index,reason", [
    (1, r"holds [\d.e+]+, beyond the ±[\d.e+-]+ that 5 clients' values clipped at ±secagg-clipping-range 8"),
    (0, r"its canary decodes to [\d.e+-]+, expected 1 ± "),
], ids=["value", "weight-factor"])
def test_one_client_shifting_its_masked_vector_fails_the_round_with_the_reason(tmp_path, index, reason):
    """Issue 36: a client shifting its masked vector by 2^30 took the model to 0.097 with nothing rejected and the
    run 'completed'.  Now the decoded aggregate is checked before it is applied: no round updates, each says why,
    and the run fails; the shift of the weight factor (which scales the whole mean toward 0) is caught by the
    canary."""
    clean, error = _secure_run(tmp_path, "clean", 5)
    assert error is None and all(r["updated"] and not r.get("rejections") for r in clean[1:])
    rows, error = _secure_run(tmp_path, "shifted", 5, _shift_masked(index))
    assert error is not None and "no round of the run updated the model" in str(error)
    for r in rows[1:]:
        assert not r["updated"] and r["replies-used"] == 0 and r["replies-rejected"] == 5
        assert r["test-loss"] == rows[0]["test-loss"]  # the model stayed the initial one
        assert "secure aggregate of 5 replies rejected:" in r["rejections"]
        assert "node " not in r["rejections"]  # no single node: the server cannot tell which client tampered
        import re
        assert re.search(reason, r["rejections"]), r["rejections"]


def test_a_client_dropping_out_mid_round_is_counted_sampled_used_dropped(tmp_path):
    """Formerly "4 ok / 2 rejected" with 5 sampled (Flower lists a failure per stage the client missed)."""
    def drop(request, reply, partition_id):
        if partition_id == 4 and _masking(request):
            return Message(Error(code=0, reason="node went away"), reply_to=request)
        return reply

    rows, error = _secure_run(tmp_path, "dropout", 5, drop)
    assert error is None
    for r in rows[1:]:
        assert r["updated"] and (r["replies-used"], r["replies-rejected"], r["replies-missing"]) == (4, 0, 1)
        assert (r["secagg-sampled"], r["secagg-used"], r["secagg-dropped"]) == (5, 4, 1)
        assert not r.get("rejections")


def test_the_aggregate_norm_check_rejects_a_round_far_beyond_the_earlier_ones():
    """The plain path's median-relative bound (update-norm-ratio, 100) on the aggregate's update norm, against the
    applied rounds' aggregates (there are no individual replies to take a median of)."""
    strategy = METHODS["fedavg"].build(client_lr=0.02, local_steps=3, batch_size=8)
    legacy = SecAggStrategy(strategy, {"w": np.zeros(3)})
    strategy.current = {"w": np.zeros(3)}
    legacy.update_norms = [0.01, 0.02, 0.005]
    layout = '[["arrays", "w"]]'

    def res(value, layout=layout):
        arrays = [np.full(3, value), np.ones(1)]  # values, canary (weights 0.5 each: canary = 1)
        return [(_Proxy(i), FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 500,
                                   {"fedadapt.layout": layout})) for i in (1, 2)]

    assert legacy.check_aggregate(res(0.5 / math.sqrt(3))) is None  # norm 0.5 ≤ 100 × 0.01
    assert "exceeds update-norm-ratio 100 × the median 0.01" in legacy.check_aggregate(res(1.01 / math.sqrt(3)))
    assert "beyond the ±16" in legacy.check_aggregate(res(17.0))  # 2 clients × 8 / (0.5 + 0.5)
    for bad in ("not json", '{"a": 1}', '[["arrays"]]', '[["arrays", ["w"]]]', "[[1, 2]]"):  # a client's layout
        assert "is not a JSON list of [record, key] string pairs" in legacy.check_aggregate(res(0.1, bad)), bad
