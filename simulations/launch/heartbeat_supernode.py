"""``flower-supernode`` with a chosen heartbeat interval, and optionally a shorter idle poll
(``python -m simulations.launch.heartbeat_supernode SECONDS [--idle-poll S] <flower-supernode arguments>``;
:func:`.modes.deploy_cluster` uses it with ``heartbeat_interval=`` / ``idle_poll=``).

A SuperNode tells the SuperLink how often it will send a heartbeat; the SuperLink marks it offline 2 intervals after
the last one it got and then answers the messages still waiting for that node with a "node unavailable" error.  Flower
1.42's SuperNode always announces (and keeps) 30 s (``flwr.common.constant.HEARTBEAT_DEFAULT_INTERVAL``) and has no
flag to change it, so a lost node is noticed up to a minute late; the SuperLink accepts any interval from 10 s to
30 min.  This runs the very same ``flower-supernode`` with that constant set to ``SECONDS`` in the two modules that read
it (the node's Fleet API connection: what it announces; the heartbeat sender: how often it sends), nothing else.

An idle SuperNode asks the SuperLink for messages every 3 s: a literal ``time.sleep(3)`` in its loop
(``flwr.supernode.start_client_internal``), with no flag either, so each exchange of a run waits up to 3 s before a
node even sees its message.  ``--idle-poll S`` makes that one sleep ``S`` seconds (more requests to the SuperLink while
idle, a shorter wait for each message); every other sleep of the loop is unchanged.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Iterator, Mapping
from types import CodeType
from typing import Any

#: The idle sleep of Flower 1.42's SuperNode loop, as written in ``flwr.supernode.start_client_internal``.
IDLE_SLEEP_S = 3


def _read_at_call_time(module: Any, name: str) -> bool:
    """Whether code defined in ``module`` (its functions, methods and the functions nested in them, decorators
    unwrapped) reads the global ``name`` when it runs, so that setting the module attribute changes what it does (a
    default argument or a copy taken at import would not see it)."""
    def codes(code: CodeType) -> Iterator[CodeType]:
        yield code
        for const in code.co_consts:
            if isinstance(const, CodeType):
                yield from codes(const)

    def functions(ns: Mapping[str, Any]) -> Iterator[Any]:
        for value in ns.values():
            if inspect.isclass(value) and value.__module__ == module.__name__:
                yield from functions(vars(value))
                continue
            fn = inspect.unwrap(value) if callable(value) else None
            if inspect.isfunction(fn) and fn.__module__ == module.__name__:
                yield fn

    return any(name in code.co_names for fn in functions(vars(module)) for code in codes(fn.__code__))


def set_heartbeat_interval(seconds: float) -> None:
    """Make this process's SuperNode announce (and keep) ``seconds`` instead of Flower's 30 s; ``SystemExit`` naming
    the module when the patch would not take effect (the constant gone, or no code there reading it at run time)."""
    from flwr.common import constant

    try:
        from flwr.supercore import heartbeat  # flwr 1.42 internals: the modules holding the interval
        from flwr.supernode import fleet_http_connection
    except ImportError as err:
        raise SystemExit(f"the heartbeat patch's modules are missing ({err}; not flwr 1.42?)") from err

    low, high = constant.HEARTBEAT_MIN_INTERVAL, constant.HEARTBEAT_MAX_INTERVAL
    if not low <= seconds <= high:
        raise SystemExit(f"heartbeat interval {seconds} s: the SuperLink accepts {low} to {high} s")
    for module in (heartbeat, fleet_http_connection):
        if not hasattr(module, "HEARTBEAT_DEFAULT_INTERVAL"):  # a Flower upgrade moved it: fail, do not ignore
            raise SystemExit(f"{module.__name__} has no HEARTBEAT_DEFAULT_INTERVAL (not flwr 1.42?)")
        if not _read_at_call_time(module, "HEARTBEAT_DEFAULT_INTERVAL"):
            raise SystemExit(f"no code in {module.__name__} reads HEARTBEAT_DEFAULT_INTERVAL when it runs: setting "
                             f"it would not change the heartbeat (not flwr 1.42?)")
        module.HEARTBEAT_DEFAULT_INTERVAL = seconds  # type: ignore[attr-defined]
        if seconds != module.HEARTBEAT_DEFAULT_INTERVAL:
            raise SystemExit(f"{module.__name__}.HEARTBEAT_DEFAULT_INTERVAL did not take {seconds} s")


class _IdlePollClock:
    """Stands in for the ``time`` module inside the SuperNode loop's module: ``sleep(3)`` sleeps ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def sleep(self, seconds: float) -> None:
        time.sleep(self.seconds if seconds == IDLE_SLEEP_S else seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def set_idle_poll(seconds: float) -> None:
    """Make this process's SuperNode ask for messages every ``seconds`` while idle instead of every 3 s."""
    try:
        from flwr.supernode import start_client_internal  # flwr 1.42 internals: the loop with the idle sleep
    except ImportError as err:
        raise SystemExit(f"the idle-poll patch's module is missing ({err}; not flwr 1.42?)") from err

    if not 0 < seconds <= IDLE_SLEEP_S:
        raise SystemExit(f"idle poll {seconds} s: expected more than 0 and at most {IDLE_SLEEP_S} s")
    if f"time.sleep({IDLE_SLEEP_S})" not in inspect.getsource(start_client_internal):  # a Flower upgrade changed it
        raise SystemExit(f"{start_client_internal.__name__} has no time.sleep({IDLE_SLEEP_S}) (not flwr 1.42?)")
    if not _read_at_call_time(start_client_internal, "time"):
        raise SystemExit(f"no code in {start_client_internal.__name__} reads its 'time' module when it runs "
                         f"(not flwr 1.42?)")
    start_client_internal.time = _IdlePollClock(seconds)  # type: ignore[assignment]
    if getattr(start_client_internal.time, "seconds", None) != seconds:
        raise SystemExit(f"{start_client_internal.__name__}.time did not take the idle poll of {seconds} s")


def main() -> None:
    """``flower-supernode`` (the arguments after ``SECONDS [--idle-poll S]``, from ``sys.argv``) announcing
    ``SECONDS``."""
    set_heartbeat_interval(float(sys.argv.pop(1)))
    if sys.argv[1:2] == ["--idle-poll"]:
        set_idle_poll(float(sys.argv[2]))
        del sys.argv[1:3]
    from flwr.supernode.cli import flower_supernode

    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
