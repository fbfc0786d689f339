"""Client-lr factors of the plug-in path, measured on an app of Flower quickstart-pytorch's shape.

``examples/pytorch_app`` is that app: the quickstart's CNN (on 8×8 digits), its DataLoader of
``{"img", "label"}`` batches, its loop (SGD with momentum 0.9, summed loss / ``len(trainloader)``), learning-rate 0.1,
1 local epoch, batch size 32, 10 SuperNodes (IID slices), every node trained every round.  Each method runs through
the README recipe (``ClientRound`` in the ClientApp, ``strategy_from_run_config`` in the ServerApp) with
``learning-rate`` = 0.1 × factor, in-process (``LoopbackGrid``), against **stock FedAvg**: the same app before
fedadapt (its own client returning ``{"train_loss", "num-examples"}``, Flower's ``FedAvg``, the app's SGD at lr 0.1).

A factor *passes* when no seed diverges (the run completes and every round's mean client train loss is finite and
below 1.5 × stock FedAvg's round-1 loss: above it, local steps made the untrained model worse) and the mean final
accuracy over the seeds is at least stock FedAvg's − 0.05.  A method keeps its registry factor
(``CLIENT_LR_FACTOR`` in ``flower_strategies/core/registry.py``) when it passes; otherwise the grid ×0.1 / ×0.3 /
×1 / ×3 / ×10 runs and the best passing factor is proposed.  Accuracy: the final global model on the union of the
10 clients' held-out splits (the app's ``test``).

    python -m simulations.tools.plugin_factors [--quick] [--seeds 0 1] [--grid] [--out docs/results/plugin-factors.md]

``--quick``: 3 methods, 3 rounds, 1 seed (a smoke run, seconds).  ``--grid``: the whole grid for every method.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import flower_strategies as fs
from simulations.engine.inprocess import LoopbackGrid

APP = Path(__file__).resolve().parents[2] / "examples" / "pytorch_app"
APP_LR, NODES, ROUNDS = 0.1, 10, 10
GRID = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
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


def accuracy(state: dict[str, torch.Tensor], nodes: int) -> float:
    """The app's ``test`` on the union of the clients' held-out splits."""
    task = _app().task
    model = task.Net()
    model.load_state_dict(state)
    hits = total = 0
    for pid in range(nodes):
        loader = task.load_data(pid, nodes, 256)[1]
        n = len(loader.dataset)
        hits, total = hits + task.test(model, loader, torch.device("cpu"))[1] * n, total + n
    return hits / total


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


def run_stock(seed: int, rounds: int, nodes: int) -> dict[str, Any]:
    from flwr.serverapp.strategy import FedAvg

    app = _app()
    spy = LossSpy("train_loss")
    grid = LoopbackGrid(stock_client_app(), nodes, _config(rounds, APP_LR), intercept=spy)
    torch.manual_seed(seed)
    initial = ArrayRecord(app.task.Net().state_dict())
    result = FedAvg(fraction_train=1.0, fraction_evaluate=0.0).start(
        grid=grid, initial_arrays=initial, train_config=ConfigRecord({"lr": APP_LR}), num_rounds=rounds)
    return {"acc": accuracy(result.arrays.to_torch_state_dict(), nodes), "losses": spy.means(), "error": ""}


def run_method(method: str, factor: float, seed: int, rounds: int, nodes: int, **extra: Any) -> dict[str, Any]:
    app = _app()
    spy = LossSpy("train-loss")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(rounds, APP_LR * factor, method=method, seed=seed, output=f"{tmp}/model.pt", **extra)
        grid = LoopbackGrid(app.client_app.app, nodes, cfg, intercept=spy)
        torch.manual_seed(seed)  # the app's server builds its initial Net() from torch's global RNG
        try:
            app.server_app.main(grid, Context(run_id=1, node_id=0, state=RecordDict(), run_config=cfg,
                                              node_config={}))
        except Exception as err:  # noqa: BLE001 - a failed run is a result here (RunFailed, ...)
            return {"acc": float("nan"), "losses": spy.means(), "error": f"{type(err).__name__}: {err}"[:120]}
        return {"acc": accuracy(torch.load(cfg["output"]), nodes), "losses": spy.means(), "error": ""}


def diverged(run: dict[str, Any], limit: float) -> bool:
    losses = run["losses"]
    return bool(run["error"]) or not losses or not all(math.isfinite(v) and v < limit for v in losses)


def evaluate(method: str, factor: float, seeds: list[int], rounds: int, nodes: int, limit: float,
             floor: float, **extra: Any) -> dict[str, Any]:
    runs = [run_method(method, factor, s, rounds, nodes, **extra) for s in seeds]
    acc = sum(r["acc"] for r in runs) / len(runs)
    bad = any(diverged(r, limit) for r in runs)
    return {"factor": factor, "acc": acc, "loss1": sum(r["losses"][0] if r["losses"] else math.nan for r in runs)
            / len(runs), "max_loss": max((max(r["losses"]) if r["losses"] else math.nan) for r in runs),
            "diverged": bad, "passes": not bad and acc >= floor, "errors": [r["error"] for r in runs if r["error"]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 methods, 3 rounds, 1 seed")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--methods", nargs="*", default=None)
    ap.add_argument("--grid", action="store_true", help="run the whole grid for every method")
    ap.add_argument("--factors", type=float, nargs="*", default=None, help="extra factors to try for every method")
    ap.add_argument("--server-lrs", type=float, nargs="*", default=None,
                    help="also run each method that has a server lr at these server lrs, at its picked factor "
                         "(default: 0.03 and 0.1 for the server-side adaptive methods; none with --quick)")
    ap.add_argument("--out", default="", help="write the markdown table here")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
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
    rounds, seeds = (3, args.seeds[:1]) if args.quick else (args.rounds, args.seeds)
    t0 = time.time()
    stock = [run_stock(s, rounds, NODES) for s in seeds]
    stock_acc = sum(r["acc"] for r in stock) / len(stock)
    stock_loss1 = sum(r["losses"][0] for r in stock) / len(stock)
    limit, floor = 1.5 * stock_loss1, stock_acc - 0.05
    lines = [f"stock FedAvg (the app's own SGD-momentum at lr {APP_LR}, Flower's FedAvg): final accuracy "
             f"{stock_acc:.3f}, round-1 train loss {stock_loss1:.3f} (mean of seeds {seeds}); per seed "
             + ", ".join(f"{r['acc']:.3f}" for r in stock), "",
             f"divergence: a round's mean client train loss non-finite or ≥ {limit:.2f} (1.5 × stock round-1) or "
             f"the run failed; pass: no seed diverges and mean accuracy ≥ {floor:.3f} (stock − 0.05)", "",
             "| method | factor (was) | client lr | final acc | round-1 train loss | max train loss | result | "
             "grid tried (factor: acc, † = diverged) |",
             "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    chosen: dict[str, float] = {}
    for method in methods:
        was = fs.get_method(method).client_lr_factor
        first = evaluate(method, was, seeds, rounds, NODES, limit, floor)
        tried = {was: first}
        if args.grid or not first["passes"] or args.factors:  # --factors without --grid: those instead of the grid
            for f in (GRID if args.grid or not args.factors else ()) + tuple(args.factors or ()):
                if f not in tried:
                    tried[f] = evaluate(method, f, seeds, rounds, NODES, limit, floor)
        passing = [t for t in tried.values() if t["passes"]]
        if first["passes"]:
            pick = first
        elif passing:
            pick = max(passing, key=lambda t: (round(t["acc"], 2), -t["factor"]))
        else:  # nothing passes: the best non-diverging, else the best
            calm = [t for t in tried.values() if not t["diverged"]] or list(tried.values())
            pick = max(calm, key=lambda t: t["acc"])
        chosen[method] = pick["factor"]
        result = "pass" if pick["passes"] else ("below stock − 0.05" if not pick["diverged"] else "DIVERGED")
        grid = ", ".join(f"×{f:g}: {t['acc']:.3f}{'†' if t['diverged'] else ''}" for f, t in sorted(tried.items()))
        server_lrs = args.server_lrs if args.server_lrs is not None else \
            (SERVER_LRS if method in SERVER_ADAPTIVE and not args.quick else ())
        default_lr = getattr(fs.get_method(method).default_hparams(), "server_lr", None)
        if server_lrs and isinstance(default_lr, float | int):
            server = {lr: evaluate(method, pick["factor"], seeds, rounds, NODES, limit, floor,
                                   **{f"{method}.server-lr": lr}) for lr in server_lrs}
            grid += "; at ×{:g}, {}.server-lr {:g} (default): {:.3f}, ".format(
                pick["factor"], method, default_lr, pick["acc"]) + ", ".join(
                f"{lr:g}: {t['acc']:.3f}{'†' if t['diverged'] else ''}" for lr, t in server.items())
        lines.append(f"| `{method}` | ×{pick['factor']:g} (×{was:g}) | {APP_LR * pick['factor']:.3g} | "
                     f"{pick['acc']:.3f} | {pick['loss1']:.3f} | {pick['max_loss']:.3f} | {result} | {grid} |")
        print(lines[-1], flush=True)
    changed = {m: f for m, f in chosen.items() if f != fs.get_method(m).client_lr_factor}
    footer = [
        "", f"factors that differ from the registry: {changed or 'none'}",
        f"wall {time.time() - t0:.0f} s, 1 torch thread; {platform.machine()} {platform.system()}, "
        f"{datetime.date.today().isoformat()}; torch {torch.__version__}",
    ]
    print("\n".join(footer), flush=True)
    if args.out:
        command = "python -m simulations.tools.plugin_factors " + " ".join(args.argv)
        page = [
            "# Client-lr factors of the plug-in path (generated)", "",
            "Generated by `" + command.strip() + "` (" + f"{datetime.date.today().isoformat()}, "
            f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, CPU only, 1 torch thread). What it "
            "measures, the pass rule and how a factor is picked: the docstring of "
            "`simulations/tools/plugin_factors.py`; what to make of it: [docs/plugin.md](../plugin.md).", "",
            "The app: `examples/pytorch_app` (Flower quickstart-pytorch's shape: its CNN on 8×8 digits, DataLoaders of "
            "`{\"img\", \"label\"}` batches, SGD with momentum 0.9, 1 local epoch, batch size 32, learning-rate "
            f"{APP_LR}), {NODES} SuperNodes (IID), every node every round, {rounds} rounds, seeds {seeds}, in-process. "
            "*factor (was)*: the factor picked (the registry's when the run started); *client lr*: "
            f"{APP_LR} × factor; *final acc*: mean over the seeds of the final global model's accuracy on the clients' "
            "held-out splits; train losses: the mean over the clients of the loss the app's train() returned.", "",
            *lines, *footer,
        ]
        Path(args.out).write_text("\n".join(page) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
