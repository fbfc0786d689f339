"""Benchmark: server time and peak extra memory of one aggregation of a ResNet-18-sized update × N replies.

    python -m simulations.bench_aggregation [--replies 20] [--method fedadam]

The replies themselves (N local models, as Flower delivers them) are built before measuring; what is reported is the
*extra* memory the strategy allocates while validating and folding them (tracemalloc peak; NumPy allocations are
traced), next to the size of one model.  Streaming aggregation keeps it at a small multiple of the model size,
independent of N.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replies", type=int, default=20)
    ap.add_argument("--method", default="fedadam")
    args = ap.parse_args(argv)

    import torchvision
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

    from flower_strategies.core import records as R
    from flower_strategies.core.registry import get_method
    from simulations.engine import LoopbackGrid

    net = torchvision.models.resnet18(num_classes=10)
    state = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    model_mb = sum(a.nbytes for a in state.values()) / 2**20
    strategy = get_method(args.method).build(trainable_keys=[n for n, _ in net.named_parameters()],
                                             min_available_nodes=1, min_train_nodes=args.replies)
    rng = np.random.default_rng(0)

    def client(msg: Message, context) -> Message:
        """A stand-in ClientApp: replies with the model plus small noise (what Flower delivers to the server)."""
        arrays = {k: Array((v + rng.normal(scale=1e-3, size=v.shape).astype(v.dtype)) if v.dtype.kind == "f" else v)
                  for k, v in state.items()}
        metrics = MetricRecord({R.NUM_EXAMPLES: 100 + msg.metadata.dst_node_id})
        return Message(RecordDict({R.MODEL: ArrayRecord(arrays), R.METRICS: metrics}), reply_to=msg)

    grid = LoopbackGrid(client, args.replies)
    replies = grid.send_and_receive(strategy.configure_train(1, ArrayRecord(net.state_dict()), ConfigRecord(), grid))
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    out, metrics = strategy.aggregate_train(1, replies)
    dt = time.perf_counter() - t0
    peak = (tracemalloc.get_traced_memory()[1] - base) / 2**20
    tracemalloc.stop()
    assert out is not None and metrics["replies-used"] == args.replies
    print(f"method={args.method} model=ResNet-18 ({sum(v.size for v in state.values()):,} values, {model_mb:.1f} MiB float32) "
          f"replies={args.replies}")
    print(f"aggregate_train: {dt:.2f} s, peak extra memory {peak:.0f} MiB = {peak / model_mb:.1f}x one model "
          f"(the {args.replies} replies themselves hold {args.replies * model_mb:.0f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
