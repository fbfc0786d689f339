"""The vectorized in-process engine (simulations.engine.vectorized) equals the sequential one for every registered
method.

Both engines drive the real strategy and the real ClientApp; the vectorized one trains each round's clients stacked
(torch.func) with the method's own local optimizer.  float64, 10 rounds, on the synthetic least-squares task
(clients of 32–51 examples, batch 16: epochs mode gives unequal step counts and partial last batches, so masking and
padding are used):

* fixed steps, every client every round (3 clients); epochs mode, 2 of 4 clients per round (persistent client state of
  clients sampled at different times, fresh and returning clients in one round) — 1e-12 relative;
* digits-mlp (a ReLU MLP, cross-entropy, Dirichlet partitions): float64 (1e-12) and float32 (1e-5).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

from app_common.task import build_model
import flower_strategies  # noqa: F401  (registers every method)
from flower_strategies.core.registry import build_strategy
from simulations.engine.inprocess import simulate
from simulations.engine.vectorized import NotVectorizable, VectorGrid, check_vectorizable
from tests.helpers import client_keys, every_method

#: the engines must agree to 1e-12 (relative) after 10 rounds
ROUNDS = 10
BASE = {"task": "synthetic-linear", "precision": "float64", "seed": 3, "batch-size": 16, "client-lr": 0.02,
        "fraction-evaluate": 0.0, "synthetic-heterogeneity": 1.0}
MODES = {
    "steps-full": {"local-steps": 2, "fraction-train": 1.0},
    "epochs-partial": {"local-steps": 0, "local-epochs": 1, "fraction-train": 0.5},
}
#: Nodes per mode.  Fixed steps, every client every round: 3 stacked clients (of 32, 38 and 44 examples) exercise the
#: client axis, its reductions and the per-client batches as 4 did, at 3/4 of the cost.  Epochs mode keeps 4 nodes:
#: 2 sampled per round out of 4 is what mixes fresh and returning clients (and unequal step counts) in one round.
NODES = {"steps-full": 3, "epochs-partial": 4}
#: learning rates at which the method is numerically stable on this task (an unstable run amplifies rounding)
LR = {"fedlamb": 0.005, "fedams": 0.005, "adpfed": 0.005}


def _run(rc, engine, nodes, **grid):
    logging.getLogger("flwr").setLevel(logging.WARNING)
    strat, _ = build_strategy({k: v for k, v in rc.items() if k not in ("task", "precision", "seed", "partitioner",
                                                                       "synthetic-heterogeneity")})
    model = build_model(rc["task"], rc["seed"], precision=rc["precision"])
    snaps, g = simulate(strat, ArrayRecord(model.state_dict()), ROUNDS, nodes, rc, engine=engine, **grid)
    return snaps, g


def _rel(a, b):
    return max(float(np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(a[k]), 1e-300)) for k in a)


def _compare(rc, nodes, tol, **grid):
    seq, _ = _run(rc, "inprocess", nodes)
    vec, grid_ = _run(rc, "vectorized", nodes, **grid)
    assert len(seq) == len(vec) == ROUNDS + 1
    assert isinstance(grid_, VectorGrid) and grid_.stacked_clients > 0  # the stacked path did train
    err = max(_rel(a, b) for a, b in zip(seq, vec, strict=True))
    assert err <= tol, f"relative difference {err:.3e} > {tol}"
    assert _rel(seq[0], seq[-1]) > 1e-3  # the runs did move the model
    return grid_


@pytest.mark.parametrize("method", every_method())
@pytest.mark.parametrize("mode", list(MODES))
def test_vectorized_engine_equals_sequential_engine(method, mode):
    rc = {**BASE, **MODES[mode], "method": method, "client-lr": LR.get(method, BASE["client-lr"])}
    grid = _compare(rc, NODES[mode], 1e-12)
    if mode == "steps-full":
        assert grid.chunks == ROUNDS  # one stacked pass per round: all 3 clients together


@pytest.mark.parametrize(("method", "precision", "tol"), [("fedlamb", "float64", 1e-12), ("scaffold", "float32", 1e-5)])
def test_digits_mlp(method, precision, tol):
    rc = {**BASE, "task": "digits-mlp", "method": method, "local-steps": 0, "local-epochs": 1, "batch-size": 32,
          "fraction-train": 0.75, "client-lr": LR.get(method, 0.05), "partitioner": "dirichlet", "precision": precision}
    _compare(rc, 4, tol)


def test_stacked_loss_before_and_full_gradient_equal_the_per_client_functions():
    """train-loss-before (one forward pass over the chunk: each client's mean, or over its seeded
    loss-before-max-examples sample) and MimeLite's full-batch gradient (one stacked pass over whole partitions)
    equal what the sequential ClientApp's train_reply computes per client, float64, unequal partition sizes."""
    from flwr.app import ConfigRecord, RecordDict

    from app_common.task import example_cross_entropy
    from flower_strategies.core.client import ClientRound, TensorPartition, record_tensors, train_reply
    from simulations.engine.vectorized import train_stacked

    model = build_model("digits-mlp", 0, precision="float64")
    gen = torch.Generator().manual_seed(5)
    sizes = (5, 13, 20)  # 5 <= the sample size (all examples), 13 and 20 > it (a seeded sample)
    data = [(torch.randn(n, 64, generator=gen, dtype=torch.float64), torch.randint(0, 10, (n,), generator=gen))
            for n in sizes]
    momentum = {k: 0.1 * torch.randn(v.shape, generator=gen, dtype=torch.float64)
                for k, v in model.state_dict().items()}
    config = ConfigRecord({"method": "mimelite", "client-lr": 0.05, "local-epochs": 1, "batch-size": 4,
                           "server-round": 2, "loss-before-max-examples": 6, **client_keys("mimelite")})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": config,
                          "momentum": ArrayRecord(momentum)})
    loss_fn = torch.nn.functional.cross_entropy
    seq = [train_reply(model, content, x, y, loss_fn, seed=7, client_key=i) for i, (x, y) in enumerate(data)]
    vec = train_stacked(model, [ClientRound(content, None, seed=7, client_key=i) for i in range(len(data))],
                        [TensorPartition(x, y) for x, y in data], example_cross_entropy)
    for a, b in zip(seq, vec, strict=True):
        before = a["metrics"]["train-loss-before"]
        assert b["metrics"]["train-loss-before"] == pytest.approx(before, rel=1e-12, abs=0)
        for record in ("arrays", "full-gradient"):
            ta, tb = record_tensors(a[record]), record_tensors(b[record])
            assert _rel({k: v.numpy() for k, v in ta.items()}, {k: v.numpy() for k, v in tb.items()}) <= 1e-12
    befores = [r["metrics"]["train-loss-before"] for r in seq]
    assert len(set(befores)) == 3  # three different clients' losses, not one value repeated


def test_chunks_split_a_round_and_give_the_same_result():
    rc = {**BASE, **MODES["epochs-partial"], "method": "scaffold", "fraction-train": 1.0}
    grid = _compare(rc, 6, 1e-12, chunk=4)
    assert grid.chunks == 2 * ROUNDS  # 6 clients in chunks of 4 and 2


def test_models_that_cannot_be_stacked_name_the_sequential_engine():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(NotVectorizable, match="--engine inprocess"):
        check_vectorizable(model, "my-task")
    check_vectorizable(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GroupNorm(2, 4)), "ok")
    check_vectorizable(torch.nn.LSTM(4, 8, num_layers=2, batch_first=True), "lstm")  # stacked as StackableLSTM
    for recurrent in (torch.nn.GRU(4, 8), torch.nn.LSTM(4, 8, bidirectional=True), torch.nn.LSTM(4, 8, proj_size=2)):
        with pytest.raises(NotVectorizable, match="--engine inprocess"):
            check_vectorizable(recurrent, "rnn")


def test_a_failing_stacked_pass_falls_back_to_the_sequential_clientapp(monkeypatch):
    import simulations.engine.vectorized as V

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("stacked pass failed")

    monkeypatch.setattr(V, "train_stacked", broken)
    rc = {**BASE, **MODES["epochs-partial"], "method": "scaffold"}
    seq, _ = _run(rc, "inprocess", 4)
    vec, grid = _run(rc, "vectorized", 4)
    assert calls and grid.stacked_clients == 0  # every chunk was tried, then answered sequentially
    assert max(_rel(a, b) for a, b in zip(seq, vec, strict=True)) == 0.0  # the sequential ClientApp's exact results


def test_launcher_engine_vectorized_gives_the_sequential_run(tmp_path):
    import json

    from simulations.launch.__main__ import main

    rc = ("num-server-rounds=2 local-steps=2 learning-curve=false precision='float64' "
          f"output-dir='{tmp_path}'")
    for engine in ("inprocess", "vectorized"):
        assert main(["sim", "--engine", engine, "--num-supernodes", "3", "--run-config",
                     f"{rc} run-name='{engine}'"]) == 0
    rows = {e: json.loads((tmp_path / e / "metrics.jsonl").read_text().splitlines()[-1])
            for e in ("inprocess", "vectorized")}
    assert rows["vectorized"]["round"] == 2
    assert rows["vectorized"]["test-loss"] == pytest.approx(rows["inprocess"]["test-loss"], rel=1e-12, abs=0)
    assert rows["vectorized"]["train-loss"] == pytest.approx(rows["inprocess"]["train-loss"], rel=1e-12, abs=0)


@pytest.mark.slow  # a child process
@pytest.mark.parametrize("task", ["digits-mlp", "cifar-gn-cnn"])
def test_bench_vectorized_runs(task, capsys, monkeypatch):
    import re

    from simulations.bench import vectorized as bench_vectorized
    from tests.helpers import children_in_process

    args = ["--task", task, "--nodes", "3", "--epochs", "1", "--rounds", "2", "--examples", "10", "--batch-size", "4",
            "--repeats", "1"]
    # sequential, vectorized, plain: the first child a real process, the other two in this one (same code)
    children = children_in_process(monkeypatch, bench_vectorized)
    assert bench_vectorized.main(args) == 0
    assert len(children) == 3 and not children[0].endswith("(in-process)"), children
    out = capsys.readouterr().out
    assert "sequential" in out and "vectorized" in out and "plain" in out and "median of 1 interleaved" in out
    if task == "cifar-gn-cnn":  # float32 local models of both engines agree
        assert float(re.search(r"sequential\): ([0-9.e+-]+)", out).group(1)) < 1e-5


def test_model_records_from_stacked_parameters_equal_each_clients_own_serialisation():
    """The replies' model records built from the stacked parameters at once are byte for byte (and field for field)
    what ``tensor_record(model.state_dict())`` writes with each client's rows copied into the model: tied weights
    under both names, a buffer, a 0-d parameter; extra state falls back to the per-client serialisation."""
    from flower_strategies.core.client import tensor_record
    from simulations.engine.vectorized import _model_records

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
            self.b.weight = self.a.weight  # tied: one parameter, two state-dict keys
            self.scale = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
            self.register_buffer("steps", torch.arange(4, dtype=torch.int64))

    model = Net()
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.randn(3, *p.shape, generator=gen, dtype=p.dtype) for n, p in model.named_parameters()}
    records = _model_records(model, params, 3)
    assert records is not None and len(records) == 3
    for c, record in enumerate(records):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n][c])
        expected = tensor_record(model.state_dict())
        assert list(record) == list(expected)
        assert sorted(expected) == ["a.bias", "a.weight", "b.bias", "b.weight", "scale", "steps"]
        assert all(vars(record[k]) == vars(expected[k]) for k in expected)  # dtype, shape, stype, bytes, dirty flag
        assert record["a.weight"].data != records[(c + 1) % 3]["a.weight"].data  # each client's own rows

    class WithExtraState(Net):
        def get_extra_state(self):
            return {"x": 1}

    assert _model_records(WithExtraState(), params, 3) is None


def test_directly_built_arrays_are_flowers_arrays():
    """``records.to_array`` sets Flower's ``Array`` fields directly (no per-call argument checks): the same fields,
    payload bytes (``np.save``'s) and object id as Flower's own constructor, for C-ordered and transposed arrays."""
    from flwr.app import Array

    from flower_strategies.core import records as R

    assert R.FAST  # with flwr 1.42 the fast path is taken (tests/test_record_paths.py runs both)
    for arr in (np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(6.0).reshape(2, 3).T, np.array(7, np.int64)):
        ours, theirs = R.to_array(arr), Array(arr)
        assert vars(ours) == vars(theirs) and ours.object_id == theirs.object_id


def test_filled_records_are_item_assigned_records():
    """``records.filled`` (Flower records filled without per-item type checks, used by every reply) gives the record
    item assignment gives — same items in the same order, an ArrayRecord marked dirty, the same serialised bytes and
    object id — and a reply built with it is exactly a reply built item by item; a non-str key still meets Flower's
    check."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    from flower_strategies.core import records as R

    assert R.FAST  # with flwr 1.42 the fast path is taken (tests/test_record_paths.py runs both)
    arrays = R.to_record({"w": np.arange(6.0).reshape(2, 3), "b": np.ones(2, np.float32)})
    metrics = R.filled(MetricRecord({"user": 3}), [("num-examples", 7), ("train-loss", 0.25), ("user", 1.5)])
    assert list(metrics.items()) == [("user", 1.5), ("num-examples", 7), ("train-loss", 0.25)]
    by_item = RecordDict()
    by_item["arrays"], by_item["metrics"], by_item["info"] = arrays, metrics, ConfigRecord({"method": "fedavg"})
    fast = R.filled(RecordDict(), [("arrays", arrays), ("metrics", metrics),
                                   ("info", R.filled(ConfigRecord(), [("method", "fedavg")]))])
    assert arrays.is_dirty and list(arrays) == ["w", "b"]  # (before object_id, which deflates and cleans)
    assert vars(fast) == vars(by_item) and fast.object_id == by_item.object_id
    assert arrays["w"].numpy().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    for cls in (ArrayRecord, MetricRecord):
        with pytest.raises(TypeError, match="Key must be of type `str`"):
            R.filled(cls(), [(1, 2.0)])


@pytest.mark.parametrize("batch_first", [True, False])
def test_stackable_lstm_equals_nn_lstm_under_vmap(batch_first):
    """StackableLSTM (explicit cells on nn.LSTM's own parameters) gives nn.LSTM's outputs and states, and under
    vmap over stacked parameters each client's gradients equal nn.LSTM's own (float64, 1e-12)."""
    from torch.func import functional_call, vmap

    from simulations.engine.vectorized import stackable

    torch.manual_seed(0)
    model = torch.nn.LSTM(3, 5, num_layers=2, batch_first=batch_first).double()
    view = stackable(torch.nn.Sequential(model))[0]
    assert type(view).__name__ == "StackableLSTM" and dict(view.named_parameters()).keys() == \
        dict(model.named_parameters()).keys()
    x = torch.randn(4, 6, 3, dtype=torch.float64)
    (out_a, (h_a, c_a)), (out_b, (h_b, c_b)) = model(x), view(x)
    for a, b in ((out_a, out_b), (h_a, h_b), (c_a, c_b)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    clients = 3
    xs = torch.randn(clients, 4, 6, 3, dtype=torch.float64)
    params = {n: (p.detach() + 0.1 * torch.randn(clients, *p.shape, dtype=torch.float64)).requires_grad_(True)
              for n, p in model.named_parameters()}
    losses = vmap(lambda p, xx: functional_call(view, p, (xx,))[0].square().mean())(params, xs)
    grads = torch.autograd.grad(losses.sum(), list(params.values()))
    for c in range(clients):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n][c])
        own = torch.autograd.grad(model(xs[c])[0].square().mean(), list(model.parameters()))
        for g, o in zip(grads, own, strict=True):
            assert torch.allclose(g[c], o, rtol=1e-12, atol=1e-15)


def test_linear_stack_equals_each_clients_own_model_and_refuses_forwards_that_mix_clients():
    """A model made of nn.Linear layers runs stacked without vmap (linear_stack): outputs and gradients equal each
    client's own model (float64, 1e-12), and the tasks' linear models take that path.  A forward that mixes the
    leading axis, reshapes by x.size(0) or uses a non-linear parameter keeps vmap (None)."""
    from app_common.task import DigitsMLP, build_model
    from simulations.engine.vectorized import linear_stack

    torch.manual_seed(0)
    model = DigitsMLP().double()
    clients = 3
    xs = torch.randn(clients, 5, 64, dtype=torch.float64)
    forward = linear_stack(model, xs[0])
    assert forward is not None and linear_stack(model, xs[0]) is forward  # built and probed once per model
    stacked = tuple((p.detach() + 0.1 * torch.randn(clients, *p.shape, dtype=torch.float64)).requires_grad_(True)
                    for p in model.parameters())
    out = forward(stacked, xs)
    grads = torch.autograd.grad(out.square().mean(dim=(1, 2)).sum(), stacked)
    for c in range(clients):
        with torch.no_grad():
            for p, s in zip(model.parameters(), stacked, strict=True):
                p.copy_(s[c])
        own = model(xs[c])
        assert torch.allclose(out[c], own, rtol=1e-12, atol=1e-14)
        for g, o in zip(grads, torch.autograd.grad(own.square().mean(), list(model.parameters())), strict=True):
            assert torch.allclose(g[c], o, rtol=1e-12, atol=1e-15)
    for task, example in (("synthetic-linear", torch.randn(4, 10)), ("leaf-synthetic", torch.randn(4, 60))):
        assert linear_stack(build_model(task, 0), example) is not None, task
    assert linear_stack(build_model("digits-cnn", 0), torch.randn(4, 1, 8, 8)) is None

    class Centred(torch.nn.Module):  # subtracts the batch mean: the leading axis is not a batch axis here
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x - x.mean(0))

    class Flat(Centred):  # flattens by x.size(0)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.reshape(x.size(0), -1))

    class OwnWeights(Centred):  # reads its layer's weight directly
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.fc.weight.T

    assert linear_stack(Centred(), torch.randn(5, 4)) is None
    replaced = DigitsMLP()
    assert linear_stack(replaced, torch.randn(4, 64)) is not None
    replaced.fc1 = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))  # a layer replaced: again
    assert linear_stack(replaced, torch.randn(4, 64)) is None
    assert linear_stack(Flat(), torch.randn(5, 2, 2)) is None
    assert linear_stack(OwnWeights(), torch.randn(5, 4)) is None


def test_clients_of_very_different_step_counts_train_in_separate_passes_with_the_same_result(monkeypatch):
    """Epochs mode, clients of 2–4 steps: with no cost per step (STEP_COST_CLIENTS = 0) every step count trains in
    its own stacked pass (step_buckets), and the run still equals the sequential engine's."""
    import simulations.engine.vectorized as vectorized

    monkeypatch.setattr(vectorized, "STEP_COST_CLIENTS", 0)
    rc = {**BASE, **MODES["epochs-partial"], "method": "scaffold", "fraction-train": 1.0}
    grid = _compare(rc, 6, 1e-12)
    assert grid.chunks > ROUNDS  # some round's 6 clients trained in more than one pass


def test_step_buckets_minimise_the_stacked_work():
    """step_buckets: every client once, longest first, buckets of consecutive step counts; its cost
    Σ longest·(step_cost + clients) equals the best over every split of the sorted step counts (brute force)."""
    from itertools import combinations, pairwise

    from simulations.engine.vectorized import step_buckets

    def cost(buckets, steps, k):
        return sum(max(steps[j] for j in b) * (k + len(b)) for b in buckets)

    rng = np.random.default_rng(0)
    assert step_buckets([]) == []
    assert step_buckets([5, 5, 5]) == [[0, 1, 2]]  # equal steps: one pass, whatever the cost per step
    assert step_buckets([285] + [5] * 900 + [100] * 99) == [[0], list(range(901, 1000)), list(range(1, 901))]
    for _ in range(200):
        steps = [int(v) for v in rng.integers(1, 40, rng.integers(1, 9))]
        k = float(rng.choice([0, 1, 4, 32]))
        got = step_buckets(steps, k)
        assert sorted(j for b in got for j in b) == list(range(len(steps)))
        flat = [steps[j] for b in got for j in b]
        assert flat == sorted(steps, reverse=True)
        assert all(min(steps[j] for j in a) > max(steps[j] for j in b) for a, b in pairwise(got))
        order = sorted(range(len(steps)), key=lambda j: -steps[j])
        best = min(cost([order[a:b] for a, b in pairwise((0, *cuts, len(order)))], steps, k)
                   for r in range(len(order)) for cuts in combinations(range(1, len(order)), r))
        assert cost(got, steps, k) == pytest.approx(best)


def test_example_cross_entropy_equals_torchs_per_example_loss_and_gradient():
    """The stacked batches' per-example cross-entropy (logsumexp less the target's logit) equals torch's
    cross_entropy(reduction="none") in value and gradient (float64, logits up to 1e3 apart, which overflow a plain
    exp), and a non-finite logit gives a non-finite loss."""
    from app_common.task import example_cross_entropy

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 10, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 30.0, 1e3]).repeat_interleave(
        torch.tensor([22, 21, 21]))[:, None]
    target = torch.randint(0, 10, (64,), generator=gen)
    weight = torch.rand(64, generator=gen, dtype=torch.float64)
    ours, theirs = (logits.clone().requires_grad_(True) for _ in range(2))
    got, want = example_cross_entropy(ours, target), torch.nn.functional.cross_entropy(theirs, target, reduction="none")
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    (got * weight).sum().backward()
    (want * weight).sum().backward()
    assert torch.allclose(ours.grad, theirs.grad, rtol=1e-12, atol=1e-14)
    bad = logits.clone()
    bad[3, 2] = float("inf")
    assert not torch.isfinite(example_cross_entropy(bad, target)[3])
    bad[5, :] = float("nan")
    assert not torch.isfinite(example_cross_entropy(bad, target)[5])
