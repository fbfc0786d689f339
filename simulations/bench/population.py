"""Benchmark: a large population in an in-process engine — seconds per round, peak memory, the state store on disk.

    python -m simulations.bench.population                       # 100,000 clients, 1 % a round, scaffold, vectorized
    python -m simulations.bench.population --nodes 2000 --engine inprocess --method fedlamb

One run of the real ServerApp (:func:`simulations.engine.run_inprocess`) on ``leaf-synthetic`` in this process, the
clients' state kept in a row store (:mod:`simulations.engine.population`) in a temporary directory.  Prints each round's
seconds (the metrics rows), the process's peak resident memory (``getrusage``), the store's bytes on disk and its
apparent size, the clients holding state and the node contexts made.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--engine", default="vectorized", choices=("inprocess", "vectorized"))
    ap.add_argument("--method", default="scaffold")
    ap.add_argument("--task", default="leaf-synthetic")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--run-config", default="{}", help="more run-config keys, as JSON")
    args = ap.parse_args(argv)

    import simulations.engine.inprocess as E

    grids: list[Any] = []
    make = E.make_grid

    def keep(*a: Any, **kw: Any) -> Any:
        grids.append(make(*a, **kw))
        return grids[-1]

    E.make_grid = keep  # to read the grid's store afterwards
    with tempfile.TemporaryDirectory(prefix="fedadapt-bench-population-") as tmp:
        cfg = {"task": args.task, "method": args.method, "fraction-train": args.fraction,
               "num-server-rounds": args.rounds, "output-dir": str(Path(tmp) / "out"), "learning-curve": False,
               **json.loads(args.run_config)}
        start = time.perf_counter()
        E.run_inprocess(cfg, args.nodes, engine=args.engine, state_dir=str(Path(tmp) / "state"))
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in next(Path(tmp, "out").rglob("metrics.jsonl")).open()]
        grid = grids[-1]
        store = grid.store
        apparent = sum(p.stat().st_size for p in Path(tmp, "state").rglob("*") if p.is_file())
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
        per_round = [float(r["seconds"]) for r in rows if int(r["round"]) > 0]
        print(f"{args.engine}, {args.task}, {args.method}, N={args.nodes:,}, {args.fraction:g} sampled, "
              f"{args.rounds} rounds: run {wall:.1f} s")
        print("seconds per round: " + ", ".join(f"{s:.1f}" for s in per_round))
        print(f"peak RSS {peak:.2f} GiB; state store {store.disk_bytes() / 2**20:.1f} MiB on disk "
              f"({apparent / 2**30:.2f} GiB apparent, sparse), {store.rows_held():,} clients with state; "
              f"{grid.contexts.made:,} node contexts made, {len(grid.contexts.live)} alive at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
