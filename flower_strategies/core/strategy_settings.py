"""A strategy's run settings: the keyword arguments it takes (:data:`SETTINGS`), the one validated
:class:`~.hparams.StrategyConfig` they make (:func:`strategy_settings`), and a setting's name on a strategy
(``strategy.client_lr``) as an AttributeError that says where the setting lives (``strategy.settings``) and how to
change it (``settings.replace``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from .hparams import StrategyConfig

#: The settings a strategy takes as keyword arguments (``FedAvg(client_lr=0.1)``) and reads as ``self.settings.x``;
#: ``method`` is the class's registry name and ``weighting`` resolves ``"default"`` to the method's own (see
#: :attr:`~.strategy.FedAdaptStrategy.weighting`).
SETTINGS = frozenset(f.name for f in dataclasses.fields(StrategyConfig)) - {"method", "num_server_rounds"}


def strategy_settings(owner: str, settings: StrategyConfig | None, method: str,
                      overrides: Mapping[str, Any]) -> StrategyConfig:
    """``settings`` (default ``StrategyConfig(method=method)``) with ``overrides`` (settings fields by name) applied
    in one validated replace; an unknown name is a TypeError naming ``owner`` (the strategy class) and the settings."""
    unknown = sorted(set(overrides) - SETTINGS)
    if unknown:
        raise TypeError(f"{owner}() got unknown setting(s) {unknown}; settings: {', '.join(sorted(SETTINGS))}")
    changes = dict(overrides)
    if "weighting" in changes and changes["weighting"] is None:
        changes["weighting"] = "default"
    base = settings if settings is not None else StrategyConfig(method=method)
    return base.replace(**changes) if changes else base


class InSettings:
    """Descriptor: reading or assigning the setting ``name`` on a strategy raises the AttributeError that points to
    ``strategy.settings``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _error(self, owner: type) -> AttributeError:
        return AttributeError(f"{owner.__name__} keeps its run settings in .settings: read strategy.settings."
                              f"{self.name}; change it with strategy.settings = strategy.settings.replace("
                              f"{self.name}=...) (validated)")

    def __get__(self, obj: Any, owner: type) -> Any:
        raise self._error(owner)

    def __set__(self, obj: Any, value: Any) -> None:
        raise self._error(type(obj))


def point_to_settings(cls: type, names: Iterable[str]) -> None:
    """Make each of ``names`` on ``cls`` an :class:`InSettings`."""
    for name in names:
        setattr(cls, name, InSettings(name))


def client_settings_line(s: StrategyConfig, apps_clients: bool) -> str:
    """The client-side settings as a strategy's summary shows them.  fedadapt's ServerApp runs fedadapt's ClientApp,
    which trains as they say; in a user's app (``apps_clients``: :meth:`~.strategy.FedAdaptStrategy.start`, another
    strategy's, a user's ServerApp) the app's own ClientApp decides its optimizer, batch size and loop: only the lr
    it is sent (``rnd.lr``) and the batches ``rnd.loader`` yields come from here."""
    if not apps_clients:
        return (f"client-lr {s.client_lr} | local-steps {s.local_steps} | local-epochs {s.local_epochs} | "
                f"batch-size {s.batch_size}")
    plan = (f"local-steps {s.local_steps} batches" if s.local_steps else
            f"local-epochs {s.local_epochs} × ⌈n / batch-size {s.batch_size}⌉ batches")
    return (f"client-side (the app decides): client-lr {s.client_lr} sent as rnd.lr; rnd.loader yields {plan} "
            f"of the app's loader; the clients' num-steps and train-loss follow in each round's MetricRecord")
