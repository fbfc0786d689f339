"""Benchmark: fedadapt side by side with pfl-research (Apple's ``pfl``), interleaved fresh processes.

    python3 -m venv /work/venv-pfl && /work/venv-pfl/bin/pip install pfl==0.6.0 torch==2.14.1   # once, its own venv
    python -m simulations.bench.pfl --pfl-python /work/venv-pfl/bin/python --repeats 3

``pfl`` is never a fedadapt dependency: it runs in its own environment as a child process (``--pfl-python``).  The
same job on both sides: the digits training split in IID partitions (fedadapt's own, handed to pfl as arrays), the
64-64-10 MLP from the same initial weights, FedAvg (server learning rate 1), E=5 local epochs, batch 16, client
learning rate 0.5, one torch thread.  Measured, each in a fresh process, the cases interleaved:

* ``whole``: interpreter start to exit of N=100 clients, every client every round, 3 rounds (fedadapt: the in-process
  and vectorized engines, :mod:`simulations.bench.startup`'s run; pfl: ``FederatedAveraging`` on a
  ``SimulatedBackend``);
* ``round``: a steady round's seconds (the lower median of rounds 2…) at N=100 (all) and at N=1,000 with 1 % (10 a
  round); ``--steady-rounds R`` takes it from a second run of R rounds of the same side (rounds 2 and 3 of a 3-round
  run are only two samples, a few ms each at N=1,000).

fedadapt evaluates the 360 test digits centrally after each round (loss and accuracy).  pfl runs twice: ``pfl`` as
pfl's own default (no central evaluation), and ``pfl+eval`` with ``CentralEvaluationCallback`` on the same 360 test
digits after each round (loss and accuracy, one batch), i.e. the same work as fedadapt's round; ratios are printed
against both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from .startup import measure

PFL_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import torch
from pfl.aggregate.simulate import SimulatedBackend
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.callback.central_evaluation import CentralEvaluationCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Metrics, Weighted
from pfl.model.pytorch import PyTorchModel

torch.set_num_threads(1)
data = np.load(sys.argv[1])
nodes, cohort, rounds, central_eval = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(64, 64), torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

    def loss(self, x, y, eval=False):
        self.eval() if eval else self.train()
        return torch.nn.functional.cross_entropy(self(x), y)

    def metrics(self, x, y, eval=False):
        self.eval() if eval else self.train()
        with torch.no_grad():
            out = self(x)
            loss = torch.nn.functional.cross_entropy(out, y, reduction="sum").item()
            correct = (out.argmax(1) == y).sum().item()
        return {"loss": Weighted(loss, len(x)), "accuracy": Weighted(correct, len(x))}


net = MLP()
net.load_state_dict({k: torch.from_numpy(data["init." + k]) for k in net.state_dict()})
parts = {u: [torch.from_numpy(data[f"x.{u}"]), torch.from_numpy(data[f"y.{u}"])] for u in range(nodes)}
train = FederatedDataset(lambda u: Dataset(parts[u], user_id=u), get_user_sampler("minimize_reuse", list(range(nodes))))
val = FederatedDataset(lambda u: Dataset(parts[u], user_id=u), get_user_sampler("random", list(range(nodes))))
model = PyTorchModel(net, local_optimizer_create=torch.optim.SGD,
                     central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
stamps = []


class Stamp(TrainingProcessCallback):
    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        stamps.append(time.perf_counter())
        return False, Metrics()


# the same 360 test digits fedadapt evaluates after each round, as one batch (Stamp runs after it)
test = Dataset([torch.from_numpy(data["test.x"]), torch.from_numpy(data["test.y"])])
evals = [CentralEvaluationCallback(test, NNEvalHyperParams(local_batch_size=None))] if central_eval else []
stamps.append(time.perf_counter())
FederatedAveraging().run(
    algorithm_params=NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=rounds + 1,
                                       train_cohort_size=cohort, val_cohort_size=0),
    backend=SimulatedBackend(training_data=train, val_data=val),
    model=model,
    model_train_params=NNTrainHyperParams(local_num_epochs=5, local_learning_rate=0.5, local_batch_size=16),
    model_eval_params=NNEvalHyperParams(local_batch_size=16),
    callbacks=[*evals, Stamp()])
seconds = [b - a for a, b in zip(stamps, stamps[1:])]
steady = sorted(seconds[1:])
print(json.dumps({"round": steady[(len(steady) - 1) // 2], "seconds": seconds}))
"""


def pfl_data(path: Path, nodes: int) -> None:
    """fedadapt's IID digits partitions and initial MLP weights as one ``.npz`` for the pfl child."""
    from app_common.task import build_model, digits_partition, load_test_data

    arrays = {f"init.{k}": v.numpy() for k, v in build_model("digits-mlp", 0).state_dict().items()}
    test_x, test_y = load_test_data("digits-mlp", seed=0)
    arrays["test.x"], arrays["test.y"] = test_x.numpy(), test_y.numpy()
    for u in range(nodes):
        x, y = digits_partition(u, nodes, partitioner="iid", seed=0)
        arrays[f"x.{u}"], arrays[f"y.{u}"] = x.numpy(), y.numpy()
    np.savez(path, **arrays)


def run_pfl(python: str, data: Path, nodes: int, cohort: int, rounds: int, central_eval: bool = False
            ) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": ""}
    start = time.perf_counter()
    res = subprocess.run([python, "-c", PFL_CHILD, str(data), str(nodes), str(cohort), str(rounds),
                          "1" if central_eval else "0"], env=env,
                         capture_output=True, text=True)
    whole = time.perf_counter() - start
    if res.returncode != 0:
        raise RuntimeError(f"pfl: exit {res.returncode}\n{res.stderr[-3000:]}")
    return {"whole": whole, "round": json.loads(res.stdout.strip().splitlines()[-1])["round"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pfl-python", required=True, help="the python of pfl's own environment")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steady-rounds", type=int, default=0,
                    help="take the steady round from separate runs of this many rounds (the median of rounds 2…; "
                         "0 = from the --rounds runs); the whole-process time stays that of --rounds")
    args = ap.parse_args(argv)
    tree = Path(__file__).resolve().parents[2]
    cases = [("N=100", 100, 100, 1.0), ("N=1000 1%", 1000, 10, 0.01)]
    res: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="fedadapt-pfl-") as tmp:
        for _, nodes, _, _ in cases:
            pfl_data(Path(tmp) / f"{nodes}.npz", nodes)
        cwd = Path(tmp) / "fedadapt"
        cwd.mkdir()
        for _, nodes, _, fraction in cases:  # fills fedadapt's data cache (untimed), as a repeated run finds it
            measure(tree, cwd, "vectorized", nodes, args.rounds, fraction)
        for r in range(args.repeats):
            for label, nodes, cohort, fraction in cases:
                runs: dict[str, Callable[..., dict[str, float]]] = {
                    "pfl": partial(run_pfl, args.pfl_python, Path(tmp) / f"{nodes}.npz", nodes, cohort,
                                   rounds=args.rounds),
                    "pfl+eval": partial(run_pfl, args.pfl_python, Path(tmp) / f"{nodes}.npz", nodes, cohort,
                                        rounds=args.rounds, central_eval=True)}
                for engine in ("inprocess", "vectorized"):
                    runs[engine] = partial(measure, tree, cwd, engine, nodes, rounds=args.rounds, fraction=fraction)
                for name, fn in runs.items():
                    got = fn()
                    if args.steady_rounds:  # the same side again, longer: its steady round replaces the short run's
                        got["round"] = fn(rounds=args.steady_rounds)["round"]
                    res.setdefault((label, name), []).append(got)
                    print(f"#{r + 1} {label} {name}: whole {got['whole']:.2f}s, round {got['round']:.3f}s", flush=True)
    steady = f"; steady round from {args.steady_rounds}-round runs" if args.steady_rounds else ""
    print(f"\ndigits-mlp FedAvg, E=5, batch 16, {args.rounds} rounds{steady}; medians of {args.repeats} interleaved "
          "fresh processes")
    print(f"{'case':<12}{'side':<12}{'whole s':>9}{'round s':>9}{'pfl/this whole':>16}{'pfl/this round':>16}"
          f"{'pfl+eval/this whole':>21}{'pfl+eval/this round':>21}")
    for label, *_ in cases:
        med = {name: {k: statistics.median(x[k] for x in res[label, name]) for k in ("whole", "round")}
               for name in ("pfl", "pfl+eval", "inprocess", "vectorized")}
        for name, m in med.items():
            ratios = "".join(f"{med[ref][k] / m[k]:>{w}.2f}" for ref, w in (("pfl", 16), ("pfl+eval", 21))
                             for k in ("whole", "round"))
            print(f"{label:<12}{name:<12}{m['whole']:>9.2f}{m['round']:>9.3f}{ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
