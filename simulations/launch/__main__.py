"""``python -m simulations.launch sim|deploy|secure``: see :mod:`simulations.launch`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import __doc__ as DOC
from .flwr_cli import RunConfigError
from .modes import launch_deploy, launch_secure_deploy, launch_sim
from .processes import APP_DIR


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulations.launch", description=DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("sim", "deploy", "secure"))
    ap.add_argument("--num-supernodes", type=int, default=10, help="virtual SuperNodes (sim)")
    ap.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                    help="sim: run on this existing Ray cluster (the head's `ray start --head --port=PORT`) "
                         "instead of a private Ray instance; an inherited RAY_ADDRESS does the same")
    ap.add_argument("--client-cpus", type=int, default=1, help="sim: Ray CPUs reserved per ClientApp actor")
    ap.add_argument("--client-gpus", type=float, default=0.0, help="sim: Ray GPUs per ClientApp actor (e.g. 0.25)")
    ap.add_argument("--ray-cpus", type=int, default=None,
                    help="sim: CPUs of the private Ray instance (default: all); --ray-cpus 1 --client-cpus 1 = one "
                         "ClientApp actor serving every SuperNode")
    ap.add_argument("--nodes", type=int, default=2, help="SuperNode processes (deploy); registered SuperNodes (secure)")
    ap.add_argument("--unregistered", type=int, default=1,
                    help="secure: extra SuperNodes whose keys are not registered (they must be refused)")
    ap.add_argument("--public-host", default=None, metavar="ADDR",
                    help="secure: a non-loopback address of this machine; SuperNodes connect through it and an "
                         "outsider with ca.crt alone is shown to be refused the Control API")
    ap.add_argument("--run-config", default=None,
                    help="run-config overrides, TOML-typed: \"method='fedadam' num-server-rounds=5\"")
    ap.add_argument("--flwr-home", default=os.environ.get("FLWR_HOME", str(APP_DIR / ".flwr")))
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is abandoned")
    ap.add_argument("--app", default=str(APP_DIR), help="Flower app directory (default: this project)")
    ap.add_argument("--task-poll-interval", type=float, default=None, metavar="S",
                    help="deploy: seconds between a SuperNode's SuperExec task polls (Flower default 1.0; 0.01-60)")
    ap.add_argument("--preloaded", action="store_true",
                    help="deploy: SuperNodes with --isolation process + a pre-loaded SuperExec that forks one "
                         "ClientApp process per message (python -m simulations.launch.preloaded_exec) instead of a "
                         "fresh flwr-clientapp interpreter")
    ap.add_argument("--node-data", nargs="+", default=None, metavar="PATH",
                    help="deploy: node-local data, one .npz per node or a directory of partition-<i>.npz "
                         "(python -m simulations.convert_data); passed as node config data-path")
    ap.add_argument("--engine", choices=("ray", "inprocess", "vectorized"), default="ray",
                    help="sim: ray = Flower's Ray simulation (default); inprocess = the in-process engine "
                         "(simulations.engine, this process, no SuperLink; see simulations.launch.seeds); vectorized "
                         "= the in-process engine training each round's clients together (simulations.vectorized)")
    ap.add_argument("--seeds", type=int, default=None, metavar="N",
                    help="sim --engine inprocess|vectorized: run the configuration with seeds s..s+N-1 "
                         "(s = run-config seed) and write seeds.json/.csv (final test accuracy/loss per seed, "
                         "mean ± std) and accuracy_band.png")
    args = ap.parse_args(argv)
    in_process = args.engine in ("inprocess", "vectorized")
    if (args.seeds is not None or in_process) and args.mode != "sim":
        ap.error("--engine inprocess|vectorized and --seeds apply to sim only")
    if args.seeds is not None and not in_process:
        ap.error("--seeds needs --engine inprocess or vectorized")
    home, app = Path(args.flwr_home).resolve(), Path(args.app).resolve()
    try:
        if args.mode == "sim" and in_process:
            from .seeds import launch_inprocess

            return launch_inprocess(args.num_supernodes, args.run_config, args.seeds, args.engine)
        if args.mode == "sim":
            return launch_sim(args.num_supernodes, args.run_config, home, args.timeout, app,
                              ray_address=args.ray_address, client_cpus=args.client_cpus, client_gpus=args.client_gpus,
                              ray_cpus=args.ray_cpus)
        if args.mode == "secure":
            res = launch_secure_deploy(args.nodes, args.run_config, home, args.timeout, app,
                                       unregistered=args.unregistered, public_host=args.public_host)
            return 0 if res.status == "finished:completed" else 1
        return launch_deploy(args.nodes, args.run_config, home, args.timeout, app,
                             node_data=args.node_data, task_poll_interval=args.task_poll_interval,
                             preloaded=args.preloaded)
    except (RunConfigError, ValueError, ConnectionError) as err:
        print(f"[fedadapt] {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
