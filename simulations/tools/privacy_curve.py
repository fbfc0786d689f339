"""Measure the privacy–accuracy curve of native user-level DP (core/privacy.py) on digits, one method per family.

    python -m simulations.tools.privacy_curve [OUT_DIR]      # default: docs/results/privacy
    python -m simulations.tools.privacy_curve OUT_DIR --methods fedlamb,mimelite   # (re)run some; keep the others' rows

Each method runs in-process (real ServerApp + ClientApp, :func:`simulations.engine.inprocess.run_inprocess`) on
digits-mlp, 20 nodes (iid), 10 sampled per round, 20 rounds, 5 local steps of batch 16, with ``dp-clip`` C = 1 and each
noise multiplier of :data:`NOISE` (plus the non-private run).  Writes ``curve.csv`` (method, z, ε at δ = 1e-5 after the
last round, final test accuracy) and ``curve.png`` (final accuracy vs ε, one line per method).  The DP noise comes
from the OS (not from ``seed``): accuracies vary from run to run; ε does not.
"""

from __future__ import annotations

import argparse
import csv
import json
import tempfile
from pathlib import Path

#: One method per paper family (FedOpt, SCAFFOLD/FedCM/FedLADA, FedDA, FedLocal, LocalUpdate, Fed-LAMB, Mime).
METHODS = ("fedavg", "fedadam", "scaffold", "fedcm", "fedlada", "fedda", "fedlocal", "localupdate", "fedlamb",
           "mimelite")
#: Noise multipliers z (0 = clipping only, reported as ε = ∞).
NOISE = (0.0, 0.5, 1.0, 2.0, 4.0)
CLIP = 1.0
BASE = {"num-server-rounds": 20, "local-steps": 5, "batch-size": 16, "partitioner": "iid", "fraction-train": 0.5,
        "min-available-nodes": 20, "seed": 0, "dp-delta": 1e-5}
NODES = 20


def run(method: str, noise: float | None, out: Path) -> dict[str, float | str | None]:
    """One run (``noise`` None = non-private); its final row."""
    from simulations.engine.inprocess import run_inprocess

    name = f"{method}-{'plain' if noise is None else noise}"
    cfg: dict[str, object] = {**BASE, "method": method, "output-dir": str(out), "run-name": name}
    if noise is not None:
        cfg.update({"dp-clip": CLIP, "dp-noise-multiplier": noise})
    run_inprocess(cfg, NODES)
    last = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()][-1]
    return {"method": method, "noise-multiplier": "none" if noise is None else noise,
            "epsilon": last.get("dp-epsilon"), "test-accuracy": last.get("test-accuracy")}


def plot(rows: list[dict[str, float | str | None]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for method in METHODS:
        pts = sorted((float(r["epsilon"]), float(r["test-accuracy"]))  # type: ignore[arg-type]
                     for r in rows if r["method"] == method and r["epsilon"] is not None)
        plain = [float(r["test-accuracy"]) for r in rows  # type: ignore[arg-type]
                 if r["method"] == method and r["noise-multiplier"] == "none"]
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        if plain:
            ax.axhline(plain[0], color=line.get_color(), linestyle=":", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("ε after 20 rounds (δ = 1e-5, user level, replace-one)")
    ax.set_ylabel("final test accuracy (digits-mlp)")
    ax.set_title(f"Native DP on digits: 20 nodes, 10 sampled/round, clip {CLIP:g}; dotted = non-private")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="docs/results/privacy", type=Path)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of the methods to run")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = args.methods.split(",")
    table = args.out / "curve.csv"
    rows: list[dict[str, float | str | None]] = []
    if table.exists():  # the rows of the methods not run now
        rows = [{k: (None if v == "" else v) for k, v in r.items()} for r in csv.DictReader(table.open())
                if r["method"] not in chosen]
    with tempfile.TemporaryDirectory() as tmp:
        for method in chosen:
            for noise in (None, *NOISE):
                rows.append(run(method, noise, Path(tmp)))
                print(rows[-1], flush=True)
    rows.sort(key=lambda r: METHODS.index(str(r["method"])))
    with table.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out / "curve.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
