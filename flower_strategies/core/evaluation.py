"""Client-side evaluation (off by default: ``fraction-evaluate = 0``): the evaluate messages of a round and the
example-weighted means of the replies' metrics, with Flower's own log lines (how many replies came back and failed,
the failures' reasons grouped)."""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log

from flwr.serverapp import Grid

from . import records as R
from .hparams import StrategyConfig
from .rejections import client_error_text
from .rounds import mean_reply_metrics


class ClientEvaluation:
    """Client-side evaluation (off by default: ``fraction-evaluate = 0``), a base of
    :class:`~.strategy.FedAdaptStrategy`: the round's evaluate messages to a sample of nodes, and the example-weighted
    means of their metrics."""

    settings: StrategyConfig
    min_evaluate_nodes: int

    def sample(self, grid: Grid, fraction: float, minimum: int) -> list[int]:
        raise NotImplementedError  # the strategy's sampler (FedAdaptStrategy.sample)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if self.settings.fraction_evaluate <= 0.0:
            return []
        node_ids = self.sample(grid, self.settings.fraction_evaluate, self.min_evaluate_nodes)
        return evaluate_messages(server_round, arrays, config, node_ids)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted means of the clients' evaluation metrics (:func:`aggregate_evaluation`)."""
        return aggregate_evaluation(server_round, replies)


def evaluate_messages(server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                      node_ids: Iterable[int]) -> list[Message]:
    """One evaluate message per node: the model and ``config`` with the round number."""
    content = RecordDict({R.MODEL: arrays, R.CONFIG: ConfigRecord({**config, R.SERVER_ROUND: server_round})})
    return [Message(content, n, MessageType.EVALUATE) for n in node_ids]


def aggregate_evaluation(server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
    """Example-weighted means of the clients' evaluation metrics (each reply's ``"metrics"`` MetricRecord, or its
    only MetricRecord, with ``num-examples`` > 0).  Logs, as Flower's own strategies do, how many replies came back
    and failed (the failures' reasons, grouped), and warns when no reply carried usable metrics."""
    replies = list(replies)
    failed = [m for m in replies if m.has_error()]
    log(INFO, "aggregate_evaluate: Received %d results and %d failures", len(replies) - len(failed), len(failed))
    for line in failure_summary(failed):
        log(INFO, "\t> %s", line)
    usable: list[dict[str, Any]] = []
    for m in replies:
        rec = None if m.has_error() else evaluate_metrics(m.content)
        n = None if rec is None else rec.get(R.NUM_EXAMPLES)
        if rec is not None and isinstance(n, (int, float)) and n > 0:
            usable.append(dict(rec))
    if replies and not usable:
        if len(failed) == len(replies):
            why = f"all {len(failed)} client evaluations failed ({failure_summary(failed)[0]})"
        else:
            why = (f"{len(replies) - len(failed)} client evaluation reply(ies) carried no usable metrics: "
                   f"@app.evaluate() must reply with a MetricRecord under "
                   f"'{R.METRICS}' holding '{R.NUM_EXAMPLES}' > 0, e.g. RecordDict({{'{R.METRICS}': "
                   f"MetricRecord({{'eval_acc': acc, '{R.NUM_EXAMPLES}': n}})}})")
        log(WARNING, "Round %d: no client-side evaluate metrics: %s", server_round, why)
    return MetricRecord({**mean_reply_metrics(usable)}) if usable else None


def evaluate_metrics(content: RecordDict) -> MetricRecord | None:
    """An evaluate reply's metrics: its ``"metrics"`` MetricRecord, else its only MetricRecord, else ``None``."""
    rec = R.get(content, R.METRICS, MetricRecord)
    if rec is not None:
        return rec
    found = [r for _, r in R.of_type(content, MetricRecord)]
    return found[0] if len(found) == 1 else None


def failure_summary(failed: Iterable[Message], width: int = 300) -> list[str]:
    """One line per distinct error reason of ``failed`` replies: how many, from which nodes, the reason (the user's
    exception first, :func:`.rejections.client_error_text`; its first ``width`` characters)."""
    by_reason: dict[str, list[int]] = {}
    for m in failed:
        reason = client_error_text(m.error.reason)
        by_reason.setdefault(reason[:width] + ("…" if len(reason) > width else ""), []).append(m.metadata.src_node_id)
    return [f"{len(nodes)} failure{'s' if len(nodes) > 1 else ''} from node{'s' if len(nodes) > 1 else ''} "
            f"{', '.join(map(str, nodes[:8]))}{', …' if len(nodes) > 8 else ''}: {reason}"
            for reason, nodes in by_reason.items()]
