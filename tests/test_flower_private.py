"""Flower's private attributes are touched in one module only, core/records.py, each through a path an import probe
checks against a public twin (issue 49, item 7)."""

from __future__ import annotations

import re
from pathlib import Path

from flwr.app import Metadata

from flower_strategies.core import records as R

ROOT = Path(__file__).resolve().parents[1]
PRIVATE = re.compile(
    r"""\.__dict__\s*\[|\.__dict__\.update\(|["']_(message_id|reply_to_message_id|data|is_dirty)["']""")


def test_only_records_touches_flowers_private_attributes():
    """(The deployment's guarded SuperLink replaces a private *function* of Flower's SuperLink in its own process and
    checks itself at start-up; docs/deployment.md.  It sets no attribute of a Flower object.)"""
    touching = sorted({p.relative_to(ROOT).as_posix()
                       for pkg in ("flower_strategies", "app_common", "client_app", "server_app", "simulations")
                       for p in (ROOT / pkg).rglob("*.py") if PRIVATE.search(p.read_text())})
    assert touching == ["flower_strategies/core/records.py"]


def sample() -> Metadata:
    return Metadata(run_id=7, message_id="", src_node_id=0, dst_node_id=4, reply_to_message_id="", group_id="1",
                    created_at=12.5, ttl=30.0, message_type="train")


def test_a_message_id_is_set_the_same_way_by_the_private_write_and_its_public_twin():
    ours, theirs = sample(), sample()
    R._write_message_id(ours, "abc")
    R._construct_message_id(theirs, "abc")
    assert ours.message_id == theirs.message_id == "abc" and vars(ours) == vars(theirs)
    kept = (theirs.run_id, theirs.dst_node_id, theirs.group_id, theirs.created_at, theirs.ttl)
    assert kept == (7, 4, "1", 12.5, 30.0)
    assert R._message_id_path() == (True, None) and R.MESSAGE_ID_WRITE  # flwr 1.42: the probe accepts the write
