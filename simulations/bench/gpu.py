"""CPU vs GPU seconds per round: the real strategy + a user-style ClientApp on CUDA (in-process engine); and
(``--cnn``) the vectorized engine on the CIFAR-shaped CNN at 1,000 clients per round, chunked.

    python -m simulations.bench.gpu                      # both devices if CUDA is present, else CPU only
    python -m simulations.bench.gpu --clients 4 --examples 256 --rounds 2 --methods fedavg fedlada scaffold
    python -m simulations.bench.gpu --cnn                # 1,000 clients × 50 examples, E=2, chunks of 250, on CUDA
    python -m simulations.bench.gpu --cnn --clients 8 --examples 8 --chunk 4 --devices cpu   # a smoke run

``--cnn`` (one round of local training, client level, seeded random 3×32×32 data, the 2-conv GroupNorm CNN of
``simulations.bench.vectorized``; plain SGD, FedAvg's local update): **stacked** — the vectorized engine's pass
(``torch.func``: ``vmap`` over ``functional_call``, the per-example losses of all clients in one call, one backward
pass of the clients' losses' sum, one SGD step of the stacked parameters), chunk by chunk; **plain** — one client
after another with ``torch.optim.SGD``, the same mini-batches; and, when flwr is installed, the engines themselves
(``simulations.engine.vectorized.train_stacked`` and the sequential ClientApp's ``train_reply``).  It needs only
torch (the flwr rows are skipped without flwr), prints the largest relative difference between the stacked and the plain
clients' models, and CUDA peak memory.  TF32 is switched off, so that the difference is the engines'.

A ResNet-18 (torchvision, 11.2 M parameters) on CIFAR-shaped synthetic tensors (3×32×32, 10 classes).  Each
client trains with ``flower_strategies.train_reply`` on a DataLoader, with the model on the chosen device (the
records are moved to the model's device and back by the library); the server is the method's real strategy.
Round 1 includes CUDA warm-up, so the figure reported is the mean of rounds 2…R (and round 1 separately).
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset


def resnet18() -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def client_app(device: torch.device, examples: int, batch_size: int) -> Any:
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp

    import flower_strategies as fs

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
    from flwr.app import ArrayRecord, MetricRecord

    import flower_strategies as fs
    from simulations.engine.inprocess import LoopbackGrid

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
    ap.add_argument("--clients", type=int, default=None, help="default 4 (--cnn: 1000)")
    ap.add_argument("--examples", type=int, default=None, help="per client; default 256 (--cnn: 64)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--devices", nargs="+", default=None)
    ap.add_argument("--cnn", action="store_true", help="the vectorized engine on the CIFAR-shaped CNN (see above)")
    ap.add_argument("--epochs", type=int, default=2, help="--cnn: local epochs")
    ap.add_argument("--chunk", type=int, default=250, help="--cnn: clients per stacked pass")
    ap.add_argument("--lr", type=float, default=0.05, help="--cnn: client learning rate")
    args = ap.parse_args(argv)
    if args.cnn:
        return cnn_main(args)
    args.clients, args.examples = args.clients or 4, args.examples or 256
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


# ------------------------------------------------------------------------------------------ --cnn
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _cnn_prefix(kind: str, n: int, *, model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor, plan: torch.Tensor,
                lr: float, chunk: int) -> list[dict[str, torch.Tensor]]:
    """:func:`_cnn_round` on the first ``n`` clients."""
    return _cnn_round(kind, model, xs[:n], ys[:n], plan[:n], lr, chunk)


def _engine_prefix(kind: str, n: int, *, model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor,
                   args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    """:func:`_engine_round` on the first ``n`` clients."""
    return _engine_round(kind, model, xs[:n], ys[:n], args)


def _cnn_round(kind: str, model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor, plan: torch.Tensor,
               lr: float, chunk: int) -> list[dict[str, torch.Tensor]]:
    """One round of local SGD of every client (``plan[c, s]``: client c's batch at step s); each client's model.
    ``stacked``: chunk by chunk, all of a chunk's clients in one pass per step; ``plain``: one after another."""
    from torch.func import functional_call, vmap

    loss_fn = torch.nn.functional.cross_entropy
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    out: list[dict[str, torch.Tensor]] = []
    if kind == "plain":
        for c in range(len(xs)):
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(start[n])
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            for idx in plan[c]:
                opt.zero_grad()
                loss_fn(model(xs[c][idx]), ys[c][idx]).backward()
                opt.step()
            out.append({n: p.detach().clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        return out
    forward = vmap(lambda p, x: functional_call(model, p, (x,)))
    for a in range(0, len(xs), chunk):
        ids = torch.arange(a, min(len(xs), a + chunk), device=xs.device)
        params = {n: v.unsqueeze(0).expand(len(ids), *v.shape).clone() for n, v in start.items()}
        for s in range(plan.shape[1]):
            idx = plan[ids, s]  # (C, batch)
            x, y = xs[ids[:, None], idx], ys[ids[:, None], idx]
            leaves = {n: p.requires_grad_(True) for n, p in params.items()}
            logits = forward(leaves, x)
            losses = loss_fn(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)
            grads = torch.autograd.grad(losses.sum(), list(leaves.values()))
            params = {n: (p - lr * g).detach() for (n, p), g in zip(leaves.items(), grads, strict=True)}
        out += [{n: v[c] for n, v in params.items()} for c in range(len(ids))]
    return out


def _engine_round(kind: str, model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor, args: argparse.Namespace,
                  ) -> list[dict[str, torch.Tensor]]:
    """The engines themselves (flwr needed): ``train_stacked`` chunk by chunk, or ``train_reply`` per client; on a
    copy of ``model`` (the engines load each client's model into the module they are given)."""
    import copy

    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    from app_common.task import example_cross_entropy
    from flower_strategies.core.client import ClientRound, TensorPartition, record_tensors, train_reply
    from simulations.engine.vectorized import train_stacked

    import flower_strategies as fs

    # the round's ConfigRecord as FedAvg's strategy sends it (the client half's keys included)
    strategy = fs.get_method("fedavg").build(client_lr=args.lr, local_epochs=args.epochs, batch_size=args.batch_size)
    config = ConfigRecord({**strategy.round_config(1), "server-round": 1})
    model = copy.deepcopy(model)
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": config})
    replies = []
    if kind == "engine-stacked":
        for a in range(0, len(xs), args.chunk):
            ids = range(a, min(len(xs), a + args.chunk))
            replies += train_stacked(model, [ClientRound(content, None, client_key=i) for i in ids],
                                     [TensorPartition(xs[i], ys[i]) for i in ids], example_cross_entropy,
                                     loss_before=False)
    else:
        replies = [train_reply(model, content, xs[i], ys[i], torch.nn.functional.cross_entropy, client_key=i,
                               loss_before=False) for i in range(len(xs))]
    # the replies are Flower records (bytes); the first three back as tensors, for the comparison of the models
    return [record_tensors(r.array_records["arrays"]) for r in replies[:3]]


def cnn_main(args: argparse.Namespace) -> int:
    """``--cnn``: one round of each engine per device, timed after a warm-up on 2 clients (module docstring)."""
    import importlib.util

    from simulations.bench.vectorized import max_rel, cifar_gn_cnn

    clients, examples = args.clients or 1000, args.examples or 64
    if examples % args.batch_size:
        raise SystemExit(f"--cnn: --examples ({examples}) must be a multiple of --batch-size ({args.batch_size})")
    devices = args.devices or (["cuda"] if torch.cuda.is_available() else ["cpu"])
    has_flwr = importlib.util.find_spec("flwr") is not None
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    per_epoch = examples // args.batch_size
    steps = args.epochs * per_epoch
    print(f"torch {torch.__version__}; cuda: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}"
          f"; flwr {'present' if has_flwr else 'absent (engine rows skipped)'}; CIFAR-shaped GroupNorm CNN, "
          f"{clients} clients × {examples} examples, E={args.epochs} ({steps} steps), batch {args.batch_size}, "
          f"chunk {args.chunk}", flush=True)
    kinds = ["stacked", "plain"] + (["engine-stacked", "engine-sequential"] if has_flwr else [])
    for dev in devices:
        device = torch.device(dev)
        torch.manual_seed(0)
        model = cifar_gn_cnn().to(device)
        gen = torch.Generator().manual_seed(1)
        xs = torch.randn(clients, examples, 3, 32, 32, generator=gen).to(device)
        ys = torch.randint(0, 10, (clients, examples), generator=gen).to(device)
        # every client's batches: a permutation per epoch, cut into batches (the engines draw their own)
        perms = torch.stack([torch.stack([torch.randperm(examples, generator=gen) for _ in range(args.epochs)])
                             for _ in range(clients)])
        plan = perms.reshape(clients, steps, args.batch_size).to(device)
        results: dict[str, tuple[float, float, list]] = {}
        for kind in kinds:
            run = (partial(_cnn_prefix, model=model, xs=xs, ys=ys, plan=plan, lr=args.lr, chunk=args.chunk)
                   if not kind.startswith("engine") else partial(_engine_prefix, model=model, xs=xs, ys=ys, args=args))
            run(kind, min(2, clients))  # warm-up: cuDNN / vmap first calls
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            models = run(kind, clients)
            _sync(device)
            peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
            first = [{n: v.cpu() for n, v in m.items()} for m in models[:3]]  # compared below
            results[kind] = (time.perf_counter() - t0, peak, first)
            print(f"  {dev} {kind}: {results[kind][0]:.2f} s", flush=True)
        print(f"{'engine':18s} {'device':6s} {'seconds':>9s} {'vs plain':>9s} {'peak CUDA MiB':>14s}")
        for kind, (sec, peak, _) in results.items():
            print(f"{kind:18s} {dev:6s} {sec:9.2f} {results['plain'][0] / sec:8.2f}x {peak:14.0f}")
        worst = max_rel(results["stacked"][2], results["plain"][2])
        print(f"max relative difference, stacked vs plain (first clients' models): {worst:.1e}", flush=True)
        if "engine-sequential" in results:
            same = max_rel(results["engine-stacked"][2], results["engine-sequential"][2])
            speedup = results["engine-sequential"][0] / results["engine-stacked"][0]
            print(f"engine-stacked vs engine-sequential: {speedup:.2f}x; max relative difference (first clients' "
                  f"models): {same:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
