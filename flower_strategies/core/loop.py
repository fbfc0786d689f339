"""The round loop, once: Flower's ``Strategy.start`` loop, resumable, with per-round hooks and reply polling.

:meth:`FedAdaptStrategy.start <.strategy.FedAdaptStrategy.start>` (a strategy in a user's ServerApp) and the fedadapt
ServerApp both run :func:`run_rounds`.  Beyond Flower's loop (which always starts at round 1) it can start after a
checkpointed round (``start_round``; no round-0 evaluation then), call ``on_round_end`` once a round's evaluation
is done (checkpoints), add per-round entries to the train config, show the train replies to the app, and poll for
replies at the app's interval (:func:`exchange`).  After each round's central evaluation and at the end it applies
the run-failure policy (:mod:`.policy`).  Two loops stay Flower's own: a Flower wrapper's ``start`` (e.g. its DP
wrappers) around a fedadapt strategy, and the SecAgg+ workflow (docs/architecture.md, "One round loop").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO
from typing import Any, Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from . import records as R
from .policy import Checked, check_strategy


class Looped(Checked, Protocol):
    """What the loop drives (:class:`~.strategy.FedAdaptStrategy`): Flower's four strategy steps, plus the run's
    length and its settings summary."""

    num_rounds: int | None

    def summary(self) -> None: ...

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]: ...

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]: ...

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]: ...

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None: ...


def own_loop_config(config: Mapping[str, Any] | None = None) -> ConfigRecord:
    """A copy of ``config`` marked as handed to ``configure_train`` by a fedadapt round loop (:data:`.records.
    OWN_LOOP`): every round of :func:`run_rounds` and of the legacy adapter carries the mark, a round run by Flower's
    ``Strategy.start`` of a wrapper does not (:func:`.privacy.flower_dp_wrapper`).  A wrapper of your own that is not a
    DP wrapper passes ``train_config=own_loop_config()`` to its ``start()``; a loop of your own hands
    ``configure_train`` ``own_loop_config(config)``."""
    return ConfigRecord({**(config or {}), R.OWN_LOOP: True})


def exchange(grid: Grid, messages: Iterable[Message], timeout: float, interval: float = 0.0) -> list[Message]:
    """``grid.send_and_receive(messages, timeout=timeout)``, polling for replies every ``interval`` seconds
    (``Grid.push_messages`` / ``Grid.pull_messages``, both public API): Flower's deployment grid sleeps a fixed 3 s
    between polls, its in-memory simulation grid 0.1 s — most of a short round.  ``interval <= 0``, or a grid that
    answers at push time (``answers_at_push = True``, the in-process engine): the grid's own ``send_and_receive``."""
    messages = list(messages)
    if interval <= 0 or getattr(grid, "answers_at_push", False):
        return list(grid.send_and_receive(messages, timeout=timeout))
    pending = set(grid.push_messages(messages))
    end = time.time() + timeout
    replies: list[Message] = []
    while pending:
        got = list(grid.pull_messages(pending))
        replies.extend(got)
        pending.difference_update(m.metadata.reply_to_message_id for m in got)
        if not pending or time.time() >= end:
            break
        time.sleep(interval)
    return replies


def run_rounds(
    strategy: Looped,
    grid: Grid,
    initial_arrays: ArrayRecord,
    num_rounds: int,
    timeout: float,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    *,
    start_round: int = 1,
    train_config: ConfigRecord | None = None,
    evaluate_config: ConfigRecord | None = None,
    on_round_end: Callable[[int, ArrayRecord], None] | None = None,
    round_config: Callable[[int], Mapping[str, Any]] | None = None,
    on_train_replies: Callable[[int, list[Message]], None] | None = None,
    poll_interval: float = 0.0,
    flower_log: bool = False,
) -> Result:
    """Rounds ``start_round … num_rounds`` (``start_round > 1``: ``initial_arrays`` are the global arrays after
    round ``start_round − 1`` and the strategy's state was restored with ``load_state_dict``).

    ``train_config`` / ``evaluate_config``: what Flower's ``start`` sends every round (empty when ``None``);
    ``round_config(round)``: extra entries of the round's train ConfigRecord (the app's, beside the strategy's);
    ``on_train_replies(round, replies)`` sees the train replies before the strategy aggregates them;
    ``poll_interval``: seconds between polls for replies (:func:`exchange`); ``flower_log``: log what Flower's
    ``Strategy.start`` logs, in its format (the run's settings, each round's aggregated client evaluate metrics and
    central ``evaluate_fn`` MetricRecord, the final results: :func:`log_start`, :func:`log_result`).  Raises
    :class:`~flower_strategies.core.policy.RunFailed` as :func:`~flower_strategies.core.policy.check_strategy` decides
    (after a round's ``evaluate_fn``, before its ``on_round_end``; and after the last round)."""
    if start_round < 1:
        raise ValueError(f"start_round must be >= 1, got {start_round}")
    strategy.num_rounds = int(num_rounds)
    flog: Callable[..., None] = log if flower_log else _quiet  # the lines only Flower's start logs
    log_start(type(strategy).__name__, (start_round, num_rounds), initial_arrays, train_config, evaluate_config,
              flower_log)
    strategy.summary()
    flog(INFO, "")
    result = Result()
    t_start = time.time()
    if evaluate_fn and start_round == 1:
        res = evaluate_fn(0, initial_arrays)
        flog(INFO, "Initial global evaluation results: %s", res)
        if res is not None:
            result.evaluate_metrics_serverapp[0] = res
    arrays = initial_arrays
    for current_round in range(start_round, num_rounds + 1):
        log(INFO, "")
        log(INFO, "[ROUND %s/%s]", current_round, num_rounds)
        config = own_loop_config({**(train_config or {}), **(round_config(current_round) if round_config else {})})
        replies = exchange(grid, strategy.configure_train(current_round, arrays, config, grid), timeout, poll_interval)
        if on_train_replies is not None:
            on_train_replies(current_round, replies)
        agg_arrays, agg_metrics = strategy.aggregate_train(current_round, replies)
        if agg_arrays is not None:
            result.arrays = agg_arrays
            arrays = agg_arrays
        if agg_metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", agg_metrics)
            result.train_metrics_clientapp[current_round] = agg_metrics
        eval_config = ConfigRecord(dict(evaluate_config or {}))
        eval_replies = exchange(grid, strategy.configure_evaluate(current_round, arrays, eval_config, grid), timeout,
                                poll_interval)
        agg_eval = strategy.aggregate_evaluate(current_round, eval_replies)
        if agg_eval is not None:
            flog(INFO, "\t└──> Aggregated MetricRecord: %s", agg_eval)
            result.evaluate_metrics_clientapp[current_round] = agg_eval
        if evaluate_fn:
            flog(INFO, "Global evaluation")
            res = evaluate_fn(current_round, arrays)
            flog(INFO, "\t└──> MetricRecord: %s", res)
            if res is not None:
                result.evaluate_metrics_serverapp[current_round] = res
        check_strategy(strategy)  # RunFailed: every client failed, or max-idle-rounds rounds updated nothing
        if on_round_end is not None:
            on_round_end(current_round, arrays)
    check_strategy(strategy, final=True)  # RunFailed: no round of the run updated the model
    flog(INFO, "")
    log(INFO, "Strategy execution finished in %.2fs", time.time() - t_start)
    log_result(result, flog)
    return result


def _quiet(*_: Any) -> None:
    """A ``log`` that logs nothing."""


def log_start(name: str, rounds: tuple[int, int], arrays: ArrayRecord, train_config: ConfigRecord | None,
              evaluate_config: ConfigRecord | None, flower_log: bool = True) -> None:
    """The head of Flower's ``Strategy.start`` log (``flower_log``): rounds, the model's size, the two configs; else
    one line naming the first and last of ``rounds`` (``(start_round, num_rounds)``)."""
    start_round, num_rounds = rounds
    if not flower_log:
        log(INFO, "Starting %s strategy at round %d of %d", name, start_round, num_rounds)
        return
    log(INFO, "Starting %s strategy:", name)
    log(INFO, "\t├── Number of rounds: %d", num_rounds)
    log(INFO, "\t├── ArrayRecord (%.2f MB)", sum(len(a.data) for a in arrays.values()) / (1024**2))
    for kind, config in (("train", train_config), ("evaluate", evaluate_config)):
        shown = ", ".join(f"'{k}': {'<bytes>' if isinstance(v, bytes) else v}" for k, v in (config or {}).items())
        log(INFO, "\t├── ConfigRecord (%s): %s", kind, f"{{{shown}}}" if config else "(empty!)")


def log_result(result: Result, say: Callable[..., None] = log) -> None:
    """The tail of Flower's ``Strategy.start`` log: the :class:`Result` (its arrays' size and every round's
    metrics), line by line, through ``say``."""
    say(INFO, "")
    say(INFO, "Final results:")
    say(INFO, "")
    for line in str(result).splitlines():
        say(INFO, "\t%s", line)
    say(INFO, "")
