"""fedadapt: adaptive federated optimization methods as Flower strategies + client local optimizers.

Flat exports and the method registry (:data:`METHODS`).  See the README for the list of methods.
"""

# Importing a method module registers its methods (each module ends with its register() calls).
from .baselines import (
    FedAdagrad,
    FedAdagradHParams,
    FedAdam,
    FedAdamHParams,
    FedAvg,
    FedAvgHParams,
    FedAvgM,
    FedAvgMHParams,
    FedOpt,
    FedProx,
    FedProxHParams,
    FedYogi,
    FedYogiHParams,
)
from . import fedlocal  # noqa: F401  (paper 000)
from .fedda import FedDA, FedDAAdagrad, FedDAAdam, FedDAHParams, FedDAOptimizer, FedDASGDM  # paper 001
from .fedcm import FedCM, FedCMOptimizer  # baseline of paper 002
from .fedlada import FedLADA, FedLADAOptimizer, LocalAdam  # paper 002
from .fedlamb import AdpFed, AdpFedHParams, FedAMS, FedAMSHParams, FedLAMB, FedLAMBHParams  # paper 004
from .scaffold import Scaffold, ScaffoldOptimizer  # baseline of papers 001/002
from .mimelite import MimeLite, MimeLiteHParams, MimeLiteOptimizer  # baseline of paper 001
from .localupdate import (  # paper 003
    LocalUpdate,
    LocalUpdateDecay,
    LocalUpdateDecayHParams,
    LocalUpdateHParams,
    LocalUpdateOptimizer,
    PlateauController,
)
from .client import local_train, train_reply
from .hparams import ConfigError, FederationConfig, HParams
from .local import LocalOptimizer, SGDOptimizer
from .registry import METHODS, MethodSpec, build_strategy, get_method, parse_run_config, register, run_config_defaults
from .server_opt import ServerOptimizer
from .strategy import FedAdaptStrategy, RecordSpec, RoundLog

__all__ = [
    "METHODS", "ConfigError", "FedAdaptStrategy", "FedAdagrad", "FedAdagradHParams", "FedAdam", "FedAdamHParams",
    "FedCM", "FedCMOptimizer", "FedLADA", "FedLADAOptimizer", "LocalAdam", "Scaffold", "ScaffoldOptimizer",
    "FedDA", "FedDAAdagrad", "FedDAAdam", "FedDAHParams", "FedDAOptimizer", "FedDASGDM", "MimeLite", "MimeLiteHParams",
    "MimeLiteOptimizer", "AdpFed", "AdpFedHParams", "FedAMS", "FedAMSHParams", "FedLAMB", "FedLAMBHParams",
    "FedAvg", "FedAvgHParams", "LocalUpdate", "LocalUpdateDecay", "LocalUpdateDecayHParams", "LocalUpdateHParams",
    "LocalUpdateOptimizer", "PlateauController", "FedAvgM", "FedAvgMHParams", "FedOpt", "FedProx", "FedProxHParams", "FedYogi",
    "FedYogiHParams", "FederationConfig", "HParams", "LocalOptimizer", "MethodSpec", "RecordSpec", "RoundLog",
    "SGDOptimizer", "ServerOptimizer", "build_strategy", "get_method", "local_train", "parse_run_config", "register",
    "run_config_defaults", "train_reply",
]
