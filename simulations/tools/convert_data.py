"""Write per-partition node-local data files (``.npz`` with ``x``, ``y``) from the bundled data sets.

    python -m simulations.tools.convert_data --out data/ --num-partitions 4 [--task digits-mlp]
                                             [--partitioner dirichlet] [--seed 0] [--dirichlet-alpha 0.3]
                                             [--classes-per-client 2] [--synthetic-dim 10]
                                             [--synthetic-heterogeneity 1.0]

writes ``data/partition-<i>.npz`` (i = 0 … N-1) holding exactly the partition the ClientApp would load for
``partition-id=i num-partitions=N`` with the same run-config settings, plus ``data/manifest.json`` (settings, file
names, sizes).  Copy file i to device i and start its SuperNode with
``--node-config "data-path='/abs/path/partition-<i>.npz' partition-id=<i>"``.  Format: see ``client_app/node_data.py``
(``x`` float32 ``[n, ...]``; ``y`` int64 labels ``[n]`` or float32 targets ``[n, 1]``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from app_common.config import AppConfig


def convert(out: str | Path, num_partitions: int, **settings: Any) -> list[Path]:
    """Write one ``partition-<i>.npz`` per partition; ``settings`` are AppConfig fields (task, seed, …)."""
    from app_common.task import load_client_data

    fed = AppConfig(**settings)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    sizes = []
    for i in range(num_partitions):
        x, y = load_client_data(
            fed.task, i, num_partitions, partitioner=fed.partitioner, seed=fed.seed, alpha=fed.dirichlet_alpha,
            classes_per_client=fed.classes_per_client, synthetic_dim=fed.synthetic_dim,
            synthetic_heterogeneity=fed.synthetic_heterogeneity, precision="float32",
        )
        path = out / f"partition-{i}.npz"
        np.savez(path, x=x.numpy(), y=y.numpy())
        files.append(path)
        sizes.append(len(x))
    manifest = {
        "format": "fedadapt node data: npz with x (float32 [n, ...]) and y (int64 [n] labels or float32 [n, 1] "
                  "targets)",
        "task": fed.task, "num-partitions": num_partitions, "partitioner": fed.partitioner, "seed": fed.seed,
        "dirichlet-alpha": fed.dirichlet_alpha, "classes-per-client": fed.classes_per_client,
        "synthetic-dim": fed.synthetic_dim, "synthetic-heterogeneity": fed.synthetic_heterogeneity,
        "files": [p.name for p in files], "examples": sizes,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--num-partitions", type=int, required=True)
    d = AppConfig()
    ap.add_argument("--task", default=d.task)
    ap.add_argument("--partitioner", default=d.partitioner)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--dirichlet-alpha", type=float, default=d.dirichlet_alpha)
    ap.add_argument("--classes-per-client", type=int, default=d.classes_per_client)
    ap.add_argument("--synthetic-dim", type=int, default=d.synthetic_dim)
    ap.add_argument("--synthetic-heterogeneity", type=float, default=d.synthetic_heterogeneity)
    a = ap.parse_args(argv)
    if a.num_partitions < 1:
        ap.error("--num-partitions must be >= 1")
    files = convert(a.out, a.num_partitions, task=a.task, partitioner=a.partitioner, seed=a.seed,
                    dirichlet_alpha=a.dirichlet_alpha, classes_per_client=a.classes_per_client,
                    synthetic_dim=a.synthetic_dim, synthetic_heterogeneity=a.synthetic_heterogeneity)
    for f in files:
        print(f.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
