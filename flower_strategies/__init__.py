"""fedadapt: adaptive federated optimization methods as Flower strategies + their client-side local optimizers.

Everything a user imports is exported here, each name loaded on first use (PEP 562): a device that imports the
client half (``ClientRound``, ``train_reply``, a method's local optimizer or hyper-parameters) loads no server-side
module (the strategy, the registry, the methods, the compat adapters).  :data:`METHODS` maps each registry name to
its strategy class, local optimizer and hyper-parameters.  See docs/methods/index.md for the list of methods and
docs/architecture.md for the layout (``core`` / ``optimizers`` / ``methods`` / ``compat`` / ``analysis``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

#: Where each exported name lives (``core`` / ``methods`` / ``compat``); imported when first read.
_WHERE: dict[str, str] = {
    **dict.fromkeys(("ClientRound", "TensorPartition", "full_gradient_from", "train_reply",), ".core.client"),
    **dict.fromkeys(("ConfigError", "HParams",), ".core.params"),
    **dict.fromkeys(("StrategyConfig",), ".core.hparams"),
    **dict.fromkeys(("LocalOptimizer", "SGDHParams", "SGDOptimizer",), ".core.local"),
    **dict.fromkeys((
        "METHODS", "MethodSpec", "build_strategy", "get_method", "parse_run_config", "register",
        "run_config_defaults", "strategy_from_run_config",
    ), ".core.registry"),
    **dict.fromkeys(("root_update_from",), ".core.rootset"),
    **dict.fromkeys(("RoundBook",), ".core.rounds"),
    **dict.fromkeys(("NodeSampler",), ".core.sampler"),
    **dict.fromkeys(("ReplyScreen", "ScreenPolicy", "Screened",), ".core.screen"),
    **dict.fromkeys(("ServerOptimizer",), ".core.server_opt"),
    **dict.fromkeys(("ClientHalfMissing", "FedAdaptStrategy", "RoundInputs", "RoundLog",), ".core.strategy"),
    **dict.fromkeys(("RecordSpec",), ".core.validation"),
    **dict.fromkeys((
        "FedAdagrad", "FedAdam", "FedAvg", "FedAvgM", "FedOpt", "FedProx", "FedYogi",
    ), ".methods.baselines"),
    **dict.fromkeys(("FedOptHParams",), ".optimizers.baselines"),
    **dict.fromkeys(("FedLocal", "FedLocalSync",), ".methods.fedlocal"),
    **dict.fromkeys(("FedLocalClientHParams", "FedLocalHParams", "FedLocalOptimizer",), ".optimizers.fedlocal"),
    **dict.fromkeys(("FedDA", "FedDAAdagrad", "FedDAAdam", "FedDASGDM",), ".methods.fedda"),
    **dict.fromkeys(("FedDAClientHParams", "FedDAHParams", "FedDAOptimizer",), ".optimizers.fedda"),
    **dict.fromkeys(("FedLADA",), ".methods.fedlada"),
    **dict.fromkeys(("FedLADAHParams", "FedLADAOptimizer",), ".optimizers.fedlada"),
    **dict.fromkeys(("FedCM",), ".methods.fedcm"),
    **dict.fromkeys(("FedCMHParams", "FedCMOptimizer",), ".optimizers.fedcm"),
    **dict.fromkeys(("Scaffold",), ".methods.scaffold"),
    **dict.fromkeys(("ScaffoldHParams", "ScaffoldOptimizer",), ".optimizers.scaffold"),
    **dict.fromkeys(("LocalUpdate", "LocalUpdateDecay",), ".methods.localupdate"),
    **dict.fromkeys((
        "LocalUpdateDecayHParams", "LocalUpdateHParams", "LocalUpdateOptimizer", "PlateauController",
        "ThetaHParams",
    ), ".optimizers.localupdate"),
    **dict.fromkeys(("AdpFed", "FedAMS", "FedLAMB",), ".methods.fedlamb"),
    **dict.fromkeys(("FedLAMBHParams", "FedLAMBOptimizer",), ".optimizers.fedlamb"),
    **dict.fromkeys(("MimeLite",), ".methods.mimelite"),
    **dict.fromkeys(("MimeLiteHParams", "MimeLiteOptimizer",), ".optimizers.mimelite"),
    **dict.fromkeys(("FedAdaptNumPyClient", "LegacyStrategy",), ".compat.legacy"),
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'flower_strategies' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value  # once: later reads are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, eagerly
    from .core.client import ClientRound, TensorPartition, full_gradient_from, train_reply
    from .core.hparams import StrategyConfig
    from .core.params import ConfigError, HParams
    from .core.local import LocalOptimizer, SGDHParams, SGDOptimizer
    from .core.registry import (
        METHODS, MethodSpec, build_strategy, get_method, parse_run_config, register, run_config_defaults,
        strategy_from_run_config,
    )
    from .core.rounds import RoundBook
    from .core.sampler import NodeSampler
    from .core.screen import ReplyScreen, ScreenPolicy, Screened
    from .core.server_opt import ServerOptimizer
    from .core.strategy import ClientHalfMissing, FedAdaptStrategy, RoundInputs, RoundLog
    from .core.validation import RecordSpec
    from .methods.baselines import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedOpt, FedOptHParams, FedProx, FedYogi
    from .methods.fedlocal import (  # paper 000
        FedLocal, FedLocalClientHParams, FedLocalHParams, FedLocalOptimizer, FedLocalSync,
    )
    from .methods.fedda import (  # paper 001
        FedDA, FedDAAdagrad, FedDAAdam, FedDAClientHParams, FedDAHParams, FedDAOptimizer, FedDASGDM,
    )
    from .methods.fedlada import FedLADA, FedLADAHParams, FedLADAOptimizer  # paper 002 (fedlada, localadam)
    from .methods.fedcm import FedCM, FedCMHParams, FedCMOptimizer  # baseline of paper 002
    from .methods.scaffold import Scaffold, ScaffoldHParams, ScaffoldOptimizer  # baseline of papers 001/002
    from .methods.localupdate import (  # paper 003
        LocalUpdate, LocalUpdateDecay, LocalUpdateDecayHParams, LocalUpdateHParams, LocalUpdateOptimizer,
        PlateauController, ThetaHParams,
    )
    from .methods.fedlamb import AdpFed, FedAMS, FedLAMB, FedLAMBHParams, FedLAMBOptimizer  # paper 004
    from .methods.mimelite import MimeLite, MimeLiteHParams, MimeLiteOptimizer  # baseline of paper 001
    from .compat.legacy import FedAdaptNumPyClient, LegacyStrategy

__all__ = [
    "__version__",
    # core
    "METHODS", "ClientHalfMissing", "ClientRound", "ConfigError", "FedAdaptStrategy", "HParams", "LocalOptimizer",
    "MethodSpec", "NodeSampler", "RecordSpec", "ReplyScreen", "RoundBook", "RoundInputs", "RoundLog", "SGDHParams",
    "SGDOptimizer", "ScreenPolicy", "Screened", "ServerOptimizer", "StrategyConfig", "TensorPartition",
    "build_strategy", "full_gradient_from", "get_method", "parse_run_config",
    "register", "root_update_from", "run_config_defaults", "strategy_from_run_config", "train_reply",
    # methods
    "AdpFed", "FedAMS", "FedAdagrad", "FedAdam", "FedAvg", "FedAvgM", "FedCM", "FedCMHParams", "FedCMOptimizer",
    "FedDA", "FedDAAdagrad", "FedDAAdam", "FedDAClientHParams", "FedDAHParams", "FedDAOptimizer", "FedDASGDM",
    "FedLADA", "FedLADAHParams", "FedLADAOptimizer", "FedLAMB", "FedLAMBHParams", "FedLAMBOptimizer", "FedLocal",
    "FedLocalClientHParams", "FedLocalHParams", "FedLocalOptimizer", "FedLocalSync", "FedOpt", "FedOptHParams",
    "FedProx", "FedYogi", "LocalUpdate", "LocalUpdateDecay", "LocalUpdateDecayHParams", "LocalUpdateHParams",
    "LocalUpdateOptimizer", "MimeLite", "MimeLiteHParams", "MimeLiteOptimizer", "PlateauController", "Scaffold",
    "ScaffoldHParams", "ScaffoldOptimizer", "ThetaHParams",
    # compat
    "FedAdaptNumPyClient", "LegacyStrategy",
]
