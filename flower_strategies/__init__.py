"""fedadapt: adaptive federated optimization methods as Flower strategies + client local optimizers.

Flat exports and the method registry (:data:`METHODS`).  See the README for the list of methods.
"""

# Importing a method module registers its methods (each module ends with its register() calls).
from .methods.baselines import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedOpt, FedOptHParams, FedProx, FedYogi
from .core.client import ClientRound, full_gradient_from, local_train, train_reply
from .methods.mimelite import MimeLite, MimeLiteHParams, MimeLiteOptimizer
from .methods.fedlocal import FedLocal, FedLocalClientHParams, FedLocalHParams, FedLocalOptimizer, FedLocalSync
from .methods.fedda import FedDA, FedDAAdagrad, FedDAAdam, FedDAClientHParams, FedDAHParams, FedDAOptimizer, FedDASGDM
from .methods.fedlamb import AdpFed, FedAMS, FedLAMB, FedLAMBHParams, FedLAMBOptimizer  # paper 004
from .methods.localupdate import LocalUpdate, LocalUpdateDecay, LocalUpdateDecayHParams, LocalUpdateHParams, LocalUpdateOptimizer, PlateauController, ThetaHParams  # paper 003
from .methods.fedcm import FedCM, FedCMHParams, FedCMOptimizer  # baseline of paper 002
from .methods.fedlada import FedLADA, FedLADAHParams, FedLADAOptimizer  # paper 002 (fedlada, localadam)
from .methods.scaffold import Scaffold, ScaffoldHParams, ScaffoldOptimizer  # baseline of papers 001/002
from .core.hparams import ConfigError, HParams, StrategyConfig
from .core.local import LocalOptimizer, SGDHParams, SGDOptimizer
from .core.registry import (
    METHODS, MethodSpec, build_strategy, get_method, parse_run_config, register, run_config_defaults, strategy_from_run_config,
)
from .core.server_opt import ServerOptimizer
from .core.strategy import ClientHalfMissing, FedAdaptStrategy, RoundInputs, RoundLog
from .core.validation import RecordSpec
