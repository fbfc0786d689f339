"""Privacy: Flower's DP layer composes or is refused (every method × component), and fedadapt's native DP
(equivalence, clipping and noise calibration, accounting, learning)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord, RecordDict
from flwr.clientapp.mod import LocalDpMod, adaptiveclipping_mod, fixedclipping_mod
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)
from scipy.stats import norm

from client_app.app import app as client_app
from flower_strategies.core import dpmods, privacy
from flower_strategies.core import records as R
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.loop import own_loop_config
from flower_strategies.core.policy import RunFailed
from flower_strategies.core.registry import METHODS
from flower_strategies.core.validation import RecordSpec
from simulations.engine.inprocess import LoopbackGrid
from tests.helpers import SYNTH_RC, NodesGrid, every_method, record, reply, synthetic_initial_arrays

NODES = 4
BIG = 1e6  # a clip far above every update norm of these runs (they stay below 40)


def build(name, **kw):
    kw = {"client_lr": 0.05, "local_steps": 2, "min_train_nodes": 2, "min_available_nodes": NODES, "seed": 0,
          "max_idle_rounds": 1, **kw}
    return METHODS[name].build(**kw)


def final_arrays(strategy, *, mod=None, rounds=2):
    """The global arrays after ``rounds`` rounds of ``strategy`` (or a Flower wrapper) against the real ClientApp on
    the float64 synthetic federation; ``mod``: a Flower client mod around the ClientApp."""
    app = client_app if mod is None else (lambda msg, ctx: mod(msg, ctx, client_app))
    grid = LoopbackGrid(app, NODES, SYNTH_RC)
    out = {}

    def capture(server_round, arrays):
        out.update(R.to_numpy(arrays))
        return MetricRecord({})

    strategy.start(grid=grid, initial_arrays=synthetic_initial_arrays(), num_rounds=rounds, evaluate_fn=capture)
    return {k: np.array(v) for k, v in out.items()}


#: Flower 1.42's privacy components: (name, wrap the strategy or None, client mod or None), noise 0 / clip BIG
#: (LocalDpMod: ε = 1e12, i.e. noise std ~1e-12).
COMPONENTS = [
    ("server-fixed", lambda s: DifferentialPrivacyServerSideFixedClipping(s, 0.0, BIG, NODES), None),
    ("server-adaptive", lambda s: DifferentialPrivacyServerSideAdaptiveClipping(s, 0.0, NODES,
                                                                                initial_clipping_norm=BIG), None),
    ("client-fixed", lambda s: DifferentialPrivacyClientSideFixedClipping(s, 0.0, BIG, NODES), fixedclipping_mod),
    ("client-adaptive", lambda s: DifferentialPrivacyClientSideAdaptiveClipping(s, 0.0, NODES,
                                                                                initial_clipping_norm=BIG),
     adaptiveclipping_mod),
    ("local-dp", None, LocalDpMod(BIG, 1.0, 1e12, 1e-5)),
]


def expected_cell(name, component):
    """What the cell must do: ``"equal"`` or ``"refused"`` (the rule of core/privacy.py, written out)."""
    strategy = build(name)
    strategy.server_state = strategy.init_server_state(R.to_numpy(synthetic_initial_arrays()))
    model_only = [s.name for s in strategy.uplink_specs()] == [R.MODEL] and not strategy.downlink(1)
    if component == "local-dp":  # local DP of a model-only reply: the server's math is post-processing
        return "equal" if model_only else "refused"
    return "equal" if model_only and strategy.averages_models else "refused"


@pytest.mark.parametrize("name", every_method())
def test_flower_privacy_layer_composes_or_is_refused(name):
    """Every method × every Flower DP component: noise 0 and a clip above every norm give the unwrapped run (float64
    tolerance), or the run is refused before any client trains / by the client, naming native DP."""
    baseline = None
    for component, wrap, mod in COMPONENTS:
        strategy = build(name, fraction_train=1.0)
        run = wrap(strategy) if wrap is not None else strategy
        if expected_cell(name, component) == "refused":
            with pytest.raises((ConfigError, RunFailed), match="native user-level DP") as info:
                final_arrays(run, mod=mod)
            if wrap is not None:  # refused at round 1's prepare_round: no round ever ran
                assert isinstance(info.value, ConfigError) and strategy.history == []
            # how it was seen (core/privacy.py, from the round's config only): a server-side wrapper's start()
            # handed down a config without fedadapt's own-loop mark; a client-side one put 'clipping_norm' into it;
            # the mod refused the multi-record message itself, or rewrote a one-record reply (its CRC no longer
            # matched)
            seen = {"server": "config lacks 'fedadapt-own-loop'", "client": "config carries 'clipping_norm'",
                    "local": "Flower's DP mods handle model-only messages|a ClientApp mod rewrote the reply's record"}
            assert info.match(seen[component.split("-")[0]]), (component, str(info.value))
            continue
        baseline = baseline or final_arrays(build(name, fraction_train=1.0))
        got = final_arrays(run, mod=mod)
        assert strategy.num_updates == 2, component
        for key in baseline:
            np.testing.assert_allclose(got[key], baseline[key], rtol=0, atol=1e-10, err_msg=f"{component}:{key}")


def test_flower_dp_is_recognised_from_the_rounds_config_only():
    """No call-stack inspection and no state: the client-side wrappers' config key is Flower's own constant, a round
    whose config lacks fedadapt's own-loop mark runs in another loop (a server-side wrapper's); what ran before
    (summary(), an earlier round, an earlier run) does not count."""
    import inspect

    try:  # where Flower keeps it: flwr 1.42 / older 1.2x
        from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM
    except ImportError:
        from flwr.common.differential_privacy_constants import KEY_CLIPPING_NORM  # type: ignore[no-redef]

    assert privacy.CLIPPING_NORM_KEY == KEY_CLIPPING_NORM
    assert "_getframe" not in inspect.getsource(privacy) and "f_back" not in inspect.getsource(privacy)
    assert privacy.flower_dp_wrapper(own_loop_config()) is None
    assert "lacks 'fedadapt-own-loop'" in privacy.flower_dp_wrapper(ConfigRecord())
    assert "clipping_norm" in privacy.flower_dp_wrapper(own_loop_config({"clipping_norm": 1.0}))
    strategy = build("fedadam", fraction_train=1.0)
    with pytest.raises(ConfigError, match="DifferentialPrivacyServerSide.*native user-level DP"):
        privacy.refuse_flower_dp(strategy, ConfigRecord())
    privacy.refuse_flower_dp(build("fedavg"), {"clipping_norm": 1.0})  # composes: nothing to refuse

    # the reported bug: summary() (a user's log line) and then the strategy's own start() — no wrapper, no refusal
    strategy.summary()
    final_arrays(strategy, rounds=1)
    assert strategy.num_updates == 1
    # after a refused wrapper run, the same strategy object runs again under its own start()
    wrapped = build("fedadam", fraction_train=1.0)
    with pytest.raises(ConfigError, match="lacks 'fedadapt-own-loop'"):
        final_arrays(DifferentialPrivacyServerSideFixedClipping(wrapped, 0.0, BIG, NODES), rounds=1)
    assert wrapped.history == []
    final_arrays(wrapped, rounds=1)
    assert wrapped.num_updates == 1
    # the mark is the loop's, not the clients': the train messages carry the same config either way
    msgs = list(build("fedadam").configure_train(1, synthetic_initial_arrays(), own_loop_config({"x": 1}),
                                                 NodesGrid(range(1, NODES + 1))))
    assert R.OWN_LOOP not in msgs[0].content[R.CONFIG] and msgs[0].content[R.CONFIG]["x"] == 1


class Logging(Strategy):
    """A user's own wrapper that is not a DP wrapper: it logs each round and hands everything on unchanged."""

    def __init__(self, inner):
        self.inner, self.rounds = inner, []

    def summary(self):
        self.inner.summary()

    def configure_train(self, server_round, arrays, config, grid):
        self.rounds.append(server_round)
        return self.inner.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        return self.inner.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round, arrays, config, grid):
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):
        return self.inner.aggregate_evaluate(server_round, replies)


def test_a_users_own_wrapper_runs_with_the_own_loop_mark():
    """A wrapper of the user's own that is not a DP wrapper, started by Flower's Strategy.start with the marked train
    config: it runs fedadam and gives the unwrapped run's model exactly; without the mark it is refused as a DP
    wrapper would be (Flower's API shows the wrapped strategy nothing that tells them apart)."""
    inner = build("fedadam", fraction_train=1.0)
    wrapper = Logging(inner)
    grid = LoopbackGrid(client_app, NODES, SYNTH_RC)
    res = wrapper.start(grid=grid, initial_arrays=synthetic_initial_arrays(), num_rounds=2,
                        train_config=own_loop_config())
    assert wrapper.rounds == [1, 2] and inner.num_updates == 2
    baseline = final_arrays(build("fedadam", fraction_train=1.0))
    got = R.to_numpy(res.arrays)
    for key in baseline:
        assert np.array_equal(got[key], baseline[key]), key
    unmarked = Logging(build("fedadam", fraction_train=1.0))
    with pytest.raises(ConfigError, match="wrapper of your own that is not a DP wrapper: start it with "
                                          "train_config=own_loop_config"):
        unmarked.start(grid=LoopbackGrid(client_app, NODES, SYNTH_RC), initial_arrays=synthetic_initial_arrays(),
                       num_rounds=1)


def test_client_half_guards_its_reply_against_dp_mods():
    """The client refuses a non-model reply when a clipping mod is around (the config key), and marks a one-record
    non-model reply with its CRC so that the server rejects it when a mod rewrote it."""
    model = R.to_record({"w": np.arange(3.0)})
    q = R.to_record({"w": np.ones(3)})
    assert dpmods.guard_reply("fedavg", {R.MODEL: model}, {"clipping_norm": 1.0}) == []
    with pytest.raises(ConfigError, match="fixedclipping_mod.*'clipping_norm'.*\\['q'\\].*native user-level DP"):
        dpmods.guard_reply("localupdate", {"q": q}, {"clipping_norm": 1.0})
    assert dpmods.guard_reply("scaffold", {R.MODEL: model, "c": q}, {}) == []  # Flower's mods refuse it themselves
    info = dict(dpmods.guard_reply("localupdate", {"q": q}, {}))
    content = RecordDict({"q": q})
    assert privacy.rewritten_reply_reason(content, info) is None
    assert privacy.rewritten_reply_reason(content, {}) is None  # no CRC sent (legacy replies, other clients)
    rewritten = RecordDict({"q": R.to_record({"w": np.ones(3) + 1e-12})})
    assert "rewrote the reply's record 'q'" in str(privacy.rewritten_reply_reason(rewritten, info))
    assert "native user-level DP" in str(privacy.rewritten_reply_reason(RecordDict({"q": q, "v": q}), info))


def test_the_composing_cells_are_the_documented_ones():
    cells = {(n, c) for n in METHODS for c, _, _ in COMPONENTS if expected_cell(n, c) == "equal"}
    assert {n for n, c in cells if c == "server-fixed"} == {"fedavg", "fedprox"}
    assert {n for n, c in cells if c == "local-dp"} == {"adpfed", "fedadagrad", "fedadam", "fedavg", "fedavgm",
                                                        "fedlocal", "fedprox", "fedyogi"}


def test_flower_server_side_clipping_equals_native_clipping_for_fedavg():
    """Where Flower's wrapper is right (FedAvg, uniform weights) its clipping is the native clipping: C = 0.05 clips
    replies, noise 0, same final model."""
    flower = build("fedavg", fraction_train=1.0, weighting="uniform")
    got = final_arrays(DifferentialPrivacyServerSideFixedClipping(flower, 0.0, 0.05, NODES))
    native = build("fedavg", fraction_train=1.0, dp_clip=0.05)
    ours = final_arrays(native)
    assert all(h.round_metrics["dp-clipped"] >= 1 for h in native.history)
    for key in got:
        np.testing.assert_allclose(ours[key], got[key], rtol=0, atol=1e-12)


# ------------------------------------------------------------------ native DP
def mocked_round(strategy, server_round, arrays, seed):
    """One round of ``strategy`` on mocked replies of every sampled node (uplink layout of the method, positive
    values for statistic records, above the value sent where the record is a running max); returns the new
    arrays."""
    grid = NodesGrid(range(1, NODES + 1))
    msgs = list(strategy.configure_train(server_round, arrays, own_loop_config(), grid))
    current = R.to_numpy(arrays)
    rng = np.random.default_rng(seed)
    replies = []
    for msg in msgs:
        node = msg.metadata.dst_node_id
        records = {}
        for spec in strategy.uplink_specs():
            keys = current if spec.keys == "model" else strategy.trainable(current)
            sent = strategy.sent.get(spec.at_least, {}) if spec.at_least else {}
            records[spec.name] = {
                k: current[k] + 0.1 * rng.standard_normal(current[k].shape) if spec.keys == "model"
                else sent.get(k, 0.0) + 0.01 + 0.1 * np.abs(rng.standard_normal(current[k].shape)) for k in keys}
        replies.append(reply(node, records, num_examples=10 + node, method=strategy.method, **{
            R.NUM_STEPS: 2.0, R.TRAIN_LOSS: 1.0, R.TRAIN_LOSS_BEFORE: 1.5}))
    new, _ = strategy.aggregate_train(server_round, replies)
    return new


def model_arrays():
    rng = np.random.default_rng(0)
    return record({"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)})


@pytest.mark.parametrize("name", every_method())
def test_native_dp_without_noise_and_clip_is_the_plain_run(name):
    """Noise 0 + a clip above every norm = the non-private run with uniform weights (float64), two rounds."""
    plain, private = build(name, weighting="uniform", num_rounds=2), build(name, dp_clip=1e12, num_rounds=2)
    a = b = model_arrays()
    for rnd in (1, 2):
        a, b = mocked_round(plain, rnd, a, rnd), mocked_round(private, rnd, b, rnd)
        assert a is not None and b is not None
        for key, value in R.to_numpy(a).items():
            np.testing.assert_allclose(R.to_numpy(b)[key], value, rtol=1e-13, atol=1e-15)
    assert private.history[-1].round_metrics["dp-clipped"] == 0
    assert "dp-epsilon" not in private.history[-1].round_metrics  # no noise: no ε to report


def test_joint_clip_and_noise_against_numpy_reference():
    """Two records (the model, measured as an update, and a statistic, measured as is) are clipped at one joint
    norm; the mean over the n sampled (not the n that replied) gets noise of std z·C/n."""
    rng = np.random.default_rng(1)
    current = {"w": rng.standard_normal(6)}
    specs = (RecordSpec(R.MODEL, "mean", "model"), RecordSpec("v", "sum", "params"))
    kept = [{R.MODEL: {"w": current["w"] + rng.standard_normal(6)}, "v": {"w": rng.standard_normal(6)}}
            for _ in range(3)]
    clip = 1.5
    scales, norms = privacy.joint_clip_scales(kept, specs, current, clip)
    joint = [math.sqrt(np.sum((k[R.MODEL]["w"] - current["w"]) ** 2) + np.sum(k["v"]["w"] ** 2)) for k in kept]
    np.testing.assert_allclose(norms, joint, rtol=1e-14)
    np.testing.assert_allclose(scales, [min(1.0, clip / n) for n in joint], rtol=1e-14)  # BLAS may round the norm
    assert min(scales) < 1
    agg = privacy.private_aggregates(kept, specs, current, scales, 4, 0.0, rng)
    upd = sum(s * (k[R.MODEL]["w"] - current["w"]) for s, k in zip(scales, kept, strict=True))
    np.testing.assert_allclose(agg[R.MODEL]["w"], current["w"] + upd / 4, rtol=1e-14)
    expected = sum(s * k["v"]["w"] for s, k in zip(scales, kept, strict=True))
    np.testing.assert_allclose(agg["v"]["w"], expected, rtol=1e-14)
    # noise: 200,000 coordinates, std z·C/n on the mean (±1 % at 5σ of the sample std's error)
    big = {"w": np.zeros(200_000)}
    one = [{R.MODEL: {"w": np.zeros(200_000)}}]
    noisy = privacy.private_aggregates(one, specs[:1], big, [1.0], 4, 0.8 * clip, np.random.default_rng(2))
    assert abs(float(np.std(noisy[R.MODEL]["w"])) / (0.8 * clip / 4) - 1) < 0.01


def test_native_dp_settings_refuse_weighted_or_robust_aggregation():
    with pytest.raises(ConfigError, match="weighting = uniform"):
        build("fedavg", dp_clip=1.0, weighting="examples")
    with pytest.raises(ConfigError, match="aggregator = mean"):
        build("fedavg", dp_clip=1.0, aggregator="median")
    s = build("fedavg", dp_clip=1.0)
    assert s.weighting == "uniform" and s.settings.update_norm_ratio == 0.0  # the clip bounds every reply
    with pytest.raises(ConfigError, match="max-merges"):
        privacy.check_specs("m", (RecordSpec("v", "max", "params"),))


def test_native_dp_decides_only_the_keys_left_to_it_and_an_explicit_conflict_names_both_keys():
    """No silent override: weighting left "default" and update-norm-ratio left unset take DP_PROFILE's values (the
    attributes are the values the run uses; the settings object names the keys a profile decided); an explicit
    conflicting value is a ConfigError naming both keys."""
    from flower_strategies.core.hparams import DP_PROFILE, StrategyConfig

    dp = StrategyConfig(dp_clip=1.0)
    assert {k: getattr(dp, k) for k in DP_PROFILE} == {"weighting": "uniform", "update_norm_ratio": 0.0}
    assert set(DP_PROFILE) <= dp.decided_by_profile
    plain = dp.replace(dp_clip=0.0)  # DP off again: the non-DP defaults, nothing left behind
    assert (plain.weighting, plain.update_norm_ratio) == ("default", 100.0)
    given = StrategyConfig(dp_clip=1.0, weighting="uniform", update_norm_ratio=0.0)
    assert given.update_norm_ratio == 0 and not set(DP_PROFILE) & given.decided_by_profile
    assert given.replace(dp_clip=0.0).weighting == "uniform"  # given, so it stays
    for key, value in (("weighting", "examples"), ("update_norm_ratio", 50.0), ("update_norm_ratio", 100.0)):
        with pytest.raises(ConfigError, match=f"dp-clip = 1.0 conflicts with {key.replace('_', '-')} = {value}"):
            StrategyConfig(dp_clip=1.0, **{key: value})
    with pytest.raises(ConfigError, match="dp-clip = 1.0 conflicts with update-norm-ratio = 3.0"):
        build("fedavg", dp_clip=1.0, update_norm_ratio=3.0)


def exact_gaussian_epsilon(mu, delta):
    """ε of a Gaussian mechanism with μ = sensitivity/std (exact: δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ)),
    by bisection."""
    lo, hi = 0.0, 100.0
    for _ in range(200):
        eps = (lo + hi) / 2
        d = norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu)
        lo, hi = (eps, hi) if d > delta else (lo, eps)
    return hi


def test_epsilon_against_exact_gaussian_and_flower_accountant():
    """Full participation (n = N): T rounds are one Gaussian mechanism with μ = 2√T/z (replace one client:
    sensitivity 2C, std z·C); the reported RDP ε is a valid upper bound within 25 % of the exact ε (the PLD
    accountant of dp-accounting agrees with the closed form to 1 %).  Sampled rounds (n < N): the same ε as Flower's
    own RdpAccountant (sampling without replacement, replace-one) given noise multiplier z/2."""
    from dp_accounting import dp_event, pld

    pytest.importorskip("flwr.supercore.privacy_accounting", reason="this Flower release has no RdpAccountant to "
                        "compare with (the compatibility leg's oldest Flower)")
    from flwr.supercore.privacy_accounting import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    z, rounds, delta = 4.0, 20, 1e-5
    exact = exact_gaussian_epsilon(2 * math.sqrt(rounds) / z, delta)
    acc = pld.PLDAccountant(value_discretization_interval=1e-2)
    acc.compose(dp_event.GaussianDpEvent(z / 2), rounds)
    assert abs(acc.get_epsilon(delta) / exact - 1) < 0.01
    ours = privacy.epsilon([(10, 10)] * rounds, z, delta)
    assert exact <= ours <= 1.25 * exact
    flower = RdpAccountant(PrivacyConfig(delta, 100, NeighboringRelation.REPLACE_ONE,
                                         SamplingMethod.WITHOUT_REPLACEMENT), orders=privacy.RDP_ORDERS)
    flower.compose(GaussianPrivacyEvent(z / 2, 10, 100), rounds)
    sampled = privacy.epsilon([(100, 10)] * rounds, z, delta)
    assert sampled == pytest.approx(flower.get_epsilon(delta), rel=1e-12)
    assert sampled < ours and privacy.epsilon([], z, delta) == 0.0 and privacy.epsilon([(4, 2)], 0.0, delta) == math.inf


def test_strategy_reports_the_accumulated_epsilon_per_round():
    strategy = build("scaffold", fraction_train=0.5, dp_clip=0.5, dp_noise_multiplier=1.0, dp_delta=1e-4)
    final_arrays(strategy, rounds=3)
    eps = [h.round_metrics["dp-epsilon"] for h in strategy.history]
    assert [h.round_metrics["dp-sampled"] for h in strategy.history] == [2, 2, 2]
    assert eps == [pytest.approx(privacy.epsilon([(NODES, 2)] * t, 1.0, 1e-4), rel=1e-12) for t in (1, 2, 3)]
    assert eps[0] < eps[1] < eps[2]
    assert all(h.round_metrics["dp-noise-std"] == pytest.approx(1.0 * 0.5 / 2) for h in strategy.history)


@pytest.mark.slow
def test_native_dp_with_moderate_noise_still_learns_digits(tmp_path):
    """digits-mlp, 20 nodes (iid), 10 sampled per round, 20 rounds, clip 1, z = 0.5: measured 0.91 final accuracy
    (non-private 0.93, chance 0.10; docs/results/privacy); the reported ε is the accountant's for 20 such rounds."""
    import json

    from simulations.engine.inprocess import run_inprocess

    cfg = {"method": "fedavg", "num-server-rounds": 20, "local-steps": 5, "batch-size": 16, "partitioner": "iid",
           "fraction-train": 0.5, "min-available-nodes": 20, "seed": 0, "dp-clip": 1.0, "dp-noise-multiplier": 0.5,
           "output-dir": str(tmp_path), "run-name": "dp"}
    run_inprocess(cfg, 20)
    rows = [json.loads(line) for line in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["test-accuracy"] >= 0.75
    assert rows[-1]["dp-epsilon"] == pytest.approx(privacy.epsilon([(20, 10)] * 20, 0.5, 1e-5), rel=1e-12)
    assert all(r["dp-noise-std"] == pytest.approx(0.5 / 10) for r in rows[1:])
