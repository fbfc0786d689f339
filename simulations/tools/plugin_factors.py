"""Client-lr factors of the plug-in path, measured on an app of Flower quickstart-pytorch's shape.

``examples/pytorch_app`` is that app: the quickstart's CNN (on 8×8 digits), its DataLoader of
``{"img", "label"}`` batches, its loop (SGD with momentum 0.9, summed loss / ``(epochs * len(trainloader))``),
learning-rate 0.1, 1 local epoch, batch size 32, IID slices, every node trained every round.  Each method runs
through the README recipe (``ClientRound`` in the ClientApp, ``strategy_from_run_config`` in the ServerApp) with
``learning-rate`` = 0.1 × factor, in-process (``LoopbackGrid``), against **stock FedAvg** from the same initial
model: the same app before fedadapt (its own client returning ``{"train_loss", "num-examples"}``, Flower's
``FedAvg``, the app's SGD at lr 0.1).

Every shape (``--shapes``, default 5 nodes × 5 rounds and 10 × 10) runs the seeds (``--seeds``: ``torch.manual_seed``
before the app builds its model, and the run-config ``seed``) plus ``--unseeded`` runs as the app runs them: no seed
anywhere (the initial model from ``torch.seed()``, whose value is kept so that stock FedAvg starts from the same
model; fedadapt's ``seed`` left at its default).  A run *holds* when its final accuracy is at least stock FedAvg's
(same shape, same initial model) − 0.05; it *stalls* when its final model predicts one class for every test example;
it *diverges* when it fails or a round's mean client train loss is non-finite or ≥ 1.5 × stock's round-1 loss.

A method's registry factor (``CLIENT_LR_FACTOR`` in ``flower_strategies/core/registry.py``) runs first; when a run
of it stalls, diverges or does not hold, its neighbours on the grid ×0.01 / ×0.03 / … / ×10 / ×30 run too, then the
next one beyond the best while the best is the edge of those tried (twice at most; ``--grid``: the whole grid;
``--no-search``: none; ``--factors``: those instead; ``--only-factors``: those, not the registry's either).  The
factor kept: no stalls and no divergence first (else the fewest), then holds most often, then higher mean accuracy,
then the smaller factor.  Accuracy: the final global model on the union of the clients' held-out splits
(the app's ``test``).  ``--json`` keeps every run (its per-round train losses too).

    python -m simulations.tools.plugin_factors [--quick] [--shapes 5x5 10x10] [--seeds 0 1 2 3] [--unseeded 1]
                                               [--grid] [--json runs.json] [--out docs/results/plugin-factors.md]

``--quick``: one 2 × 3 shape, 1 seed, no unseeded run (a smoke run, seconds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import flower_strategies as fs
from simulations.engine.inprocess import LoopbackGrid

APP = Path(__file__).resolve().parents[2] / "examples" / "pytorch_app"
APP_LR = 0.1
GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
QUICK_METHODS = ("fedadam", "fedlada", "scaffold")
#: The server-side adaptive methods: also run at these server lrs (their default is in the table's header).
SERVER_ADAPTIVE, SERVER_LRS = ("adpfed", "fedadagrad", "fedadam", "fedyogi"), (0.03, 0.1)


def _app() -> Any:
    if str(APP) not in sys.path:
        sys.path.insert(0, str(APP))
    import pytorchapp.client_app
    import pytorchapp.server_app
    import pytorchapp.task

    return pytorchapp


def accuracy(state: dict[str, torch.Tensor], nodes: int) -> tuple[float, int]:
    """The app's ``test`` on the union of the clients' held-out splits: accuracy, and how many classes the model
    predicts there (1: it stalled at one class)."""
    task = _app().task
    model = task.Net()
    model.load_state_dict(state)
    hits = total = 0
    predicted: set[int] = set()
    for pid in range(nodes):
        loader = task.load_data(pid, nodes, 256)[1]
        n = len(loader.dataset)
        hits, total = hits + task.test(model, loader, torch.device("cpu"))[1] * n, total + n
        with torch.no_grad():
            predicted.update(int(c) for b in loader for c in model(b["img"]).argmax(1))
    return hits / total, len(predicted)


class LossSpy:
    """``LoopbackGrid`` interceptor: every train reply's train loss (metric ``key``), by round."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.by_round: dict[int, list[float]] = {}

    def __call__(self, request: Message, reply: Message, partition_id: int) -> Message:
        if request.metadata.message_type == MessageType.TRAIN and not reply.has_error():
            config: Any = request.content["config"]  # record values are typed as any record value
            metrics: Any = reply.content["metrics"]
            rnd = int(config["server-round"])
            value = metrics.get(self.key)
            if value is not None:
                self.by_round.setdefault(rnd, []).append(float(value))
        return reply

    def means(self) -> list[float]:
        return [sum(v) / len(v) for _, v in sorted(self.by_round.items())]


def stock_client_app() -> ClientApp:
    """The app before fedadapt: the quickstart's own ClientApp (its train(), its reply)."""
    task = _app().task
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = task.Net()
        model.load_state_dict(cast(ArrayRecord, msg.content["arrays"]).to_torch_state_dict())
        loader, _ = task.load_data(context.node_config["partition-id"], context.node_config["num-partitions"],
                                   context.run_config["batch-size"])
        loss = task.train(model, loader, context.run_config["local-epochs"], msg.content["config"]["lr"],
                          torch.device("cpu"))
        metrics = MetricRecord({"train_loss": loss, "num-examples": len(loader.dataset)})
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)

    return app


def _config(rounds: int, lr: float, **extra: Any) -> dict[str, Any]:
    return {"num-server-rounds": rounds, "fraction-train": 1.0, "fraction-evaluate": 0.0, "local-epochs": 1,
            "learning-rate": lr, "batch-size": 32, **extra}


@dataclass(frozen=True)
class Init:
    """Where a run starts: ``torch.manual_seed(torch_seed)`` before the app builds its model; ``run_seed``: the
    run-config ``seed`` (``None``: left at fedadapt's default, as an app that sets no seed runs)."""

    torch_seed: int
    run_seed: int | None

    @property
    def label(self) -> str:
        return f"seed {self.run_seed}" if self.run_seed is not None else f"unseeded (torch.seed() {self.torch_seed})"

    @staticmethod
    def unseeded() -> Init:
        torch.seed()  # a fresh, nondeterministic draw, as a process that seeds nothing gets
        return Init(torch.initial_seed(), None)


def run_stock(init: Init, rounds: int, nodes: int) -> dict[str, Any]:
    from flwr.serverapp.strategy import FedAvg

    app = _app()
    spy = LossSpy("train_loss")
    grid = LoopbackGrid(stock_client_app(), nodes, _config(rounds, APP_LR), intercept=spy)
    torch.manual_seed(init.torch_seed)
    initial = ArrayRecord(app.task.Net().state_dict())
    result = FedAvg(fraction_train=1.0, fraction_evaluate=0.0).start(
        grid=grid, initial_arrays=initial, train_config=ConfigRecord({"lr": APP_LR}), num_rounds=rounds)
    acc, classes = accuracy(result.arrays.to_torch_state_dict(), nodes)
    return {"acc": acc, "classes": classes, "losses": spy.means(), "error": ""}


def run_method(method: str, factor: float, init: Init, rounds: int, nodes: int, **extra: Any) -> dict[str, Any]:
    app = _app()
    spy = LossSpy("train-loss")
    with tempfile.TemporaryDirectory() as tmp:
        seed = {} if init.run_seed is None else {"seed": init.run_seed}
        cfg = _config(rounds, APP_LR * factor, method=method, output=f"{tmp}/model.pt", **seed, **extra)
        grid = LoopbackGrid(app.client_app.app, nodes, cfg, intercept=spy)
        torch.manual_seed(init.torch_seed)  # the app's server builds its initial Net() from torch's global RNG
        try:
            app.server_app.main(grid, Context(run_id=1, node_id=0, state=RecordDict(), run_config=cfg,
                                              node_config={}))
        except Exception as err:  # noqa: BLE001 - a failed run is a result here (RunFailed, ...)
            return {"acc": float("nan"), "classes": 0, "losses": spy.means(),
                    "error": f"{type(err).__name__}: {err}"[:120]}
        acc, classes = accuracy(torch.load(cfg["output"]), nodes)
        return {"acc": acc, "classes": classes, "losses": spy.means(), "error": ""}


@dataclass
class Shape:
    """One shape of the sweep (``nodes`` × ``rounds``), its starts and stock FedAvg from each of them."""

    nodes: int
    rounds: int
    inits: list[Init]
    stock: dict[Init, dict[str, Any]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.nodes}×{self.rounds}"

    def stock_run(self, init: Init) -> dict[str, Any]:
        if init not in self.stock:
            self.stock[init] = run_stock(init, self.rounds, self.nodes)
        return self.stock[init]

    def limit(self) -> float:
        """Divergence: a round's mean client train loss ≥ 1.5 × stock's mean round-1 loss (seeded starts)."""
        firsts = [self.stock_run(i)["losses"][0] for i in self.inits]
        return 1.5 * sum(firsts) / len(firsts)


def judge(run: dict[str, Any], stock: dict[str, Any], limit: float) -> dict[str, Any]:
    losses = run["losses"]
    diverged = bool(run["error"]) or not losses or not all(math.isfinite(v) and v < limit for v in losses)
    return {**run, "stock_acc": stock["acc"], "diverged": diverged, "stalls": run["classes"] == 1,
            "holds": not run["error"] and run["acc"] >= stock["acc"] - 0.05}


def evaluate(method: str, factor: float, shapes: list[Shape], unseeded: dict[str, list[Init]],
             **extra: Any) -> dict[str, Any]:
    """``method`` at ``factor`` on every shape from every start (the seeds, then that shape's unseeded starts)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for shape in shapes:
        limit = shape.limit()
        runs[shape.name] = [
            {**judge(run_method(method, factor, init, shape.rounds, shape.nodes, **extra), shape.stock_run(init),
                     limit), "init": init.label}
            for init in shape.inits + unseeded[shape.name]]
    every = [r for rs in runs.values() for r in rs]
    return {"factor": factor, "runs": runs, "holds": sum(r["holds"] for r in every), "total": len(every),
            "stalls": sum(r["stalls"] for r in every), "diverged": sum(r["diverged"] for r in every),
            "acc": sum(0.0 if math.isnan(r["acc"]) else r["acc"] for r in every) / len(every)}


def _rank(t: dict[str, Any]) -> tuple[bool, float, float, float, float]:
    """No stalls and no divergence first, then the fewest of them, then the largest share of runs that hold, then
    the higher mean accuracy, then the smaller factor."""
    bad = (t["stalls"] + t["diverged"]) / t["total"]
    return (not bad, -bad, t["holds"] / t["total"], round(t["acc"], 2), -t["factor"])


def _neighbours(factor: float) -> tuple[float, ...]:
    if factor in GRID:
        i = GRID.index(factor)
        return GRID[max(i - 1, 0):i] + GRID[i + 1:i + 2]
    return (factor / 3, factor * 3)


def _beyond(factor: float, tried: Mapping[float, Any]) -> float | None:
    """The grid's next factor beyond ``factor`` when ``factor`` is the lowest or highest of ``tried``."""
    if factor not in GRID:
        return None
    i = GRID.index(factor)
    if factor == min(tried) and i > 0:
        return GRID[i - 1]
    if factor == max(tried) and i + 1 < len(GRID):
        return GRID[i + 1]
    return None


def _clean(t: dict[str, Any]) -> bool:
    return not t["stalls"] and not t["diverged"] and t["holds"] == t["total"]


def _cell(t: dict[str, Any], shape: str) -> str:
    rs = t["runs"][shape]
    mean = sum(0.0 if math.isnan(r["acc"]) else r["acc"] for r in rs) / len(rs)
    marks = "".join("∅" if r["stalls"] else ("†" if r["diverged"] else "") for r in rs)
    return f"{sum(r['holds'] for r in rs)}/{len(rs)}, {mean:.3f}{' ' + marks if marks else ''}"


def _tally(t: dict[str, Any]) -> str:
    marks = "".join(f" ({n} {m})" for n, m in ((t["stalls"], "∅"), (t["diverged"], "†")) if n)
    return f"{t['holds']}/{t['total']}, {t['acc']:.3f}{marks}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one 2 × 3 shape, 1 seed, no unseeded run")
    ap.add_argument("--shapes", nargs="*", default=["5x5", "10x10"], help="NODESxROUNDS")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2, 3])
    ap.add_argument("--unseeded", type=int, default=1, help="unseeded runs per method and shape")
    ap.add_argument("--methods", nargs="*", default=None)
    ap.add_argument("--grid", action="store_true", help="run the whole grid for every method")
    ap.add_argument("--factors", type=float, nargs="*", default=None, help="extra factors to try for every method")
    ap.add_argument("--no-search", action="store_true", help="the registry factor only (no neighbours)")
    ap.add_argument("--only-factors", action="store_true", help="the --factors only (not the registry's)")
    ap.add_argument("--server-lrs", type=float, nargs="*", default=None,
                    help="also run each method that has a server lr at these server lrs, at its picked factor "
                         "(default: 0.03 and 0.1 for the server-side adaptive methods; none with --quick)")
    ap.add_argument("--json", default="", help="write every run (per-round train losses too) here")
    ap.add_argument("--out", default="", help="write the markdown page here")
    ap.add_argument("--merge", nargs="*", default=None, metavar="JSON",
                    help="write the page from these --json files (runs of several commands) instead of running")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.merge:
        return _merge(args)
    threads, level = torch.get_num_threads(), logging.getLogger("flwr").level
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    try:
        return _sweep(args)
    finally:
        torch.set_num_threads(threads)
        logging.getLogger("flwr").setLevel(level)


def _sweep(args: argparse.Namespace) -> int:
    methods = args.methods or (list(QUICK_METHODS) if args.quick else sorted(fs.METHODS))
    seeds = args.seeds[:1] if args.quick else args.seeds
    dims = [(2, 3)] if args.quick else [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    n_unseeded = 0 if args.quick else args.unseeded
    shapes = [Shape(n, r, [Init(s, s) for s in seeds]) for n, r in dims]
    t0 = time.time()
    lines = []
    for shape in shapes:
        stock = [shape.stock_run(i) for i in shape.inits]
        lines.append(f"stock FedAvg, {shape.name} (the app's own SGD-momentum at lr {APP_LR}, Flower's FedAvg): "
                     f"final accuracy {sum(r['acc'] for r in stock) / len(stock):.3f} (mean of seeds {seeds}); per "
                     "seed " + ", ".join(f"{r['acc']:.3f}" for r in stock)
                     + f"; divergence limit {shape.limit():.2f}")
    head = " | ".join(f"{s.name}: holds, mean acc" for s in shapes)
    lines += ["", f"| method | factor (was) | client lr | {head} | stalls | result | factors tried (holds/runs, "
              "mean acc) |", "|---|---|---|" + "---|" * len(shapes) + "---|---|---|"]
    print("\n".join(lines), flush=True)
    chosen: dict[str, float] = {}
    record: list[dict[str, Any]] = []
    for method in methods:
        unseeded = {s.name: [Init.unseeded() for _ in range(n_unseeded)] for s in shapes}
        was = fs.get_method(method).client_lr_factor
        tried = {} if args.only_factors else {was: evaluate(method, was, shapes, unseeded)}
        candidates = GRID if args.grid else (() if args.only_factors or _clean(tried[was]) or args.factors
                                             or args.no_search else _neighbours(was))
        for f in candidates + tuple(args.factors or ()):
            if f not in tried:
                tried[f] = evaluate(method, f, shapes, unseeded)
        # the best tried is at an edge: one step further
        for _ in range(0 if args.grid or args.factors or args.no_search else 2):
            best = max(tried.values(), key=_rank)
            step = _beyond(best["factor"], tried)
            if _clean(best) or step is None:
                break
            tried[step] = evaluate(method, step, shapes, unseeded)
        pick = max(tried.values(), key=_rank)
        chosen[method] = pick["factor"]
        result = ("STALLS" if pick["stalls"] else "DIVERGES" if pick["diverged"] else
                  "holds" if pick["holds"] == pick["total"] else f"holds {pick['holds']}/{pick['total']}")
        grid = ", ".join(f"×{f:g}: {_tally(t)}" for f, t in sorted(tried.items()))
        server_lrs = args.server_lrs if args.server_lrs is not None else \
            (SERVER_LRS if method in SERVER_ADAPTIVE and not args.quick else ())
        default_lr = getattr(fs.get_method(method).default_hparams(), "server_lr", None)
        if server_lrs and isinstance(default_lr, float | int):
            server = {lr: evaluate(method, pick["factor"], shapes, unseeded, **{f"{method}.server-lr": lr})
                      for lr in server_lrs}
            grid += f"; at ×{pick['factor']:g}, {method}.server-lr {default_lr:g} (default): " \
                    f"{pick['holds']}/{pick['total']}, " + ", ".join(f"{lr:g}: {_tally(t)}" for lr, t in server.items())
            record += [{"method": method, "factor": pick["factor"], "server_lr": lr, **t} for lr, t in server.items()]
        record += [{"method": method, **t} for t in tried.values()]
        cells = " | ".join(_cell(pick, s.name) for s in shapes)
        lines.append(f"| `{method}` | ×{pick['factor']:g} (×{was:g}) | {APP_LR * pick['factor']:.3g} | {cells} | "
                     f"{pick['stalls']} | {result} | {grid} |")
        print(lines[-1], flush=True)
    changed = {m: f for m, f in chosen.items() if f != fs.get_method(m).client_lr_factor}
    footer = ["", f"factors that differ from the registry: {changed or 'none'}",
              f"wall {time.time() - t0:.0f} s, 1 torch thread; {platform.machine()} {platform.system()}, "
              f"{datetime.date.today().isoformat()}; torch {torch.__version__}"]
    print("\n".join(footer), flush=True)
    if args.json:
        stock_runs = [{"shape": s.name, "init": i.label, **r} for s in shapes for i, r in s.stock.items()]
        Path(args.json).write_text(json.dumps({"argv": args.argv, "stock": stock_runs, "methods": record},
                                              default=str))
    if args.out:
        command = "python -m simulations.tools.plugin_factors " + " ".join(args.argv)
        page = [
            "# Client-lr factors of the plug-in path (generated)", "",
            "Generated by `" + command.strip() + "` (" + f"{datetime.date.today().isoformat()}, "
            f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, CPU only, 1 torch thread). What it "
            "measures, the rules and how a factor is picked: the docstring of `simulations/tools/plugin_factors.py`; "
            "what to make of it: [docs/plugin.md](../plugin.md).", "",
            "The app: `examples/pytorch_app` (Flower quickstart-pytorch's shape: its CNN on 8×8 digits, DataLoaders of "
            "`{\"img\", \"label\"}` batches, SGD with momentum 0.9, 1 local epoch, batch size 32, learning-rate "
            f"{APP_LR}), IID nodes, every node every round, in-process; shapes "
            f"{', '.join(s.name for s in shapes)} (nodes × rounds); from seeds {seeds} and {n_unseeded} unseeded "
            "start(s) per method and shape. *factor (was)*: the factor picked (the registry's when the run started); "
            f"*client lr*: {APP_LR} × factor; *holds*: runs whose final accuracy is ≥ stock FedAvg's from the same "
            "initial model − 0.05, of all runs; *mean acc*: the final global model's accuracy on the clients' held-out "
            "splits, mean over the runs; *stalls* / ∅: runs whose final model predicts one class; †: diverged "
            "(failed, or a non-finite or ≥ limit mean client train loss).", "",
            *lines, *footer,
        ]
        Path(args.out).write_text("\n".join(page) + "\n")
    return 0


def _pooled(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """Several evaluations of one method and factor (from several commands) as one."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for e in evals:
        for shape, rs in e["runs"].items():
            runs.setdefault(shape, []).extend(rs)
    every = [r for rs in runs.values() for r in rs]
    return {"factor": evals[0]["factor"], "runs": runs, "holds": sum(r["holds"] for r in every),
            "total": len(every), "stalls": sum(r["stalls"] for r in every),
            "diverged": sum(r["diverged"] for r in every),
            "acc": sum(0.0 if math.isnan(r["acc"]) else r["acc"] for r in every) / len(every)}


def _merge(args: argparse.Namespace) -> int:
    """The page from ``--json`` files: every method's evaluations pooled by factor, the factor kept by the sweep's
    rule (no stalls and no divergence first, then the larger share of runs that hold, …), server-lr runs beside."""
    stock: list[dict[str, Any]] = []
    evals: dict[str, dict[float, list[dict[str, Any]]]] = {}
    server: dict[str, list[dict[str, Any]]] = {}
    commands = []
    for path in args.merge:
        data = json.loads(Path(path).read_text())
        commands.append(f"`python -m simulations.tools.plugin_factors {' '.join(data.get('argv', []))}`")
        stock += data["stock"]
        for rec in data["methods"]:
            if "server_lr" in rec:
                server.setdefault(rec["method"], []).append(rec)
            else:
                evals.setdefault(rec["method"], {}).setdefault(float(rec["factor"]), []).append(rec)
    shapes = list(dict.fromkeys(r["shape"] for r in stock))
    lines = []
    for shape in shapes:
        seeded = [r["acc"] for r in stock if r["shape"] == shape and r["init"].startswith("seed")]
        lines.append(f"stock FedAvg, {shape} (the app's own SGD-momentum at lr {APP_LR}, Flower's FedAvg), seeded "
                     f"starts over all commands: final accuracy {sum(seeded) / len(seeded):.3f} (min "
                     f"{min(seeded):.3f}, max {max(seeded):.3f}, {len(seeded)} runs)")
    head = " | ".join(f"{s}: holds, mean acc" for s in shapes)
    lines += ["", f"| method | factor (registry) | client lr | {head} | stalls | result | factors measured "
              "(holds/runs, mean acc) |", "|---|---|---|" + "---|" * len(shapes) + "---|---|---|"]
    chosen = {}
    for method in sorted(evals):
        tried = {f: _pooled(e) for f, e in evals[method].items()}
        pick = max(tried.values(), key=_rank)
        chosen[method] = pick["factor"]
        was = fs.get_method(method).client_lr_factor
        result = ("STALLS" if pick["stalls"] else "DIVERGES" if pick["diverged"] else
                  "holds" if pick["holds"] == pick["total"] else f"holds {pick['holds']}/{pick['total']}")
        grid = ", ".join(f"×{f:g}: {_tally(t)}" for f, t in sorted(tried.items()))
        for rec in server.get(method, []):
            grid += f"; at ×{rec['factor']:g}, {method}.server-lr {rec['server_lr']:g}: {_tally(rec)}"
        cells = " | ".join(_cell(pick, s) if s in pick["runs"] else "–" for s in shapes)
        lines.append(f"| `{method}` | ×{pick['factor']:g} (×{was:g}) | {APP_LR * pick['factor']:.3g} | {cells} | "
                     f"{pick['stalls']} | {result} | {grid} |")
    changed = {m: f for m, f in chosen.items() if f != fs.get_method(m).client_lr_factor}
    page = [
        "# Client-lr factors of the plug-in path (generated)", "",
        f"Generated by `python -m simulations.tools.plugin_factors {' '.join(args.argv)}` from the runs of "
        + "; ".join(commands) + f" ({platform.machine()} {platform.system()}, {os.cpu_count()} cores, CPU only, 1 "
        "torch thread each). What it measures, the rules and how a factor is picked: the docstring of "
        "`simulations/tools/plugin_factors.py`; what to make of it: [docs/plugin.md](../plugin.md).", "",
        "The app: `examples/pytorch_app` (Flower quickstart-pytorch's shape: its CNN on 8×8 digits, DataLoaders of "
        "`{\"img\", \"label\"}` batches, SGD with momentum 0.9, 1 local epoch, batch size 32, learning-rate "
        f"{APP_LR}), IID nodes, every node every round, in-process; shapes {', '.join(shapes)} (nodes × rounds). "
        "*factor (registry)*: the factor kept (the registry's); *client lr*: "
        f"{APP_LR} × factor; *holds*: runs whose final accuracy is ≥ stock FedAvg's from the same initial model − "
        "0.05, of all runs (each command's seeded starts and its unseeded ones: `torch.seed()`, fedadapt's `seed` "
        "left at its default); *mean acc*: the final global model's accuracy on the clients' held-out splits, mean "
        "over the runs; *stalls* / ∅: runs whose final model predicts one class; †: diverged (failed, or a "
        "non-finite or ≥ 1.5 × stock's round-1 mean client train loss).", "",
        *lines, "", f"factors kept that differ from the registry: {changed or 'none'}",
    ]
    Path(args.out or "plugin-factors.md").write_text("\n".join(page) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
