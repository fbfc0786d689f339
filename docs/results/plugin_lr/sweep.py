"""Client-lr sweep for the plug-in path: every method in examples/pytorch_app (its own DataLoader, loop and
momentum SGD where the method allows), the app's ``learning-rate`` scaled by 0.1, 1 and 10, a few rounds in-process.

    flock /tmp/fedadapt-heavy.lock python docs/results/plugin_lr/sweep.py [--rounds 3] [--out table.md]

Accuracy: the final global model on the union of the clients' held-out splits (the app's ``load_data``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from flwr.app import Context, RecordDict

import flower_strategies as fs
from simulations.engine import LoopbackGrid

APP = Path(__file__).resolve().parents[3] / "examples" / "pytorch_app"
sys.path.insert(0, str(APP))
from pytorchapp import client_app, server_app  # noqa: E402
from pytorchapp.task import Net, load_data, test  # noqa: E402

NODES, APP_LR, FACTORS = 3, 0.05, (0.1, 1.0, 10.0)


def accuracy(state: dict) -> float:
    """The app's own test() on each client's held-out split, example-weighted."""
    model = Net()
    model.load_state_dict(state)
    loaders = [load_data(pid, NODES, 256)[1] for pid in range(NODES)]
    sizes = [len(loader.dataset) for loader in loaders]
    accs = [test(model, loader, torch.device("cpu"))[1] for loader in loaders]
    return sum(a * n for a, n in zip(accs, sizes)) / sum(sizes)


def run(method: str, lr: float, rounds: int, out: Path) -> float:
    cfg = {"num-server-rounds": rounds, "fraction-train": 1.0, "local-epochs": 1, "learning-rate": lr,
           "batch-size": 32, "method": method, "output": str(out), "fraction-evaluate": 0.0}
    torch.manual_seed(0)  # the app's server builds its initial Net() from torch's global RNG
    server_app.main(LoopbackGrid(client_app.app, NODES, cfg),
                    Context(run_id=1, node_id=0, state=RecordDict(), run_config=cfg, node_config={}))
    return accuracy(torch.load(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--methods", nargs="*", default=sorted(fs.METHODS))
    args = ap.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.manual_seed(0)
    rows = [f"round-0 accuracy (the initial Net): {accuracy(Net().state_dict()):.3f}", "",
            "| method | client half | ×0.1 | ×1 | ×10 | best |", "|---|---|---|---|---|---|"]
    for method in args.methods:
        accs = [run(method, APP_LR * f, args.rounds, Path(f"/tmp/plugin_lr_{method}.pt")) for f in FACTORS]
        best = FACTORS[max(range(len(FACTORS)), key=lambda i: accs[i])]
        half = "yes" if fs.get_method(method).build().needs_client_half else "no"
        rows.append(f"| `{method}` | {half} | " + " | ".join(f"{a:.3f}" for a in accs) + f" | ×{best:g} |")
        print(rows[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
