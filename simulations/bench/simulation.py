"""Benchmark: simulation overhead against a plain sequential PyTorch loop doing the same local work.

    python -m simulations.bench.simulation                     # digits-mlp, 10 rounds, E ∈ {1, 5}, N ∈ {10, 100}
    python -m simulations.bench.simulation --ray               # + the Ray simulation (python -m simulations.launch sim)
    python -m simulations.bench.simulation --nodes 3 --rounds 2 --epochs 1   # smoke run (the test uses it)

For every (E, N) it prints the CPU and wall time of

* ``plain``  — a hand-written loop: build the model, then per round and client: load the global weights, plain
  ``torch.optim.SGD`` over exactly the mini-batches of ``core/client/data.py``'s ``batch_indices`` (same seed, round,
  client key), then the example-weighted average of the client models (the data are loaded once, before timing;
  the final test evaluation is not timed);
* ``engine`` — :func:`simulations.engine.inprocess.run_inprocess`: the real ServerApp + ClientApp in this process, every
  message a real Flower ``Message`` with serialised ``ArrayRecord``s, with ``train-loss-before = false`` and
  ``learning-curve = false`` (:data:`LEAN`: the plain loop computes neither) — it still validates every reply,
  evaluates the global model centrally on the test split before round 1 and after every round, writes
  ``metrics.jsonl``/``metrics.csv``, ``model.pt`` and ``summary.json``;
* ``defaults`` — the same run with the app's defaults (+ ``train-loss-before``: one forward pass over each client's
  data per round, + ``learning_curve.png``); CPU seconds only;
* ``ray``    (``--ray``) — a real ``python -m simulations.launch sim`` run (lean settings); its steady state is the
  mean of the ``seconds`` column of ``metrics.jsonl`` over the rounds after the first (start-up of Ray excluded),
  × rounds;
* ``floor``  — the least any runtime built on Flower's messages can do: the plain loop passing its weights through
  bare Flower messages (:func:`flower_exchange`: per client the train ``Message``, the client reading the model's
  arrays, its reply ``Message`` with the model ``ArrayRecord`` + a ``MetricRecord`` + a ``ConfigRecord``, the server
  reading the reply's arrays; no strategy, validation, metrics or files).  It is measured in the loop, not added
  up, because the messages between the clients also slow the training itself down (caches); for Ray additionally
  Flower's fixed 0.1-s poll per round (``flwr/server/superlink/fleet/vce/vce_api.py``: the Ray backend fetches new
  messages from the LinkState every 0.1 s), i.e. at least ``max(floor round, 0.1 s)`` per round;

and the ratios ``engine / plain``, ``ray / plain`` (target ≤ 1.10) and ``floor / plain``.  Every measurement runs
in a fresh child process (imports and torch's first-call initialisation are done before timing: not a per-run cost).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import cast


def warm_up() -> None:
    """One untimed forward/backward/SGD step (torch's first-call initialisation is not anyone's per-run cost)."""
    import torch

    from app_common.task import build_model

    torch.set_num_threads(1)
    model = build_model("digits-mlp", 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(model(torch.zeros(4, 64)), torch.zeros(4, dtype=torch.long)).backward()
    opt.step()


#: What the plain loop does not do either: the clients' train-loss-before and the learning-curve plot.
LEAN = {"train-loss-before": False, "learning-curve": False}


def run_config(nodes: int, rounds: int, epochs: int, out: str, lean: bool = True) -> dict:
    return {"method": "fedavg", "task": "digits-mlp", "num-server-rounds": rounds, "local-epochs": epochs,
            "min-available-nodes": nodes, "min-train-nodes": nodes, "partitioner": "iid", "seed": 0,
            "client-lr": 0.1, "batch-size": 32, "output-dir": out,
            "run-name": f"bench-n{nodes}-e{epochs}{'' if lean else '-defaults'}", **(LEAN if lean else {})}


# ------------------------------------------------------------------------------------------ children
def plain(nodes: int, rounds: int, epochs: int, messages: bool = False) -> dict:
    """The plain loop; ``messages=True``: the same loop passing its weights through bare Flower messages (the floor)."""
    import numpy as np
    import torch

    from app_common.task import build_model, digits_partition, digits_split
    from flower_strategies.core.client import batch_indices

    torch.set_num_threads(1)
    data = [digits_partition(i, nodes, partitioner="iid", seed=0) for i in range(nodes)]
    _, _, x_te, y_te = digits_split(0)
    warm_up()
    via = flower_exchange() if messages else None
    t0, c0 = time.perf_counter(), time.process_time()
    model = build_model("digits-mlp", 0)
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    loss_fn = torch.nn.functional.cross_entropy
    for rnd in range(1, rounds + 1):
        acc = {k: torch.zeros_like(v) for k, v in glob.items()}
        total = 0
        sent = via.broadcast(glob) if via else None
        for i, (x, y) in enumerate(data):
            model.load_state_dict(via.receive(sent, i + 1) if via else glob)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            steps = epochs * -(-len(x) // 32)
            for idx in batch_indices(len(x), 32, steps, 0, rnd, i):
                idx_t = torch.from_numpy(idx)
                opt.zero_grad()
                loss_fn(model(x[idx_t]), y[idx_t]).backward()
                opt.step()
            local = via.reply(model.state_dict(), len(x)) if via else model.state_dict()
            for k, v in local.items():
                acc[k] += v * len(x)
            total += len(x)
        glob = {k: v / total for k, v in acc.items()}
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    model.load_state_dict(glob)
    with torch.no_grad():
        accuracy = float((model(torch.from_numpy(x_te)).argmax(1) == torch.from_numpy(y_te)).float().mean())
    return {"seconds": seconds, "cpu": cpu, "accuracy": accuracy, "np": np.__version__}


def flower_exchange():
    """The least a Flower runtime does per client: the round's train ``Message`` (the model ``ArrayRecord`` built
    once per round) to the node, the client reading the arrays, its reply ``Message`` with the model ``ArrayRecord``
    + a ``MetricRecord`` + a ``ConfigRecord``, the server reading the reply's arrays — serialised with
    :func:`flower_strategies.core.records.to_record` (the fastest writer of Flower's ``.npy`` format we have) and read
    with zero-copy views.  No strategy, no validation, no metrics, no files."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from flower_strategies.core import records as R
    from flower_strategies.core.client import record_tensors

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0  # what the engine's grid sets
    config = ConfigRecord({"server-round": 1, "method": "fedavg", "client-lr": 0.1, "local-epochs": 1,
                           "batch-size": 32})

    class Exchange:
        msg: Message

        def broadcast(self, state: dict) -> RecordDict:
            return RecordDict({"arrays": R.to_record({k: v.numpy() for k, v in state.items()}), "config": config})

        def receive(self, content: RecordDict, node: int) -> dict:
            self.msg = Message(content=content, message_type="train", dst_node_id=node)
            R.set_message_id(self.msg, "m")
            return record_tensors(cast(ArrayRecord, self.msg.content["arrays"]), copy=False)

        def reply(self, state: dict, n: int) -> dict:
            content = RecordDict({"arrays": R.to_record({k: v.numpy() for k, v in state.items()}),
                                  "metrics": MetricRecord({"num-examples": n, "num-steps": 1.0, "train-loss": 0.0}),
                                  "fedadapt.info": ConfigRecord({"method": "fedavg"})})
            back = Message(content=content, reply_to=self.msg)
            return record_tensors(cast(ArrayRecord, back.content["arrays"]), copy=False)

    return Exchange()


def engine(nodes: int, rounds: int, epochs: int, out: str, lean: bool = True) -> dict:
    import matplotlib.pyplot  # noqa: F401  (imports are not the engine's per-run cost)
    import torch

    import client_app.app  # noqa: F401
    import server_app.app  # noqa: F401
    from app_common.task import digits_partition
    from simulations.engine.inprocess import run_inprocess

    torch.set_num_threads(1)
    for i in range(nodes):  # the data set split once, as the plain loop's data are loaded before timing
        digits_partition(i, nodes, partitioner="iid", seed=0)
    cfg = run_config(nodes, rounds, epochs, out, lean)
    warm_up()
    t0, c0 = time.perf_counter(), time.process_time()
    summary = run_inprocess(cfg, nodes)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    rows = [json.loads(line) for line in (Path(out) / cfg["run-name"] / "metrics.jsonl").read_text().splitlines()]
    steady = [r["seconds"] for r in rows if r["round"] >= 2]
    return {"seconds": seconds, "cpu": cpu, "steady": sum(steady) / len(steady) * rounds,
            "accuracy": summary["final"].get("test-accuracy")}


def ray(nodes: int, rounds: int, epochs: int, out: str) -> dict:
    cfg = run_config(nodes, rounds, epochs, out)
    from simulations.launch.flwr_cli import format_run_config

    rc = format_run_config(cfg)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "simulations.launch", "sim", "--num-supernodes", str(nodes),
                           "--run-config", rc], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    path = Path(out) / cfg["run-name"] / "metrics.jsonl"
    if proc.returncode != 0 or not path.is_file():
        raise RuntimeError(f"ray run failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steady = [r["seconds"] for r in rows if r["round"] >= 2]
    return {"seconds": sum(steady) / len(steady) * rounds, "wall": wall, "accuracy": rows[-1].get("test-accuracy")}


def measure(kind: str, nodes: int, rounds: int, epochs: int, out: str) -> dict:
    cmd = [sys.executable, "-m", "simulations.bench.simulation", "--child", kind, "--nodes", str(nodes),
           "--rounds", str(rounds), "--epochs", str(epochs), "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child {kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--epochs", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--ray", action="store_true", help="also run the Ray simulation (N = 10 only unless --ray-all)")
    ap.add_argument("--ray-all", action="store_true", help="Ray for every N too")
    ap.add_argument("--out", default="", help="output directory of the runs (default: a temporary one)")
    ap.add_argument("--child", choices=("plain", "engine", "defaults", "ray", "floor"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        n, e = args.nodes[0], args.epochs[0]
        if args.child == "plain":
            res = plain(n, args.rounds, e)
        elif args.child == "ray":
            res = ray(n, args.rounds, e, args.out)
        elif args.child == "floor":
            res = plain(n, args.rounds, e, messages=True)
        else:
            res = engine(n, args.rounds, e, args.out, lean=args.child == "engine")
        print(json.dumps(res))
        return 0

    out = args.out or tempfile.mkdtemp(prefix="fedadapt-bench-sim-")
    out = str(Path(out).resolve())
    rows = []
    for e in args.epochs:
        for n in args.nodes:
            r = {"E": e, "N": n, "plain": measure("plain", n, args.rounds, e, out),
                 "engine": measure("engine", n, args.rounds, e, out),
                 "defaults": measure("defaults", n, args.rounds, e, out),
                 "floor": measure("floor", n, args.rounds, e, out)}
            if args.ray and (n == 10 or args.ray_all):
                r["ray"] = measure("ray", n, args.rounds, e, out)
            rows.append(r)
            print(f"  measured E={e} N={n}", file=sys.stderr, flush=True)
    print(f"\ndigits-mlp, fedavg, {args.rounds} rounds, batch 32, iid; seconds (final test accuracy)")
    print("engine = the whole run_inprocess call with " + ", ".join(f"{k}={str(v).lower()}" for k, v in LEAN.items())
          + f" (strategy, reply validation, test set, {args.rounds + 1} central evaluations, metrics files, model.pt,"
          " summary.json);"
          " defaults = the same run with the app's defaults (+ train-loss-before, + learning_curve.png);"
          " cpu = process CPU seconds (one torch thread; robust on a shared machine), wall = wall seconds;"
          " steady = mean wall time of rounds >= 2 (metrics.jsonl seconds) x rounds")
    print(" floor = the plain loop passing its weights through bare Flower messages (flower_exchange: no strategy,"
          " validation, metrics or files); ray floor = rounds x max(floor round, 0.1 s: Flower's Ray backend polls for"
          " messages every 0.1 s)")
    print(f"{'E':>2s} {'N':>4s} {'plain cpu':>9s} {'engine cpu':>10s} {'ratio':>6s} {'floor cpu':>9s} {'ratio':>6s} "
          f"{'defaults':>8s} {'ratio':>6s} | {'plain wall':>10s} {'engine wall':>11s} {'ratio':>6s} | "
          f"{'eng steady':>10s} {'ray steady':>10s} {'ratio':>6s} {'ray floor':>9s} {'ratio':>6s} | accuracy")
    for r in rows:
        p, g, d, f, y = r["plain"], r["engine"], r["defaults"], r["floor"], r.get("ray")
        ray_floor = args.rounds * max(f["seconds"] / args.rounds, 0.1)
        ray_s = f"{y['seconds']:10.2f} {y['seconds'] / p['seconds']:5.2f}x" if y else f"{'-':>10s} {'-':>6s}"
        print(f"{r['E']:>2d} {r['N']:>4d} {p['cpu']:9.2f} {g['cpu']:10.2f} {g['cpu'] / p['cpu']:5.2f}x "
              f"{f['cpu']:9.2f} {f['cpu'] / p['cpu']:5.2f}x {d['cpu']:8.2f} {d['cpu'] / p['cpu']:5.2f}x | "
              f"{p['seconds']:10.2f} {g['seconds']:11.2f} {g['seconds'] / p['seconds']:5.2f}x | "
              f"{g['steady']:10.2f} {ray_s} {ray_floor:9.2f} {ray_floor / p['seconds']:5.2f}x | "
              f"{p['accuracy']:.3f} {g['accuracy']:.3f} {d['accuracy']:.3f} {f['accuracy']:.3f}"
              f"{' ' + format(y['accuracy'], '.3f') if y else ''}")
    print("target: engine/plain and ray/plain <= 1.10 (the floor columns: the best any runtime built on Flower's "
          "Message and Ray backend can reach)")
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
