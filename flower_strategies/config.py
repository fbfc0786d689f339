"""Print the ``[tool.flwr.app.config]`` lines your Flower app declares to use a fedadapt method.

    python -m flower_strategies.config fedlada          # one method
    python -m flower_strategies.config --list           # every method: client half?, client lr to start from
    python -m flower_strategies.config --check "clinet-lr=0.1" [--app .]   # a --run-config line, before flwr run

Flower refuses ``--run-config`` keys the app does not declare (``[code: 15] Invalid run configuration.``, before any
of the app's code runs); paste these lines under ``[tool.flwr.app.config]`` in your ``pyproject.toml``, then build
the strategy with ``flower_strategies.strategy_from_run_config(context.run_config, names={...})``.  ``--check``
names each key of a ``--run-config`` line that the app does not declare, with its close matches among the app's
keys and fedadapt's.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.registry import METHODS, config_lines, did_you_mean, run_config_defaults


def check_run_config(run_config: str, app_dir: Path | str = ".") -> list[str]:
    """What Flower would refuse in ``flwr run <app_dir> --run-config "<run_config>"``: one line per key the app's
    ``[tool.flwr.app.config]`` does not declare, with its close matches among the declared keys and fedadapt's (a
    fedadapt key the app does not declare: how to declare it).  Empty: Flower accepts the keys."""
    from flwr.common.config import flatten_dict, get_project_config, parse_config_args

    pyproject = Path(app_dir) / "pyproject.toml"
    declared = flatten_dict(get_project_config(app_dir)["tool"]["flwr"]["app"].get("config", {}))
    ours = run_config_defaults()
    problems = []
    for key in parse_config_args([run_config]):
        if key in declared:
            continue
        prefix = key.partition(".")[0]
        method = prefix if prefix in METHODS else str(declared.get("method", "<method>"))
        declare = (f"add it to [tool.flwr.app.config] (python -m flower_strategies.config {method} prints the "
                   f"lines)")
        line = (f"{key!r} is not declared in {pyproject} [tool.flwr.app.config], so Flower refuses the run "
                f"('[code: 15] Invalid run configuration.'); ")
        if key in ours:
            problems.append(line + f"it is a fedadapt key your app does not declare: {declare}")
            continue
        close = difflib.get_close_matches(key, [*declared, *(k for k in ours if k not in declared)], n=3)
        undeclared = [c for c in close if c not in declared]
        problems.append(line + did_you_mean(key, close) + (
            f" ({', '.join(map(repr, undeclared))}: fedadapt's, not declared by your app: {declare})"
            if undeclared else ""))
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flower_strategies.config", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("method", nargs="?", help="registry name of the method")
    ap.add_argument("--list", action="store_true", help="list the registered methods")
    ap.add_argument("--check", metavar="RUN_CONFIG", help="check a --run-config line against the app's declared keys")
    ap.add_argument("--app", default=".", help="the Flower app's directory (with --check; default: .)")
    args = ap.parse_args(argv)
    if args.check is not None:
        problems = check_run_config(args.check, args.app)
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        if not problems:
            print(f"ok: {Path(args.app) / 'pyproject.toml'} declares every key of the line")
        return 2 if problems else 0
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
