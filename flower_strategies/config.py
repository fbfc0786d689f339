"""Print the ``[tool.flwr.app.config]`` lines your Flower app declares to use a fedadapt method.

    python -m flower_strategies.config fedlada          # one method
    python -m flower_strategies.config --list           # every method: client half?, client lr to start from

Flower refuses ``--run-config`` keys the app does not declare; paste these lines under
``[tool.flwr.app.config]`` in your ``pyproject.toml``, then build the strategy with
``flower_strategies.strategy_from_run_config(context.run_config, names={...})``.
"""

from __future__ import annotations

import argparse
import sys

from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.registry import METHODS, config_lines  # the registry registers every built-in method


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flower_strategies.config", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("method", nargs="?", help="registry name of the method")
    ap.add_argument("--list", action="store_true", help="list the registered methods")
    args = ap.parse_args(argv)
    if args.list or not args.method:
        print(f"{'method':18s} {'client half':11s} {'client lr':9s} summary")
        for name, spec in sorted(METHODS.items()):
            half = "yes" if spec.needs_client_half else "no"
            print(f"{name:18s} {half:11s} ×{spec.client_lr_factor:<8g} {spec.summary}")
        print("\nclient half: yes = your ClientApp must run the method's local optimizer (ClientRound);\n"
              "client lr: where to start, as a multiple of your app's own SGD learning rate (measured on a "
              "quickstart-pytorch-shaped app: docs/results/plugin-factors.md).")
        return 0
    try:
        print(config_lines(args.method))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
