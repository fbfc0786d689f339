"""``python -m simulations.launch sim|deploy|secure``: see :mod:`simulations.launch` (``--help`` is kept short)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .flwr_cli import RunConfigError
from .modes import launch_deploy, launch_secure_deploy, launch_sim, ray_address_check
from .processes import APP_DIR
from .progress import quiet_flower

DESCRIPTION = ("Run the fedadapt Flower app for real; exit 0 only when the run finished:completed.\n"
               "One line per round (round r/R, elapsed, ETA); more in docs/deployment.md.")
EXAMPLES = """examples:
  python -m simulations.launch sim --run-config "method='fedadam' num-server-rounds=5"
  python -m simulations.launch sim --engine vectorized --num-supernodes 100 --run-config "method='scaffold'"
  python -m simulations.launch sim --engine vectorized --ray-actors 2 --num-supernodes 1000
  python -m simulations.launch sim --engine inprocess --seeds 3
  python -m simulations.launch deploy --nodes 3 --preloaded
  python -m simulations.launch secure --nodes 2
"""


def parser() -> argparse.ArgumentParser:
    """The launcher's options: the common ones first, then those of each mode; examples at the end."""
    ap = argparse.ArgumentParser(
        prog="python -m simulations.launch", usage="%(prog)s {sim,deploy,secure} [options]", description=DESCRIPTION,
        epilog=EXAMPLES, formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=30))
    ap.add_argument("mode", choices=("sim", "deploy", "secure"),
                    help="sim: Flower's Ray simulation (or --engine); deploy: a local SuperLink + SuperNodes; "
                         "secure: deploy over TLS with SuperNode authentication")
    ap.add_argument("--run-config", default=None, metavar="STR",
                    help="run-config overrides, TOML-typed: \"method='fedadam' num-server-rounds=5\"")
    ap.add_argument("--verbose", action="store_true",
                    help="also show Flower's INFO lines (always in <flwr-home>/logs/flwr-run.log)")
    ap.add_argument("--flwr-home", default=os.environ.get("FLWR_HOME", str(APP_DIR / ".flwr")), metavar="DIR",
                    help="Flower's state, logs and connections (default: <app>/.flwr)")
    ap.add_argument("--timeout", type=float, default=3600.0, metavar="S", help="abandon the run after S seconds")
    ap.add_argument("--app", default=str(APP_DIR), metavar="DIR", help="Flower app directory (default: this project)")
    sim = ap.add_argument_group("sim")
    sim.add_argument("--num-supernodes", type=int, default=10, metavar="N", help="virtual SuperNodes (default 10)")
    sim.add_argument("--engine", choices=("ray", "inprocess", "vectorized"), default="ray",
                     help="ray (default); inprocess: this process, no SuperLink; vectorized: each round's clients "
                          "trained together")
    sim.add_argument("--seeds", type=int, default=None, metavar="N",
                     help="inprocess|vectorized: seeds s..s+N-1 (s = run-config seed): seeds.json/.csv, "
                          "accuracy_band.png")
    sim.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                     help="an existing Ray cluster's head (or RAY_ADDRESS) instead of a private Ray instance")
    sim.add_argument("--ray-actors", type=int, default=None, metavar="N",
                     help="vectorized: train each round's chunks on N Ray actors (with --ray-address: on that cluster)")
    sim.add_argument("--client-cpus", type=int, default=1, metavar="N", help="Ray CPUs per ClientApp actor")
    sim.add_argument("--client-gpus", type=float, default=0.0, metavar="F", help="Ray GPUs per ClientApp actor")
    sim.add_argument("--ray-cpus", type=int, default=None, metavar="N",
                     help="CPUs of the private Ray instance (default: all)")
    dep = ap.add_argument_group("deploy / secure")
    dep.add_argument("--nodes", type=int, default=2, metavar="N", help="SuperNodes (secure: registered ones)")
    dep.add_argument("--node-data", nargs="+", default=None, metavar="PATH",
                     help="deploy: one .npz per node, or a directory of partition-<i>.npz "
                          "(simulations.tools.convert_data)")
    dep.add_argument("--preloaded", action="store_true",
                     help="deploy: a pre-loaded SuperExec forks each ClientApp (simulations.launch.preloaded_exec)")
    dep.add_argument("--task-poll-interval", type=float, default=None, metavar="S",
                     help="deploy: seconds between SuperExec task polls (Flower: 1.0)")
    dep.add_argument("--unregistered", type=int, default=1, metavar="N",
                     help="secure: SuperNodes with unregistered keys (must be refused)")
    dep.add_argument("--public-host", default=None, metavar="ADDR",
                     help="secure: a non-loopback address of this machine to connect through")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    in_process = args.engine in ("inprocess", "vectorized")
    if (args.seeds is not None or in_process) and args.mode != "sim":
        ap.error("--engine inprocess|vectorized and --seeds apply to sim only")
    if args.seeds is not None and not in_process:
        ap.error("--seeds needs --engine inprocess or vectorized")
    if args.ray_actors is not None and (args.engine != "vectorized" or args.ray_actors < 1):
        ap.error("--ray-actors N (N >= 1) needs --engine vectorized")
    home, app = Path(args.flwr_home).resolve(), Path(args.app).resolve()
    try:
        if args.mode == "sim" and in_process:
            from .seeds import launch_inprocess

            with quiet_flower(args.verbose):
                ray = ({"actors": args.ray_actors, "address": args.ray_address and ray_address_check(args.ray_address)}
                       if args.ray_actors else {})
                return launch_inprocess(args.num_supernodes, args.run_config, args.seeds, args.engine, **ray)
        if args.mode == "sim":
            return launch_sim(args.num_supernodes, args.run_config, home, args.timeout, app,
                              ray_address=args.ray_address, client_cpus=args.client_cpus, client_gpus=args.client_gpus,
                              ray_cpus=args.ray_cpus, verbose=args.verbose)
        if args.mode == "secure":
            res = launch_secure_deploy(args.nodes, args.run_config, home, args.timeout, app,
                                       unregistered=args.unregistered, public_host=args.public_host,
                                       verbose=args.verbose)
            return 0 if res.status == "finished:completed" else 1
        return launch_deploy(args.nodes, args.run_config, home, args.timeout, app,
                             node_data=args.node_data, task_poll_interval=args.task_poll_interval,
                             preloaded=args.preloaded, verbose=args.verbose)
    except (RunConfigError, ValueError, ConnectionError) as err:
        print(f"[fedadapt] {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
