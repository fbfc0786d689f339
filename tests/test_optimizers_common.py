"""Registry-driven common tests of every method's client optimizer (as torch's optimizer tests are): used in a plain
torch loop it gives exactly the reply ``train_reply`` gives; ``state_dict()`` round-trips mid-round; misuse is a clear
error.  A new registered method gets these tests with no edit here."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, RecordDict

import flower_strategies as fs
from flower_strategies.core import records as R
from flower_strategies.core.client import ClientRound, batch_indices, full_gradient_from
from flower_strategies.methods.localupdate import ThetaHParams, parse_theta
from flower_strategies.core.loop import own_loop_config

NAMES = sorted(fs.METHODS)
N, SEED, KEY = 24, 3, 1


def _model() -> torch.nn.Module:
    torch.default_generator.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()


def _data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(N, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)


def _round(name: str) -> RecordDict:
    """Round 1 of ``name`` with its default hyper-parameters: what a client receives."""
    model = _model()
    spec = fs.METHODS[name]
    steps = 4
    if issubclass(spec.hparams, ThetaHParams):  # LocalUpdate: exactly K(Θ) steps
        hp = spec.default_hparams()
        steps = len(parse_theta(hp.theta, hp.theta_steps))
    strategy = spec.build(client_lr=0.05, local_steps=steps, batch_size=8, num_rounds=10,
                          trainable_keys=[n for n, _ in model.named_parameters()])
    return strategy.prepare_round(1, ArrayRecord(model.state_dict()), own_loop_config(), num_sampled=1)


def _plain_loop(name: str, content: RecordDict, stop_after: int | None = None):
    """The user's own loop: ClientRound gives the optimizer; the loop uses the same batches as train_reply."""
    x, y = _data()
    model = _model()
    rnd = ClientRound(content, state=RecordDict())
    rnd.load_model(model)
    grad = full_gradient_from(model, [(x, y)], F.cross_entropy) if rnd.needs_full_gradient else None
    opt = rnd.optimizer(model, num_examples=N, full_gradient=grad)
    steps = rnd.num_steps(N)
    bs = N if rnd.full_batch else int(rnd.config[R.BATCH_SIZE])
    batches = batch_indices(N, bs, steps, SEED, rnd.server_round, KEY)
    for i, idx in enumerate(batches):
        if stop_after is not None and i == stop_after:
            return model, opt, rnd, batches[i:]
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x[torch.from_numpy(idx)]), y[torch.from_numpy(idx)]).backward()
        opt.step()
    return model, opt, rnd, []


def _arrays(reply: RecordDict) -> dict[str, dict[str, np.ndarray]]:
    return {name: {k: v.numpy() for k, v in rec.items()} for name, rec in reply.array_records.items()}


def _content(name: str) -> RecordDict:
    return _round(name)


@pytest.mark.parametrize("name", NAMES)
def test_plain_torch_loop_gives_the_reply_train_reply_gives(name):
    content = _content(name)
    model, opt, rnd, _ = _plain_loop(name, content)
    x, y = _data()
    before = rnd.loss_before(_model(), [(x, y)], F.cross_entropy, N) if rnd.needs_loss_before else None
    mine = rnd.reply(model, opt, num_examples=N, train_loss_before=before)  # LocalUpdateDecay's server reads it
    theirs = fs.train_reply(_model(), content, x, y, F.cross_entropy, state=RecordDict(), seed=SEED, client_key=KEY)
    a, b = _arrays(mine), _arrays(theirs)
    assert set(a) == set(b) and a
    for rec in a:
        for k in a[rec]:
            np.testing.assert_array_equal(a[rec][k], b[rec][k], err_msg=f"{name} {rec}/{k}")
    assert mine[R.METRICS][R.NUM_STEPS] == theirs[R.METRICS][R.NUM_STEPS] == opt.steps_taken
    assert mine[R.REPLY_INFO][R.METHOD] == theirs[R.REPLY_INFO][R.METHOD] == name


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_mid_round(name):
    content = _content(name)
    full_model, full_opt, rnd, _ = _plain_loop(name, content)
    model, opt, rnd2, rest = _plain_loop(name, content, stop_after=2)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    model2 = _model()
    model2.load_state_dict(saved_model)
    opt2 = rnd2.optimizer(model2, num_examples=N, full_gradient=opt.full_gradient)
    opt2.load_state_dict(saved_opt)
    x, y = _data()
    for idx in rest:
        opt2.zero_grad(set_to_none=False)
        F.cross_entropy(model2(x[torch.from_numpy(idx)]), y[torch.from_numpy(idx)]).backward()
        opt2.step()
    assert opt2.steps_taken == full_opt.steps_taken
    for k, v in full_model.state_dict().items():
        torch.testing.assert_close(model2.state_dict()[k], v, rtol=0, atol=0)
    up, up2 = full_opt.uplink(), opt2.uplink()
    for rec in up:
        for k in up[rec]:
            torch.testing.assert_close(up2[rec][k], up[rec][k], rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_misuse_is_a_clear_error(name):
    content = _content(name)
    spec = fs.METHODS[name]
    rnd = ClientRound(content, state=RecordDict())
    model = _model()
    x, y = _data()
    grad = full_gradient_from(model, [(x, y)], F.cross_entropy) if rnd.needs_full_gradient else None
    opt = rnd.optimizer(model, num_examples=N, full_gradient=grad)
    with pytest.raises(RuntimeError, match="no local step was taken"):
        opt.uplink()
    with pytest.raises(TypeError, match="unknown hyper-parameter"):
        spec.local_optimizer(model.named_parameters(), lr=0.1, not_a_flag=1, planned_steps=4, full_gradient=grad,
                             downlink=rnd.content and {n: r.to_torch_state_dict() for n,
                                                       r in content.array_records.items()
                                                       if n != R.MODEL})
    with pytest.raises(ValueError, match="lr"):
        spec.local_optimizer(model.named_parameters(), lr=-1.0, planned_steps=4, full_gradient=grad)
    with pytest.raises(TypeError, match="named_parameters"):
        spec.local_optimizer(model.parameters(), lr=0.1, planned_steps=4, full_gradient=grad)
    required = [n for n in content.array_records if n != R.MODEL]
    if required:  # every downlink record the server sends is needed: leaving them out is a clear error
        with pytest.raises(ValueError, match="downlink"):
            opt = spec.local_optimizer(model.named_parameters(), lr=0.1, planned_steps=4, full_gradient=grad,
                                       **spec.hparams.client_kwargs_from_wire(rnd.config, name))
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
