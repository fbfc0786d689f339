"""The public surface: everything a user needs is importable from ``flower_strategies`` and listed in ``__all__``."""

from __future__ import annotations

import flower_strategies as fs


def test_all_names_exist_and_are_unique():
    assert len(fs.__all__) == len(set(fs.__all__))
    missing = [n for n in fs.__all__ if not hasattr(fs, n)]
    assert not missing, missing


def test_every_registered_method_is_exported_with_its_hparams_and_optimizer():
    exported = [getattr(fs, n) for n in fs.__all__ if isinstance(getattr(fs, n), type)]
    for name, spec in fs.METHODS.items():
        assert spec.strategy in exported, f"{name}: strategy {spec.strategy.__name__} not exported"
        assert spec.hparams in exported, f"{name}: hparams {spec.hparams.__name__} not exported"
        assert spec.local_optimizer in exported, f"{name}: optimizer {spec.local_optimizer.__name__} not exported"
        assert spec.local_optimizer.hparams_class in exported, f"{name}: client hparams not exported"


def test_user_facing_entry_points():
    for name in ("ClientRound", "train_reply", "strategy_from_run_config", "LegacyStrategy", "FedAdaptNumPyClient",
                 "build_strategy", "ClientHalfMissing"):
        assert name in fs.__all__
