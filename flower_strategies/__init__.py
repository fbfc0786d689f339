"""fedadapt: adaptive federated optimization methods as Flower strategies + client local optimizers.

Flat exports and the method registry (:data:`METHODS`).  See the README for the list of methods.
"""

# Importing a method module registers its methods (each module ends with its register() calls).
from .methods.baselines import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedOpt, FedOptHParams, FedProx, FedYogi
from .methods.fedcm import FedCM, FedCMHParams, FedCMOptimizer  # baseline of paper 002
from .methods.fedlada import FedLADA, FedLADAHParams, FedLADAOptimizer  # paper 002 (fedlada, localadam)
from .methods.scaffold import Scaffold, ScaffoldHParams, ScaffoldOptimizer  # baseline of papers 001/002
from .core.client import local_train, train_reply
from .core.hparams import ConfigError, HParams, StrategyConfig
from .core.local import LocalOptimizer, SGDHParams, SGDOptimizer
from .core.registry import METHODS, MethodSpec, build_strategy, get_method, parse_run_config, register, run_config_defaults
from .core.server_opt import ServerOptimizer
from .core.strategy import FedAdaptStrategy, RoundInputs, RoundLog
from .core.validation import RecordSpec
