"""Benchmark: the vectorized engine on Ray actors, and side by side with Flower's Ray backend.

    python -m simulations.bench.ray actors                 # 1 vs 2 Ray actors (and the one-process engine), interleaved
    python -m simulations.bench.ray cluster                # 2 actors on a head + worker Ray cluster on this machine
    python -m simulations.bench.ray flower --nodes 1000    # Flower's Ray backend vs the vectorized engine, N supernodes
    python -m simulations.bench.ray flower --nodes 10000 --fraction 0.1

Every run is a fresh child process (``python -m simulations.launch sim …`` for Flower's backend, an in-process
``run_inprocess`` otherwise) with lean settings (no client evaluation, no ``train-loss-before``, no learning-curve
plot).  The figure is the median of the per-round ``seconds`` the ServerApp writes to ``metrics.jsonl`` for rounds
2…R, so Ray's start-up, actor creation and round 1's warm-up are left out; round 1 and the whole run are printed
too.  Peak memory is the largest sum of the resident set sizes of the child and all of its descendants (Ray's GCS,
raylet, workers, actors), sampled every 0.2 s.

``actors`` / ``cluster``: a compute-heavy round (``digits-cnn``, every client every round, several local epochs) with
each chunk trained stacked; ``--repeats R`` measures each engine R times, interleaved.  ``flower``: the same task,
model, method and sampling on both engines (``synthetic-linear``, FedAvg): Flower's simulation runs one ClientApp call
per sampled supernode on one Ray actor per CPU (``--ray-cpus``), the vectorized engine the round's clients stacked.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

LEAN = {"train-loss-before": False, "learning-curve": False, "fraction-evaluate": 0.0, "overwrite": True}


def compute_config(args: argparse.Namespace, out: str, name: str) -> dict[str, Any]:
    """The compute-heavy round of ``actors``/``cluster``: digits-cnn, every client, ``--epochs`` local epochs."""
    return {"method": args.method, "task": "digits-cnn", "num-server-rounds": args.rounds, "local-epochs": args.epochs,
            "local-steps": 0, "min-available-nodes": args.nodes, "min-train-nodes": args.nodes,
            "fraction-train": 1.0, "partitioner": "iid", "seed": 0, "client-lr": 0.05, "batch-size": args.batch_size,
            "output-dir": out, "run-name": name, **LEAN}


def flower_config(args: argparse.Namespace, out: str, name: str) -> dict[str, Any]:
    """The ``flower`` comparison's run: synthetic-linear (seeded per-client data), FedAvg, ``--fraction`` sampled."""
    sampled = max(1, int(args.nodes * args.fraction))
    return {"method": "fedavg", "task": "synthetic-linear", "num-server-rounds": args.rounds, "local-epochs": 1,
            "local-steps": 0, "min-available-nodes": args.nodes, "min-train-nodes": sampled,
            "fraction-train": args.fraction, "seed": 0, "client-lr": 0.02, "batch-size": 16, "output-dir": out,
            "run-name": name, **LEAN}


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_measured(cmd: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``cmd``; its result and the peak (MiB) of the summed resident memory of it and its descendants."""
    from simulations.launch.processes import process_tree

    peak, stop = [0], threading.Event()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def sample() -> None:
        while not stop.wait(0.2):
            peak[0] = max(peak[0], sum(_rss_kb(p) for p in process_tree([proc.pid])))

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        out += f"\n[bench.ray] timed out after {timeout:.0f} s"
    stop.set()
    watcher.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, out), peak[0] / 1024


def round_seconds(run_dir: Path) -> list[float]:
    """The per-round ``seconds`` of a run's ``metrics.jsonl`` (rounds 1…R)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [float(r["seconds"]) for r in rows if int(r.get("round", 0)) > 0 and r.get("seconds") is not None]


def child(spec: dict[str, Any]) -> None:
    """One in-process run (``spec``: run config, nodes, engine, grid keywords, torch threads)."""
    import logging

    import torch

    from client_app.app import app as client_app
    from server_app.app import run
    from simulations.engine.inprocess import make_grid

    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(int(spec["threads"]))
    grid = make_grid(client_app, int(spec["nodes"]), spec["config"], spec["engine"], **spec["grid"])
    summary = run(grid, spec["config"])
    nodes = grid.actor_nodes() if hasattr(grid, "actor_nodes") else []
    print(json.dumps({"status": summary.get("status"), "final": summary.get("final"), "actor_nodes": nodes,
                      "chunks_per_actor": getattr(grid, "chunks_per_actor", None)}, default=str), flush=True)


def measure(kind: str, args: argparse.Namespace, out: Path, tag: str, address: str | None = None) -> dict[str, Any]:
    """One fresh child run of ``kind``: ``one`` (one-process vectorized), ``ray1``/``ray2`` (1/2 actors; on the
    cluster at ``address`` if given) or ``flower`` (Flower's Ray backend through the launcher)."""
    name = f"{kind}-{tag}"
    build = flower_config if args.mode == "flower" else compute_config
    cfg = build(args, str(out), name)
    if kind == "flower":
        from simulations.launch.flwr_cli import format_run_config

        cmd = [sys.executable, "-m", "simulations.launch", "sim", "--num-supernodes", str(args.nodes),
               "--ray-cpus", str(args.actors), "--flwr-home", str(out / f"home-{name}"), "--timeout",
               str(args.timeout), "--run-config", format_run_config(cfg)]
    else:
        grid: dict[str, Any] = {"chunk": args.chunk} if args.chunk else {}
        if kind.startswith("ray"):
            grid.update(actors=int(kind[3:]), address=address)
        spec = {"config": cfg, "nodes": args.nodes, "engine": "vectorized", "grid": grid,
                "threads": args.actors if kind == "one" and args.one_threads else 1}
        cmd = [sys.executable, "-m", "simulations.bench.ray", "_child", json.dumps(spec)]
    t0 = time.perf_counter()
    res, peak = run_measured(cmd, args.timeout)
    wall = time.perf_counter() - t0
    secs = round_seconds(out / name)
    ok = res.returncode == 0 and len(secs) == args.rounds
    if not ok:
        print(f"[bench.ray] {name} failed (exit {res.returncode}):\n{res.stdout[-3000:]}", flush=True)
    lines = reversed(res.stdout.splitlines())
    info: dict[str, Any] = next((json.loads(line) for line in lines if line.startswith("{")), {})
    if info.get("actor_nodes"):
        print(f"  {name}: actors on {len(set(info['actor_nodes']))} Ray node(s), chunks per actor "
              f"{info['chunks_per_actor']}", flush=True)
    return {"kind": kind, "ok": ok, "rounds": secs, "later": statistics.median(secs[1:]) if len(secs) > 1 else None,
            "wall": wall, "peak_mb": peak}


def table(results: dict[str, list[dict[str, Any]]], base: str) -> None:
    print(f"{'engine':10s} {'round 1 s':>10s} {'later rounds s (median)':>24s} {'spread':>16s} {'whole run s':>12s} "
          f"{'peak MiB':>9s} {'vs ' + base:>8s}", flush=True)
    med = {k: statistics.median([r["later"] for r in v if r["ok"]]) if any(r["ok"] for r in v) else None
           for k, v in results.items()}
    for kind, runs in results.items():
        good = [r for r in runs if r["ok"]]
        if not good:
            print(f"{kind:10s} failed", flush=True)
            continue
        later = [r["later"] for r in good]
        base_s, kind_s = med.get(base), med[kind]
        ratio = f"{base_s / kind_s:.2f}×" if base_s and kind_s else "-"
        print(f"{kind:10s} {statistics.median(r['rounds'][0] for r in good):10.2f} {med[kind]:24.3f} "
              f"{min(later):7.3f}–{max(later):<8.3f} {statistics.median(r['wall'] for r in good):12.1f} "
              f"{max(r['peak_mb'] for r in good):9.0f} {ratio:>8s}", flush=True)


def start_cluster(home: Path, temp_dir: Path) -> tuple[Any, str]:
    """A Ray head and a worker node on this machine, 1 CPU each (``ray start --block``, stopped with the returned
    :class:`~simulations.launch.processes.Cluster`, never with ``ray stop``)."""
    from simulations.launch.processes import Cluster, bin_path, free_port

    procs = Cluster(home, home / "logs", grace_s=15)
    procs.__enter__()
    address = f"127.0.0.1:{free_port()}"
    for name, extra in (("ray-head", ["--head", f"--port={address.rsplit(':', 1)[1]}", "--include-dashboard=false",
                                      f"--ray-client-server-port={free_port()}"]),
                        ("ray-worker", [f"--address={address}"])):
        ports = [str(free_port()) for _ in range(4)]
        node = procs.start(name, [
            bin_path("ray"), "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
            "--num-cpus=1", "--num-gpus=0", f"--object-store-memory={200 * 2**20}", f"--temp-dir={temp_dir}",
            "--dashboard-agent-listen-port", ports[0], "--dashboard-agent-grpc-port", ports[1],
            "--runtime-env-agent-port", ports[2], "--metrics-export-port", ports[3], "--min-worker-port=0",
            "--max-worker-port=0", *extra])
        log, deadline = procs.log_dir / f"{name}.log", time.monotonic() + 120
        while "Ray runtime started." not in log.read_text(errors="replace"):
            if node.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(log.read_text(errors="replace")[-3000:])
            time.sleep(0.2)
    return procs, address


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["_child"]:
        child(json.loads(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("actors", "cluster", "flower"))
    ap.add_argument("--nodes", type=int, default=None, help="supernodes (actors/cluster: 40; flower: 1000)")
    ap.add_argument("--fraction", type=float, default=1.0, help="flower: fraction-train")
    ap.add_argument("--epochs", type=int, default=20, help="actors/cluster: local epochs")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--method", default="scaffold", help="actors/cluster: the method (stateful by default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--actors", type=int, default=2, help="Ray actors (flower: --ray-cpus of Flower's Ray instance)")
    ap.add_argument("--chunk", type=int, default=0, help="clients per stacked pass (0: the engine's choice)")
    ap.add_argument("--one-threads", action="store_true", help="actors: the one-process engine with --actors threads")
    ap.add_argument("--engines", nargs="+", default=None, help="flower: subset of flower vectorized")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = ap.parse_args(argv)
    args.nodes = args.nodes or (1000 if args.mode == "flower" else 40)
    out = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    import os

    print(f"bench.ray {args.mode}: {os.cpu_count()} CPUs, nodes {args.nodes}, rounds {args.rounds}, repeats "
          f"{args.repeats}" + (f", fraction {args.fraction}" if args.mode == "flower" else
                               f", digits-cnn {args.method} E={args.epochs} batch {args.batch_size}"), flush=True)
    procs, temp = None, None
    try:
        address = None
        if args.mode == "cluster":
            temp = Path(tempfile.mkdtemp(prefix="rb-", dir="/tmp"))  # short: Ray's sockets live under it
            procs, address = start_cluster(out / "cluster", temp)
            kinds, base = ["ray2"], "ray2"
        elif args.mode == "actors":
            kinds, base = ["one", "ray1", f"ray{args.actors}"], "ray1"
        else:
            kinds = ["flower" if e == "flower" else "one" for e in (args.engines or ["flower", "vectorized"])]
            base = kinds[0]
        results: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for r in range(args.repeats):
            for kind in kinds:
                res = measure(kind, args, out, str(r), address)
                results[kind].append(res)
                print(f"  {kind} #{r}: rounds {[round(s, 3) for s in res['rounds']]}, whole {res['wall']:.1f} s, "
                      f"peak {res['peak_mb']:.0f} MiB", flush=True)
        names = {"one": "vectorized (1 process)", "ray1": "1 actor", "flower": "Flower Ray"}
        print("\n" + ", ".join(f"{k} = {names.get(k, k[3:] + ' actors')}" for k in kinds), flush=True)
        table(results, base)
    finally:
        if procs is not None:
            procs.__exit__(None, None, None)
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
