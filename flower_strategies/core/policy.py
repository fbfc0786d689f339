"""The run-failure policy: a run that trains nothing ends failed, whichever loop runs it.

After every round (and at the end of the run) :func:`check_progress` reads the strategy's round history and raises
:class:`RunFailed` when

* every sampled client failed in the last round (its message names the first client error);
* the last ``max-idle-rounds`` rounds updated nothing (every reply rejected or missing; it names the rejections);
* at the end of the run (``final``), no round of the run updated the model.

One policy, applied in two places: the round loop (:func:`.loop.run_rounds`, which runs
:meth:`FedAdaptStrategy.start <.strategy.FedAdaptStrategy.start>` and the fedadapt ServerApp) and the legacy adapter
(:class:`~flower_strategies.compat.legacy.LegacyStrategy`).
``max-idle-rounds`` is a strategy setting (:class:`~.hparams.StrategyConfig`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .privacy import mod_refusal_hint
from .rejections import Kind
from .rounds import RoundLog

__all__ = ["RunFailed", "check_progress", "check_strategy", "what_happened"]

#: How many rejection reasons a failure message quotes.
QUOTED = 3


class _IdleSetting(Protocol):
    @property
    def max_idle_rounds(self) -> int: ...


class Checked(Protocol):
    """What the policy reads of a strategy (:class:`~.strategy.FedAdaptStrategy`): its round history and the
    ``max-idle-rounds`` setting."""

    @property
    def history(self) -> Sequence[RoundLog]: ...

    @property
    def settings(self) -> _IdleSetting: ...


class RunFailed(RuntimeError):
    """The run trained nothing (or stopped training): it ends failed, with the reason."""


def check_progress(history: Sequence[RoundLog], max_idle_rounds: int, *, final: bool = False) -> None:
    """Raise :class:`RunFailed` when every client failed in the last round, when the last ``max_idle_rounds`` rounds
    updated nothing (0 = never), or (``final``) when no round of the run updated the model."""
    if not history:
        return
    last = history[-1]
    errors = [r for r in last.rejections if r.kind in (Kind.CLIENT_ERROR, Kind.MOD_REFUSED)]
    if not last.updated and last.replies_used == 0 and errors and len(errors) == last.replies_rejected:
        raise RunFailed(f"round {last.server_round}: every client failed; first error: {errors[0]}"
                        f"{mod_refusal_hint(errors[0])}")
    idle = 0
    for h in reversed(history):
        if h.updated:
            break
        idle += 1
    if max_idle_rounds and idle >= max_idle_rounds:
        raise RunFailed(f"the last {idle} rounds updated nothing (max-idle-rounds = {max_idle_rounds}); round "
                        f"{last.server_round}: {what_happened(last)}")
    if final and idle == len(history):
        raise RunFailed(f"no round of the run updated the model ({len(history)} rounds); last round "
                        f"{last.server_round}: {what_happened(last)}")


def what_happened(round_log: RoundLog) -> str:
    """Why round ``round_log`` updated nothing, in words: its rejections with their first reasons, the sampled nodes
    that sent no reply, and replies that were used without an update."""
    parts = []
    rejected, used, sampled = round_log.replies_rejected, round_log.replies_used, round_log.sampled
    if rejected:
        parts.append(f"{rejected} replies rejected ({'; '.join(map(str, round_log.rejections[:QUOTED]))})")
    missing = sampled - used - rejected
    if missing > 0:
        parts.append(f"{missing} of {sampled} sampled nodes sent no reply (lost, or too slow for round-timeout)")
    if used:
        parts.append(f"{used} valid replies but no model update (fewer than min-replies, or the server "
                     f"update was not finite; see the round's warnings)")
    return "; ".join(parts) or f"no reply arrived ({sampled} nodes sampled)"


def check_strategy(strategy: Checked, *, final: bool = False) -> None:
    """:func:`check_progress` on ``strategy``'s history with its ``max_idle_rounds`` setting."""
    check_progress(strategy.history, strategy.settings.max_idle_rounds, final=final)


