"""Run-config validation, the registry contract (every method), and pyproject ↔ registry consistency."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord

import flower_strategies as fs
from app_common.config import AppConfig
from app_common.task import build_model
from flower_strategies.core.client import full_gradient_from, num_local_steps
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.registry import METHODS, parse_run_config, register, run_config_defaults
from flower_strategies.core.loop import own_loop_config
from simulations.tools import configgen

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "cfg,message",
    [
        ({"method": "fedmagic"}, "unknown method 'fedmagic'; valid methods: "),
        ({"num-server-round": 3}, "unknown run-config key(s) ['num-server-round']"),
        ({"num-server-rounds": "3"}, "num-server-rounds must be int, got str"),
        ({"num-server-rounds": 0}, "num-server-rounds = 0 is out of range; must be >= 1"),
        ({"fraction-train": 1.5}, "fraction-train = 1.5 is out of range"),
        ({"fraction-train": 0.0}, "fraction-train = 0.0 is out of range; must be > 0.0"),
        ({"task": "cifar"}, "task = 'cifar' is not valid; choose one of: digits-mlp, digits-cnn, synthetic-linear"),
        ({"method": "fedadam", "fedadam.tau": -1.0}, "fedadam.tau = -1.0 is out of range; must be >= 0.0"),
        ({"method": "fedadam", "fedadam.bias-correction": "keras"}, "fedadam.bias-correction = 'keras' is not valid"),
        ({"method": "fedavgm", "fedavgm.beta1": True}, "fedavgm.beta1 must be float, got bool"),
        ({"client-lr": float("nan")}, "client-lr must be finite"),
    ],
)
def test_bad_run_config_gives_one_clear_error(cfg, message):
    with pytest.raises(ConfigError) as err:
        parse_run_config(cfg, AppConfig)
    assert message in str(err.value)


def test_another_methods_key_is_rejected_naming_the_valid_keys():
    with pytest.raises(ConfigError) as err:
        parse_run_config({"method": "fedavg", "fedadam.tau": 0.5})
    msg = str(err.value)
    assert "['fedadam.tau'] belong to other methods, but method = 'fedavg'" in msg and "fedavg.server-lr" in msg
    # Flower passes every declared key with its default: unchanged foreign defaults are fine.
    parse_run_config({"method": "fedavg", **METHODS["fedadam"].defaults()})


def test_valid_method_list_is_in_the_error():
    with pytest.raises(ConfigError) as err:
        parse_run_config({"method": "x"})
    for name in METHODS:
        assert name in str(err.value)


def test_bad_config_fails_before_any_message_is_sent(tmp_path):
    from server_app.app import run
    from simulations.engine.inprocess import LoopbackGrid

    calls = []
    grid = LoopbackGrid(lambda m, c: calls.append(m), 3)
    with pytest.raises(ConfigError):
        run(grid, {"method": "fedadam", "fedadam.beta1": 2.0, "output-dir": str(tmp_path)})
    assert calls == [] and not any(tmp_path.iterdir())


def test_int_is_accepted_for_float_keys():
    fed, spec, hp = parse_run_config({"method": "fedadam", "client-lr": 1, "fedadam.server-lr": 1})
    assert fed.client_lr == 1.0 and isinstance(hp.server_lr, float)


def test_pyproject_config_table_matches_registry():
    assert configgen.main(["--check", "--pyproject", str(ROOT / "pyproject.toml"), "--docs", str(ROOT / "docs")]) == 0
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]

    def flat(d, pre=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{pre}{k}.")
            else:
                yield f"{pre}{k}", v

    assert dict(flat(table)) == run_config_defaults(AppConfig)


def test_pyproject_components_and_packages():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "fedadapt"
    assert meta["tool"]["flwr"]["app"]["components"] == {
        "serverapp": "server_app.app:app", "clientapp": "client_app.app:app"}
    for pkg in meta["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]:
        assert (ROOT / pkg / "py.typed").exists()


# ------------------------------------------------------------------ registry-wide common tests
@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_builds_from_defaults_and_its_optimizer_steps(name):
    spec = METHODS[name]
    hp = spec.hparams()
    for f in dataclasses.fields(hp):
        assert f.metadata.get("help"), f"{name}.{f.name} has no help text"
    strategy, fed = fs.build_strategy({"method": name})
    assert isinstance(strategy, spec.strategy) and strategy.method == name
    model = build_model("digits-mlp", 0)
    content = strategy.prepare_round(1, ArrayRecord(model.state_dict()), own_loop_config(), num_sampled=1)
    cfg = dict(content.config_records["config"])
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    opt_cls = spec.local_optimizer
    opt = opt_cls(
        model.named_parameters(), lr=cfg["client-lr"],
        downlink={n: r.to_torch_state_dict() for n, r in content.array_records.items() if n != "arrays"},
        full_gradient=full_gradient_from(model, [(x, y)], F.cross_entropy) if opt_cls.needs_full_gradient else None,
        planned_steps=num_local_steps(len(x), cfg),
        **spec.hparams.client_kwargs_from_wire(cfg, name),
    )
    assert isinstance(opt, torch.optim.Optimizer)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.steps_taken == 1
    assert cfg["method"] == name


ALIASES = {"fedavgm": "FedAvgM", "fedadagrad": "FedAdagrad", "fedadam": "FedAdam", "fedyogi": "FedYogi",
           "fedprox": "FedProx", "fedda-sgdm": "FedDASGDM", "fedda-adam": "FedDAAdam", "fedda-adagrad": "FedDAAdagrad",
           "fedams": "FedAMS", "adpfed": "AdpFed", "fedlocal-sync": "FedLocalSync"}


def test_an_alias_class_states_its_defaults_in_its_body_and_register_reads_them():
    """An importable alias class names its registry name and states its field defaults in its own body
    (``hparam_defaults``); ``register`` reads them into the name's ``MethodSpec.overrides`` and changes no class."""
    assert not hasattr(fs.FedAdaptStrategy, "variant") and not hasattr(fs.FedAdaptStrategy, "registered_defaults")
    for name, cls_name in ALIASES.items():
        spec, cls = METHODS[name], getattr(fs, cls_name)
        assert spec.strategy is cls and cls.method == name and spec.overrides
        assert "variant" not in vars(cls) and dict(vars(cls)["hparam_defaults"]) == dict(spec.overrides)
        assert cls.make_hparams() == spec.default_hparams() == cls().hparams
    before = {cls: dict(vars(cls)) for cls in {spec.strategy for spec in METHODS.values()}}
    try:
        spec = register(fs.FedAdam, name="fedadam-test", server_lr=0.5, paper="test", summary="test")
        assert dict(spec.overrides) == {"server_opt": "adam", "server_lr": 0.5}  # the class's, then the name's
        assert {cls: dict(vars(cls)) for cls in before} == before  # register() changed no class
    finally:
        METHODS.pop("fedadam-test", None)
    with pytest.raises(TypeError, match="hparam_defaults"):
        register(type("Own", (fs.FedAvg,), {"method": "own-test"}), server_lr=2.0, paper="test", summary="test")
    assert "own-test" not in METHODS
    assert METHODS["localadam"].strategy is fs.FedLADA and fs.FedLADA.make_hparams().amend_weight == 0.1
    assert METHODS["localadam"].default_hparams().amend_weight == 1.0
    assert fs.FedOpt.make_hparams() == fs.FedOptHParams()  # the base class is not an alias


def test_client_lr_decay_is_one_declared_field_applied_by_the_base():
    decaying = {name for name, spec in METHODS.items() if "client_lr_decay" in spec.hparams.__dataclass_fields__}
    assert decaying == {"fedlada", "localadam", "fedcm", "scaffold"}
    for name in decaying:
        cls = METHODS[name].strategy
        assert "client_lr_at" not in vars(cls)
        s = METHODS[name].build(METHODS[name].default_hparams().replace(client_lr_decay=0.5), client_lr=0.8)
        assert [s.client_lr_at(r) for r in (1, 2, 3)] == [0.8, 0.4, 0.2]
    assert METHODS["fedavg"].build(client_lr=0.8).client_lr_at(5) == 0.8


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_has_a_doc_page_mentioning_it(name):
    pages = list((ROOT / "docs" / "methods").glob("*.md"))
    assert any(f"`{name}`" in p.read_text() for p in pages), f"no docs/methods page documents `{name}`"


def test_optimizer_requires_named_parameters():
    with pytest.raises(TypeError, match="named_parameters"):
        fs.SGDOptimizer(torch.nn.Linear(2, 1).parameters(), lr=0.1)


def test_sgd_optimizer_step_with_prox_and_weight_decay():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    opt = fs.SGDOptimizer([("p", p)], lr=0.1, weight_decay=0.5, mu=2.0)
    # first step at the round start x_t = (1, -2) (prox term 0): d = g + 0.5·x_t = (5, 5) moves p to x_t − 0.5
    p.grad = torch.tensor([4.5, 6.0], dtype=torch.float64)
    opt.step()
    np.testing.assert_allclose(p.detach().numpy(), [0.5, -2.5], atol=1e-12)
    p.grad = torch.tensor([0.3, 0.1], dtype=torch.float64)
    opt.step()
    x = np.array([0.5, -2.5])
    expected = x - 0.1 * (np.array([0.3, 0.1]) + 0.5 * x + 2.0 * (x - np.array([1.0, -2.0])))
    np.testing.assert_allclose(p.detach().numpy(), expected, atol=1e-12)


def test_readme_lists_every_method_and_its_two_commands():
    readme = (ROOT / "README.md").read_text()
    for name in METHODS:
        assert f"`{name}`" in readme, name
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in readme and "python -m pytest -q" in ci
