"""Benchmark: the vectorized in-process engine against the sequential one and a plain per-client PyTorch loop.

    python -m simulations.bench.vectorized                          # digits-mlp, N=100 clients/round, E=5, 3 rounds
    python -m simulations.bench.vectorized --nodes 1000 --memory-mb 64 --skip-sequential   # N=1,000, chunked
    python -m simulations.bench.vectorized --task cifar-gn-cnn --device cuda --nodes 100     # GPU, client level

``digits-mlp`` (whole engines, FedAvg, every client every round, lean settings as in ``bench_simulation``):

* ``sequential`` — :func:`simulations.engine.inprocess.run_inprocess` with ``engine="inprocess"`` (clients one by one);
* ``vectorized`` — the same call with ``engine="vectorized"`` (:mod:`simulations.engine.vectorized`);
* ``plain``      — ``bench_simulation``'s hand-written loop (plain ``torch.optim.SGD`` per client, same batches).

``cifar-gn-cnn`` (client level, no data set needed: seeded random CIFAR-shaped data, 3×32×32, 10 classes; a small
CNN with GroupNorm): one round's local training of N clients by the sequential ClientApp's own function
(:func:`~flower_strategies.core.client.train_reply`, one client after another), by
:func:`simulations.engine.vectorized.train_stacked` (all together) and by a plain per-client SGD loop; the replies of
both engines are compared (max relative difference of the local models).

Each measurement runs in a fresh child process (imports and first-call initialisation untimed). ``--repeats R``
(default 5) measures every engine R times, interleaved (sequential, vectorized, plain, sequential, …), each time in a
new child: every timed run is exactly one run of the single-measurement definition (fresh process, untimed warm-up),
and interleaving spreads slow drifts of the machine's load over all engines alike instead of over one of them. The
table prints each engine's median seconds, the ratios of the medians, the spread (min–max) and the largest peak
resident memory (CPU) or peak CUDA memory of its children.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LEAN = {"train-loss-before": False, "learning-curve": False}


def digits_config(nodes: int, rounds: int, epochs: int, out: str, device: str, batch: int) -> dict:
    return {"method": "fedavg", "task": "digits-mlp", "num-server-rounds": rounds, "local-epochs": epochs,
            "min-available-nodes": nodes, "min-train-nodes": nodes, "fraction-train": 1.0, "partitioner": "iid",
            "seed": 0, "client-lr": 0.1, "batch-size": batch, "output-dir": out, "device": device,
            "run-name": f"bench-vec-n{nodes}-e{epochs}", **LEAN}


def _peak_mb(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------------------ digits (engines)
def digits_child(kind: str, args: argparse.Namespace) -> dict:
    import torch

    import client_app.app  # noqa: F401  (imports are not a per-run cost)
    import server_app.app  # noqa: F401
    from app_common.task import digits_partition
    from simulations.bench.simulation import plain, warm_up
    from simulations.engine.inprocess import run_inprocess

    torch.set_num_threads(1)
    if kind == "plain":
        res = plain(args.nodes, args.rounds, args.epochs)
        return {"seconds": res["seconds"], "accuracy": res["accuracy"], "peak_mb": _peak_mb("cpu")}
    for i in range(args.nodes):
        digits_partition(i, args.nodes, partitioner="iid", seed=0)
    cfg = digits_config(args.nodes, args.rounds, args.epochs, args.out, args.device, args.batch_size)
    cfg["run-name"] += f"-{kind}"
    warm_up()
    grid = {"memory_mb": args.memory_mb} if kind == "vectorized" else {}
    t0 = time.perf_counter()
    summary = run_inprocess(cfg, args.nodes, engine="inprocess" if kind == "sequential" else kind, **grid)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "accuracy": summary["final"].get("test-accuracy"), "peak_mb": _peak_mb(args.device)}


# ------------------------------------------------------------------------------------------ CIFAR-shaped CNN (clients)
def cifar_gn_cnn():
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def cnn_child(kind: str, args: argparse.Namespace) -> dict:
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from app_common.task import example_cross_entropy
    from flower_strategies import FedAvg
    from flower_strategies.core.client import ClientRound, TensorPartition, batch_indices, record_tensors, train_reply
    from simulations.engine.vectorized import train_stacked

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    device = torch.device(args.device)
    # Full float32 on CUDA (no TF32 in convolutions/matmuls), so that the engines' difference is the engines'.
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = cifar_gn_cnn().to(device)
    gen = torch.Generator().manual_seed(1)
    n = args.examples
    xs = torch.randn(args.nodes, n, 3, 32, 32, generator=gen).to(device)
    ys = torch.randint(0, 10, (args.nodes, n), generator=gen).to(device)
    config = ConfigRecord({**FedAvg().round_config(1), "client-lr": 0.05, "local-epochs": args.epochs,
                           "batch-size": args.batch_size, "server-round": 1})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": config})
    loss_fn = torch.nn.functional.cross_entropy

    def run() -> list:
        if kind == "vectorized":
            size, out = args.chunk or args.nodes, []
            for s in range(0, args.nodes, size):
                ids = range(s, min(args.nodes, s + size))
                out += train_stacked(model, [ClientRound(content, None, client_key=i) for i in ids],
                                     [TensorPartition(xs[i], ys[i]) for i in ids], example_cross_entropy,
                                     loss_before=False)
            return out
        if kind == "sequential":
            return [train_reply(model, content, xs[i], ys[i], loss_fn, client_key=i, loss_before=False)
                    for i in range(args.nodes)]
        start = {k: v.clone() for k, v in model.state_dict().items()}  # plain
        for i in range(args.nodes):
            model.load_state_dict(start)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            steps = args.epochs * -(-n // args.batch_size)
            for idx in batch_indices(n, args.batch_size, steps, 0, 1, i):
                idx_t = torch.from_numpy(idx).to(device)
                opt.zero_grad()
                loss_fn(model(xs[i][idx_t]), ys[i][idx_t]).backward()
                opt.step()
        model.load_state_dict(start)
        return []

    small = args.nodes
    args.nodes = min(2, small)  # warm-up (cuDNN/vmap first calls) on 2 clients
    run()
    args.nodes = small
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    replies = run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    firsts = [{k: v.reshape(-1)[:64].tolist() for k, v in record_tensors(r["arrays"]).items()} for r in replies[:3]]
    return {"seconds": seconds, "peak_mb": _peak_mb(args.device), "first_models": firsts}


# ------------------------------------------------------------------------------------------ driver
def measure(kind: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "simulations.bench.vectorized", "--child", kind, "--task", args.task,
           "--nodes", str(args.nodes), "--rounds", str(args.rounds), "--epochs", str(args.epochs),
           "--batch-size", str(args.batch_size), "--examples", str(args.examples), "--device", args.device,
           "--memory-mb", str(args.memory_mb), "--chunk", str(args.chunk), "--out", args.out]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child {kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def max_rel(a: list, b: list) -> float:
    """The largest difference between two lists of models (``{name: array}``), per array relative to the first list's
    largest magnitude (bench.gpu uses it too)."""
    import numpy as np

    worst = 0.0
    for ma, mb in zip(a, b, strict=True):
        for k in ma:
            x, y = np.asarray(ma[k]), np.asarray(mb[k])
            worst = max(worst, float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30)))
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=("digits-mlp", "cifar-gn-cnn"), default="digits-mlp")
    ap.add_argument("--nodes", type=int, default=100, help="clients per round (all nodes train every round)")
    ap.add_argument("--epochs", type=int, default=5, help="local epochs E")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (digits-mlp)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--examples", type=int, default=50, help="examples per client (cifar-gn-cnn)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--memory-mb", type=float, default=1024.0, help="vectorized engine: memory budget per chunk")
    ap.add_argument("--chunk", type=int, default=0, help="cifar-gn-cnn: clients per stacked pass (0 = all)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed runs per engine, interleaved, each in a fresh process; the table shows medians")
    ap.add_argument("--skip-sequential", action="store_true", help="only vectorized + plain (large N)")
    ap.add_argument("--out", default="", help="output directory of the runs (default: a temporary one)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        res = (digits_child if args.task == "digits-mlp" else cnn_child)(args.child, args)
        print(json.dumps(res))
        return 0
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    tmp = not args.out
    base = Path(args.out or tempfile.mkdtemp(prefix="fedadapt-bench-vec-")).resolve()
    kinds = ([] if args.skip_sequential else ["sequential"]) + ["vectorized", "plain"]
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for rep in range(args.repeats):
        args.out = str(base / f"repeat-{rep}")  # each run its own output directory
        for kind in kinds:
            runs[kind].append(measure(kind, args))
            print(f"  repeat {rep + 1}/{args.repeats} {kind}: {runs[kind][-1]['seconds']:.2f} s", file=sys.stderr,
                  flush=True)
    res = {kind: {**rs[0], "seconds": statistics.median(r["seconds"] for r in rs),
                  "spread": (min(r["seconds"] for r in rs), max(r["seconds"] for r in rs)),
                  "peak_mb": max(r["peak_mb"] for r in rs)} for kind, rs in runs.items()}
    what = (f"digits-mlp, fedavg, {args.rounds} rounds (whole engine runs, lean settings)" if args.task == "digits-mlp"
            else f"cifar-gn-cnn, one round of local training, {args.examples} examples/client (client level)")
    print(f"\n{what}; N={args.nodes} clients/round, E={args.epochs}, batch {args.batch_size}, device {args.device}, "
          + (f"vectorized memory budget {args.memory_mb:g} MiB" if args.task == "digits-mlp"
             else f"vectorized chunk {args.chunk or args.nodes} clients per stacked pass"))
    print(f"median of {args.repeats} interleaved run(s) per engine, each in a fresh process; ratios of the medians")
    print(f"{'':12s} {'seconds':>9s} {'min-max':>11s} {'vs sequential':>13s} {'vs plain':>9s} {'peak MiB':>9s}")
    for kind in ("sequential", "vectorized", "plain"):
        if kind not in res:
            continue
        r = res[kind]
        seq = res.get("sequential", {}).get("seconds")
        vs_seq = f"{seq / r['seconds']:12.2f}x" if seq else f"{'-':>13s}"
        spread = f"{r['spread'][0]:.2f}-{r['spread'][1]:.2f}"
        print(f"{kind:12s} {r['seconds']:9.2f} {spread:>11s} {vs_seq} {res['plain']['seconds'] / r['seconds']:8.2f}x "
              f"{r['peak_mb']:9.0f}" + (f"   accuracy {r['accuracy']:.3f}" if r.get("accuracy") is not None else ""))
    if args.task == "cifar-gn-cnn" and "sequential" in res:
        print(f"max relative difference of the first clients' local models (vectorized vs sequential): "
              f"{max_rel(res['vectorized']['first_models'], res['sequential']['first_models']):.1e}")
    if tmp:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
