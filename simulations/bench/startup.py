"""Benchmark: a run's fixed cost (start-up) and whole-process time, for one or more source trees side by side.

    python -m simulations.bench.startup --tree before=/tmp/base --tree after=. --repeats 3

Each measurement is a fresh ``python`` process running the in-process engine on digits-mlp (FedAvg, N=100 clients,
every client every round, E=5, batch 16, 3 rounds; ``--engine`` / ``--nodes`` / ``--rounds`` change that) from the
given tree (its directory first on ``PYTHONPATH``) in a new working directory, so caches start cold unless
``--warm-cache`` (then one untimed run first fills the tree's data cache and every timed run reuses it).  It reports:

* ``whole``   — the process's wall time, interpreter start to exit;
* ``imports`` — importing the engine, the ServerApp and the ClientApp, and ``torch._dynamo`` (which ``torch.optim``
  imports at the first optimizer step, ~1.5 s here: an import, but paid inside round 1 otherwise);
* ``data imports`` — with a cold cache (no ``--warm-cache``) only: importing scikit-learn (``sklearn.datasets``,
  ``sklearn.model_selection``), ``datasets`` and ``flwr_datasets.partitioner``, which such a run needs to split the
  digits and partition them (a warm run imports none of them: 0 there);
* ``fixed``   — the run's one-time cost: its wall time (after all the imports) less ``rounds ×`` a steady round's time
  (the median of the ``seconds`` of rounds 2… in the metrics rows; round 1 carries the clients' first data loading,
  round 0 the test set and the initial central evaluation, so both count as fixed beyond a steady round);
* ``round``   — that steady round's seconds.

Runs are interleaved (tree A, tree B, A, B, …); the table prints the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from simulations.engine.inprocess import run_inprocess
import server_app.app, client_app.app  # noqa: F401
import torch._dynamo  # noqa: F401  (torch.optim imports it at the first optimizer step: an import, timed as one)
t1 = time.perf_counter()
if sys.argv[5] == "1":  # a cold data cache: the run imports these to split and partition (timed as imports here)
    import sklearn.datasets, sklearn.model_selection, datasets, flwr_datasets.partitioner  # noqa: F401,E401
t_data = time.perf_counter()
cfg = json.loads(sys.argv[1])
summary = run_inprocess(cfg, int(sys.argv[2]), engine=sys.argv[3])
t2 = time.perf_counter()
rows = [json.loads(line) for line in open(sys.argv[4])]
steady = sorted(float(r["seconds"]) for r in rows if int(r["round"]) >= 2)
low_median = steady[(len(steady) - 1) // 2]
print(json.dumps({"imports": t1 - t0, "data_imports": t_data - t1, "run": t2 - t_data, "round": low_median,
                  "rounds": len(rows) - 1}))
"""


def measure(tree: Path, cwd: Path, engine: str, nodes: int, rounds: int, fraction: float = 1.0,
            data_imports: bool = False) -> dict[str, float]:
    """One fresh process of ``tree`` in ``cwd`` (see the module docstring); ``fraction``: fraction-train;
    ``data_imports``: import the data libraries before the run, timed apart (``data_imports``)."""
    out = cwd / "out"
    cfg = {"num-server-rounds": rounds, "fraction-train": fraction, "partitioner": "iid", "output-dir": str(out),
           "run-name": "bench", "overwrite": True, "learning-curve": False}
    env = {**os.environ, "PYTHONPATH": str(tree), "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    import time

    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), str(nodes), engine,
                          str(out / "bench" / "metrics.jsonl"), "1" if data_imports else "0"],
                         cwd=cwd, env=env, capture_output=True, text=True)
    whole = time.perf_counter() - start
    if res.returncode != 0:
        raise RuntimeError(f"{tree}: exit {res.returncode}\n{res.stderr[-3000:]}")
    got = json.loads(res.stdout.strip().splitlines()[-1])
    return {"whole": whole, "imports": got["imports"], "data_imports": got["data_imports"],
            "fixed": got["run"] - got["rounds"] * got["round"], "round": got["round"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=DIR", help="a source tree to run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine", default="inprocess", choices=("inprocess", "vectorized"))
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm-cache", action="store_true", help="one untimed run per tree fills its data cache first")
    args = ap.parse_args(argv)
    trees = [(name, Path(d).resolve()) for name, d in (t.split("=", 1) for t in args.tree)]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    with tempfile.TemporaryDirectory(prefix="fedadapt-startup-") as tmp:
        cwds = {name: Path(tmp) / name for name, _ in trees}
        for name, tree in trees:
            cwds[name].mkdir()
            if args.warm_cache:
                measure(tree, cwds[name], args.engine, args.nodes, args.rounds)
        for r in range(args.repeats):
            for name, tree in trees:
                cwd = cwds[name] if args.warm_cache else Path(tmp) / f"{name}-{r}"
                cwd.mkdir(exist_ok=True)
                results[name].append(measure(tree, cwd, args.engine, args.nodes, args.rounds,
                                             data_imports=not args.warm_cache))
                print(f"{name} #{r + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in results[name][-1].items()),
                      flush=True)
    print(f"\n{args.engine}, digits-mlp FedAvg, N={args.nodes}, E=5, {args.rounds} rounds; medians of {args.repeats} "
          f"({'warm' if args.warm_cache else 'cold'} data cache)")
    print(f"{'tree':<12}{'whole s':>10}{'imports s':>11}{'data imports s':>16}{'fixed s':>10}{'round s':>10}")
    for name, rows in results.items():
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        print(f"{name:<12}{med['whole']:>10.2f}{med['imports']:>11.2f}{med['data_imports']:>16.2f}"
              f"{med['fixed']:>10.2f}{med['round']:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
