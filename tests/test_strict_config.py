"""Strict ``strategy_from_run_config``: misspelled keys, method names and ``names=`` entries are errors that list only
the close matches; and a client optimizer bound to another model instance's parameters is refused."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

import flower_strategies as fs
from flower_strategies.core import records as R
from flower_strategies.core.client import ClientRound, check_bound
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.registry import parse_run_config, strategy_from_run_config
from flower_strategies.core.loop import own_loop_config

#: A user's app run-config: its own keys beside fedadapt's.
APP = {"num-server-rounds": 3, "learning-rate": 0.05, "local-epochs": 1, "batch-size": 32, "output": "m.pt",
       "fraction-fit": 0.5, "min-available-clients": 2, "train.augment": True, "method": "fedlada"}
NAMES = {"learning-rate": "client-lr"}


def error_of(run_config, **kw) -> str:
    with pytest.raises(ConfigError) as err:
        strategy_from_run_config(run_config, **kw)
    return str(err.value)


def quoted(msg: str) -> set[str]:
    return set(re.findall(r"'([^']+)'", msg))


def test_a_users_app_with_its_own_keys_builds():
    s = strategy_from_run_config(APP, names=NAMES)
    assert (s.method, s.settings.client_lr, s.num_rounds) == ("fedlada", 0.05, 3)
    s = strategy_from_run_config({**APP, "fedlada.amend-weight": 0.05, "fedadam.server-lr": 0.1}, names=NAMES)
    assert s.hparams.amend_weight == 0.05  # another method's declared keys are ignored


def test_unknown_key_under_a_method_prefix_names_the_close_match():
    msg = error_of({**APP, "fedlada.amend-weigth": 0.05}, names=NAMES)
    assert "'fedlada.amend-weigth' is not a key of method fedlada: did you mean 'fedlada.amend-weight'" in msg
    assert len(quoted(msg)) <= 5 and "fedadam.server-lr" not in msg
    msg = error_of({**APP, "fedadam.server-lrr": 0.1}, names=NAMES)  # another registered method's prefix too
    assert "did you mean 'fedadam.server-lr'" in msg


def test_misspelled_method_prefix_names_the_close_match():
    msg = error_of({**APP, "fedlda.amend-weight": 0.05}, names=NAMES)
    assert "'fedlda' is not a method; did you mean 'fedlada.amend-weight'" in msg


@pytest.mark.parametrize("where", ["run-config", "argument"])
def test_misspelled_method_lists_only_close_names(where):
    if where == "run-config":
        msg = error_of({**APP, "method": "fedlda"}, names=NAMES)
        assert "unknown method 'fedlda' (run-config key 'method'); did you mean 'fedlada'" in msg
    else:
        msg = error_of(APP, names=NAMES, method="fedadm")
        assert "unknown method 'fedadm'; did you mean 'fedadam'" in msg
    assert len(quoted(msg)) <= 5 < len(fs.METHODS) and "scaffold" not in msg


def test_misspelled_run_wide_key_names_the_close_match_and_the_escape():
    msg = error_of({**APP, "client-lrr": 0.1, "local-epoch": 2}, names=NAMES)
    assert "'client-lrr' is not a strategy key: did you mean 'client-lr'?" in msg
    assert "'local-epoch' is not a strategy key: did you mean 'local-epochs'?" in msg
    assert "app_keys=" in msg and "min-train-nodes" not in msg
    s = strategy_from_run_config({**APP, "client-lrr": 0.1, "local-epoch": 2}, names=NAMES,
                                 app_keys=["client-lrr", "local-epoch"])
    assert s.settings.client_lr == 0.05


def test_names_must_name_run_config_keys_and_strategy_keys():
    msg = error_of(APP, names={"learning_rate": "client-lr"})
    assert "names maps 'learning_rate' to 'client-lr', but the run-config has no key 'learning_rate'; did you mean " \
           "'learning-rate'?" in msg
    assert f"(the run-config's keys: {', '.join(sorted(APP))})" in msg  # the keys that exist
    msg = error_of(APP, names={"learning-rate": "client_lr"})
    assert "names maps 'learning-rate' to 'client_lr', which is not a strategy key; did you mean 'client-lr'? (the " \
           "strategy keys: aggregator, batch-size, byzantine-fraction, client-lr," in msg
    assert "fraction-train" in msg and "min-train-nodes" in msg


def test_the_apps_unknown_key_error_lists_close_matches_not_every_key():
    with pytest.raises(ConfigError) as err:
        parse_run_config({"num-server-round": 3, "fedavg.server-lrr": 1.0})
    msg = str(err.value)
    assert msg.startswith("unknown run-config key(s) ['fedavg.server-lrr', 'num-server-round']")
    assert "'num-server-round': did you mean 'num-server-rounds'?" in msg and "'fedavg.server-lr'" in msg
    assert len(msg) < 400


# ------------------------------------------------------------------------------------------ optimizer binding
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x)


def _round(method: str) -> tuple[ClientRound, Tiny]:
    torch.manual_seed(0)
    model = Tiny()
    strategy = fs.METHODS[method].build()
    content = strategy.prepare_round(1, ArrayRecord(model.state_dict()), own_loop_config(), 1)
    return ClientRound(content, state=RecordDict()), model


def _step(model, opt):
    opt.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()


@pytest.mark.parametrize("method", ["fedavg", "fedlada"])
def test_an_optimizer_of_another_model_instance_is_refused(method):
    rnd, model = _round(method)
    rnd.load_model(model)
    other = copy.deepcopy(model)  # equal values, other tensors
    opt = rnd.optimizer(other, num_examples=4)
    _step(other, opt)
    with pytest.raises(ValueError, match=r"is bound to parameters that are not this Tiny's own \(fc.weight, fc.bias\)"
                                         r".*Fix: build it with ClientRound.optimizer\(model\) on the model you train"):
        rnd.reply(model, opt, num_examples=4)
    check_bound(opt, other)  # its own model
    with pytest.raises(ValueError, match="not this Tiny's own"):
        check_bound(opt, Tiny())  # a model rebuilt after the optimizer


def test_the_optimizer_of_the_model_itself_is_accepted_after_moving_it():
    rnd, model = _round("fedavg")
    rnd.load_model(model)
    opt = rnd.optimizer(model, num_examples=4)
    model.to(torch.float32)  # module conversion keeps the parameters' identity
    _step(model, opt)
    reply = rnd.reply(model, opt, num_examples=4)
    assert R.MODEL in reply.array_records and reply[R.METRICS][R.NUM_STEPS] == 1.0


def test_a_run_config_line_is_checked_against_the_apps_declared_keys(capsys):
    """``python -m flower_strategies.config --check``: what Flower would refuse with ``[code: 15] Invalid run
    configuration.`` (keys the app does not declare), each with its close matches, before ``flwr run``."""
    from flower_strategies.config import check_run_config, main

    app = Path(__file__).resolve().parent.parent / "examples" / "pytorch_app"
    assert check_run_config("learning-rate=0.2 method='fedadam' local-epochs=2", app) == []
    problems = check_run_config("lerning-rate=0.2 clinet-lr=0.1 fedlada.amend-weight=0.1", app)
    head = f"is not declared in {app / 'pyproject.toml'} [tool.flwr.app.config], so Flower refuses the run " \
           "('[code: 15] Invalid run configuration.'); "
    assert problems == [
        f"'lerning-rate' {head}did you mean 'learning-rate'?",
        f"'clinet-lr' {head}did you mean 'client-lr'? ('client-lr': fedadapt's, not declared by your app: add it to "
        "[tool.flwr.app.config] (python -m flower_strategies.config fedlada prints the lines))",
        f"'fedlada.amend-weight' {head}it is a fedadapt key your app does not declare: add it to "
        "[tool.flwr.app.config] (python -m flower_strategies.config fedlada prints the lines)",
    ]
    assert main(["--check", "clinet-lr=0.1", "--app", str(app)]) == 2
    assert "error: 'clinet-lr' is not declared" in capsys.readouterr().err
    assert main(["--check", "learning-rate=0.2", "--app", str(app)]) == 0
    assert "ok:" in capsys.readouterr().out
