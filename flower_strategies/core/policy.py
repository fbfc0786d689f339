"""The run-failure policy: a run that trains nothing ends failed, whichever loop runs it.

After every round (and at the end of the run) :func:`check_progress` reads the strategy's round history and raises
:class:`RunFailed` when

* every sampled client failed in the last round (its message names the first client error);
* the last ``max-idle-rounds`` rounds updated nothing (every reply rejected or missing; it names the rejections);
* the server rejected more than half of the sampled replies in each of the last ``max-rejected-rounds`` rounds (a
  run that is mostly attack, or whose root update or settings reject the honest replies: it names the rejections
  counted by kind, instead of completing at the model the attackers left);
* at the end of the run (``final``), no round of the run updated the model.

One policy, applied in two places: the round loop (:func:`.loop.run_rounds`, which runs
:meth:`FedAdaptStrategy.start <.strategy.FedAdaptStrategy.start>` and the fedadapt ServerApp) and the legacy adapter
(:class:`~flower_strategies.compat.legacy.LegacyStrategy`).
``max-idle-rounds`` and ``max-rejected-rounds`` are strategy settings (:class:`~.hparams.StrategyConfig`).
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

    @property
    def max_rejected_rounds(self) -> int: ...


class Checked(Protocol):
    """What the policy reads of a strategy (:class:`~.strategy.FedAdaptStrategy`): its round history and the
    ``max-idle-rounds`` / ``max-rejected-rounds`` settings."""

    @property
    def history(self) -> Sequence[RoundLog]: ...

    @property
    def settings(self) -> _IdleSetting: ...


class RunFailed(RuntimeError):
    """The run trained nothing (or stopped training): it ends failed, with the reason."""


#: Rejections that are the clients' own failures, not the server's refusals (the "every client failed" rule).
FAILURES = (Kind.CLIENT_ERROR, Kind.MOD_REFUSED)
#: Rejections ``max-rejected-rounds`` does not count: the clients' failures, and Krum / multi-Krum leaving replies out
#: (a selection that drops n − 1 or t replies of every round by design).
NOT_REFUSALS = (*FAILURES, Kind.LEFT_OUT)


def check_progress(history: Sequence[RoundLog], max_idle_rounds: int, *, final: bool = False,
                   max_rejected_rounds: int = 0) -> None:
    """Raise :class:`RunFailed` when every client failed in the last round, when the last ``max_idle_rounds`` rounds
    updated nothing (0 = never), when the server rejected more than half of the sampled replies in each of the last
    ``max_rejected_rounds`` rounds (0 = never; client failures and Krum's selection do not count), or (``final``) when
    no round of the run updated the model."""
    if not history:
        return
    last = history[-1]
    errors = [r for r in last.rejections if r.kind in (Kind.CLIENT_ERROR, Kind.MOD_REFUSED)]
    if not last.updated and last.replies_used == 0 and errors and len(errors) == last.replies_rejected:
        raise RunFailed(f"round {last.server_round}: every client failed; first error: {errors[0]}"
                        f"{mod_refusal_hint(errors[0])}")
    if len(history) == 1 and not last.updated and last.replies_used == 0 and last.rejections and all(
            r.kind is Kind.UNTRUSTED for r in last.rejections):
        raise RunFailed(
            f"round {last.server_round}, the run's first: every reply ({last.replies_rejected}) was rejected for its "
            f"trust (its update points away from the server's own root-set update): the root update, not the "
            f"clients, is the likely fault. Check that root_update (1) loads the round's broadcast model "
            f"(content['arrays']) before training, every round; (2) returns the trained model, not its difference, "
            f"as named NumPy arrays under the clients' record names (e.g. {{'arrays': ...}}); (3) trains with the "
            f"method's client half and the clients' loss and learning rate, on examples of the clients' "
            f"distribution. flower_strategies.root_update_from(model, loader, loss_fn) builds one that does "
            f"(FedAdaptStrategy.root_update's docstring, docs/robustness.md). First rejection: {last.rejections[0]}")
    idle = 0
    for h in reversed(history):
        if h.updated:
            break
        idle += 1
    if max_idle_rounds and idle >= max_idle_rounds:
        raise RunFailed(f"the last {idle} rounds updated nothing (max-idle-rounds = {max_idle_rounds}); round "
                        f"{last.server_round}: {what_happened(last)}")
    refused = 0
    for h in reversed(history):
        if 2 * sum(r.kind not in NOT_REFUSALS for r in h.rejections) <= h.sampled:
            break
        refused += 1
    if max_rejected_rounds and refused >= max_rejected_rounds:
        rounds = history[-refused:]
        kinds: dict[str, int] = {}
        for r in (r for h in rounds for r in h.rejections if r.kind not in NOT_REFUSALS):
            kinds[r.kind.value] = kinds.get(r.kind.value, 0) + 1
        counts = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
        raise RunFailed(
            f"the server rejected more than half of the sampled replies in each of the last {refused} rounds "
            f"(max-rejected-rounds = {max_rejected_rounds}): {sum(kinds.values())} of "
            f"{sum(h.sampled for h in rounds)} replies rejected, by kind: {counts}. Most clients are attacking, or "
            f"the server's own reference rejects honest replies (defence = robust: check the root update, "
            f"docs/robustness.md); round {last.server_round}: {what_happened(last)}")
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
    check_progress(strategy.history, strategy.settings.max_idle_rounds, final=final,
                   max_rejected_rounds=strategy.settings.max_rejected_rounds)


