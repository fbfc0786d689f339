"""fedadapt: adaptive federated optimization methods as Flower strategies + their client-side local optimizers.

Everything a user imports is exported here; :data:`METHODS` maps each registry name to its strategy class,
local optimizer and hyper-parameters.  See docs/methods/index.md for the list of methods and docs/architecture.md for
the layout (``core`` / ``methods`` / ``compat`` / ``analysis``).
"""

from ._version import __version__

# Core: strategy base and its parts (sampler, reply screen, round book), client optimizer base, hyper-parameters,
# registry, client API.
from .core.client import ClientRound, TensorPartition, full_gradient_from, train_reply
from .core.hparams import ConfigError, HParams, StrategyConfig
from .core.local import LocalOptimizer, SGDHParams, SGDOptimizer
from .core.registry import (
    METHODS, MethodSpec, build_strategy, get_method, parse_run_config, register, run_config_defaults,
    strategy_from_run_config,
)
from .core.rootset import root_update_from
from .core.rounds import RoundBook
from .core.sampler import NodeSampler
from .core.screen import ReplyScreen, ScreenPolicy, Screened
from .core.server_opt import ServerOptimizer
from .core.strategy import ClientHalfMissing, FedAdaptStrategy, RoundInputs, RoundLog
from .core.validation import RecordSpec

# Methods: importing a module registers its methods (each module ends with its register() calls).
from .methods.baselines import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedOpt, FedOptHParams, FedProx, FedYogi
from .methods.fedlocal import FedLocal, FedLocalClientHParams, FedLocalHParams, FedLocalOptimizer, FedLocalSync  # 000
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

# Compat: Flower's legacy API (NumPyClient + flwr.server.strategy).
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
