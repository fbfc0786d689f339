"""Benchmark: what the client half costs a device to import, for one or more checkouts side by side.

    python -m simulations.bench.client_import ROOT [ROOT ...] [--repeats 5]

For each ``ROOT`` (a checkout of this repository, e.g. this one and an older one from ``git archive``), each repeat
runs a fresh interpreter that first imports what any Flower client with torch loads anyway (``torch``, ``flwr.app``,
``flwr.clientapp``), then times ``import flower_strategies.core.client`` plus the look-up of a method's local
optimizer (``FedLADAOptimizer``), and reports the wall time, the growth of the process's peak resident set
(``ru_maxrss``) and the modules that import loaded.  One row per root: the medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch, flwr.app, flwr.clientapp
base = set(sys.modules)
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
import flower_strategies.core.client
from flower_strategies.core.local import local_optimizer_named
local_optimizer_named("FedLADAOptimizer")
seconds = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
new = set(sys.modules) - base
print(json.dumps({"seconds": seconds, "rss_mb": (rss - rss0) / 1024, "modules": len(new),
                  "package_modules": sum(m.startswith("flower_strategies") for m in new)}))
"""


def measure(root: str, repeats: int) -> dict[str, float]:
    rows = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", CHILD], cwd=root, capture_output=True, text=True, check=True,
                             env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin", "FLWR_TELEMETRY_ENABLED": "0"})
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs="+")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"{'root':<40} {'import s':>9} {'RSS +MB':>8} {'modules':>8} {'of them fedadapt':>17}")
    for root in args.roots:
        m = measure(root, args.repeats)
        print(f"{root:<40} {m['seconds']:9.3f} {m['rss_mb']:8.1f} {m['modules']:8.0f} {m['package_modules']:17.0f}")


if __name__ == "__main__":
    main()
