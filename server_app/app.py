"""Method-agnostic ServerApp.

1. Validates the whole run-config (unknown method/key, wrong type, out-of-range value → one clear error,
   raised before round 1) and builds the strategy from the registry.
2. Asks every connected node for its partition id (a QUERY message) when clients are sub-sampled, so that
   sampling with the run's seed picks the same partitions whatever node ids the runtime assigned.
3. Runs the strategy, evaluating the global model centrally on the held-out test split after every round;
   writes ``<output-dir>/<run-name>/metrics.jsonl`` + ``metrics.csv``, prints one progress line per round
   and saves ``model.pt``, ``summary.json`` (outcome, resolved configuration, versions, git commit, host; written
   for failed runs too) and (``learning-curve``) ``learning_curve.png`` at the end; ``tracking`` also sends each
   row and the configuration to TensorBoard, MLflow or W&B (:mod:`server_app.tracking`).
4. With ``checkpoint-every > 0`` writes a data-only ``checkpoint.npz`` (:mod:`flower_strategies.core.checkpoint`)
   on that cadence, after the last round and on SIGINT/SIGTERM; ``resume`` continues a run from one.  Such runs
   carry a run token (in the checkpoint; a resumed run sends the same one) that names the clients' node-local
   saved state (:mod:`client_app.client_state`, keys :mod:`app_common.wire`), so that stateful methods resume exactly.
"""

from __future__ import annotations

import gc
import json
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from app_common import wire
from app_common.config import ROUND_PARTITIONERS, AppConfig, run_name_problem
from app_common.hub_data import DatasetUnavailable
from app_common.task import build_model, evaluate, load_test_data
from flower_strategies.core import checkpoint as ckpt
from flower_strategies.core import records as R
from flower_strategies.core.client import record_tensors
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.loop import exchange, run_rounds
from flower_strategies.core.policy import RunFailed
from flower_strategies.core.robust import TRUST_RULES
from flower_strategies.core.registry import parse_run_config, run_config_defaults
from flower_strategies.core.strategy import ClientHalfMissing, FedAdaptStrategy, RoundLog

from . import plots, presets, provenance, rundir, tracking
from . import root, secure
from .metrics import MetricsWriter, Progress, progress_line

app = ServerApp()


def run_dir(fed: AppConfig, run_config: Mapping[str, Any] | None = None,
            payload: Mapping[str, Any] | None = None) -> Path:
    """``<output-dir>/<run-name>``.  An empty run-name gives, for a fresh run, :func:`server_app.rundir.
    default_run_name` of ``run_config`` (the run-config as given, before presets); for a resumed run (``payload``:
    its checkpoint) the directory name the checkpoint records, so that what a resumed run may change does not move
    it (a checkpoint written before names were recorded: the name it had then, which hashed no resumable key)."""
    given = run_config or {}
    name = fed.run_name
    if not name and payload is not None:
        name = str(payload["app"].get(RUN_NAME) or "")
        reason = run_name_problem(name)
        if reason is not None:
            raise ckpt.CheckpointError(f"the checkpoint's run directory name {name!r} is not valid: {reason}")
        name = name or rundir.default_run_name(fed.method, fed.task, fed.seed, given, run_config_defaults(AppConfig),
                                               ckpt.RESUMABLE_CHANGES | APP_RESUMABLE_CHANGES)
    name = name or rundir.default_run_name(fed.method, fed.task, fed.seed, given, run_config_defaults(AppConfig),
                                           rundir.UNHASHED)
    return Path(fed.output_dir).expanduser().resolve() / name


def discover_partitions(grid: Grid, strategy: FedAdaptStrategy, timeout: float, poll_interval: float = 0.0) -> None:
    """Ask connected nodes for their partition id; order sampling by it (fallback: node id).  An in-process grid
    that holds a large population out of core knows them without asking (``partition_order``)."""
    nodes = strategy.sample(grid, 1.0, strategy.settings.min_available_nodes)  # a draw from the sampling RNG either way
    known = getattr(grid, "partition_order", lambda: None)()
    if known is not None:
        strategy.order_nodes(known)
        return
    msgs = [Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=n) for n in nodes]
    order: dict[int, Any] = {}
    for reply in exchange(grid, msgs, timeout, poll_interval):
        metrics = None if reply.has_error() else R.get(reply.content, R.METRICS, MetricRecord)
        if metrics is not None and "partition-id" in metrics:  # nodes with their own data may have none
            order[reply.metadata.src_node_id] = int(cast(int, metrics["partition-id"]))
    if len(order) < len(nodes):
        log(WARNING, "Only %d of %d nodes reported a partition id; the others are ordered by node id",
            len(order), len(nodes))
    strategy.order_nodes(order)


def send_round_partitions(strategy: FedAdaptStrategy) -> None:
    """Per-round partitioners (``round-iid`` / ``round-class``): every train message of a round also carries the
    round's sampled partition ids, in sampling order (:data:`app_common.wire.ROUND_PARTITIONS` in its ConfigRecord),
    from which each client finds its slot in the round's allocation.  The strategy's own ``configure_train`` samples
    and builds the round's content (one object for all of its messages); the list is added to that content's
    ConfigRecord.  So every sampled client learns which partition ids were sampled with it."""
    configure = strategy.configure_train

    def configure_train(server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list[Message]:
        messages = list(configure(server_round, arrays, config, grid))
        order = strategy.sampler.node_order
        lacking = [m.metadata.dst_node_id for m in messages if m.metadata.dst_node_id not in order]
        if lacking:
            raise ConfigError(f"a per-round partitioner needs every node's partition id; node(s) {lacking[:5]} "
                              "reported none (node-local data?): use partitioner = 'iid', 'dirichlet' or 'classes'")
        ids = [int(order[m.metadata.dst_node_id]) for m in messages]
        for content in {id(m.content): m.content for m in messages}.values():
            record = R.get(content, R.CONFIG, ConfigRecord)
            assert record is not None  # prepare_round writes it
            record[wire.ROUND_PARTITIONS] = ids
        return messages

    strategy.configure_train = configure_train  # type: ignore[method-assign]


def prepare_sampling(grid: Grid, strategy: FedAdaptStrategy, fed: AppConfig) -> None:
    """Before round 1: the nodes' partition ids where sampling or the data allocation needs them (partial
    participation, per-round partitioners: clients find their slot by partition id)."""
    per_round = fed.partitioner in ROUND_PARTITIONERS
    if per_round or fed.fraction_train < 1.0 or fed.fraction_evaluate not in (0.0, 1.0):
        discover_partitions(grid, strategy, fed.round_timeout, fed.grid_pull_interval)
    if per_round:
        send_round_partitions(strategy)


class Checkpointer:
    """Writes ``checkpoint.npz`` every ``every`` rounds and after the last one; keeps the latest round's
    encoded checkpoint in memory so that SIGINT/SIGTERM can write it before the process exits."""

    def __init__(self, path: Path, every: int, num_rounds: int, encode: Callable[[int, ArrayRecord], bytes]) -> None:
        self.path, self.every, self.num_rounds, self.encode = path, every, num_rounds, encode
        self.latest: bytes | None = None
        self.latest_round = -1
        self.written_round = -1

    def round_end(self, server_round: int, arrays: ArrayRecord) -> None:
        """``on_round_end`` of :func:`run_rounds`: encode the round's checkpoint; write it on the cadence."""
        self.latest, self.latest_round = self.encode(server_round, arrays), server_round
        if server_round % self.every == 0 or server_round == self.num_rounds:
            self.write()

    def write(self) -> None:
        if self.latest is not None and self.written_round != self.latest_round:
            ckpt.write_atomic(self.path, self.latest)
            self.written_round = self.latest_round
            log(INFO, "fedadapt: checkpoint of round %d written to %s", self.latest_round, self.path)

    @contextmanager
    def signal_handlers(self) -> Iterator[None]:
        """While active, SIGINT/SIGTERM write the last completed round's checkpoint, then hand over to the previous
        handler (Flower's graceful exit in a deployed ServerApp) or exit (KeyboardInterrupt / SystemExit(128+signum)).
        Only possible in the main thread; the previous handlers are restored on exit."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        previous: dict[int, Any] = {}

        def handler(signum: int, frame: Any) -> None:
            log(WARNING, "fedadapt: received signal %d; writing the checkpoint of round %d", signum, self.latest_round)
            self.write()
            prev = previous.get(signum)
            if callable(prev):  # e.g. Flower's own graceful-exit handler in a deployed ServerApp
                prev(signum, frame)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.getsignal(sig)
            signal.signal(sig, handler)
        try:
            yield
        finally:
            for signum, prev in previous.items():
                signal.signal(signum, prev)


def make_checkpointer(fed: AppConfig, out: Path, strategy: FedAdaptStrategy, writer: MetricsWriter,
                      run_config: Mapping[str, Any], run_token: str = "", root_secret: int | None = None
                      ) -> Checkpointer | None:
    """The run's :class:`Checkpointer` (``checkpoint-every > 0``), else None.  ``root_secret``: the FLTrust root
    secret (:func:`server_app.root.root_secret`), kept in the checkpoint only, so that a resumed run continues
    exactly."""
    if fed.checkpoint_every <= 0:
        return None
    secret = {} if root_secret is None else {root.ROOT_SECRET: str(root_secret)}

    def encode(server_round: int, arrays: ArrayRecord) -> bytes:
        return ckpt.encode(server_round=server_round, num_rounds=fed.num_server_rounds, arrays=R.to_numpy(arrays),
                           strategy=strategy, metrics_rows=writer.rows, run_config=run_config,
                           app={RUN_TOKEN: run_token, RUN_NAME: out.name, **secret})

    return Checkpointer(out / "checkpoint.npz", fed.checkpoint_every, fed.num_server_rounds, encode)


# ------------------------------------------------------------------------------------------ the run, in steps
def build(run_config: Mapping[str, Any]) -> tuple[AppConfig, torch.nn.Module, FedAdaptStrategy]:
    """Validate the whole run-config (one clear error before anything is sent) and build model + strategy."""
    parsed, spec, hp = parse_run_config(run_config, AppConfig)  # the run's one parse of its run-config
    fed = cast(AppConfig, parsed)  # an instance of the settings class it was given
    model = build_model(fed.task, fed.seed, fed.synthetic_dim, fed.precision)
    trainable = [name for name, _ in model.named_parameters()]
    strategy = spec.build(hp, settings=fed, trainable_keys=trainable, num_rounds=fed.num_server_rounds)
    strategy.apps_clients = False  # fedadapt's ClientApp trains as the settings say (the summary shows them)
    assert isinstance(fed, AppConfig)
    aggregator = strategy.settings.aggregator
    if aggregator in TRUST_RULES:  # FLTrust: the server's own update on its root set (server_app.root)
        log(INFO, "fedadapt: aggregator %s, root set of %d training examples", aggregator, fed.root_set_size)
    tracking.check_available(fed.tracking)  # a missing tracker package fails here, before anything is written
    if fed.secure_aggregation != "off":
        secure.check(fed, strategy)  # SecAgg+: eligible method and settings, or ConfigError naming what to use
    if not fed.train_loss_before and strategy.needs_train_loss_before:
        raise ConfigError(f"train-loss-before = false: {fed.method} needs the clients' train-loss-before (e.g. a "
                          "plateau controller that decays the learning rates on it); set train-loss-before = true")
    return fed, model, strategy


#: App run-config keys that may differ on resume besides the library's ``checkpoint.RESUMABLE_CHANGES``.
APP_RESUMABLE_CHANGES = frozenset({"tracking", "overwrite"})


def read_resume(fed: AppConfig, run_config: Mapping[str, Any], model: torch.nn.Module) -> dict[str, Any] | None:
    """The validated checkpoint to resume from (``resume`` key), or None for a fresh run."""
    if not fed.resume:
        return None
    payload = ckpt.load(fed.resume, max_member_bytes=ckpt.member_limit(model.state_dict()))
    ckpt.check_round(payload, fed.num_server_rounds)
    # where the rows are also sent (``tracking``) is no part of the run's results, nor is ``overwrite`` (how a fresh
    # run starts): they may change on resume
    drop = APP_RESUMABLE_CHANGES
    ckpt.check_compatible({**payload, "run_config": {k: v for k, v in payload["run_config"].items() if k not in drop}},
                          {k: v for k, v in run_config.items() if k not in drop},
                          {k: v for k, v in run_config_defaults(AppConfig).items() if k not in drop})
    ckpt.check_arrays(payload, model.state_dict())
    return payload


def load_test_split(fed: AppConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The central test set; a hub task whose data set can be read neither from the hub nor from ``dataset-path``
    fails the run here, before round 1, with the loader's message (which names ``dataset-path``)."""
    try:
        return _load_test_split(fed)
    except DatasetUnavailable as err:
        log(ERROR, "fedadapt: run FAILED: %s", err)
        raise


def _load_test_split(fed: AppConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return load_test_data(
        fed.task, seed=fed.seed, num_clients=fed.synthetic_clients, synthetic_dim=fed.synthetic_dim,
        synthetic_heterogeneity=fed.synthetic_heterogeneity, precision=fed.precision, data_dir=fed.data_dir,
        max_examples=fed.test_max_examples, dataset_path=fed.dataset_path, synthetic_alpha=fed.synthetic_alpha,
        synthetic_beta=fed.synthetic_beta,
    )


def resume_into(strategy: FedAdaptStrategy, writer: MetricsWriter, payload: dict[str, Any]) -> tuple[ArrayRecord, int]:
    """Restore the strategy state and the metrics rows; return the global arrays and the first round to run.

    Call after :func:`discover_partitions` (which draws from the sampling RNG in a fresh run too): the restored
    RNG state is exactly the one the uninterrupted run had after round ``payload['round']``."""
    ckpt.restore_strategy(strategy, payload)
    writer.restore(payload["metrics_rows"])
    return R.to_record(payload["arrays"]), payload["round"] + 1


def round_row(server_round: int, test_metrics: Mapping[str, float], report: RoundLog | None) -> dict[str, Any]:
    """The metrics row of ``server_round``: central test metrics + the round's report (``RoundBook.report``:
    replies, bytes, the method's own round metrics such as decayed learning rates; ``None``: no train round)."""
    row: dict[str, Any] = {"round": server_round, "test-loss": test_metrics["loss"]}
    if "accuracy" in test_metrics:
        row["test-accuracy"] = test_metrics["accuracy"]
    if server_round == 0 or report is None:
        return row
    h = report
    row.update({
        "train-loss": h.train_metrics.get(R.TRAIN_LOSS), "train-loss-before": h.train_metrics.get(R.TRAIN_LOSS_BEFORE),
        "replies-used": h.replies_used, "replies-rejected": h.replies_rejected,
        "replies-missing": max(0, h.sampled - h.replies_used - h.replies_rejected),
        "bytes-down": h.bytes_down, "bytes-up": h.bytes_up, "updated": h.updated,
    })
    for key in ("weights-clipped", "updates-clipped"):
        if key in h.train_metrics:
            row[key] = h.train_metrics[key]
    row.update(h.round_metrics)
    if h.rejections:
        row["rejections"] = "; ".join(map(str, h.rejections))
    return row


RUN_TOKEN = "run-token"
#: The run directory's name, in the checkpoint: where a resumed run with an empty run-name continues.
RUN_NAME = "run-name"


def run_token(payload: Mapping[str, Any] | None) -> str:
    """The run's token: the checkpoint's when resuming, else a new one (a fresh run never meets stale client state)."""
    if payload is not None and payload["app"].get(RUN_TOKEN):
        return str(payload["app"][RUN_TOKEN])
    if payload is not None:
        log(WARNING, "fedadapt: the checkpoint has no run token (written before client state was kept on the nodes): "
            "the clients' saved state of the interrupted run cannot be found; stateful methods restart it")
    return secrets.token_hex(8)


class ClientStateReport:
    """After a resume, which clients continued their saved state (:mod:`client_app.client_state`, keys
    :mod:`app_common.wire`); printed once."""

    def __init__(self, resumed_after: int | None) -> None:
        self.resumed_after = resumed_after
        self.counts: dict[str, int] = {}

    def __call__(self, server_round: int, replies: list[Message]) -> None:
        if self.resumed_after is None or self.counts:
            return
        for msg in replies:
            info = None if msg.has_error() else R.get(msg.content, R.REPLY_INFO, ConfigRecord)
            if info is not None and wire.STATUS in info:
                key = str(info[wire.STATUS])
                self.counts[key] = self.counts.get(key, 0) + 1
        fresh = self.counts.get("fresh", 0)
        if fresh:
            log(WARNING, "fedadapt: resumed after round %d, but %d of %d clients of round %d found no saved client "
                "state of this run (first time sampled, or their node restarted with an empty disk or without a "
                "client-state directory): for them the resumed run is not the interrupted one continued exactly",
                self.resumed_after, fresh, sum(self.counts.values()), server_round)
        elif self.counts:
            log(INFO, "fedadapt: resumed after round %d; the clients of round %d continued their saved state (%s)",
                self.resumed_after, server_round, self.counts)


def write_summary(out: Path, fed: AppConfig, run_config: Mapping[str, Any], strategy: FedAdaptStrategy,
                  writer: MetricsWriter, seconds: float, resumed_after: int | None,
                  checkpointer: Checkpointer | None, failure: str | None = None,
                  client_states: Mapping[str, int] | None = None,
                  info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``summary.json``: outcome (``status``, ``failure``), final row, the run-config as given (``run_config``:
    the keys set, presets applied) and, from ``info`` (:func:`server_app.provenance.run_info`), the resolved
    configuration of every key (``config``), ``versions``, ``git`` and ``host``."""
    summary = {
        "status": "failed" if failure else "completed", "failure": failure, "method": fed.method, "task": fed.task,
        "rounds": fed.num_server_rounds, "final": writer.rows[-1] if writer.rows else {}, "seconds": round(seconds, 3),
        "run_config": dict(run_config), "rounds_without_update": [h.server_round for h in strategy.history
                                                                  if not h.updated],
        "resumed_after_round": resumed_after, **(info or {}),
    }
    if checkpointer is not None:
        summary["checkpoint"] = str(checkpointer.path)
    if resumed_after is not None:
        summary["client_state_after_resume"] = dict(client_states or {})
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
    return summary


def run(grid: Grid, run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Everything ``main`` does, callable with any Grid (the in-process engine uses it too).

    Once the run directory exists, every outcome writes ``summary.json`` (``status`` failed with the error on any
    exception) and closes the tracker."""
    given = run_config
    run_config = presets.apply(run_config)  # the task's per-method presets on keys left at their defaults
    fed, model, strategy = build(run_config)
    payload = read_resume(fed, run_config, model)
    out = run_dir(fed, given, payload)
    # the run owns its directory until it ends, and a fresh run never takes over another's (server_app.rundir)
    with rundir.claim(out, fresh=not fed.resume, overwrite=fed.overwrite), frozen_heap():
        return _run(grid, run_config, fed, model, strategy, out, payload)


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Leave the objects alive when a run starts (torch, Flower, the app: about 350,000) out of the cyclic
    collector's passes while it runs (``gc.freeze``), and give them back after it (``gc.unfreeze``).  Every reply
    makes hundreds of container objects, so a round of 1,000 clients triggers full collections, and each full pass
    over the start-up objects took ~0.2 s: 74 of a 244 ms round at 1,000 digits-MLP clients (in-process engine), 10
    ms with them frozen.  Reference counting frees frozen objects as before; only cycles among them wait for the
    run's end.  In a process that has frozen objects itself, the permanent generation is its own: left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _run(grid: Grid, run_config: Mapping[str, Any], fed: AppConfig, model: torch.nn.Module,
         strategy: FedAdaptStrategy, out: Path, payload: dict[str, Any] | None) -> dict[str, Any]:
    writer = MetricsWriter(out)
    info = provenance.run_info(fed, strategy.method, strategy.hparams)
    log(INFO, "fedadapt: method=%s task=%s rounds=%d → %s", fed.method, fed.task, fed.num_server_rounds, out)
    t0 = time.monotonic()
    tracker: tracking.Tracker = tracking.Tracker()
    checkpointer: Checkpointer | None = None
    resumed_after = None if payload is None else payload["round"]
    report = ClientStateReport(resumed_after)
    try:
        x_test, y_test = load_test_split(fed)  # inside: a data set that cannot be loaded fails with a summary too
        tracker = tracking.start(fed.tracking, out, info["config"])
        prepare_sampling(grid, strategy, fed)
        initial, start_round = ArrayRecord(model.state_dict()), 1
        if payload is not None:
            initial, start_round = resume_into(strategy, writer, payload)
            log(INFO, "fedadapt: resuming from %s after round %d", fed.resume, start_round - 1)

        progress = Progress(fed.num_server_rounds, t0)  # elapsed and ETA on every round's line

        def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model.load_state_dict(record_tensors(arrays, copy=False))
            m = evaluate(model, x_test, y_test, fed.task)
            row = writer.add(round_row(server_round, m, strategy.rounds.report(server_round)))
            tracker.log_round(row)
            print(progress_line(row, fed.num_server_rounds, progress), flush=True)
            return MetricRecord(dict(m))  # run_rounds then applies the run-failure policy (core/policy.py)

        token = run_token(payload) if fed.checkpoint_every > 0 else ""
        secret: int | None = None
        if strategy.settings.aggregator in TRUST_RULES:  # the secret trust reference (server_app.root)
            secret = root.root_secret(fed, payload)
            strategy.root_update = root.root_update(fed, secret)
        checkpointer = make_checkpointer(fed, out, strategy, writer, run_config, token, secret)

        def round_config(server_round: int) -> dict[str, Any]:
            """Tells clients which saved state is theirs (runs that write checkpoints, i.e. can be resumed)."""
            if checkpointer is None:
                return {}
            keep = checkpointer.written_round if checkpointer.written_round >= 0 else (resumed_after or 0)
            return {wire.CLIENT_STATE_KEY: token, wire.CLIENT_STATE_KEEP: keep,
                    wire.CLIENT_STATE_BASE: resumed_after or 0}

        failure: RunFailed | None = None
        final = initial
        with checkpointer.signal_handlers() if checkpointer else nullcontext():
            try:
                if fed.secure_aggregation != "off":  # Flower's SecAgg+ workflow (no checkpoints: secure.check)
                    result = secure.run_secure_rounds(fed, strategy, grid, initial, evaluate_fn)
                else:
                    result = run_rounds(strategy, grid, initial, fed.num_server_rounds, fed.round_timeout, evaluate_fn,
                                        start_round=start_round,
                                        on_round_end=checkpointer.round_end if checkpointer else None,
                                        round_config=round_config, on_train_replies=report,
                                        poll_interval=fed.grid_pull_interval)
                final = result.arrays if len(result.arrays) else initial  # empty when no round updated the model
            except (RunFailed, ClientHalfMissing) as err:
                failure = err if isinstance(err, RunFailed) else RunFailed(str(err))
                updated = [h for h in strategy.history if h.updated]
                final = R.to_record(strategy.current) if updated and strategy.current is not None else final
        model.load_state_dict(final.to_torch_state_dict())
        torch.save(model.state_dict(), out / "model.pt")
        if fed.learning_curve:
            plots.write_learning_curve(writer.rows, out, f"{fed.method} on {fed.task}")
    except BaseException as err:  # anything else (a crash, SIGINT/SIGTERM): the run ends failed, with its error
        try:
            write_summary(out, fed, run_config, strategy, writer, time.monotonic() - t0, resumed_after, checkpointer,
                          f"{type(err).__name__}: {err}", report.counts, provenance.resolved(info))
        finally:
            tracker.close("failed")
        log(ERROR, "fedadapt: run FAILED: %s: %s (metrics in %s)", type(err).__name__, err, out)
        raise
    try:
        summary = write_summary(out, fed, run_config, strategy, writer, time.monotonic() - t0, resumed_after,
                                checkpointer, None if failure is None else str(failure), report.counts,
                                provenance.resolved(info))
    finally:
        tracker.close("completed" if failure is None else "failed")
    if failure is not None:
        log(ERROR, "fedadapt: run FAILED: %s (metrics in %s)", failure, out)
        raise failure
    log(INFO, "fedadapt: finished; metrics in %s", out)
    return summary


@app.main()
def main(grid: Grid, context: Context) -> None:
    run(grid, dict(context.run_config))
