"""The ServerApp's round loop: Flower's ``Strategy.start`` loop, resumable and with a per-round hook.

Flower's loop always starts at round 1; a resumed run must start after the checkpointed round (and skip the
round-0 evaluation), and checkpoints are written once a round's evaluation is done.  This is the one place
that loop lives; a strategy used in someone else's ServerApp runs under Flower's own ``start``.  Both apply the
same run-failure policy (:mod:`flower_strategies.core.policy`): after each round's evaluation and at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from logging import INFO

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from flower_strategies.core.policy import check_strategy
from flower_strategies.core.strategy import FedAdaptStrategy


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
    strategy: FedAdaptStrategy,
    grid: Grid,
    initial_arrays: ArrayRecord,
    num_rounds: int,
    timeout: float,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    *,
    start_round: int = 1,
    on_round_end: Callable[[int, ArrayRecord], None] | None = None,
    round_config: Callable[[int], Mapping[str, Any]] | None = None,
    on_train_replies: Callable[[int, list[Message]], None] | None = None,
    poll_interval: float = 0.0,
) -> Result:
    """Rounds ``start_round … num_rounds`` (``start_round > 1``: ``initial_arrays`` are the global arrays after
    round ``start_round − 1`` and the strategy's state was restored with ``load_state_dict``).

    ``round_config(round)``: extra entries of the round's train ConfigRecord (the app's, beside the strategy's);
    ``on_train_replies(round, replies)`` sees the train replies before the strategy aggregates them;
    ``poll_interval``: seconds between polls for replies (:func:`exchange`).  Raises
    :class:`~flower_strategies.core.policy.RunFailed` as :func:`~flower_strategies.core.policy.check_strategy` decides
    (after a round's ``evaluate_fn``, before its ``on_round_end``; and after the last round)."""
    if start_round < 1:
        raise ValueError(f"start_round must be >= 1, got {start_round}")
    strategy.num_rounds = int(num_rounds)
    log(INFO, "Starting %s strategy at round %d of %d", type(strategy).__name__, start_round, num_rounds)
    with strategy.driven():  # fedadapt's own driver (core/privacy.py: summary() outside it means a wrapper)
        strategy.summary()
    result = Result()
    t_start = time.time()
    if evaluate_fn and start_round == 1:
        res = evaluate_fn(0, initial_arrays)
        if res is not None:
            result.evaluate_metrics_serverapp[0] = res
    arrays = initial_arrays
    for current_round in range(start_round, num_rounds + 1):
        log(INFO, "")
        log(INFO, "[ROUND %s/%s]", current_round, num_rounds)
        extra = ConfigRecord(dict(round_config(current_round))) if round_config else ConfigRecord()
        replies = exchange(grid, strategy.configure_train(current_round, arrays, extra, grid), timeout, poll_interval)
        if on_train_replies is not None:
            on_train_replies(current_round, replies)
        agg_arrays, agg_metrics = strategy.aggregate_train(current_round, replies)
        if agg_arrays is not None:
            result.arrays = agg_arrays
            arrays = agg_arrays
        if agg_metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", agg_metrics)
            result.train_metrics_clientapp[current_round] = agg_metrics
        eval_replies = exchange(grid, strategy.configure_evaluate(current_round, arrays, ConfigRecord(), grid), timeout,
                                poll_interval)
        agg_eval = strategy.aggregate_evaluate(current_round, eval_replies)
        if agg_eval is not None:
            result.evaluate_metrics_clientapp[current_round] = agg_eval
        if evaluate_fn:
            res = evaluate_fn(current_round, arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[current_round] = res
        check_strategy(strategy)  # RunFailed: every client failed, or max-idle-rounds rounds updated nothing
        if on_round_end is not None:
            on_round_end(current_round, arrays)
    check_strategy(strategy, final=True)  # RunFailed: no round of the run updated the model
    log(INFO, "Strategy execution finished in %.2fs", time.time() - t_start)
    return result
