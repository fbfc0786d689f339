"""The plug-in edge: every method runs inside the project's quickstart-shaped app
(examples/pytorch_app: its own DataLoader, loop, momentum SGD, device) through the README recipe, in-process
(LoopbackGrid), and learns or fails naming the fix; the app's batch objects pass through ClientRound; FedDA's
full-batch rounds and MimeLite's full gradient come from the app's loader; the legacy twin (examples/legacy_app)
runs the app's own DataLoader, train() and client-side evaluation; every error message names functions that exist."""

from __future__ import annotations

import ast
import logging
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, RecordDict
from flwr.client import NumPyClient
from flwr.client import ClientApp as LegacyClientApp
from flwr.server.compat import start_grid

import flower_strategies as fs
from flower_strategies.core.policy import RunFailed
from flower_strategies.core.loop import own_loop_config
from simulations.engine.inprocess import LoopbackGrid

ROOT = Path(__file__).resolve().parent.parent
for app_dir in ("pytorch_app", "legacy_app"):
    sys.path.insert(0, str(ROOT / "examples" / app_dir))
from legacyapp import client_app as legacy_client  # noqa: E402
from legacyapp import server_app as legacy_server  # noqa: E402
from pytorchapp import client_app as user_client  # noqa: E402
from pytorchapp import server_app as user_server  # noqa: E402
from pytorchapp.task import Net, load_data  # noqa: E402

from tests.helpers import DictLoader, read_digits_once  # noqa: E402

APP_LR = 0.1  # examples/pytorch_app/pyproject.toml's learning-rate (the quickstart's)
NODES = 2


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    read_digits_once(monkeypatch, sys.modules["pytorchapp.task"], sys.modules["legacyapp.task"])
    logging.getLogger("flwr").setLevel(logging.WARNING)
    yield
    logging.getLogger("flwr").setLevel(logging.INFO)


def _accuracy(state: dict) -> float:
    model = Net()
    model.load_state_dict(state)
    hits = total = 0
    with torch.no_grad():
        for pid in range(NODES):
            for b in load_data(pid, NODES, 512)[1]:
                hits, total = hits + int((model(b["img"]).argmax(1) == b["label"]).sum()), total + len(b["label"])
    return hits / total


def _run_app(tmp_path, method: str, lr: float, rounds: int = 2, nodes: int = NODES, intercept=None, **extra):
    cfg = {"num-server-rounds": rounds, "fraction-train": 1.0, "local-epochs": 1, "learning-rate": lr,
           "batch-size": 32, "method": method, "output": str(tmp_path / f"{method}.pt"), "fraction-evaluate": 0.0,
           **extra}
    grid = LoopbackGrid(user_client.app, nodes, cfg, intercept=intercept)
    torch.manual_seed(0)  # the app's server builds its initial Net() from torch's global RNG
    user_server.main(grid, Context(run_id=1, node_id=0, state=RecordDict(), run_config=cfg, node_config={}))
    return torch.load(cfg["output"]), grid


def test_every_method_runs_at_its_factor_in_the_quickstart_app_through_the_recipe(tmp_path, caplog):
    """The documented recipe with the table's starting lr (the app's lr × the method's factor) for every registered
    method, 2 rounds of 8 local steps on 2 nodes (cheap): the run completes, the model moves and stays finite, and
    the server sees no diverging training loss (its warning, flower_strategies.core.rounds.loss_alarm).  How often
    each factor ends as well as stock FedAvg is measured at 5 × 5 and 10 × 10 from 5 starts by
    simulations/tools/plugin_factors.py (docs/results/plugin-factors.md; the slow tier's
    test_every_method_at_its_published_factor_on_the_measured_short_shape reruns its seed-0 5 × 5 runs): the
    quickstart's CNN sits on a loss plateau for its first rounds, too long for a fast test."""
    torch.manual_seed(0)
    start = Net().state_dict()
    for method in sorted(fs.METHODS):
        caplog.clear()
        final, _ = _run_app(tmp_path, method, APP_LR * fs.get_method(method).client_lr_factor, **{"local-steps": 8})
        assert all(bool(torch.isfinite(v).all()) for v in final.values()), method
        assert max(float((final[k] - start[k]).abs().max()) for k in final) > 1e-3, method
        diverging = [r.getMessage() for r in caplog.records if "diverging" in r.getMessage()]
        assert not diverging, (method, diverging)


@pytest.mark.slow
def test_every_method_at_its_published_factor_on_the_measured_short_shape():
    """End to end, the slow tier: the quickstart-shaped app through the recipe (its ServerApp and ClientApp
    functions, in-process) for every method at the factor docs/results/plugin-factors.md publishes (the registry's),
    5 nodes × 5 rounds from seed 0, against stock FedAvg (Flower's FedAvg, the app's own client) from the same model:
    each run completes and ends predicting more than one class, and a method the page reports holding in every 5 × 5
    run ends at or above stock FedAvg − 0.05 here too (simulations/tools/plugin_factors.py, as the page)."""
    from simulations.tools import plugin_factors as pf

    page = (ROOT / "docs" / "results" / "plugin-factors.md").read_text()
    rows = {m: (float(f), int(held), int(runs)) for m, f, held, runs in re.findall(
        r"^\| `([a-z0-9-]+)` \| ×([\d.]+) \(×[\d.]+\) \| [\d.]+ \| (\d+)/(\d+), [\d.]+[^|]*\|", page, re.M)}
    assert set(rows) == set(fs.METHODS)
    assert {m: f for m, (f, _, _) in rows.items()} == {m: s.client_lr_factor for m, s in fs.METHODS.items()}
    start = pf.Init(0, 0)
    stock = pf.run_stock(start, 5, 5)
    failed = []
    for method in sorted(fs.METHODS):
        factor, held, runs = rows[method]
        run = pf.run_method(method, factor, start, 5, 5)
        if run["error"] or run["classes"] < 2 or (held == runs and run["acc"] < stock["acc"] - 0.05):
            failed.append((method, factor, run["acc"], run["classes"], run["error"]))
    assert not failed, (stock["acc"], failed)


def test_a_stalled_run_warns_naming_the_lr(tmp_path, caplog):
    """The quickstart app at a learning rate far too low (1e-6, 5 rounds): the clients' train loss stays flat at
    round 1's level, and round 5 warns that training is not progressing, naming the client lr; at the method's
    factor the same run warns nothing."""
    for lr, warned in ((1e-6, True), (APP_LR * fs.get_method("fedavg").client_lr_factor, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="flwr"):
            _run_app(tmp_path, "fedavg", lr, rounds=5)
        stalled = [r.getMessage() for r in caplog.records if "not progressing" in r.getMessage()]
        if warned:
            assert len(stalled) == 1 and stalled[0].startswith("Round 5: training is not progressing: the clients' "
                                                               "mean train loss has stayed at round 1's level"), stalled
            assert f"client lr {lr:g} (run-config client-lr, or your app's name for it)" in stalled[0]
        else:
            assert not stalled, stalled


def test_the_factor_script_regenerates_its_table(tmp_path):
    """simulations/tools/plugin_factors.py --quick (one 2 × 3 shape, 1 seed): stock FedAvg, then fedams at its factor
    (``--no-search``: no neighbours), written as the markdown page of docs/results/plugin-factors.md, every run kept
    in the JSON (per-round train losses, predicted classes, stock's accuracy from the same model)."""
    import json

    from simulations.tools import plugin_factors

    out, runs = tmp_path / "table.md", tmp_path / "runs.json"
    argv = ["--quick", "--no-search", "--methods", "fedams", "--json", str(runs), "--out", str(out)]
    assert plugin_factors.main(argv) == 0
    text = out.read_text()
    assert text.startswith("# Client-lr factors of the plug-in path (generated)\n\nGenerated by `python -m "
                           f"simulations.tools.plugin_factors {' '.join(argv)}` (")
    assert "\nstock FedAvg, 2×3 (the app's own SGD-momentum at lr 0.1, Flower's FedAvg): final accuracy" in text
    assert re.search(r"^\| `fedams` \| ×0\.1 \(×0\.1\) \| 0\.01 \| 1/1, 0\.\d{3} \| 0 \| holds \| "
                     r"×0\.1: 1/1, 0\.\d{3} \|$", text, re.M), text
    data = json.loads(runs.read_text())
    (stock,), (method,) = data["stock"], data["methods"]
    (run,) = method["runs"]["2×3"]
    assert stock["init"] == run["init"] == "seed 0" and run["stock_acc"] == stock["acc"]
    assert len(run["losses"]) == 3 and run["classes"] > 1 and run["holds"] and not run["stalls"]
    merged = tmp_path / "merged.md"  # the page from the runs of several commands (here one)
    assert plugin_factors.main(["--merge", str(runs), "--out", str(merged)]) == 0
    text = merged.read_text()
    assert f"from the runs of `python -m simulations.tools.plugin_factors {' '.join(argv)}` (" in text
    assert re.search(r"^\| `fedams` \| ×0\.1 \(×0\.1\) \| 0\.01 \| 1/1, 0\.\d{3} \| 0 \| holds \| "
                     r"×0\.1: 1/1, 0\.\d{3} \|$", text, re.M), text


def _message(method: str, model: torch.nn.Module, num_rounds: int = 3, server_round: int = 1,
             **settings) -> RecordDict:
    """The train message content the method's strategy sends for ``model``."""
    strategy = fs.get_method(method).build(**settings)
    strategy.num_rounds = num_rounds
    return strategy.prepare_round(server_round, ArrayRecord(model.state_dict()), own_loop_config(), 1)


def test_server_only_methods_keep_the_apps_own_momentum_sgd(tmp_path):
    """fedavg in the app (1 node, 1 round): the global model is what the app's own train() with
    torch.optim.SGD(momentum=0.9) makes of its DataLoader (not fedadapt's plain-SGD optimizer)."""
    from pytorchapp.task import train

    one_node = {"min-train-nodes": 1, "min-available-nodes": 1}
    final, _ = _run_app(tmp_path, "fedavg", APP_LR, rounds=1, nodes=1, **one_node)
    reference = {}
    for momentum in (0.9, 0.0):
        torch.manual_seed(0)
        initial, model = Net(), Net()  # the server's initial model, then the client's Net() (same RNG draws)
        model.load_state_dict(initial.state_dict())
        loader, _ = load_data(0, 1, 32)
        if momentum:
            train(model, loader, 1, APP_LR, torch.device("cpu"))
        else:
            train(model, loader, 1, APP_LR, torch.device("cpu"), optimizer=torch.optim.SGD(model.parameters(), APP_LR))
        reference[momentum] = model.state_dict()
    for k, v in reference[0.9].items():  # float32 server step x + 1·(x_1 − x): rounding only
        np.testing.assert_allclose(final[k].numpy(), v.numpy(), rtol=0, atol=1e-6)
    assert max(float((final[k] - v).abs().max()) for k, v in reference[0.0].items()) > 1e-3
    assert not fs.ClientRound(_message("fedavg", Net())).needs_client_half
    assert fs.ClientRound(_message("fedprox", Net())).needs_client_half


# ------------------------------------------------------------------ FedDA's full-batch rounds, MimeLite's full gradient
def _digits(n: int = 100):
    loader, _ = load_data(0, 1, n)
    batch = next(iter(loader))
    return batch["img"].double(), batch["label"]


def _double_net() -> torch.nn.Module:
    torch.manual_seed(1)
    return Net().double()


def test_fedda_full_batch_round_is_one_step_on_every_example_of_the_apps_loader():
    x, y = _digits()
    loader = DictLoader(x, y, 16)
    model = _double_net()
    rnd = fs.ClientRound(_message("fedda", model, num_rounds=2, server_round=2), None, loader,
                         torch.nn.functional.cross_entropy)
    assert rnd.full_batch
    for epoch in range(3):  # the app's own epoch loop: only the first pass yields, one batch of all 100 examples
        batches = list(rnd.loader)
        assert len(batches) == (1 if epoch == 0 else 0)
    (batch,) = fs.ClientRound(_message("fedda", model, 2, 2), None, loader, torch.nn.functional.cross_entropy).batches()
    assert set(batch) == {"img", "label"} and torch.equal(batch["img"], x) and torch.equal(batch["label"], y)
    # a loop that iterates its own DataLoader instead takes 7 mini-batch steps: refused, naming the fix
    opt = rnd.optimizer(model)
    for b in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(b["img"]), b["label"]).backward()
        opt.step()
    with pytest.raises(ValueError, match=r"full-batch round .* but 7 steps were taken: iterate ClientRound.loader"):
        rnd.reply(model, opt)


def test_fedda_full_batch_rounds_take_one_step_in_the_app(tmp_path):
    """FedDA in the app, its last round full-batch: each client takes its epoch of mini-batches in round 1 and
    exactly one step in round 2 (the replies' num-steps)."""
    steps: list[tuple[int, float]] = []

    def spy(request, reply, partition_id):
        steps.append((int(request.content["config"]["server-round"]), float(reply.content["metrics"]["num-steps"])))
        return reply

    _run_app(tmp_path, "fedda", APP_LR * 10, intercept=spy, **{"fedda.full-batch-last": 0.5})
    per_epoch = [len(load_data(p, NODES, 32)[0]) for p in range(NODES)]
    assert sorted(steps) == sorted([(1, float(k)) for k in per_epoch] + [(2, 1.0)] * NODES)


def test_mimelite_full_gradient_comes_from_the_apps_loader_and_loss():
    """ClientRound.optimizer computes MimeLite's full gradient from the loader given to ClientRound (the app's
    dict batches through the default unpack): equal to the float64 gradient of the mean loss over all examples."""
    x, y = _digits()
    model = _double_net()
    content = _message("mimelite", model)
    rnd = fs.ClientRound(content, None, DictLoader(x, y, 32), torch.nn.functional.cross_entropy)
    opt = rnd.optimizer(model)
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(opt.full_gradient[name].numpy(), p.grad.numpy(), rtol=1e-12, atol=1e-15)
    # without the loader: the error names the exact call, with functions that exist
    with pytest.raises(ValueError, match=r"flower_strategies\.full_gradient_from\(model, trainloader, loss_fn\)"):
        fs.ClientRound(content).optimizer(model)
    # a model that is not the received one: refused (the gradient is taken at x_t)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(ValueError, match=r"load the global model first \(ClientRound.load_model\(model\)\)"):
        fs.ClientRound(content, None, DictLoader(x, y, 32), torch.nn.functional.cross_entropy).optimizer(model)


def test_the_apps_batch_objects_pass_through_and_unpack_maps_them():
    """Dict batches reach the user's loop unchanged; the library's own passes read them with the default unpack
    (documented keys) or a user-given one; an unreadable batch names ``unpack=``."""
    x, y = _digits(40)
    model = _double_net()
    loss = torch.nn.functional.cross_entropy
    content = _message("fedavg", model, batch_size=8, local_epochs=1)  # one pass: 40 examples, 5 batches
    rnd = fs.ClientRound(content, None, DictLoader(x, y, 8), loss)
    batches = list(rnd.loader)
    assert len(batches) == 5 and all(set(b) == {"img", "label"} for b in batches)
    with torch.no_grad():
        want = float(loss(model(x), y))
    assert rnd.loss_before(model) == pytest.approx(want, rel=1e-12)

    class Odd(DictLoader):
        def __iter__(self):
            for b in super().__iter__():
                yield {"pixels": b["img"], "digit": b["label"]}

    custom = fs.ClientRound(content, None, Odd(x, y, 8), loss, unpack=lambda b: (b["pixels"], b["digit"]))
    assert custom.loss_before(model) == pytest.approx(want, rel=1e-12)
    with pytest.raises(TypeError, match=r"pass ClientRound\(\.\.\., unpack=lambda b"):
        fs.ClientRound(content, None, Odd(x, y, 8), loss).loss_before(model)


def test_localupdatedecay_reply_carries_the_loss_before_from_the_loader():
    x, y = _digits(40)
    model = _double_net()
    loss = torch.nn.functional.cross_entropy
    with torch.no_grad():
        want = float(loss(model(x), y))
    rnd = fs.ClientRound(_message("localupdatedecay", model), None, DictLoader(x, y, 8), loss)
    opt = rnd.optimizer(model)
    for b in rnd.loader:
        opt.zero_grad()
        loss(model(b["img"]), b["label"]).backward()
        opt.step()
    assert rnd.reply(model, opt)["metrics"]["train-loss-before"] == pytest.approx(want, rel=1e-12)
    bare = fs.ClientRound(_message("localupdatedecay", model))
    with pytest.raises(ValueError, match=r"train_loss_before=before"):
        bare.reply(model, bare.optimizer(model, num_examples=40), num_examples=40)


# ------------------------------------------------------------------ the legacy twin
def _run_legacy(client_app, method: str, rounds: int = 2):
    """examples/legacy_app's server_fn under Flower's legacy start_grid, in-process; the global model after each
    round and the clients' aggregated evaluation metrics."""
    cfg = {"num-server-rounds": rounds, "local-epochs": 1, "batch-size": 32, "method": method, "output": "",
           "learning-rate": APP_LR * fs.get_method(method).client_lr_factor}
    parts = legacy_server.server_fn(Context(run_id=1, node_id=0, state=RecordDict(), run_config=cfg, node_config={}))
    strategy = parts.strategy
    models, evaluations = [], []
    strategy.evaluate_fn = lambda server_round, arrays: models.append(arrays) or None
    aggregate = strategy.aggregate_evaluate
    strategy.aggregate_evaluate = lambda *a: evaluations.append(aggregate(*a)) or evaluations[-1]
    start_grid(grid=LoopbackGrid(client_app, NODES, cfg), strategy=strategy, config=parts.config)
    return models, evaluations


def _legacy_accuracy(arrays) -> float:
    from legacyapp.task import Net as LegacyNet
    from legacyapp.task import load_data as legacy_data
    from legacyapp.task import test

    model = LegacyNet()
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()})
    accuracies = [test(model, legacy_data(p, NODES, 64)[1], torch.device("cpu"))[1] for p in range(NODES)]
    return float(np.mean(accuracies))


def test_legacy_twin_runs_the_apps_loader_loop_and_client_evaluation_and_fedlada_learns(monkeypatch):
    """examples/legacy_app: FedAdaptNumPyClient runs the app's own train() over the round's view of its DataLoader
    and its test() as client-side evaluation; fedlada learns there (its round-0 model is at chance)."""
    loaders = []
    real_train = legacy_client.train
    monkeypatch.setattr(legacy_client, "train", lambda model, loader, *a: loaders.append(loader) or real_train(
        model, loader, *a))
    models, evaluations = _run_legacy(legacy_client.app, "fedlada")
    assert len(loaders) == 2 * NODES and all(isinstance(ld.dataset, torch.utils.data.Subset) for ld in loaders)
    assert len(evaluations) == 2 and all(0.0 <= m["accuracy"] <= 1.0 for _, m in evaluations)
    before, after = _legacy_accuracy(models[0]), _legacy_accuracy(models[-1])
    assert before < 0.2 and after > 0.6, (before, after)
    assert evaluations[-1][1]["accuracy"] == pytest.approx(after, abs=0.02)  # the clients' own test() agrees


def test_a_stock_numpy_client_under_legacy_strategy_fails_loudly():
    """A stock NumPyClient (returns its model, no fedadapt layout) with LegacyStrategy, even for fedavg: the run
    fails with RunFailed naming the rejections, not a completed run that trained nothing."""

    class Stock(NumPyClient):
        def get_parameters(self, config):
            return [v.numpy() for v in Net().state_dict().values()]

        def fit(self, parameters, config):
            return parameters, 10, {}

    stock = LegacyClientApp(client_fn=lambda context: Stock().to_client())
    with pytest.raises(RunFailed, match="fedadapt.layout"):
        _run_legacy(stock, "fedavg", rounds=3)


# ------------------------------------------------------------------ messages name what exists; lines a user changes
_REFERENCE = re.compile(r"\b(flower_strategies|fs|ClientRound)\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def _raise_messages():
    """(file, line, text) of every string literal inside the library's raise statements (f-string parts too)."""
    for path in sorted((ROOT / "flower_strategies").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                for sub in ast.walk(node.exc):
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                        yield path.relative_to(ROOT), node.lineno, sub.value


def _resolve(ref: str) -> object | None:
    """The object a ``flower_strategies.<name>…`` / ``fs.<name>…`` / ``ClientRound.<attr>`` reference names, or
    None: a top-level name must be public (``__all__``) or a module (``python -m flower_strategies.config``)."""
    import importlib

    head, *rest = ref.split(".")
    if head == "ClientRound":
        obj: object = fs.ClientRound
    else:
        obj, module = fs, "flower_strategies"
        while rest:  # the longest importable module prefix, then attributes
            try:
                obj, module, rest = importlib.import_module(f"{module}.{rest[0]}"), f"{module}.{rest[0]}", rest[1:]
            except ImportError:
                break
        if obj is fs and rest[0] not in fs.__all__:
            return None
    for attr in rest:
        if not hasattr(obj, attr):
            return None
        obj = getattr(obj, attr)
    return obj


def test_error_messages_name_only_functions_that_exist():
    refs = [(f, line, m.group(0)) for f, line, text in _raise_messages() for m in _REFERENCE.finditer(text)]
    assert len(refs) >= 5  # the scan finds the messages that name calls (full_gradient_from, ClientRound.loader, …)
    assert _resolve("flower_strategies.full_gradient") is None and _resolve("ClientRound.full_grad") is None
    missing = [f"{f}:{line} {ref}" for f, line, ref in refs if _resolve(ref) is None]
    assert not missing, missing


def test_the_recipe_is_at_most_five_client_lines_and_two_server_lines():
    """The lines of examples/pytorch_app that use fedadapt (its README snippets): the client's train() changes 4
    lines + 1 import, the server 1 line + 1 import — the same for every method (FedDA and MimeLite included)."""
    app = ROOT / "examples" / "pytorch_app" / "pytorchapp"
    client = [ln for ln in (app / "client_app.py").read_text().splitlines() if re.search(r"\brnd\b|ClientRound", ln)]
    server = [ln for ln in (app / "server_app.py").read_text().splitlines() if "strategy_from_run_config" in ln]
    assert len(client) <= 5 and len(server) <= 2, (client, server)
    assert not re.search(r"mimelite|fedda|full_gradient|full_batch", (app / "client_app.py").read_text())


@pytest.mark.parametrize("doc", ["README.md", "docs/methods/index.md"])
def test_method_tables_and_config_list_show_client_half_and_client_lr(doc, capsys):
    """README's short methods table and the docs' full one: every method, with its client half and client lr."""
    from flower_strategies.config import main

    text = (ROOT / doc).read_text()
    rows = re.findall(r"^\| (`[a-z0-9-]+`(?: / `[a-z0-9-]+`)*) \|(?:[^|]*\|){1,2} (yes|no) \| ×([\d.]+) \|", text, re.M)
    named = {n: (half, float(lr)) for cell, half, lr in rows for n in re.findall(r"`([a-z0-9-]+)`", cell)}
    assert named == {n: ("yes" if s.needs_client_half else "no", s.client_lr_factor) for n, s in fs.METHODS.items()}
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    for name, (half, lr) in named.items():
        assert re.search(rf"^{re.escape(name)}\s+{half}\s+×{lr:g}\s", out, re.M), name
