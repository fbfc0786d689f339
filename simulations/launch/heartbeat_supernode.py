"""``flower-supernode`` with a chosen heartbeat interval (``python -m simulations.launch.heartbeat_supernode SECONDS
<flower-supernode arguments>``; :func:`.modes.deploy_cluster` uses it with ``heartbeat_interval=``).

A SuperNode tells the SuperLink how often it will send a heartbeat; the SuperLink marks it offline 2 intervals after
the last one it got and then answers the messages still waiting for that node with a "node unavailable" error.  Flower
1.42's SuperNode always announces (and keeps) 30 s (``flwr.common.constant.HEARTBEAT_DEFAULT_INTERVAL``) and has no
flag to change it, so a lost node is noticed up to a minute late; the SuperLink accepts any interval from 10 s to
30 min.  This runs the very same ``flower-supernode`` with that constant set to ``SECONDS`` in the two modules that read
it (the node's Fleet API connection: what it announces; the heartbeat sender: how often it sends), nothing else.
"""

from __future__ import annotations

import sys


def set_heartbeat_interval(seconds: float) -> None:
    """Make this process's SuperNode announce (and keep) ``seconds`` instead of Flower's 30 s."""
    from flwr.common import constant
    from flwr.supercore import heartbeat  # flwr 1.42 internals (pinned): the modules holding the interval
    from flwr.supernode import fleet_http_connection

    low, high = constant.HEARTBEAT_MIN_INTERVAL, constant.HEARTBEAT_MAX_INTERVAL
    if not low <= seconds <= high:
        raise SystemExit(f"heartbeat interval {seconds} s: the SuperLink accepts {low} to {high} s")
    for module in (heartbeat, fleet_http_connection):
        if not hasattr(module, "HEARTBEAT_DEFAULT_INTERVAL"):  # a Flower upgrade moved it: fail, do not ignore
            raise SystemExit(f"{module.__name__} has no HEARTBEAT_DEFAULT_INTERVAL (not flwr 1.42?)")
        module.HEARTBEAT_DEFAULT_INTERVAL = seconds  # type: ignore[attr-defined]


def main() -> None:
    """``flower-supernode`` (the arguments after ``SECONDS``, from ``sys.argv``) announcing ``SECONDS``."""
    set_heartbeat_interval(float(sys.argv.pop(1)))
    from flwr.supernode.cli import flower_supernode

    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
