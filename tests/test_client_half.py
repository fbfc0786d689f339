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
