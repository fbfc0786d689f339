"""Theory plots: paper 000 Fig. 1 (fixed-point bias of local adaptivity) and paper 003's surrogate fixed point.

The Fig. 1 runs are described by ``catalogue/theory.toml``: ``client-lrs``, a base ``run-config`` (task, model,
method and its fixed keys), one ``[curves]`` entry of run-config keys per correction, and ``server-lr-key`` (reported
in the JSON next to the distances).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .catalogue import load
from .runner import run_one


def fixed_point_runs(out: Path, spec: dict[str, Any] | None = None) -> dict[str, list[float]]:
    """Paper 000 Fig. 1 on our synthetic least-squares federation: ‖x_T − x*‖ per correction and client lr.

    Clients run full-batch steps of restarted local AdaGrad; x* is the minimiser of the example-weighted global loss
    (ordinary least squares on all clients' training data, the objective of ``weighting = examples``).  Without
    correction the fixed point moves with the client lr and does not reach x* as the lr decays; local / joint
    correction remove the preconditioner bias.
    """
    import numpy as np
    import torch

    from app_common.task import synthetic_client

    spec = spec or load("theory.toml")
    base = spec["run-config"]
    clients = int(base["synthetic-clients"])
    parts = [synthetic_client(i, base["synthetic-dim"], base["synthetic-heterogeneity"], base["seed"])
             for i in range(clients)]
    a = np.concatenate([p[0] for p in parts]).astype(np.float64)
    y = np.concatenate([p[1] for p in parts]).astype(np.float64)[:, 0]
    x_star = np.linalg.lstsq(a, y, rcond=None)[0]
    dist: dict[str, list[float]] = {}
    for curve, keys in spec["curves"].items():
        dist[curve] = []
        for lr in spec["client-lrs"]:
            cfg = {**base, **keys, "client-lr": lr, "output-dir": str(out / "runs"),
                   "run-name": f"fixedpoint-{curve}-lr{lr:g}"}
            run_one(cfg, clients)
            w = torch.load(out / "runs" / cfg["run-name"] / "model.pt")["w.weight"].numpy()[0]
            dist[curve].append(float(np.linalg.norm(w - x_star)))
    return dist


def theory(out: Path) -> list[Path]:
    """Write ``fixed_point_bias.png`` (+ ``fixed_point_bias.json``) and paper 003's ``surrogate_fixed_point.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from simulations.tools import surrogate_plot

    spec = load("theory.toml")
    lrs, rounds = spec["client-lrs"], spec["run-config"]["num-server-rounds"]
    out.mkdir(parents=True, exist_ok=True)
    dist = fixed_point_runs(out, spec)
    server_lr = {curve: keys.get(spec["server-lr-key"]) for curve, keys in spec["curves"].items()}
    (out / "fixed_point_bias.json").write_text(json.dumps({"client_lr": lrs, "distance": dist, "server_lr": server_lr},
                                                          indent=2))
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for corr, d in dist.items():
        ax.plot(lrs, d, marker="o", label=f"correction = {corr}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("client learning rate η (restarted local AdaGrad, K = 10 full-batch steps)")
    ax.set_ylabel(f"‖x_T − x*‖ after {rounds} rounds")
    ax.set_title("Paper 000 Fig. 1: fixed-point bias on heterogeneous least squares", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fixed_point_bias.png", dpi=110)
    plt.close(fig)
    surrogate = surrogate_plot.main([str(out / "surrogate_fixed_point.png")])
    return [out / "fixed_point_bias.png", out / "fixed_point_bias.json", surrogate]
