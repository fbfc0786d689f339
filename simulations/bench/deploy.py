"""Where the time of a deployment round goes, and seconds per round of the local deployment.

    python -m simulations.bench.deploy startup [--repeats 5]
        Per-message ClientApp start-up, measured without any Flower server process:
        * ``spawn``: a fresh interpreter importing what ``flwr-clientapp`` + our ClientApp import (what Flower 1.42
          does for EVERY message: the SuperNode's SuperExec starts one ``flwr-clientapp`` process per message);
        * ``fork``: a child forked from a process that already imported them (what a pre-loaded executor would pay);
        * ``train``: one real ClientApp train call (digits-mlp, 1 local epoch) in a warm process, for scale.

    python -m simulations.bench.deploy deploy [--nodes 2] [--rounds 3] [--task-poll-interval 0.1] [--preloaded]
                                              [--node-data DIR]
        A real local deployment (``simulations.launch deploy``: SuperLink + N SuperNodes on 127.0.0.1); prints the
        seconds of every round as the ServerApp measured them (``metrics.jsonl``) and their mean.  Starts real
        Flower processes: run it on a machine you do not share.

Both print one JSON line at the end (machine-readable) after the human-readable lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: What a ``flwr-clientapp`` process imports before it can run our ClientApp (``torch._dynamo``: imported lazily by
#: the first ``torch.optim.Optimizer(...)``, so every train message pays it too).
CLIENTAPP_IMPORTS = (
    "from flwr.supernode.runtime.run_clientapp import run_clientapp; import client_app.app; import flower_strategies; "
    "import torch._dynamo"
)


def bench_startup(repeats: int) -> dict[str, float]:
    spawn = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", CLIENTAPP_IMPORTS], cwd=ROOT, check=True)
        spawn.append(time.perf_counter() - t0)

    exec(CLIENTAPP_IMPORTS, {})  # warm this process  # noqa: S102 - constant string
    fork = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # child: the modules are already there
            import client_app.app  # noqa: F401
            os._exit(0)
        os.waitpid(pid, 0)
        fork.append(time.perf_counter() - t0)

    train = _train_seconds(repeats)
    out = {"spawn_s": statistics.median(spawn), "fork_s": statistics.median(fork), "train_s": statistics.median(train)}
    print(f"fresh flwr-clientapp-like process (imports)  : {out['spawn_s']:.3f} s (median of {repeats})")
    print(f"fork of a pre-loaded process                 : {out['fork_s']:.4f} s")
    print(f"one ClientApp train call (digits-mlp, 1 epoch): {out['train_s']:.3f} s")
    return out


def _train_seconds(repeats: int) -> list[float]:
    import time as _t

    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, Metadata, RecordDict

    from client_app.app import app as client_app
    from app_common.task import build_model
    from flower_strategies import FedAvg

    times = []
    for i in range(repeats):
        content = RecordDict({"arrays": ArrayRecord(build_model("digits-mlp", 0).state_dict()), "config": ConfigRecord(
            {**FedAvg().round_config(1), "server-round": 1, "client-lr": 0.1, "local-steps": 0, "local-epochs": 1,
             "batch-size": 32})})
        md = Metadata(run_id=1, message_id=f"m{i}", src_node_id=0, dst_node_id=1, reply_to_message_id="",
                      group_id="", created_at=_t.time(), ttl=3600.0, message_type=MessageType.TRAIN)
        ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                      run_config={})
        t0 = _t.perf_counter()
        client_app(Message(content=content, metadata=md), ctx)  # type: ignore[call-overload]  # the runtime's form
        times.append(_t.perf_counter() - t0)
    return times


def bench_deploy(nodes: int, rounds: int, task_poll_interval: float | None, node_data: str | None,
                 run_config: str, preloaded: bool = False) -> dict[str, Any]:
    from simulations.launch import launch_deploy

    with tempfile.TemporaryDirectory(prefix="fedadapt-bench-") as tmp:
        out = Path(tmp) / "out"
        cfg = f"num-server-rounds={rounds} output-dir='{out}' run-name='bench' {run_config}".strip()
        t0 = time.monotonic()
        rc = launch_deploy(nodes, cfg, Path(tmp) / "flwr", timeout=1800,
                           node_data=[node_data] if node_data else None, task_poll_interval=task_poll_interval,
                           preloaded=preloaded)
        wall = time.monotonic() - t0
        if rc != 0:
            raise SystemExit(f"deployment failed (rc={rc})")
        rows = [json.loads(line) for line in (out / "bench" / "metrics.jsonl").read_text().splitlines()]
    per_round = [float(r["seconds"]) for r in rows[1:]]
    res = {"nodes": nodes, "rounds": rounds, "task_poll_interval": task_poll_interval, "preloaded": preloaded,
           "seconds_per_round": statistics.mean(per_round), "rounds_s": per_round, "wall_s": wall}
    print(f"seconds per round: {', '.join(f'{s:.1f}' for s in per_round)} (mean {res['seconds_per_round']:.1f}); "
          f"wall {wall:.0f} s incl. start-up")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("startup", "deploy"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--task-poll-interval", type=float, default=None)
    ap.add_argument("--preloaded", action="store_true", help="pre-loaded SuperExec (simulations.launch.preloaded_exec)")
    ap.add_argument("--node-data", default=None, help="directory of partition-<i>.npz (simulations.tools.convert_data)")
    ap.add_argument("--run-config", default="")
    a = ap.parse_args(argv)
    if a.mode == "startup":
        res = bench_startup(a.repeats)
    else:
        res = bench_deploy(a.nodes, a.rounds, a.task_poll_interval, a.node_data, a.run_config, a.preloaded)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
