"""fedadapt: adaptive federated optimization methods as Flower strategies + client local optimizers.

Flat exports and the method registry (:data:`METHODS`).  See the README for the list of methods.
"""

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
from .client import local_train, train_reply
from .hparams import ConfigError, FederationConfig, HParams
from .local import LocalOptimizer, SGDOptimizer
from .registry import METHODS, MethodSpec, build_strategy, get_method, parse_run_config, register, run_config_defaults
from .server_opt import ServerOptimizer
from .strategy import FedAdaptStrategy, RecordSpec, RoundLog

_REDDI = "Reddi et al., Adaptive Federated Optimization, ICLR 2021"
register(FedAvg, SGDOptimizer, paper="McMahan et al., AISTATS 2017", summary="local SGD + (weighted) model averaging")
register(FedAvgM, SGDOptimizer, paper="Hsu et al., 2019", summary="FedAvg + server heavy-ball momentum")
register(FedAdagrad, SGDOptimizer, paper=_REDDI, summary="local SGD + server AdaGrad")
register(FedAdam, SGDOptimizer, paper=_REDDI, summary="local SGD + server Adam")
register(FedYogi, SGDOptimizer, paper=_REDDI, summary="local SGD + server Yogi")
register(FedProx, SGDOptimizer, paper="Li et al., MLSys 2020", summary="local SGD with proximal term + FedAvg")

__all__ = [
    "METHODS", "ConfigError", "FedAdaptStrategy", "FedAdagrad", "FedAdagradHParams", "FedAdam", "FedAdamHParams",
    "FedAvg", "FedAvgHParams", "FedAvgM", "FedAvgMHParams", "FedOpt", "FedProx", "FedProxHParams", "FedYogi",
    "FedYogiHParams", "FederationConfig", "HParams", "LocalOptimizer", "MethodSpec", "RecordSpec", "RoundLog",
    "SGDOptimizer", "ServerOptimizer", "build_strategy", "get_method", "local_train", "parse_run_config", "register",
    "run_config_defaults", "train_reply",
]
