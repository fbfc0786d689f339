"""CPU vs GPU seconds per round: the real strategy + a user-style ClientApp on CUDA (in-process engine).

    python -m simulations.bench.gpu                      # both devices if CUDA is present, else CPU only
    python -m simulations.bench.gpu --clients 4 --examples 256 --rounds 2 --methods fedavg fedlada scaffold

A ResNet-18 (torchvision, 11.2 M parameters) on CIFAR-shaped synthetic tensors (3×32×32, 10 classes).  Each
client trains with ``flower_strategies.train_reply`` on a DataLoader, with the model on the chosen device (the
records are moved to the model's device and back by the library); the server is the method's real strategy.
Round 1 includes CUDA warm-up, so the figure reported is the mean of rounds 2…R (and round 1 separately).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader, TensorDataset

import flower_strategies as fs
from simulations.engine.inprocess import LoopbackGrid


def resnet18() -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def client_app(device: torch.device, examples: int, batch_size: int) -> ClientApp:
    app = ClientApp()
    cache: dict[int, DataLoader] = {}

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        if pid not in cache:
            g = torch.Generator().manual_seed(pid)
            x = torch.randn(examples, 3, 32, 32, generator=g)
            y = torch.randint(0, 10, (examples,), generator=g)
            cache[pid] = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=g)
        model = resnet18().to(device)
        content = fs.train_reply(model, msg.content, cache[pid], torch.nn.functional.cross_entropy, state=context.state)
        return Message(content=content, reply_to=msg)

    return app


def bench(method: str, device: torch.device, clients: int, examples: int, rounds: int, batch_size: int) -> list[float]:
    spec = fs.get_method(method)
    model = resnet18()
    strategy = spec.build(client_lr=0.01, local_epochs=1, batch_size=batch_size, min_train_nodes=clients,
                          min_available_nodes=clients, trainable_keys=[n for n, _ in model.named_parameters()],
                          num_rounds=rounds)
    grid = LoopbackGrid(client_app(device, examples, batch_size), clients, {})
    times: list[float] = []
    last = [time.perf_counter()]

    def tick(server_round: int, arrays: Any) -> MetricRecord:
        if device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if server_round > 0:
            times.append(now - last[0])
        last[0] = now
        return MetricRecord({})

    strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=rounds, evaluate_fn=tick)
    rejected = sum(h.replies_rejected for h in strategy.history)
    if rejected or not all(h.updated for h in strategy.history):
        raise RuntimeError(f"{method} on {device}: {rejected} rejected replies / rounds without update")
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["fedavg", "fedlada", "scaffold"])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--examples", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--devices", nargs="+", default=None)
    args = ap.parse_args(argv)
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    print(f"torch {torch.__version__}; cuda: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}; "
          f"CPU threads {torch.get_num_threads()}; ResNet-18, {args.clients} clients × {args.examples} examples, "
          f"batch {args.batch_size}, {args.rounds} rounds", flush=True)
    print(f"{'method':10s} {'device':6s} {'round 1 s':>10s} {'later rounds s':>15s}", flush=True)
    results: dict[tuple[str, str], float] = {}
    for method in args.methods:
        for dev in devices:
            t = bench(method, torch.device(dev), args.clients, args.examples, args.rounds, args.batch_size)
            later = sum(t[1:]) / max(len(t) - 1, 1)
            results[(method, dev)] = later
            print(f"{method:10s} {dev:6s} {t[0]:10.2f} {later:15.2f}", flush=True)
    if "cpu" in devices and "cuda" in devices:
        for method in args.methods:
            print(f"{method}: GPU speed-up {results[(method, 'cpu')] / results[(method, 'cuda')]:.1f}× per round")
        app_check(args.methods)
    return 0


def app_check(methods: list[str]) -> None:
    """fedadapt's own ServerApp + ClientApp (in-process) with ``device`` = cpu and cuda: same learning, any method."""
    import tempfile

    from simulations.engine.inprocess import run_inprocess

    for method in methods:
        finals = {}
        for dev in ("cpu", "cuda"):
            cfg = {"method": method, "task": "synthetic-linear", "num-server-rounds": 3, "local-steps": 5,
                   "device": dev, "output-dir": tempfile.mkdtemp(), "client-lr": 0.05}
            finals[dev] = run_inprocess(cfg, 4)["final"]["test-loss"]
        print(f"app path {method}: final test loss cpu {finals['cpu']:.6f} cuda {finals['cuda']:.6f}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
