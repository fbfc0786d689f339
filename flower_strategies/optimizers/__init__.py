"""The client half of every built-in method: hyper-parameters, local optimizers, record names.

Importing this package fills :data:`~flower_strategies.core.local.LOCAL_OPTIMIZERS` (the name a round's
``local-optimizer`` sends → the class) without importing any server-side module: a device that only trains imports
the client API (:mod:`flower_strategies.core.client`) and, at its first round, this package
(:func:`~flower_strategies.core.local.local_optimizer_named`).  Each ``methods/<name>.py`` imports its client half from
here; the registry checks that a registered method's optimizer is the one found here under its name.
"""

from ..core.local import add_local_optimizer
from .fedcm import FedCMOptimizer
from .fedda import FedDAOptimizer
from .fedlada import FedLADAOptimizer
from .fedlamb import FedLAMBOptimizer
from .fedlocal import FedLocalOptimizer
from .localupdate import LocalUpdateOptimizer
from .mimelite import MimeLiteOptimizer
from .scaffold import ScaffoldOptimizer

#: Every built-in method's local optimizer (plain SGD, FedAvg's and the FedOpt family's, is core's own).
BUILT_IN = (FedCMOptimizer, FedDAOptimizer, FedLADAOptimizer, FedLAMBOptimizer, FedLocalOptimizer,
            LocalUpdateOptimizer, MimeLiteOptimizer, ScaffoldOptimizer)
for _optimizer in BUILT_IN:
    add_local_optimizer(_optimizer)

__all__ = ["BUILT_IN"]
