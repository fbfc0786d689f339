"""Learning-rate sweep by the papers' rule: lowest mean ``train-loss-before`` over the last rounds, mean over seeds.

Which lrs are swept comes from ``catalogue/sweep.toml`` and the registry: the client grid of an entry is its method's
(``[client-grid]``, default ``sgd``) unless a declared field picks another (``[client-grid-by-field]``); the server lr
is swept for methods whose hyper-parameters declare ``server_lr`` and that are not in ``[server] averaging``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
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
    """The swept values of one entry: a product over run-config ``keys``, one value tuple per key."""

    entry: Entry
    keys: tuple[str, ...]
    values: tuple[tuple[Any, ...], ...]

    @property
    def combos(self) -> list[tuple[Any, ...]]:
        return list(itertools.product(*self.values))

    def overrides(self, combo: Sequence[Any]) -> dict[str, Any]:
        return dict(zip(self.keys, combo, strict=True))

    def label(self, combo: Sequence[Any]) -> str:
        """``client=0.1,server=0.03`` (the suite's lrs) or ``client-lr=0.1,weight-decay=0.01`` (a paper's grid)."""
        return ",".join(f"{_short(k)}={x:g}" for k, x in zip(self.keys, combo, strict=True))


def _short(key: str) -> str:
    if key == "client-lr":
        return "client"
    return "server" if key.endswith(".server-lr") else key.split(".")[-1]


def _edge_name(key: str) -> str:
    return {"client": "client-lr", "server": "server-lr"}.get(_short(key), _short(key))


def thinned(values: Sequence[Any], at_most: int) -> tuple[Any, ...]:
    """At most ``at_most`` of ``values`` (0: all), evenly spread over the list and keeping both ends."""
    if at_most <= 0 or len(values) <= at_most:
        return tuple(values)
    if at_most == 1:
        return (values[len(values) // 2],)
    return tuple(values[round(i * (len(values) - 1) / (at_most - 1))] for i in range(at_most))


def plan(paper: Paper, setting: str, grid: Sequence[float] | None, param: str, thin: int = 0) -> list[Plan]:
    """The entries to sweep (registered, with something to sweep) and their values: the paper's own grid for a
    label that has one (``[sweep] grids``; ``grid`` replaces its client lrs), else the client lr grid (or ``grid``)
    × the server lr grid by ``param``; ``thin``: at most that many values of each key's grid (not of ``grid`` nor of
    the server factors)."""
    methods, plans = registered(), []
    for e in paper.entries_for(setting):
        if e.method not in methods:
            continue
        own = paper.sweep_grids.get(e.label)
        if own:
            chosen = {k: tuple(grid) if grid and k == "client-lr" else thinned(v, thin) for k, v in own.items()}
            plans.append(Plan(e, tuple(chosen), tuple(chosen.values())))
            continue
        cg = (tuple(grid) if grid else thinned(sweep_grid(e), thin)) if param in ("client", "both") else ()
        sg = server_grid(paper, setting, e) if param in ("server", "both") else None
        keys, values = (("client-lr",), (cg,)) if cg else ((), ())
        if sg:
            keys, values = (*keys, sg[0]), (*values, sg[1])
        if keys:
            plans.append(Plan(e, keys, values))
    return plans


def choose(p: Plan, scores: Mapping[tuple[Any, ...], float]) -> dict[str, Any]:
    """The lowest-score combination (ties: the smaller values), flagged when on the edge of its grid."""
    best = min(scores, key=lambda k: (scores[k], *k))
    over = p.overrides(best)
    edge = [_edge_name(k) for k, x, g in zip(p.keys, best, p.values, strict=True)
            if len(g) > 1 and x in (min(g), max(g))]
    server_key = next((k for k in p.keys if k.endswith(".server-lr")), None)
    return {"client_lr": over.get("client-lr", p.entry.overrides.get("client-lr")), "server_key": server_key,
            "server_lr": over.get(server_key) if server_key else None, "overrides": over, "at_edge": edge,
            "scores": {p.label(k): s for k, s in scores.items()}}


def sweep(paper: Paper, setting: str, seeds: Sequence[int], rounds: int, out: Path,
          grid: Sequence[float] | None = None, param: str = "both", jobs: int = 1, thin: int = 0) -> dict[str, Any]:
    """Pick each entry's learning rates: by default the lowest mean ``train-loss-before`` over the last rounds (mean
    over seeds); a paper with its own ``[sweep]`` ranks by its ``metric`` over its grids (``thin``: at most that many
    values per key, evenly spread, ends kept).

    ``param``: ``client`` sweeps the client lr (grid per entry, or ``grid``), ``server`` the server lr of server-tuned
    methods (factors of the entry's own), ``both`` their product.  Divergent runs (non-finite score or a failed run)
    rank last.  A choice on the edge of its grid is flagged (``at_edge``): the optimum may lie outside.
    """
    if param not in PARAMS:
        raise ValueError(f"param must be one of {', '.join(PARAMS)}, got {param!r}")
    plans = plan(paper, setting, grid, param, thin)
    nodes = paper.nodes_for(setting)
    metric = paper.sweep_metric or "mean_train_loss_last"
    sign = -1.0 if "accuracy" in metric else 1.0  # the score is minimised
    tasks = []
    for p in plans:
        for combo in p.combos:
            over = p.overrides(combo)
            name = "-".join(f"{k.split('.')[-1]}{x:g}" for k, x in over.items())
            for seed in seeds:
                cfg = run_config_for(paper, setting, p.entry, seed, rounds, out / "runs" / name, over)
                tasks.append(Task(f"sweep {paper.key}/{setting} {p.entry.label} {name} seed {seed}", cfg, nodes,
                                  settings()[setting].engine))
    done = iter(execute(tasks, jobs, Progress(len(tasks))))
    target = paper.target_for(setting)
    chosen = {}
    for p in plans:
        scores = {}
        for combo in p.combos:
            values = [sign * _num(summarize(rows, target)[metric]) if rows else math.inf
                      for rows, _, _ in (next(done) for _ in seeds)]
            scores[combo] = statistics.fmean(x if math.isfinite(x) else math.inf for x in values)
        chosen[p.entry.label] = choose(p, scores)
    rule = (f"{'highest' if sign < 0 else 'lowest'} mean {metric} (last {last_window(rounds)} rounds), mean over seeds"
            if paper.sweep_metric else
            f"lowest mean train-loss-before over the last {last_window(rounds)} rounds, mean over seeds")
    result = {"paper": paper.key, "setting": setting, "seeds": list(seeds), "rounds": rounds, "param": param,
              "thin": thin, "rule": rule, "chosen": chosen}
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=2, default=_json_default))
    return result


def _num(v: Any) -> float:
    return math.nan if v is None else float(v)


def sweep_for(sweeps: Sequence[Mapping[str, Any]], paper: str, setting: str) -> Mapping[str, Any] | None:
    """The sweep that applies to ``paper`` on ``setting``: one made on that setting wins, else one made on another
    setting of the paper with the same task (digits lrs carry over between digits partitions, never to Shakespeare)."""
    table = settings()
    task = table[setting].task
    mine = [d for d in sweeps if d.get("paper") == paper and d.get("setting") in table
            and table[d["setting"]].task == task]
    return min(mine, key=lambda d: d.get("setting") != setting, default=None)


def overrides_from_sweep(data: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per label the run-config overrides a ``sweep.json`` chose (client lr, and the server lr where swept; every
    swept key for a paper's own grid)."""
    out: dict[str, dict[str, Any]] = {}
    for label, c in data["chosen"].items():
        if "overrides" in c:
            out[label] = dict(c["overrides"])
            continue
        o = {"client-lr": float(c["client_lr"])}
        if c.get("server_key") and c.get("server_lr") is not None:
            o[c["server_key"]] = float(c["server_lr"])
        out[label] = o
    return out
