"""Benchmark: one server aggregation (``aggregate_train``) of N replies of a ResNet-18-sized model, fedadapt side by
side with Flower 1.42's built-in strategies, against the floor.

    python -m simulations.bench.aggregation                       # N = 20 and 100, ResNet-18 (11.2 M float32 values)
    python -m simulations.bench.aggregation --replies 20 --size tiny   # a smoke run (the test uses it)

Every measurement runs in its own child process (``--child``): the child builds the model and the N replies first
(random but fixed: ``x + s_i·roll(ξ, i)`` with ``ξ ~ N(0, 1e-3²)`` drawn once from seed 0, ``s_i = 1 + 0.01·i``;
``num-examples = 100 + i``), runs round 1 untimed (warm-up; adaptive state gets created), then times round 2's
``configure_train`` (untimed) + ``aggregate_train`` (timed) on the same replies for rounds 2–4 and reports the
fastest (the machine may be shared).  Just before each of those calls it times the floor's fold (below) of the same
replies: each row's time over its own floor, and a pair's ratio over those, do not drift with the machine's load
between children.  Memory: rounds 5 and 6 run under ``tracemalloc`` (NumPy buffers and the
serialised ``bytes`` are traced; malloc's caching does not hide anything) and the peak of traced memory during round
6's call above its start is the *extra* memory the call needed on top of the replies it was handed (returned model
included), in model copies (tracing from round 5 on: tracemalloc cannot see the release of a block allocated before
it started, so the server state that round 6 replaces must come from a traced round);
a second child measures round 2 as peak resident-set growth (``rss``: VmHWM reset through ``/proc/self/clear_refs``,
glibc's mmap threshold pinned so freed blocks go back to the OS).  The memory check uses the larger of the two.

Rows:

* ``floor``  — deserialise every reply once (``Array.numpy()``, Flower's own deserialisation) and sum the floating
  arrays in place into one float32 accumulator per array (every ArrayRecord: a method row's own floor covers its
  whole uplink): the least any aggregation of serialised replies must do;
* ``floor-view`` (information) — the same with zero-copy read-only views of the payloads instead of copies;
* ``fedadapt <method>`` and ``flwr <Strategy>`` for the pairs FedAvg, FedAvgM, FedAdagrad, FedAdam, FedYogi (each
  with its own defaults), and fedadapt-only rows for one method of each other family (fedlada, scaffold,
  fedlamb, fedda, fedcm, fedlocal, localupdate, mimelite): their replies carry every record the method declares
  (non-model records are ``|noise|``).

The ratios against the targets come last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from typing import cast

import numpy as np

PAIRS = (("fedavg", "FedAvg"), ("fedavgm", "FedAvgM"), ("fedadagrad", "FedAdagrad"), ("fedadam", "FedAdam"),
         ("fedyogi", "FedYogi"))
ONLY_FEDADAPT = ("fedlada", "scaffold", "fedlamb", "fedda", "fedcm", "fedlocal", "localupdate", "mimelite")
ADAPTIVE = ("fedadagrad", "fedadam", "fedyogi")


# ------------------------------------------------------------------------------------------ child side
def model_layout(size: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """``(state, trainable keys)``: ResNet-18's state_dict (float32 + int64 BN counters) or a tiny stand-in."""
    if size == "tiny":
        state: dict[str, np.ndarray] = {
            "conv.weight": np.zeros((8, 3, 3, 3), np.float32), "bn.weight": np.ones(8, np.float32),
            "bn.bias": np.zeros(8, np.float32), "bn.running_mean": np.zeros(8, np.float32),
            "bn.num_batches_tracked": np.zeros((), np.int64), "fc.weight": np.zeros((10, 8), np.float32)}
        return state, ["conv.weight", "bn.weight", "bn.bias", "fc.weight"]
    import torchvision

    net = torchvision.models.resnet18(num_classes=10)
    state = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
    return state, [n for n, _ in net.named_parameters()]


class Replies:
    """The N replies' payloads, derived from one noise draw (cheap to build, random but fixed)."""

    def __init__(self, state: dict[str, np.ndarray], n: int) -> None:
        self.state, self.n = state, n
        size = sum(v.size for v in state.values() if v.dtype.kind == "f")
        self.noise = np.random.default_rng(0).normal(scale=1e-3, size=size).astype(np.float32)

    def arrays(self, i: int, keys: list[str] | None = None, model: bool = True, r: int = 0) -> dict[str, np.ndarray]:
        # client i's reply in round r: distinct per client and per round (a byte-identical reply to a changed model
        # is a replay, which fedadapt's strategies reject)
        noise = np.roll(self.noise, 7919 * i) * np.float32(1.0 + 0.01 * i + 1e-4 * r)
        out, at = {}, 0
        for k, v in self.state.items():
            if v.dtype.kind != "f":
                if keys is None:
                    out[k] = v
                continue
            part = noise[at:at + v.size].reshape(v.shape)
            at += v.size
            if keys is None or k in keys:
                out[k] = (v + part) if model else np.abs(part)
        return out


def child(kind: str, name: str, n: int, size: str, mode: str = "time") -> dict:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

    from flower_strategies.core import records as R
    from flower_strategies.core.loop import own_loop_config
    from simulations.engine.inprocess import LoopbackGrid

    state, trainable = model_layout(size)
    model_bytes = sum(v.nbytes for v in state.values())
    replies = Replies(state, n)
    initial = ArrayRecord({k: Array(v) for k, v in state.items()})

    if kind == "flwr":
        import flwr.serverapp.strategy as fs

        strategy = getattr(fs, name)(min_available_nodes=1, min_train_nodes=n, fraction_evaluate=0.0)

        def content_for(i: int, r: int, sent: RecordDict) -> RecordDict:
            return RecordDict({R.MODEL: ArrayRecord({k: Array(v) for k, v in replies.arrays(i, r=r).items()}),
                               R.METRICS: MetricRecord({R.NUM_EXAMPLES: 100 + i})})
    elif kind == "fedadapt":
        from flower_strategies.core.registry import get_method

        strategy = get_method(name).build(trainable_keys=trainable, min_available_nodes=1, min_train_nodes=n,
                                          num_rounds=10)
        specs = strategy.uplink_specs()

        def content_for(i: int, r: int, sent: RecordDict) -> RecordDict:
            recs: dict = {}
            for s in specs:
                arrays = replies.arrays(i, None if s.keys == "model" else trainable, model=s.name == R.MODEL, r=r)
                if s.at_least is not None:  # a running max (FedLADA's v̂): the one sent, raised by |noise|
                    arrays = {k: sent.array_records[s.at_least][k].numpy() + v for k, v in arrays.items()}
                recs[s.name] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
            recs[R.METRICS] = MetricRecord({R.NUM_EXAMPLES: 100 + i, R.NUM_STEPS: 10})
            recs[R.REPLY_INFO] = ConfigRecord({R.METHOD: name})
            return RecordDict(recs)
    else:
        strategy = None

        def content_for(i: int, r: int, sent: RecordDict) -> RecordDict:
            return RecordDict({R.MODEL: ArrayRecord({k: Array(v) for k, v in replies.arrays(i, r=r).items()}),
                               R.METRICS: MetricRecord({R.NUM_EXAMPLES: 100 + i})})

    def client(msg: Message, context) -> Message:
        config = msg.content.config_records.get(R.CONFIG)
        r = int(cast(int, config[R.SERVER_ROUND])) if config is not None and R.SERVER_ROUND in config else 0
        return Message(content_for(msg.metadata.dst_node_id, r, msg.content), reply_to=msg)

    grid = LoopbackGrid(client, n)
    floor_msgs = None
    if strategy is None:
        floor_msgs = grid.send_and_receive(
            [Message(RecordDict(), message_type="train", dst_node_id=i) for i in grid.get_node_ids()])
    arrays = initial

    def fold_floor(msgs, view: bool):
        """Every ArrayRecord of every reply deserialised once and its floating arrays summed in place."""
        acc: dict[tuple[str, str], np.ndarray] = {}
        for m in msgs:
            for name, record in m.content.array_records.items():
                for k, a in record.items():
                    arr = R.view(a) if view else a.numpy()
                    if arr.dtype.kind != "f":
                        continue
                    if (name, k) in acc:
                        np.add(acc[name, k], arr, out=acc[name, k])
                    else:
                        acc[name, k] = arr.copy() if view else arr
        return acc

    def aggregate(server_round: int, measured, floor=None):
        """One round; only the aggregation itself runs inside ``measured`` (and, with ``floor``, the floor's fold of
        the same replies inside ``floor`` just before it)."""
        nonlocal arrays
        if strategy is None:
            with measured:
                fold_floor(floor_msgs, name == "view")
            return
        msgs = grid.send_and_receive(strategy.configure_train(server_round, arrays, own_loop_config(), grid))
        if floor is not None:
            with floor:
                fold_floor(msgs, False)
        gc.collect()
        with measured:
            out, metrics = strategy.aggregate_train(server_round, msgs)
        used = int(metrics["replies-used"]) if "replies-used" in metrics else n
        assert out is not None and used == n, (name, dict(metrics))
        arrays = out

    import contextlib
    import tracemalloc

    class Clock(contextlib.AbstractContextManager):
        def __enter__(self):
            gc.collect()
            self.t0, self.c0 = time.perf_counter(), time.process_time()
            return self

        def __exit__(self, *exc):
            self.seconds, self.cpu = time.perf_counter() - self.t0, time.process_time() - self.c0

    class Traced(contextlib.AbstractContextManager):
        """Peak traced memory above the start of the block; tracing must already run (see below)."""

        def __enter__(self):
            gc.collect()
            tracemalloc.reset_peak()
            self.base = tracemalloc.get_traced_memory()[0]
            return self

        def __exit__(self, *exc):
            self.peak = tracemalloc.get_traced_memory()[1] - self.base
            tracemalloc.stop()

    class Resident(contextlib.AbstractContextManager):
        """Peak resident-set growth (Linux: VmHWM reset through /proc/self/clear_refs; 0 where unavailable)."""

        @staticmethod
        def status() -> dict[str, int]:
            with open("/proc/self/status") as f:
                return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                        if k in ("VmHWM", "VmRSS")}

        def __enter__(self):
            gc.collect()
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                self.base = self.status()["VmRSS"]
            except OSError:
                self.base = None
            return self

        def __exit__(self, *exc):
            self.peak = self.status()["VmHWM"] - self.base if self.base is not None else 0

    aggregate(1, contextlib.nullcontext())  # warm-up (creates the server state)
    if mode == "rss":
        resident = Resident()
        aggregate(2, resident)
        return {"rss_bytes": resident.peak}
    clocks, floors = [Clock() for _ in range(3)], [Clock() for _ in range(3)]
    for r, c, f in zip((2, 3, 4), clocks, floors, strict=True):
        aggregate(r, c, f if strategy is not None else None)
    # tracemalloc only sees blocks allocated while it runs: round 5 runs traced (unmeasured) so that the server state
    # it creates is traced, and its release when round 6 replaces it lowers the count as it lowers real memory
    tracemalloc.start()
    aggregate(5, contextlib.nullcontext())
    traced = Traced()
    aggregate(6, traced)
    dt, cpu, peak = min(c.seconds for c in clocks), min(c.cpu for c in clocks), traced.peak
    own = floors if strategy is not None else clocks  # a floor row is its own floor
    return {"kind": kind, "name": name, "n": n, "seconds": dt, "cpu": cpu, "peak_bytes": peak,
            "model_bytes": model_bytes, "floor_seconds": min(f.seconds for f in own),
            "floor_cpu": min(f.cpu for f in own)}


# ------------------------------------------------------------------------------------------ parent side
def measure(kind: str, name: str, n: int, size: str) -> dict:
    """Time (+ tracemalloc) in one child process, resident-set growth in another: the RSS child pins glibc's mmap
    threshold, so that big blocks go back to the OS when freed and the growth of one call is its real peak (not
    hidden by memory an earlier round freed but kept) — which would slow the timed child's allocations."""
    out = {}
    for mode, extra_env in (("time", {}), ("rss", {"MALLOC_MMAP_THRESHOLD_": "131072"})):
        cmd = [sys.executable, "-m", "simulations.bench.aggregation", "--child", kind, name, str(n), "--size", size,
               "--mode", mode]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore", **extra_env})
        if proc.returncode != 0:
            raise RuntimeError(f"child {kind} {name} N={n} ({mode}) failed:\n{proc.stderr[-3000:]}")
        out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def relative(row: dict) -> float:
    """A row's time over its own child's floor (:func:`child`)."""
    return row["seconds"] / row["floor_seconds"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replies", type=int, nargs="+", default=[20, 100])
    ap.add_argument("--size", choices=("resnet18", "tiny"), default="resnet18")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="report wall seconds or process CPU seconds (robust on a shared machine)")
    ap.add_argument("--methods", nargs="+", metavar="M", help="only these fedadapt methods (default: every row)")
    ap.add_argument("--child", nargs=3, metavar=("KIND", "NAME", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("time", "rss"), default="time", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, name, n = args.child
        print(json.dumps(child(kind, name, int(n), args.size, args.mode)))
        return 0

    rows: dict[tuple[int, str], dict] = {}
    for n in args.replies:
        plan = [("floor", "copy", "floor"), ("floor", "view", "floor-view")]
        for ours, theirs in PAIRS:
            plan += [("fedadapt", ours, f"fedadapt {ours}"), ("flwr", theirs, f"flwr {theirs}")]
        plan += [("fedadapt", m, f"fedadapt {m}") for m in ONLY_FEDADAPT]
        if args.methods:
            plan = [p for p in plan if p[0] == "floor" or p[2].split()[-1].lower() in
                    {m.lower() for m in args.methods} | {t.lower() for o, t in PAIRS if o in args.methods}]
        for kind, name, label in plan:
            rows[(n, label)] = r = measure(kind, name, n, args.size)
            print(f"  measured N={n:<4d} {label:<20s} {r['seconds']:7.3f} s", file=sys.stderr, flush=True)

    if args.clock == "cpu":
        for r in rows.values():
            r["seconds"], r["floor_seconds"] = r["cpu"], r["floor_cpu"]
    model_mb = next(iter(rows.values()))["model_bytes"] / 2**20
    print(f"\nmodel: {args.size} ({model_mb:.1f} MiB); s = fastest aggregate_train of rounds 2-4 (after a warm-up "
          f"round; {args.clock} seconds); /floor = that over the fastest floor fold of the same replies in the same "
          f"child, timed just before each of those calls; extra = tracemalloc peak during round 6's aggregate_train, "
          f"rss = peak resident-set growth of round 2's in a separate child, both in model copies, the returned "
          f"model included")
    for n in args.replies:
        print(f"\nN = {n} replies")
        print(f"{'':<12s} {'fedadapt s':>10s} {'/floor':>7s} {'extra':>7s} {'rss':>7s} {'flwr s':>9s} {'/floor':>7s} "
              f"{'extra':>7s} {'rss':>7s} {'flwr/ours':>9s}")

        def cols(r: dict) -> str:
            return (f"{r['seconds'] / r['floor_seconds']:6.2f}x {r['peak_bytes'] / r['model_bytes']:6.2f}x "
                    f"{r['rss_bytes'] / r['model_bytes']:6.2f}x")

        for label in ("floor", "floor-view"):
            r = rows[(n, label)]
            print(f"{label:<12s} {r['seconds']:10.3f} {cols(r)}")
        for ours, theirs in PAIRS:
            a, b = rows.get((n, f"fedadapt {ours}")), rows.get((n, f"flwr {theirs}"))
            if a and b:
                print(f"{ours:<12s} {a['seconds']:10.3f} {cols(a)} {b['seconds']:9.3f} {cols(b)} "
                      f"{relative(b) / relative(a):8.2f}x")
        for m in ONLY_FEDADAPT:
            if (a := rows.get((n, f"fedadapt {m}"))):
                print(f"{m:<12s} {a['seconds']:10.3f} {cols(a)}")

    print("\ntargets (issue 49): fedavg <= 1.15x its floor; fedavg and fedadam faster than Flower's FedAvg / FedAdam "
          "(flwr/ours > 1: each over its own child's floor, so that a shared machine's drift between children "
          "cancels); extra memory beyond the returned model <= 1 model copy")
    for n in args.replies:
        for ours, theirs in PAIRS:
            a, b = rows.get((n, f"fedadapt {ours}")), rows.get((n, f"flwr {theirs}"))
            if not a:
                continue
            beyond = max(a["peak_bytes"], a["rss_bytes"]) / a["model_bytes"] - 1.0
            checks = [f"{relative(a):5.2f}x floor" + (f" ({'ok' if relative(a) <= 1.15 else 'MISS'})"
                                                       if ours == "fedavg" else ""),
                      f"beyond the returned model {beyond:4.2f} copies ({'ok' if beyond <= 1.0 else 'MISS'})"]
            if b:
                faster = relative(b) / relative(a)
                checks.append(f"flwr {theirs}/ours {faster:5.2f}x" + (f" ({'ok' if faster > 1 else 'MISS'})"
                                                                       if ours in ("fedavg", "fedadam") else ""))
            print(f"N={n:<4d} {ours:<11s} " + " | ".join(checks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
