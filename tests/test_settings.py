"""FedAdaptStrategy's one settings object (StrategyConfig): construction, validation, attributes, registry path;
and the base's downlink cast and declarations."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import flower_strategies as fs
from flower_strategies.core import records as R
from flower_strategies.core.hparams import ConfigError, StrategyConfig
from flower_strategies.core.registry import build_strategy, strategy_from_run_config
from flower_strategies.core.loop import own_loop_config
from tests.helpers import record


def test_readme_construction_applies_overrides_to_one_settings_object():
    s = fs.FedLADA(fs.FedLADA.make_hparams(amend_weight=0.05), client_lr=0.01, fraction_train=0.5, seed=0)
    assert isinstance(s.settings, StrategyConfig)
    assert (s.settings.client_lr, s.settings.fraction_train, s.settings.seed) == (0.01, 0.5, 0)
    assert s.settings.method == "fedlada" and s.hparams.amend_weight == 0.05
    assert s.weighting == fs.FedLADA.default_weighting  # "default" resolved by the class


def test_settings_object_plus_overrides():
    base = StrategyConfig(client_lr=0.3, batch_size=8)
    s = fs.FedAvg(settings=base, batch_size=16, weighting=None)
    assert base.batch_size == 8  # the caller's object is not changed
    assert (s.settings.client_lr, s.settings.batch_size, s.settings.weighting) == (0.3, 16, "default")
    assert fs.FedAvg(settings=base).settings is base


def test_one_validation_path():
    with pytest.raises(ConfigError, match="fraction_train = 0.0 is out of range"):
        fs.FedAvg(fraction_train=0.0)
    with pytest.raises(ConfigError, match="aggregator = 'mode' is not valid"):
        fs.FedAvg(aggregator="mode")
    with pytest.raises(ConfigError, match="local-steps and local-epochs are both 0"):
        fs.FedAvg(local_steps=0, local_epochs=0)
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['client_learning_rate'\]"):
        fs.FedAvg(client_learning_rate=0.1)
    s = fs.FedAvg()
    with pytest.raises(ConfigError, match="max_update_norm = -1.0 is out of range"):
        s.settings.replace(max_update_norm=-1.0)  # a change goes through the same validation
    s.settings = s.settings.replace(max_update_norm=5.0)
    assert s.settings.max_update_norm == 5.0


def test_settings_are_read_from_the_settings_object_only():
    """No settings proxy on strategies: a setting's name on the strategy (read, or assigned as the old proxy
    allowed) is an AttributeError that names ``settings.replace``; a misspelt one is a plain AttributeError."""
    s = fs.FedAvg(client_lr=0.1)
    with pytest.raises(AttributeError, match=r"strategy\.settings\.client_lr"):
        s.client_lr  # noqa: B018 - the read is the test
    with pytest.raises(AttributeError, match=r"settings\.replace\(max_update_norm=\.\.\.\)"):
        s.max_update_norm = 5.0
    assert s.settings.max_update_norm == 0.0 and "max_update_norm" not in vars(s)
    with pytest.raises(AttributeError, match="client_lrr"):
        s.client_lrr  # noqa: B018 - a typo, which mypy reports too (no __getattr__ makes attributes Any)
    for cls in (fs.FedAdaptStrategy, *strategy_classes()):
        assert "__getattr__" not in vars(cls) and "__setattr__" not in vars(cls), cls


def strategy_classes() -> set[type]:
    """Every registered strategy class and its bases up to FedAdaptStrategy."""
    from flower_strategies.core.registry import METHODS

    return {base for spec in METHODS.values() for base in spec.strategy.__mro__
            if issubclass(base, fs.FedAdaptStrategy)}


def test_ints_for_float_settings_are_stored_as_floats():
    s = fs.FedAvg(client_lr=1, wait_for_nodes=3)
    assert type(s.settings.client_lr) is float and type(s.settings.wait_for_nodes) is float
    assert type(s.round_config(1)[R.CLIENT_LR]) is float


def test_strategy_kwargs_bridge_is_gone_and_registry_passes_the_settings():
    assert not hasattr(StrategyConfig, "strategy_kwargs")
    s, fed = build_strategy({"method": "fedadam", "client-lr": 0.02, "num-server-rounds": 7}, trainable_keys=["w"])
    assert s.settings is fed and s.num_rounds == 7 and s.method == "fedadam" and s.trainable_keys == ["w"]
    t = strategy_from_run_config({"learning-rate": 0.5}, method="fedavg", names={"learning-rate": "client-lr"},
                                 min_replies=2)
    assert (t.settings.client_lr, t.settings.fraction_evaluate, t.settings.min_replies) == (0.5, 1.0, 2)
    assert fs.FedAvg().num_rounds is None  # direct construction: unknown until start()


def test_extra_arguments_beside_the_settings():
    s = fs.FedAvg(trainable_keys=("w",), min_evaluate_nodes=3, num_rounds=4, method="alias")
    assert (s.trainable_keys, s.min_evaluate_nodes, s.num_rounds, s.method) == (["w"], 3, 4, "alias")
    assert fs.FedAvg.method == "fedavg"  # the alias is per instance


def test_downlink_is_cast_to_the_model_dtypes_in_the_base():
    class Extra(fs.FedAvg):
        def downlink(self, server_round):
            return {"m": {"w": np.ones(3, np.float64)}, "meta": {"count": np.array([2.0], np.float64)}}

    content = Extra().prepare_round(1, record({"w": np.zeros(3, np.float32)}), own_loop_config(), num_sampled=1)
    assert R.to_numpy(content["m"])["w"].dtype == np.float32  # a model key: the model's dtype
    assert R.to_numpy(content["meta"])["count"].dtype == np.float64  # not a model key: as given


def test_declarations_and_state_format():
    assert fs.FedAdaptStrategy.needs_train_loss_before is False
    s = fs.FedAvg()
    assert set(s.state_dict()) == {"server_state", "rng", "num_updates", "nodes_seen", "history", "reply_digests"}
    assert {f.name for f in dataclasses.fields(StrategyConfig)} >= {"client_lr", "aggregator", "max_weight_ratio"}
