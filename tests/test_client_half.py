"""The client half needs nothing from the server side (issue 38, item 5).

What a client must know about the method — whether it has a client half, which local optimizer, whether the server
reads ``train-loss-before``, whether the optimizer needs the full gradient — travels in the round's ConfigRecord, is
decided once on the server (:func:`flower_strategies.core.local.has_client_half`), and the client modules import no
server-side module, not even transitively (read from the source with ``ast``, as tests/test_structure.py does).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, RecordDict

import flower_strategies as fs
from flower_strategies.core import records as R
from flower_strategies.core.client import ClientRound, RoundLoader, TensorPartition
from flower_strategies.core.local import LOCAL_OPTIMIZERS
from flower_strategies.core.loop import own_loop_config

from .test_structure import ROOT, import_graph

CLIENT = "flower_strategies.core.client"
#: Server-side modules and packages (and the library's public surface, whose __init__ imports everything).  Not
#: listed: core/privacy.py (the client's reply guard beside the server's native DP) and what it imports.
SERVER_SIDE = tuple(f"flower_strategies.core.{m}" for m in (
    "strategy", "registry", "screen", "binding", "sampler", "policy", "checkpoint", "server_opt", "privacy",
    "validation", "aggregation", "rounds",
)) + ("flower_strategies.methods", "flower_strategies.compat", "server_app", "client_app", "simulations")


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def server_side(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m == "flower_strategies" or any(
        m == s or m.startswith(s + ".") for s in SERVER_SIDE))


def test_the_client_modules_import_no_server_side_module_even_transitively():
    graph = import_graph()
    assert all(any(m == s or m.startswith(s + ".") for m in graph) for s in SERVER_SIDE)  # a moved module: update
    client_modules = [m for m in graph if m == CLIENT or m.startswith(CLIENT + ".")]
    assert {f"{CLIENT}.{part}" for part in ("data", "loop", "round", "wire")} <= set(client_modules)
    for module in client_modules:
        assert server_side(reachable(graph, module)) == [], module
    assert "flower_strategies.core.local" in reachable(graph, CLIENT)  # the walk follows the client's imports
    legacy = reachable(graph, "flower_strategies.compat.legacy")  # and would see a server-side one
    assert "flower_strategies.core.strategy" in server_side(legacy)


def test_needs_a_client_half_is_decided_in_one_place():
    sources = {p: p.read_text() for p in (ROOT / "flower_strategies").rglob("*.py")}
    deciders = [p.relative_to(ROOT).as_posix() for p, text in sources.items() if "is not SGDOptimizer" in text]
    assert deciders == ["flower_strategies/core/local.py"]


def _content(method: str, model: torch.nn.Module, **settings) -> RecordDict:
    strategy = fs.get_method(method).build(**settings)
    strategy.num_rounds = 3
    return strategy.prepare_round(1, ArrayRecord(model.state_dict()), own_loop_config(), 1)


@pytest.mark.parametrize("method", sorted(fs.METHODS))
def test_the_round_config_tells_the_client_what_its_method_needs(method):
    spec = fs.get_method(method)
    strategy = spec.build()
    rnd = ClientRound(_content(method, torch.nn.Linear(3, 2)))
    assert rnd.config[R.LOCAL_OPTIMIZER] == strategy.local_optimizer.__name__
    assert rnd.local_optimizer is strategy.local_optimizer is LOCAL_OPTIMIZERS[strategy.local_optimizer.__name__]
    assert rnd.needs_client_half is strategy.needs_client_half is spec.needs_client_half
    assert rnd.needs_loss_before is strategy.needs_train_loss_before
    assert rnd.needs_full_gradient is strategy.local_optimizer.needs_full_gradient


def test_a_set_client_hyper_parameter_is_a_client_half_on_the_wire():
    assert not ClientRound(_content("fedavg", torch.nn.Linear(3, 2))).needs_client_half
    strategy = fs.FedAvg(fs.FedAvg.make_hparams(mu=0.1))  # FedProx's proximal term on a FedAvg
    content = strategy.prepare_round(1, ArrayRecord(torch.nn.Linear(3, 2).state_dict()), own_loop_config(), 1)
    assert ClientRound(content).needs_client_half


@pytest.mark.parametrize("key", [R.CLIENT_HALF, R.LOCAL_OPTIMIZER, R.LOSS_BEFORE, R.FULL_GRADIENT])
def test_a_round_config_from_an_older_server_fails_naming_the_missing_key(key):
    content = _content("fedlada", torch.nn.Linear(3, 2))
    del content[R.CONFIG][key]
    with pytest.raises(ValueError, match=f"lacks \\['{key}'\\]: it was sent by a fedadapt server older"):
        ClientRound(content)


def test_an_unknown_local_optimizer_fails_naming_the_known_ones():
    content = _content("scaffold", torch.nn.Linear(3, 2))
    content[R.CONFIG][R.LOCAL_OPTIMIZER] = "NoSuchOptimizer"
    with pytest.raises(ValueError, match="'NoSuchOptimizer' is unknown to this client .*ScaffoldOptimizer"):
        ClientRound(content)


def test_the_round_loader_has_explicit_attributes_not_a_proxy():
    x, y = torch.randn(10, 3), torch.randint(0, 2, (10,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    rnd = ClientRound(_content("fedavg", torch.nn.Linear(3, 2)), None, loader)
    assert rnd.loader.wrapped is loader and rnd.loader.dataset is loader.dataset and rnd.loader.batch_size == 4
    assert "__getattr__" not in vars(RoundLoader)
    with pytest.raises(AttributeError):
        rnd.loader.num_workers  # noqa: B018  # not forwarded: rnd.loader.wrapped.num_workers
    assert isinstance(ClientRound(_content("fedavg", torch.nn.Linear(3, 2)), None, TensorPartition(x, y)).loader,
                      RoundLoader)


def test_the_client_package_keeps_the_names_users_import():
    import flower_strategies.core.client as client

    assert fs.ClientRound is client.ClientRound and fs.train_reply is client.train_reply
    assert fs.TensorPartition is client.TensorPartition and fs.full_gradient_from is client.full_gradient_from
    assert Path(client.__file__).parent.name == "client"


#: What a device that trains may load of the package: the client API, its wire keys, the hyper-parameter declaration
#: and the built-in local optimizers (everything else — SERVER_SIDE above, and core.hparams with its run settings —
#: is the server's).
DEVICE_MODULES = ("flower_strategies", "flower_strategies._version", "flower_strategies.core",
                  "flower_strategies.core.client", "flower_strategies.core.local", "flower_strategies.core.params",
                  "flower_strategies.core.records", "flower_strategies.core.dpmods", "flower_strategies.optimizers")

_DEVICE = r'''
import json, sys
import numpy as np, torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flower_strategies import ClientRound, FedLADAOptimizer, train_reply
from flower_strategies.core import records as R

for where in sys.argv[1:]:
    manifest = json.load(open(where + "/content.json"))
    arrays = np.load(where + "/arrays.npz")
    content = RecordDict({name: R.to_record({k: arrays[f"{name}//{k}"] for k in keys})
                          for name, keys in manifest["records"].items()})
    content[R.CONFIG] = ConfigRecord(manifest["config"])
    torch.manual_seed(0)
    x, y = torch.randn(12, 3, dtype=torch.float64), torch.randn(12, 2, dtype=torch.float64)
    model = torch.nn.Linear(3, 2).double()
    reply = train_reply(model, content, x, y, torch.nn.functional.mse_loss, state=RecordDict(), seed=3, client_key=5)
    assert ClientRound(content).local_optimizer.__name__ == manifest["config"]["local-optimizer"]
    out = {f"{name}//{k}": v for name, rec in reply.array_records.items() for k, v in R.to_numpy(rec).items()}
    np.savez(where + "/reply.npz", **out)
json.dump(sorted(m for m in sys.modules if m.startswith(("flower_strategies", "client_app", "server_app",
                                                          "simulations", "app_common"))),
          open(sys.argv[1] + "/../modules.json", "w"))
'''
DEVICE_METHODS = ("fedlada", "scaffold", "mimelite", "localupdate")


def test_a_device_that_trains_loads_no_server_side_module(tmp_path):
    """In one fresh interpreter, as a device: the public client API imported (``from flower_strategies import
    ClientRound, train_reply, …``), one round of each method trained on the message this server prepared; each reply
    equals the same round trained here bit for bit, and no server-side module was loaded (``sys.modules``)."""
    import json
    import subprocess
    import sys

    import numpy as np

    from flower_strategies.core.client import train_reply

    contents = {}
    for method in DEVICE_METHODS:
        torch.manual_seed(0)
        content = contents[method] = _content(method, torch.nn.Linear(3, 2).double(), client_lr=0.05,
                                              local_steps=3, batch_size=4)
        where = tmp_path / method
        where.mkdir()
        records = {name: list(rec.keys()) for name, rec in content.array_records.items()}
        np.savez(where / "arrays.npz", **{f"{n}//{k}": v for n, rec in content.array_records.items()
                                          for k, v in R.to_numpy(rec).items()})
        (where / "content.json").write_text(json.dumps({"records": records,
                                                        "config": dict(content.config_records[R.CONFIG])}))
    done = subprocess.run([sys.executable, "-c", _DEVICE, *(str(tmp_path / m) for m in DEVICE_METHODS)], cwd=ROOT,
                          capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "FLWR_TELEMETRY_ENABLED": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads((tmp_path / "modules.json").read_text())
    assert server_side(set(loaded)) == ["flower_strategies"]  # the package itself, whose __init__ loads lazily
    assert "flower_strategies.core.hparams" not in loaded
    assert [m for m in loaded if not m.startswith(DEVICE_MODULES)] == []
    assert {f"flower_strategies.optimizers.{m}" for m in DEVICE_METHODS} <= set(loaded)  # found client-side

    for method, content in contents.items():
        torch.manual_seed(0)
        x, y = torch.randn(12, 3, dtype=torch.float64), torch.randn(12, 2, dtype=torch.float64)
        here = train_reply(torch.nn.Linear(3, 2).double(), content, x, y, torch.nn.functional.mse_loss,
                           state=RecordDict(), seed=3, client_key=5)
        there = np.load(tmp_path / method / "reply.npz")
        expected = {f"{n}//{k}": v for n, rec in here.array_records.items() for k, v in R.to_numpy(rec).items()}
        assert sorted(there.files) == sorted(expected), method
        for key, value in expected.items():
            assert np.array_equal(there[key], value), (method, key)


def test_the_app_client_imports_secure_aggregation_and_checkpoint_code_only_where_used():
    """client_app recognises Flower's SecAgg+ record by name (the adapter's and Flower's name) and imports the
    SecAgg+ adapter and the checkpoint writer inside the functions that use them, never at module level."""
    import ast

    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    from client_app import app as client
    from flower_strategies.compat import secagg

    assert client.SECAGG_CONFIGS == secagg.SECAGG_CONFIGS == RECORD_KEY_CONFIGS
    for path in (ROOT / "client_app").glob("*.py"):
        top = {n.module for n in ast.parse(path.read_text()).body if isinstance(n, ast.ImportFrom)}
        assert not top & {"flower_strategies.compat.secagg", "flower_strategies.core.checkpoint"}, path
