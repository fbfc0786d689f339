"""The fedadapt app's run-config: the library's strategy settings plus tasks, data, output and checkpoints.

The library (``flower_strategies``) knows nothing about these keys; both apps parse them with
:func:`parse` (one validation, one error naming the valid choices).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flower_strategies.core.hparams import ConfigError, StrategyConfig, param

TASKS = ("digits-mlp", "digits-cnn", "synthetic-linear", "shakespeare-lstm", "leaf-synthetic", "mnist-mlp",
         "mnist-cnn",  # real MNIST (prepared offline, app_common/mnist.py); four on hub data:
         "cifar10-resnet18", "cifar100-resnet18", "fashion-mnist-cnn", "femnist-cnn")
#: ``round-iid`` / ``round-class``: paper 004's allocation, the whole training split divided anew every round among
#: the round's active devices (app_common/partitions.py ``round_allocation``); digits and MNIST tasks only.
PARTITIONERS = ("iid", "dirichlet", "classes", "round-iid", "round-class")
ROUND_PARTITIONERS = ("round-iid", "round-class")
ROUND_TASKS = ("digits-mlp", "digits-cnn", "mnist-mlp", "mnist-cnn")
TRACKING = ("none", "tensorboard", "mlflow", "wandb")


@dataclass(frozen=True)
class AppConfig(StrategyConfig):
    """The fedadapt app's run-wide settings: the strategy's (:class:`StrategyConfig`) plus data, model and output.

    The local-training keys (``client-lr`` 0.5, ``local-epochs`` 5, ``batch-size`` 16) keep the library's defaults
    (declared once, in :class:`StrategyConfig`); with them the default job (FedAvg, digits-mlp, Dirichlet(0.3),
    10 nodes, 10 rounds) reaches ≥ 0.90 test accuracy, and ``presets`` adapts the learning rates of the other methods
    to it (:mod:`server_app.presets`).
    """

    task: str = param("digits-mlp", choices=TASKS, help="data set + model")
    partitioner: str = param("dirichlet", choices=PARTITIONERS,
        help="how the training split is divided: fixed partitions per node (iid, dirichlet, classes), or paper 004's "
             "allocation anew each round among the round's sampled nodes (round-iid: random equal shards; round-class:"
             " one class per node; digits and mnist tasks; every sampled node learns the round's sampled partition "
             "ids)")
    dirichlet_alpha: float = param(0.3, lo=0.0, lo_open=True, help="concentration of the Dirichlet label skew")
    classes_per_client: int = param(2, lo=1, hi=10, help="labels per client for `partitioner=classes`")
    output_dir: str = param("outputs", help="metrics/model directory (relative paths: to the ServerApp's cwd)")
    run_name: str = param("", help="sub-directory of output-dir, one path component (no / or \\, not . or .., no NUL, "
                          "at most 128 characters, not ending in .prev-<n>); empty = <method>-<task>-seed<seed>, then "
                          "-<hash of the other non-default keys> if any (server_app/rundir.py)")
    overwrite: bool = param(False, help="a fresh run into a run directory that holds an earlier run's files moves "
                            "them to <run-name>.prev-<n>/; false = refuse (set resume to continue that run)")
    synthetic_clients: int = param(10, lo=1, help="clients of the synthetic task (partitions)")
    synthetic_dim: int = param(10, lo=1, help="dimension of the synthetic least-squares task")
    synthetic_heterogeneity: float = param(1.0, lo=0.0, help="spread of the clients' optima (synthetic task)")
    synthetic_alpha: float = param(1.0, lo=0.0, help="leaf-synthetic: spread of the clients' models, Synthetic(α, β)")
    synthetic_beta: float = param(1.0, lo=0.0, help="leaf-synthetic: spread of the clients' inputs, Synthetic(α, β)")
    precision: str = param("float32", choices=("float32", "float64"),
        help="model/data dtype (float64 for exactness checks)")
    round_timeout: float = param(3600.0, lo=0.0, lo_open=True, help="seconds to wait for replies")
    data_dir: str = param(".cache/fedadapt",
        help="prepared data cache of file-based tasks (shakespeare-lstm, mnist-mlp, mnist-cnn); relative to the app's "
             "cwd")
    mnist_source: str = param("prepared", choices=("prepared", "hub"),
        help="mnist-mlp/mnist-cnn: prepared = the arrays `python -m app_common.mnist prepare` wrote under data-dir; "
             "hub = the same arrays through the hub loader (ylecun/mnist, or the copy dataset-path names; a non-empty "
             "dataset-path selects it too)")
    dataset_path: str = param("",
        help="hub tasks (cifar10/100, mnist, fashion-mnist, femnist; mnist-mlp/mnist-cnn read it instead of the "
             "prepared arrays): directory of a local copy written by datasets' "
             "DatasetDict.save_to_disk, read by the clients and for the server's test split; empty = the Hugging Face "
             "hub; relative to the app's cwd")
    checkpoint_every: int = param(0, lo=0,
        help="write <output-dir>/<run-name>/checkpoint.npz (data only: arrays + JSON) every N rounds, at the end and "
             "on SIGINT/SIGTERM; 0 = off")
    resume: str = param("",
        help="path of a checkpoint.npz to continue from (next round on; validated, never unpickled); empty = fresh run")
    device: str = param("auto", choices=("auto", "cpu", "cuda"),
        help="where ClientApps train: auto = cuda when available (a SuperNode's node-config `device` overrides it; "
             "with Ray give clients GPUs via client-resources-num-gpus)")
    test_max_examples: int = param(0, lo=0,
        help="central test set: a seeded sample of at most this many examples; 0 = the task's default (digits: all "
             "360; mnist: all 10,000; shakespeare-lstm: 2,000)")
    root_set_size: int = param(300, lo=1,
        help="aggregator fltrust (defence = robust): the server's trusted root set, this many examples of the task's "
             "training split (never the test split), drawn with the server's secret root seed; unused otherwise")
    root_seed: int = param(-1, lo=-1,
        help="aggregator fltrust (defence = robust): -1 = the root set and the server's batch order come from a secret "
             "the server draws at start (kept only in its checkpoint, never logged); >= 0 = this seed instead, for "
             "experiments only: the run-config reaches every ClientApp, so a published root-seed lets any client "
             "compute the server's trust reference and voids the gate")
    train_loss_before: bool = param(True,
        help="clients report train-loss-before, the received model's loss on their data (one extra forward pass over "
             "it per round; localupdatedecay's controller needs it); false = skip it")
    learning_curve: bool = param(True,
        help="write learning_curve.png (matplotlib, ~0.3 s) at the end of the run; false = skip it")
    grid_pull_interval: float = param(0.05, lo=0.0,
        help="seconds between the ServerApp's polls for replies (Flower's own grids wait 3 s per poll in a deployment,"
             " 0.1 s in a simulation); 0 = the grid's own")
    presets: bool = param(True,
        help="apply the task's tuned per-method learning rates (server_app/presets.py) to the keys left at their "
             "defaults; false = the declared defaults")
    tracking: str = param("none", choices=TRACKING,
        help="also send each round's metrics row and the resolved configuration to an experiment tracker (its package "
             "must be installed; server_app/tracking.py): tensorboard writes <output-dir>/<run-name>/tensorboard/, "
             "mlflow <output-dir>/<run-name>/mlruns/ (or MLFLOW_TRACKING_URI), wandb <output-dir>/<run-name>/wandb/ "
             "(WANDB_MODE, default offline)")
    secure_aggregation: str = param("off", choices=("off", "secaggplus"),
        help="secaggplus = Flower's SecAgg+ (legacy SecAggPlusWorkflow + secaggplus_mod): the server sees only the "
             "example-weighted mean of the replies; for methods whose every uplink record is such a mean, with "
             "weighting = examples (others refused; docs/privacy.md section 4)")
    secagg_num_shares: float = param(3.0, lo=0.0, lo_open=True,
        help="SecAgg+ shares per client's secret: a whole number >= 3, or a fraction in (0, 1] of the sampled "
             "clients (1 = every client, i.e. SecAgg)")
    secagg_reconstruction_threshold: float = param(2.0, lo=0.0, lo_open=True,
        help="SecAgg+ shares needed to reconstruct a secret (dropout tolerance vs. collusion): a whole number below "
             "secagg-num-shares, or a fraction in (0, 1] of the shares")
    secagg_clipping_range: float = param(8.0, lo=0.0, lo_open=True,
        help="SecAgg+ clips every weighted reply value (value × num-examples / secagg-max-weight) to ± this before "
             "quantizing; clipped values are counted per round (secagg-clipped)")
    secagg_quantization_range: int = param(4194304, lo=2, hi=2**30,
        help="SecAgg+ quantization levels (2^22): one round's mean is within 3·n·clipping-range / "
             "(quantization-range · Σ num-examples / max-weight) of the exact mean")
    secagg_max_weight: float = param(1000.0, lo=0.0, lo_open=True,
        help="SecAgg+ num-examples that weighs 1 (a client with more has its values clipped sooner)")


    def __post_init__(self) -> None:
        super().__post_init__()
        reason = run_name_problem(self.run_name)
        if reason is not None:
            raise ConfigError(f"run-name = {self.run_name!r} is not valid: {reason}")
        if self.partitioner in ROUND_PARTITIONERS:
            if self.task not in ROUND_TASKS:
                raise ConfigError(f"partitioner = {self.partitioner!r} divides the digits and MNIST training splits "
                                  f"only ({', '.join(ROUND_TASKS)}), not task = {self.task!r}; use iid, dirichlet or "
                                  "classes")
            if self.secure_aggregation != "off":
                raise ConfigError(f"partitioner = {self.partitioner!r} tells the round's nodes which partition ids "
                                  "were sampled (Message API train config); secure-aggregation runs through the legacy "
                                  "workflow, which does not: use secure-aggregation = 'off' or another partitioner")


#: The longest ``run-name`` (a directory name well inside every file system's 255-byte limit, with room for
#: ``.prev-<n>``).
RUN_NAME_MAX = 128


def run_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a run directory's name inside ``output-dir`` (``None``: it can; empty = the default
    name): it must be one path component, so that a run writes, and moves aside, only its own directory."""
    if not name:
        return None
    if "\x00" in name:
        return "it holds a NUL byte"
    if "/" in name or "\\" in name:
        return "it must be one path component inside output-dir (no / or \\)"
    if name in (".", ".."):
        return f"{name!r} names output-dir itself or its parent, not a run directory inside it"
    if len(name) > RUN_NAME_MAX:
        return f"it has {len(name)} characters; at most {RUN_NAME_MAX}"
    if re.search(r"\.prev-\d+$", name):
        return "names ending in .prev-<n> are where earlier runs' files are moved aside (server_app/rundir.py)"
    return None


def parse(run_config: Mapping[str, Any]) -> AppConfig:
    """The app settings of ``run_config`` (method keys are ignored here; the registry validates them)."""
    keys = AppConfig.keys(None)
    return AppConfig.from_run_config({k: v for k, v in run_config.items() if k in keys}, None)
