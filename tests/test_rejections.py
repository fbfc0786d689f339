"""Typed rejections (flower_strategies/core/rejections.py): every :class:`Kind` is produced by its own case, keeps the
wording the logs and metrics show, and nothing in the library or the apps decides anything from that wording."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Error, Message
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from flower_strategies.core import records as R
from flower_strategies.core import validation
from flower_strategies.core.binding import ReplyBinder
from flower_strategies.core.privacy import UPLINK_CRC
from flower_strategies.core.rejections import Kind, Rejection
from flower_strategies.core.screen import ReplyScreen, ScreenPolicy
from flower_strategies.core.validation import RecordSpec
from tests.helpers import metadata, reply, set_task_identity
from tests.test_binding import reply_to, train_request

ROOT = Path(__file__).resolve().parent.parent
CURRENT = {"w": np.zeros(4, np.float32)}
MODEL = (RecordSpec(R.MODEL, "mean", "model"),)


def model_reply(src, value, n=10, **kw):
    return reply(src, {R.MODEL: {"w": np.full(4, value, np.float32)}}, num_examples=n, **kw)


def screened(replies, policy=ScreenPolicy(), specs=MODEL, **kw):
    return ReplyScreen(CURRENT, specs, ["w"], policy, method="fedavg", **kw).run(1, replies).rejections


def bound(round_trip):
    """The rejections of a :class:`ReplyBinder` round (stale, oversized, replay) after a first round."""
    set_task_identity()
    binder = ReplyBinder()
    old = {"w": np.full(4, 0.5, np.float32)}
    binder.expect([])
    first = binder.check(1, [reply_to(train_request(), old)], CURRENT, MODEL, ["w"], 0)
    kept = ReplyScreen(CURRENT, MODEL, ["w"]).run(1, first.passed).kept
    binder.remember(first, [r.msg for r in kept])
    sent, replies, cap = round_trip(old)
    binder.expect(sent)
    return binder.check(2, replies, {"w": np.ones(4, np.float32)}, MODEL, ["w"], cap).rejections


def _stale(_):
    return [train_request(1)], [reply_to(train_request(3), {"w": np.ones(4, np.float32)}, node=3)], 0


def _oversized(_):
    request = train_request(4)
    return [request], [reply_to(request, {"w": np.zeros(4000, np.float32)}, node=4)], 300


def _replay(old):
    request = train_request(2)
    return [request], [reply_to(request, old, node=2)], 0


def _unreadable(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("surprise")
    monkeypatch.setattr(validation.R, "checked_view", boom)
    return screened([model_reply(1, 1.0)])


def _rewritten(_):
    forged = model_reply(1, 1.0)
    forged.content[R.REPLY_INFO] = ConfigRecord({R.METHOD: "fedavg", UPLINK_CRC: 12345})
    return screened([forged])


def _untrusted(_):
    screen = ReplyScreen(CURRENT, MODEL, ["w"], ScreenPolicy(aggregator="fltrust-gate", update_norm_ratio=0),
                         method="fedavg", root={R.MODEL: {"w": np.ones(4, np.float32)}})  # the server's update: +1
    return screen.run(1, [model_reply(i, 1.0 + 0.1 * i) for i in range(1, 4)] + [model_reply(4, -1.0)]).rejections


def _secure_aggregate(monkeypatch):
    from flower_strategies import FedAvg
    from flower_strategies.compat.secagg import SecAggStrategy

    strategy = FedAvg(min_available_nodes=3, min_train_nodes=3, fraction_evaluate=0.0)
    secure = SecAggStrategy(strategy, dict(CURRENT), num_rounds=1)
    strategy.current = dict(CURRENT)  # as configure_fit leaves it
    monkeypatch.setattr(secure, "check_aggregate", lambda results: "its canary decodes to 0, expected 1")
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.zeros(4, np.float32)]), 10, {})
    secure.aggregate_fit(1, [(None, res)] * 3, [])  # type: ignore[list-item]
    return strategy.history[-1].rejections


#: Each kind, the case that produces it, and the words it shows (``str(rejection)``, a regular expression).
CASES = {
    Kind.CLIENT_ERROR: (lambda _: screened([Message(error=Error(code=2, reason="OOM"), metadata=metadata(7))]),
                        r"^node 7: client error: OOM$"),
    Kind.MOD_REFUSED: (lambda _: screened([Message(error=Error(code=6, reason="fixedclipping_mod expects exactly "
                                                               "one ArrayRecord"), metadata=metadata(7))]),
                       r"^node 7: client error: fixedclipping_mod expects"),
    Kind.STALE: (lambda _: bound(_stale), r"^node 3: stale: it answers message "),
    Kind.OVERSIZED: (lambda _: bound(_oversized), r"^node 4: oversized: \d+ bytes > max-reply-bytes 300$"),
    Kind.REPLAY: (lambda _: bound(_replay), r"^node 2: replay: byte-identical to a reply to an earlier round's"),
    Kind.CLIENT_HALF: (lambda _: screened([model_reply(1, 1.0, method="fedlada"), model_reply(2, 1.0, method="fedavg")],
                                          needs_client_half=True),
                       r"^node 1: reply was not produced by the client half of fedadapt method 'fedavg' \(its "
                       r"'fedadapt' ConfigRecord names 'fedlada'\)$"),
    Kind.METRICS: (lambda _: screened([model_reply(1, 1.0, n=0)]),
                   r"^node 1: metric 'num-examples' missing or not a positive whole number: 0$"),
    Kind.MISSING_RECORD: (lambda _: screened([model_reply(1, 1.0)], specs=(*MODEL, RecordSpec("v", "sum", "params"))),
                          r"^node 1: missing ArrayRecord 'v'$"),
    Kind.BAD_RECORD: (lambda _: screened([reply(1, {R.MODEL: {"w": np.zeros(3, np.float32)}})]),
                      r"^node 1: record 'arrays' key 'w' "),
    Kind.UNREADABLE: (_unreadable, r"^node 1: unreadable reply \(RuntimeError: surprise\)$"),
    Kind.NONFINITE: (lambda _: screened([model_reply(1, np.nan)]), r"^node 1: record 'arrays' key 'w' holds NaN/Inf$"),
    Kind.INVARIANT: (lambda _: screened([reply(1, {R.MODEL: {"w": np.ones(4, np.float32)},
                                                   "v": {"w": np.array([1, 2, -3, 4], np.float32)}})],
                                        specs=(*MODEL, RecordSpec("v", "mean", "params", floor=0.0))),
                     r"^node 1: record 'v' key 'w' has values below 0 \(min -3\), which no honest client sends$"),
    Kind.MAX_NORM: (lambda _: screened([model_reply(1, 10.0)], ScreenPolicy(max_update_norm=5.0)),
                    r"^node 1: record 'arrays' update norm 20 exceeds max-update-norm 5$"),
    Kind.NORM_RATIO: (lambda _: screened([model_reply(i, 1.0) for i in range(1, 4)] + [model_reply(4, 1e6)]),
                      r"^node 4: record 'arrays' norm 2e\+06 exceeds update-norm-ratio 100 × the round's median 2$"),
    Kind.REWRITTEN: (_rewritten, r"^node 1: a ClientApp mod rewrote the reply's record 'arrays' after fedadapt's"),
    Kind.DIRECTION: (lambda _: screened([model_reply(i, 1.0 + 0.1 * i) for i in range(1, 5)] + [model_reply(5, -3.0)],
                                        ScreenPolicy(update_cosine_floor=0.0, update_norm_ratio=0)),
                     r"^node 5: record 'arrays' update points against the round's centre \(cosine -1.000 < "
                     r"update-cosine-floor 0\)$"),
    Kind.UNTRUSTED: (_untrusted, r"^node 4: record 'arrays' update has FLTrust trust 0 \(its cosine with the "
                                 r"server's root-set update is <= 0\)$"),
    Kind.LEFT_OUT: (lambda _: screened([model_reply(i, 1.0 + 0.1 * i) for i in range(1, 5)] + [model_reply(5, 9.0)],
                                       ScreenPolicy(aggregator="multi-krum", update_norm_ratio=0)),
                    r"^node 5: left out by aggregator multi-krum \(score "),
    Kind.TOO_FEW: (lambda _: screened([model_reply(1, 1.0), model_reply(2, 1.0)],
                                      ScreenPolicy(aggregator="trimmed-mean")),
                   r"^node 1: aggregator trimmed-mean needs at least 3 usable replies"),
    Kind.SECURE_AGGREGATE: (_secure_aggregate,
                            r"^secure aggregate of 3 replies rejected: its canary decodes to 0, expected 1$"),
    Kind.RESTORED: (lambda _: [Rejection.from_state("node 3: client error: boom")], r"^node 3: client error: boom$"),
}


def test_every_kind_has_its_case():
    assert set(CASES) == set(Kind)


@pytest.mark.parametrize("kind", list(Kind), ids=[k.value for k in Kind])
def test_each_kind_is_produced_by_its_case_with_its_wording(kind, monkeypatch):
    produce, words = CASES[kind]
    rejections = produce(monkeypatch)
    assert rejections and all(isinstance(r, Rejection) for r in rejections), rejections
    first = rejections[0]
    assert first.kind is kind, (first.kind, str(first))
    assert re.search(words, str(first)), str(first)
    assert Rejection.from_state(first.to_state()) == first  # a checkpoint keeps the kind


# ------------------------------------------------------------------ nothing decides from the wording
#: Where rejections are made and consumed: the library and both apps (with what they share, app_common/).
SOURCES = sorted([*(ROOT / "flower_strategies").rglob("*.py"), *(ROOT / "server_app").rglob("*.py"),
                  *(ROOT / "client_app").rglob("*.py"), *(ROOT / "app_common").rglob("*.py")])
#: Calls that match text.
TEXT_MATCHERS = {"startswith", "endswith", "find", "rfind", "index", "count", "search", "match", "fullmatch",
                 "findall", "split", "partition"}


def _words(text: str) -> str:
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def _literal(node: ast.AST, constants: dict[str, list[str]]) -> list[str] | None:
    """The text of a string constant, a name bound to text, or a tuple/list of them; ``None`` for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, (ast.Tuple, ast.List)):
        parts = [_literal(e, constants) for e in node.elts]
        return None if not parts or None in parts else [t for p in parts for t in p or []]
    return None


def _constants(tree: ast.Module) -> dict[str, list[str]]:
    """The names a module binds to literal text anywhere: ``NAME = "..."``, ``names = ("...", "...")``, and the
    loop variables over such text (``for m in names``)."""
    out: dict[str, list[str]] = {}
    for _ in range(2):  # a loop over a name bound later in the walk
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, (ast.comprehension, ast.For)):
                targets, value = [node.target], node.iter
            else:
                continue
            texts = _literal(value, out)
            if texts:
                out.update({t.id: texts for t in targets if isinstance(t, ast.Name)})
    return out


def _strings(node: ast.AST, constants: dict[str, list[str]]) -> list[str]:
    """The literal text in ``node`` as words: string constants, the literal parts of f-strings, and the text bound
    to names (:func:`_constants`); not the keys of subscripts (``row["run-config"]``)."""
    out = []
    todo = [node]
    while todo:
        sub = todo.pop()
        if isinstance(sub, ast.Subscript):
            todo.append(sub.value)
            continue
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            out.append(sub.value)
        elif isinstance(sub, ast.Name) and sub.id in constants:
            out += constants[sub.id]
        todo.extend(ast.iter_child_nodes(sub))
    return [_words(t) for t in out]


def rejection_wording(sources) -> list[str]:
    """The literal fragments (of two words or more) of every detail the code passes to ``Rejection(...)``."""
    fragments = []
    trees = [ast.parse(path.read_text()) for path in sources]
    shared: dict[str, list[str]] = {}  # module-level text of every module: a detail may use an imported constant
    for tree in trees:
        shared.update(_constants(tree))
    for tree in trees:
        imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        constants = {**{k: v for k, v in shared.items() if k in imported}, **_constants(tree)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Rejection":
                for arg in node.args[2:]:
                    fragments += [w for w in _strings(arg, constants) if " " in w]
    return fragments


def text_matches(source: str, wording: list[str]) -> list[str]:
    """Where ``source`` matches text against rejection ``wording``: an ``in`` / ``not in`` test or a text-matching
    call (``startswith``, ``re.search``, …) one of whose operands holds literal text (a constant, an f-string part,
    a name bound to literal text, a loop variable over such text) that shares two words or more with a rejection's
    wording; and any such test on a rejection's ``detail``."""
    tree = ast.parse(source)
    constants = _constants(tree)
    hits = []
    for node in ast.walk(tree):
        operands: list[ast.AST] = []
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in TEXT_MATCHERS:
            operands = [node.func.value, *node.args]
        for operand in operands:
            if any(isinstance(sub, ast.Attribute) and sub.attr == "detail" for sub in ast.walk(operand)):
                hits.append(f"line {operand.lineno}: tests a rejection's detail")
            for text in _strings(operand, constants):
                if " " in text and any(text in w or w in text for w in wording):
                    hits.append(f"line {operand.lineno}: {text!r}")
    return hits


def test_the_wording_is_found():
    """The check sees the wording it guards: the client-error, missing-record, client-half and DP-fix texts."""
    wording = rejection_wording(SOURCES)
    for phrase in ("client error", "missing arrayrecord", "not produced by the client half", "holds nan inf",
                   "native user level dp", "fixedclipping mod"):
        assert any(phrase in w for w in wording), phrase


@pytest.mark.parametrize("old", [
    'errors = [r for r in last.rejections if ": client error:" in r]',
    'missing_half += reason.startswith(CLIENT_HALF_REASON) or reason.startswith("missing ArrayRecord")',
    'CLIENT_HALF_REASON = "reply was not produced by the client half of fedadapt method"\n'
    'half = reason.startswith(CLIENT_HALF_REASON)',
    'hint = any(m in client_error for m in ("fixedclipping_mod", "adaptiveclipping_mod", "LocalDpMod"))',
    'FIX = "use fedadapt\'s native user-level DP instead: dp-clip = C > 0"\nshown = FIX not in client_error',
    'nan = [r for r in rejections if re.search("holds NaN/Inf", r)]',
    'errors = [r for r in rejections if r.detail.startswith("client error")]',
])
def test_the_check_catches_the_former_text_matching(old):
    """The patterns the library used before rejections were typed (and two more) are caught."""
    assert text_matches(old, rejection_wording(SOURCES)), old


def test_nothing_in_the_library_or_apps_matches_rejection_text():
    wording = rejection_wording(SOURCES)
    hits = {str(p.relative_to(ROOT)): h for p in SOURCES if (h := text_matches(p.read_text(), wording))}
    assert not hits, hits


def test_no_call_stack_walking():
    """Flower's DP wrappers are recognised from public signals (core/privacy.py), nothing walks the call stack."""
    banned = re.compile(r"\binspect\.(stack|currentframe|getouterframes|getframeinfo)\b|\bsys\._getframe\b|"
                        r"\b_callers\b|\bf_back\b|\bf_locals\b")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in [*SOURCES, *(ROOT / "simulations").rglob("*.py")]
            for i, line in enumerate(p.read_text().splitlines(), 1) if banned.search(line)]
    assert not hits, hits


def _ray_reason(user_error: Exception) -> str:
    """The error reason Flower's simulation engine sends when a ClientApp raises ``user_error`` under its Ray backend
    (flwr/server/superlink/fleet/vce/vce_api.py: ``str(type(ex)) + ":<'" + str(ex) + "'>"``, where ``ex`` is the
    RayTaskError of its ClientAppActor, whose ``run`` re-raises the user's exception as a ClientAppException)."""
    import traceback

    from flwr.clientapp.client_app import ClientAppException
    RayTaskError = pytest.importorskip("ray.exceptions", reason="Ray is the app's extra; the compatibility leg "
                                       "installs the library only").RayTaskError

    try:
        try:
            raise user_error
        except Exception as ex:
            raise ClientAppException(str(ex)) from ex
    except ClientAppException as cae:
        ray_error = RayTaskError("ClientAppActor.run", traceback.format_exc(), cae, proctitle="ray::ClientAppActor.run",
                                 pid=4242, ip="10.0.0.7", actor_id="7f9a3c1d2e4b5a6f7081",
                                 actor_repr="<flwr.simulation.ray_transport.ray_actor.ClientAppActor object at "
                                            "0x7f3a2c1d9e50>").as_instanceof_cause()
    return str(type(ray_error)) + ":<'" + str(ray_error) + "'>"


class _Mismatch(Exception):
    pass


@pytest.mark.parametrize("error, expected", [
    (ValueError("eval batch has 3 channels, model expects 1"),
     "ValueError: eval batch has 3 channels, model expects 1 [via RayTaskError(ClientAppException)]"),
    (_Mismatch("labels 0..9 expected"), "_Mismatch: labels 0..9 expected [via RayTaskError(ClientAppException)]"),
])
def test_a_ray_error_reason_keeps_the_users_exception_first(error, expected):
    from flower_strategies.core.rejections import client_error_text

    reason = _ray_reason(error)
    assert len(reason) > 300 and "actor_id" in reason[:300] and str(error) not in reason[:150]  # what it was
    assert client_error_text(reason) == expected
    assert client_error_text("<class 'KeyError'>:<''img''>") == "KeyError: 'img'"  # deployment / no Ray
    assert client_error_text("<class 'flwr.clientapp.client_app.ClientAppException'>:<'\nException "
                             "ClientAppException occurred. Message: OOM'>") == "OOM [via ClientAppException]"
    assert client_error_text("  left \n over ") == "left over"  # anything else: whitespace collapsed


def test_failure_reasons_in_a_run_name_the_users_exception(caplog):
    """A ClientApp whose evaluate (and, in round 2, train) raises, in-process; the replies carry the reason Flower's
    Ray backend would send: the evaluate failure line, the train rejections and the run's failure message start with
    the user's exception."""
    import logging

    from flwr.app import Array, ArrayRecord, MessageType, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    import flower_strategies as fs
    from simulations.engine.inprocess import LoopbackGrid

    app = ClientApp()

    @app.train()
    def train(msg, context):
        if int(msg.content["config"]["server-round"]) == 2:
            raise KeyError("img")
        metrics = MetricRecord({"num-examples": 10})
        return Message(RecordDict({"arrays": msg.content["arrays"], "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg, context):
        raise ValueError("eval batch has 3 channels, model expects 1")

    def as_ray(request, reply, partition_id):
        if not reply.has_error():
            return reply
        user = ValueError("eval batch has 3 channels, model expects 1") \
            if request.metadata.message_type == MessageType.EVALUATE else KeyError("img")
        return Message(Error(code=reply.error.code, reason=_ray_reason(user)), reply_to=request)

    from flower_strategies.core.policy import RunFailed

    strategy = fs.FedAvg(fraction_evaluate=1.0, max_idle_rounds=0)
    failed = r"^round 2: every client failed; first error: node 1: client error: KeyError: 'img' \[via RayTaskError"
    with caplog.at_level(logging.INFO, logger="flwr"), pytest.raises(RunFailed, match=failed):
        strategy.start(grid=LoopbackGrid(app, 2, {}, intercept=as_ray),
                       initial_arrays=ArrayRecord({"w": Array(np.zeros(4, np.float32))}), num_rounds=2)
    lines = [r.getMessage() for r in caplog.records]
    assert "\t> 2 failures from nodes 1, 2: ValueError: eval batch has 3 channels, model expects 1 [via " \
           "RayTaskError(ClientAppException)]" in lines
    (round2,) = [h for h in strategy.history if h.server_round == 2]
    assert [str(r) for r in round2.rejections] == [
        f"node {n}: client error: KeyError: 'img' [via RayTaskError(ClientAppException)]" for n in (1, 2)]
