"""Learning-rate sweep by the papers' rule: lowest mean ``train-loss-before`` over the last rounds, mean over seeds.

Which lrs are swept comes from ``catalogue/sweep.toml`` and the registry: the client grid of an entry is its method's
(``[client-grid]``, default ``sgd``) unless a declared field picks another (``[client-grid-by-field]``); the server lr
is swept for methods whose hyper-parameters declare ``server_lr`` and that are not in ``[server] averaging``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .catalogue import Entry, Paper, load, registered, run_config_for, settings
from .report import _json_default
from .runner import Progress, Task, execute, last_window, server_lr_of, summarize

PARAMS = ("client", "server", "both")


@functools.cache
def _rules() -> dict[str, Any]:
    return load("sweep.toml")


def server_factors() -> tuple[float, ...]:
    return tuple(_rules()["server"]["factors"])


def sweep_grid(entry: Entry) -> tuple[float, ...]:
    """Client-lr grid of an entry (empty: the client lr is not swept)."""
    rules, spec = _rules(), registered().get(entry.method)
    grid = rules["client-grid"].get(entry.method, "sgd")
    for fld, by_value in rules["client-grid-by-field"].items():
        key = f"{entry.method}.{fld}"
        default = spec.defaults().get(key) if spec is not None else None
        grid = by_value.get(entry.overrides.get(key, default), grid)
    return tuple(rules["client-grids"][grid])


def server_tuned(method: str) -> bool:
    """Whether ``method``'s server lr is a tuned hyper-parameter: it declares ``server_lr`` and is not averaging."""
    spec = registered().get(method)
    if spec is None or method in _rules()["server"]["averaging"]:
        return False
    return "server_lr" in {f.name for f in dataclasses.fields(spec.hparams)}


def server_grid(paper: Paper, setting: str, entry: Entry) -> tuple[str, tuple[float, ...]] | None:
    """``(run-config key, server lrs)`` for entries of server-tuned methods, else ``None``."""
    if not server_tuned(entry.method):
        return None
    base = server_lr_of(run_config_for(paper, setting, entry, 0, 1, Path(".")))
    if not base:  # unset (a variant's table default): nothing to scale
        return None
    return f"{entry.method}.server-lr", tuple(float(f"{base * f:.6g}") for f in server_factors())


@dataclass(frozen=True)
class Plan:
    """The lr pairs of one entry: ``(client lr | None, server lr | None)``, ``None`` = the entry's own."""

    entry: Entry
    client: tuple[float, ...]
    server_key: str | None
    server: tuple[float | None, ...]

    @property
    def combos(self) -> list[tuple[float | None, float | None]]:
        return [(c, v) for c in (self.client or (None,)) for v in self.server]

    def overrides(self, c: float | None, v: float | None) -> dict[str, float | None]:
        return {**({"client-lr": c} if c is not None else {}), **({self.server_key: v} if self.server_key else {})}


def plan(paper: Paper, setting: str, grid: Sequence[float] | None, param: str) -> list[Plan]:
    """The entries to sweep (registered, with something to sweep) and their lr pairs."""
    methods, plans = registered(), []
    for e in paper.entries_for(setting):
        if e.method not in methods:
            continue
        cg = (tuple(grid) if grid else sweep_grid(e)) if param in ("client", "both") else ()
        sg = server_grid(paper, setting, e) if param in ("server", "both") else None
        if cg or sg:
            key, sv = sg if sg else (None, (None,))
            plans.append(Plan(e, cg, key, sv))
    return plans


def choose(p: Plan, scores: Mapping[tuple[float | None, float | None], float]) -> dict[str, Any]:
    """The lowest-score pair (ties: the smaller lrs), flagged when on the edge of its grid."""
    c, v = min(scores, key=lambda k: (scores[k], k[0] or 0.0, k[1] or 0.0))
    edge = [name for name, x, g in (("client-lr", c, p.client), ("server-lr", v, p.server))
            if x is not None and len(g) > 1 and x in (min(g), max(g))]  # type: ignore[type-var]  # no None in a grid
    label = lambda a, b: ",".join(x for x in (f"client={a:g}" if a is not None else "",  # noqa: E731
                                              f"server={b:g}" if b is not None else "") if x)
    return {"client_lr": c if c is not None else p.entry.overrides["client-lr"], "server_key": p.server_key,
            "server_lr": v, "at_edge": edge, "scores": {label(a, b): s for (a, b), s in scores.items()}}


def sweep(paper: Paper, setting: str, seeds: Sequence[int], rounds: int, out: Path,
          grid: Sequence[float] | None = None, param: str = "both", jobs: int = 1) -> dict[str, Any]:
    """Pick each entry's learning rates: lowest mean ``train-loss-before`` over the last rounds (mean over seeds).

    ``param``: ``client`` sweeps the client lr (grid per entry, or ``grid``), ``server`` the server lr of server-tuned
    methods (factors of the entry's own), ``both`` their product.  Divergent runs (non-finite loss or a failed run)
    rank last.  A choice on the edge of its grid is flagged (``at_edge``): the optimum may lie outside.
    """
    if param not in PARAMS:
        raise ValueError(f"param must be one of {', '.join(PARAMS)}, got {param!r}")
    plans = plan(paper, setting, grid, param)
    nodes = paper.nodes_for(setting)
    tasks = []
    for p in plans:
        for c, v in p.combos:
            over = p.overrides(c, v)
            name = "-".join(f"{k.split('.')[-1]}{x:g}" for k, x in over.items())
            for seed in seeds:
                cfg = run_config_for(paper, setting, p.entry, seed, rounds, out / "runs" / name, over)
                tasks.append(Task(f"sweep {paper.key}/{setting} {p.entry.label} {name} seed {seed}", cfg, nodes))
    done = iter(execute(tasks, jobs, Progress(len(tasks))))
    target = paper.target_for(setting)
    chosen = {}
    for p in plans:
        scores = {}
        for combo in p.combos:
            losses = [summarize(rows, target)["mean_train_loss_last"] if rows else math.inf
                      for rows, _, _ in (next(done) for _ in seeds)]
            scores[combo] = statistics.fmean(x if math.isfinite(x) else math.inf for x in losses)
        chosen[p.entry.label] = choose(p, scores)
    result = {"paper": paper.key, "setting": setting, "seeds": list(seeds), "rounds": rounds, "param": param,
              "rule": f"lowest mean train-loss-before over the last {last_window(rounds)} rounds, mean over seeds",
              "chosen": chosen}
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=2, default=_json_default))
    return result


def sweep_for(sweeps: Sequence[Mapping[str, Any]], paper: str, setting: str) -> Mapping[str, Any] | None:
    """The sweep that applies to ``paper`` on ``setting``: one made on that setting wins, else one made on another
    setting of the paper with the same task (digits lrs carry over between digits partitions, never to Shakespeare)."""
    table = settings()
    task = table[setting].task
    mine = [d for d in sweeps if d.get("paper") == paper and d.get("setting") in table
            and table[d["setting"]].task == task]
    return min(mine, key=lambda d: d.get("setting") != setting, default=None)


def overrides_from_sweep(data: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per label the run-config overrides a ``sweep.json`` chose (client lr, and the server lr where swept)."""
    out = {}
    for label, c in data["chosen"].items():
        o = {"client-lr": float(c["client_lr"])}
        if c.get("server_key") and c.get("server_lr") is not None:
            o[c["server_key"]] = float(c["server_lr"])
        out[label] = o
    return out
