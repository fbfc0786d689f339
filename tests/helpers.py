"""Test helpers: mocked Flower messages and a node-only grid (no runtime needed)."""

from __future__ import annotations

import functools
import json
import subprocess
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.serverapp import Grid

from flower_strategies.core.loop import own_loop_config

try:  # Flower >= 1.38 builds a message outside a runtime only once a task identity is set
    from flwr.supercore.task_identity import TaskIdentity
except ImportError:  # older Flower: no such step
    TaskIdentity = None


#: One method of each kind of server state, client state and reply record.  The matrices that cross every method
#: with one more feature (the vectorized engine, crash/resume, hostile replies, injected faults, Flower's privacy
#: layers, the legacy API) run these in the fast tier (``-m "not slow"``) and the other methods of the 22 in the full
#: suite only (:func:`every_method`).  fedavg: no state; fedadam: server moments; fedda: dual averaging; fedcm: a
#: downlink record; scaffold: client state and summed control deltas; fedlada: second-moment uplink records;
#: fedlamb: client momentum and the layer-wise trust ratio; fedlocal: a restarted local optimizer with corrections;
#: mimelite: the full-batch gradient; localupdatedecay: the train-loss-before controller.  Every other method is a
#: variant of one of these and has its own exactness tests in the fast tier.
REPRESENTATIVE_METHODS = frozenset({"fedavg", "fedadam", "fedda", "fedcm", "scaffold", "fedlada", "fedlamb", "fedlocal",
                                    "mimelite", "localupdatedecay"})


def client_keys(method: str) -> dict:
    """What ``method``'s strategy tells its client half in every round's ConfigRecord (``client-half``,
    ``local-optimizer``, ``loss-before``, ``full-gradient``): for a test that builds a train message by hand."""
    from flower_strategies.core import records as R
    from flower_strategies.core.registry import get_method

    config = get_method(method).build().round_config(1)
    return {k: config[k] for k in (R.CLIENT_HALF, R.LOCAL_OPTIMIZER, R.LOSS_BEFORE, R.FULL_GRADIENT)}


def every_method() -> list:
    """Every registered method, sorted, as ``pytest.param``s: those outside :data:`REPRESENTATIVE_METHODS` marked
    ``slow`` (the full suite runs all 22; tests/conftest.py's ``SLOW_GROUPS`` lists their modules as in-process)."""
    from flower_strategies.core.registry import METHODS

    assert set(METHODS) >= REPRESENTATIVE_METHODS, sorted(REPRESENTATIVE_METHODS - set(METHODS))
    return [pytest.param(name, marks=() if name in REPRESENTATIVE_METHODS else pytest.mark.slow)
            for name in sorted(METHODS)]


def set_task_identity() -> None:
    if TaskIdentity is None:
        return
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0


def metadata(src: int, dst: int = 0, message_type: str = MessageType.TRAIN) -> Metadata:
    return Metadata(
        run_id=1, message_id=uuid.uuid4().hex, src_node_id=src, dst_node_id=dst, reply_to_message_id="",
        group_id="", created_at=time.time(), ttl=3600.0, message_type=message_type,
    )


def record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v, order="C")) for k, v in arrays.items()})


def reply(src: int, records: Mapping[str, Mapping[str, np.ndarray]], num_examples: float | None = 10,
          method: str | None = None, **metrics: float) -> Message:
    """A mocked train reply; ``method`` adds the marker a fedadapt client half puts in its reply."""
    content = RecordDict({name: record(a) for name, a in records.items()})
    if method is not None:
        content["fedadapt"] = ConfigRecord({"method": method})
    m = dict(metrics)
    if num_examples is not None:
        m["num-examples"] = num_examples
    content["metrics"] = MetricRecord(m)
    return Message(content=content, metadata=metadata(src))


def error_reply(src: int, reason: str = "boom") -> Message:
    return Message(error=Error(code=1, reason=reason), metadata=metadata(src))


def train_message(content: RecordDict, dst: int = 1) -> Message:
    return Message(content=content, metadata=metadata(0, dst))


class NodesGrid(Grid):
    """A grid that only knows node ids (for configure_* calls with mocked replies)."""

    def __init__(self, node_ids) -> None:
        set_task_identity()
        self.ids = list(node_ids)

    def set_run(self, run) -> None: ...

    @property
    def run(self):  # type: ignore[override]
        return None

    def create_message(self, *a, **k):  # type: ignore[override]
        raise NotImplementedError

    def get_node_ids(self):
        return list(self.ids)

    def push_messages(self, messages):
        raise NotImplementedError

    def pull_messages(self, message_ids):
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):
        raise NotImplementedError


def our_processes(home) -> list[str]:
    """Live processes (not zombies) whose command line names ``home`` (a launch's FLWR_HOME): none once it ended."""
    out = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(home) in line and not line.startswith("Z")]


def config(**kv) -> ConfigRecord:
    """The train config a fedadapt round loop hands ``configure_train`` (marked: :func:`.loop.own_loop_config`)."""
    return own_loop_config(kv)


# ------------------------------------------------------------ paper-002 harness (FedLADA / FedCM / SCAFFOLD tests)
SYNTH_DIM = 5
SYNTH_NODES = 10
SYNTH_RC = {"task": "synthetic-linear", "seed": 0, "precision": "float64", "synthetic-dim": SYNTH_DIM}
SYNTH_X0 = np.array([[0.3, -0.2, 0.1, 0.5, -0.4]])


def synthetic_initial_arrays() -> ArrayRecord:
    """The synthetic-linear model (float64) started at :data:`SYNTH_X0`."""
    import torch

    from app_common.task import build_model

    model = build_model("synthetic-linear", 0, SYNTH_DIM, "float64")
    with torch.no_grad():
        model.w.weight.copy_(torch.from_numpy(SYNTH_X0))
    return ArrayRecord(model.state_dict())


def recorded_run(cls, hp, rounds, capture, *, fraction=0.5, client_lr=0.05, local_steps=5, local_epochs=1, batch_size=8,
                 weighting=None, **kwargs):
    """Run strategy class ``cls`` (real strategy + real ClientApp, in-process) on the synthetic federation.

    Returns ``(weights per round, sampled partition ids per round, [capture(new server state) of each server update],
    strategy, grid)``.
    """
    from simulations.engine.inprocess import simulate

    schedule: list[list[int]] = []
    captured: list = []

    class Recording(cls):
        def configure_train(self, server_round, arrays, config, grid):
            msgs = list(super().configure_train(server_round, arrays, config, grid))
            schedule.append([m.metadata.dst_node_id - 1 for m in msgs])
            return msgs

        def server_update(self, inputs, state):
            out = super().server_update(inputs, state)
            captured.append(capture(out[1]))
            return out

    strat = Recording(hp, client_lr=client_lr, local_steps=local_steps, local_epochs=local_epochs,
                      batch_size=batch_size, fraction_train=fraction, weighting=weighting, seed=0, **kwargs)
    snaps, grid = simulate(strat, synthetic_initial_arrays(), rounds, SYNTH_NODES, SYNTH_RC)
    return [s["w.weight"] for s in snaps], schedule, captured, strat, grid


def plain_loop_round(strategy, make_model, x, y, loss_fn, *, client_state=None, server_round=1, seed=0, client_key=0,
                     interrupt_at=None):
    """One client round of ``strategy`` run twice on the message it prepares: by ``train_reply`` and by a plain torch
    loop around the method's optimizer built by hand (``interrupt_at = j``: after step j, ``state_dict()`` → a new
    optimizer on a new model → ``load_state_dict()`` → continue).  Same mini-batches (``batch_indices``).

    Returns ``(reply RecordDict, saved client state of train_reply, model state_dict, uplink, client_state)``,
    the last three from the plain loop.
    """
    from flwr.app import RecordDict as RD

    from flower_strategies.core import records as R
    from flower_strategies.core.client import (
        batch_indices, downlink_records, load_client_state, num_local_steps, save_client_state, train_reply,
    )
    from flower_strategies.core.registry import get_method

    model = make_model()
    content = strategy.prepare_round(server_round, ArrayRecord(model.state_dict()), own_loop_config(), num_sampled=1)
    saved = RD()
    save_client_state(saved, client_state or {})
    reply = train_reply(make_model(), content, x, y, loss_fn, state=saved, seed=seed, client_key=client_key)

    cfg = dict(content.config_records[R.CONFIG])
    spec = get_method(str(cfg[R.METHOD]))
    steps = num_local_steps(len(x), cfg)

    def build(m):
        return spec.local_optimizer(
            m.named_parameters(), lr=float(cfg[R.CLIENT_LR]), downlink=downlink_records(content),
            client_state=client_state or {}, planned_steps=steps if spec.local_optimizer.needs_planned_steps else None,
            **spec.hparams.client_kwargs_from_wire(cfg, spec.name),
        )

    model.load_state_dict(content.array_records[R.MODEL].to_torch_state_dict())
    opt = build(model)
    batches = batch_indices(len(x), int(cfg[R.BATCH_SIZE]), steps, seed, server_round, client_key)
    for j, idx in enumerate(batches):
        if j == interrupt_at:
            sd = opt.state_dict()
            resumed = make_model()
            resumed.load_state_dict(model.state_dict())
            model, opt = resumed, build(resumed)
            opt.load_state_dict(sd)
        opt.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        opt.step()
    return reply, load_client_state(saved), model.state_dict(), opt.uplink(), opt.client_state()


def assert_same_round(a, b=None):
    """``a`` (a :func:`plain_loop_round` result): the plain loop's model, uplink and client state equal
    ``train_reply``'s exactly; ``b`` (another result, e.g. interrupted): its plain loop equals ``a``'s exactly."""
    import torch

    reply, saved, model, uplink, client_state = a
    for k, v in model.items():
        torch.testing.assert_close(torch.from_numpy(reply["arrays"][k].numpy()), v, rtol=0, atol=0, msg=f"model {k}")
    assert set(reply.array_records) - {"arrays"} == set(uplink)
    for name, arrays in uplink.items():
        for k, v in arrays.items():
            torch.testing.assert_close(torch.from_numpy(reply[name][k].numpy()), v, rtol=0, atol=0, msg=f"{name} {k}")
    assert set(saved) == set(client_state)
    for name, arrays in client_state.items():
        for k, v in arrays.items():
            torch.testing.assert_close(saved[name][k], v, rtol=0, atol=0, msg=f"client state {name} {k}")
    if b is not None:
        _, _, model_b, uplink_b, state_b = b
        for k in model:
            torch.testing.assert_close(model[k], model_b[k], rtol=0, atol=0)
        for got, want in ((uplink, uplink_b), (client_state, state_b)):
            assert set(got) == set(want)
            for name in got:
                for k in got[name]:
                    torch.testing.assert_close(got[name][k], want[name][k], rtol=0, atol=0)


def mlp_task(n=13, seed=0):
    """A float64 two-layer MLP regression task: ``(make_model, x, y, loss_fn)`` (every call of ``make_model`` gives
    the same initial weights)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(n, 2, generator=gen, dtype=torch.float64)

    def make_model():
        torch.default_generator.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()

    return make_model, x, y, torch.nn.functional.mse_loss


def named_randn(model, seed, positive=False):
    """``{param name: float64 array}`` of random values shaped like ``model``'s parameters
    (``positive``: |·| + 0.01)."""
    rng = np.random.default_rng(seed)
    out = {k: rng.normal(size=tuple(p.shape)) for k, p in model.named_parameters()}
    return {k: np.abs(v) + 0.01 for k, v in out.items()} if positive else out


def with_server_state(strategy, state):
    """``strategy`` resumed (public ``load_state_dict``) with server state ``state`` before its first round."""
    sd = strategy.state_dict()
    sd["server_state"] = state
    strategy.load_state_dict(sd)
    return strategy


def rewrite_checkpoint(src, dst, edit):
    """Copy the checkpoint ``src`` to ``dst`` after ``edit(members, meta)`` changed its arrays or metadata."""
    import json

    with np.load(src, allow_pickle=False) as z:
        members = {n: z[n] for n in z.files}
    meta = json.loads(members["meta"].tobytes())
    edit(members, meta)
    members["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(dst, **members)
    return dst


@functools.lru_cache(maxsize=1)
def digits_once():
    """scikit-learn's ``load_digits()``, parsed once per test process.

    The example apps (``examples/*/task.py``, the user's own code) call ``load_digits()`` in every ``load_data``, which
    parses the bundled CSV again (~30 ms); their tests call it hundreds of times.  The Bunch is only read there."""
    from sklearn.datasets import load_digits

    return load_digits()


def read_digits_once(monkeypatch, *task_modules) -> None:
    """Make the example apps' ``task.load_digits`` return :func:`digits_once` (same arrays, read once)."""
    for module in task_modules:
        monkeypatch.setattr(module, "load_digits", digits_once)


def children_in_process(monkeypatch, bench, real: int = 1) -> list[str]:
    """Let the benchmark module ``bench`` run its measurement children in this process, except the first ``real``.

    The benchmarks (``simulations/bench/*.py``) start ``python -m <bench> --child …`` for every measurement, so that
    imports and first-call initialisation are nobody's measured cost; each child costs 5–8 CPU-s of imports (torch,
    Flower, scikit-learn) on top of a smoke run's fraction of a second.  Here the first ``real`` children are real
    processes (the child entry point and the parent's reading of its stdout are checked end to end); each later one
    calls ``<bench>.main(child_args)`` in this process with stdout and stderr captured, and the parent gets that as
    the ``subprocess.run`` result it reads.  Returns the children's argument lines, in order, the in-process ones
    ending in ``(in-process)``."""
    import contextlib
    import importlib
    import io
    import sys

    run, calls = subprocess.run, []

    def fake_run(cmd, *args, **kwargs):
        if list(cmd[:3]) != [sys.executable, "-m", bench.__name__]:  # not one of the benchmark's children
            return run(cmd, *args, **kwargs)
        line = " ".join(map(str, cmd[3:]))
        if len(calls) < real:
            calls.append(line)
            return run(cmd, *args, **kwargs)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = importlib.import_module(cmd[2]).main([str(a) for a in cmd[3:]])
        calls.append(f"{line} (in-process)")
        return subprocess.CompletedProcess(cmd, code, out.getvalue(), err.getvalue())

    monkeypatch.setattr(subprocess, "run", fake_run)
    return calls


def check_secagg_run(log: Path, run_dir: Path) -> None:
    """One SecAgg+ round of 3 clients through a real runtime (Ray or a deployment; ``log`` = the run's ``flwr run``
    log): every reply aggregated, nothing clipped, the model learned; the workflow ran its four stages (the
    in-process tests of tests/test_secagg.py cover several rounds)."""
    from flower_strategies.compat.secagg import CLIPPED

    got = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in got] == [0, 1]
    assert got[1]["replies-used"] == 3 and got[1]["updated"] and got[1][CLIPPED] == 0
    assert got[1]["test-accuracy"] > got[0]["test-accuracy"] + 0.2
    assert log.read_text(errors="replace").count("Secure aggregation completed.") == 1


class DictLoader:
    """A loader of the app's own batch objects, flwr-datasets' dicts ``{"img": x, "label": y}``, with a DataLoader's
    ``.dataset`` and ``len()`` (its number of batches)."""

    def __init__(self, x, y, batch: int) -> None:
        self.x, self.y, self.batch, self.dataset = x, y, batch, range(len(x))

    def __iter__(self):
        for s in range(0, len(self.x), self.batch):
            yield {"img": self.x[s : s + self.batch], "label": self.y[s : s + self.batch]}

    def __len__(self) -> int:
        return -(-len(self.x) // self.batch)


class ScreenedRound:
    """A round's screen and aggregate steps as the strategy runs them (``ReplyScreen.run``, then
    ``ReplyScreen.aggregate``): the :class:`~flower_strategies.core.screen.Screened` fields, plus ``aggregates``."""

    def __init__(self, screen, server_round: int, replies) -> None:
        self.screened = screen.run(server_round, replies)
        self.aggregates = screen.aggregate(self.screened)

    def __getattr__(self, name: str):
        return getattr(self.screened, name)


class RoundScreen:
    """A :class:`~flower_strategies.core.screen.ReplyScreen` whose ``run`` also takes the aggregate step."""

    def __init__(self, screen) -> None:
        self.screen = screen

    def run(self, server_round: int, replies) -> ScreenedRound:
        return ScreenedRound(self.screen, server_round, replies)

    def __getattr__(self, name: str):
        return getattr(self.screen, name)
