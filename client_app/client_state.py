"""Node-local persistence of a method's client state, so that a resumed run continues it exactly.

In Flower 1.42 ``Context.state`` belongs to one run: a run resumed from a checkpoint (``resume=``, a new
``flwr run``) meets empty ``Context.state`` on every SuperNode, and SCAFFOLD's ``c_i`` or Fed-LAMB's ``m`` would
silently restart.  So the method's client state (the ``fedadapt.<name>`` records of ``Context.state``, see
:func:`flower_strategies.core.client.save_client_state`) is also kept on the node's disk, keyed by the *run*:

* The ServerApp (``checkpoint-every > 0``) sends in every round's ConfigRecord :data:`KEY` = the run token (hex,
  generated at the run's first start, kept in the checkpoint and sent again by a resumed run; a fresh run with the
  same ``run-name`` gets a new one, so it never picks up stale state) and :data:`KEEP` = the last round whose
  checkpoint was written (a resume continues after it).
* The ClientApp of a node with a client-state directory (node config ``client-state-dir``, else the environment
  variable ``FEDADAPT_CLIENT_STATE_DIR``) keeps ``<dir>/<token>/client-<id>/round-<r>.npz`` (``id`` = partition id,
  else node id).  Before training round ``t`` it loads the file with the largest ``r < t`` into ``Context.state``
  (files with ``r >= t`` were written after the checkpoint the run resumed from, by the interrupted run: deleted);
  after training it writes ``round-<t>.npz`` atomically and deletes the files no resume can need any more (those
  older than the newest one with ``r <= keep``).

File format: an ``.npz`` archive (read with ``allow_pickle=False``: data only) of members ``"0"``, ``"1"``, … and
``"meta"``, a UTF-8 JSON document stored as ``uint8`` (format, token, client id, round, ``[[record, key], …]``).
A node restarted with an empty disk (or without a client-state directory) cannot continue its state: its client
starts afresh and reports ``client-state = "fresh"`` in its reply (the ServerApp prints it after a resume).
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from collections.abc import Mapping
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, RecordDict
from flwr.common import log

from flower_strategies.core import records as R
from flower_strategies.core.checkpoint import write_atomic

#: Round-config key: the run token naming the run's client state (sent only by runs that write checkpoints).
KEY = "client-state-key"
#: Round-config key: the last round whose server checkpoint was written (0: none yet).
KEEP = "client-state-keep"
#: Reply-info key (``fedadapt`` ConfigRecord of a train reply): where the client's state came from this round.
STATUS = "client-state"
NODE_CONFIG_KEY = "client-state-dir"
ENV_VAR = "FEDADAPT_CLIENT_STATE_DIR"
FORMAT = "fedadapt-client-state"
_TOKEN = re.compile(r"[0-9a-f]{8,64}")
_FILE = re.compile(r"round-(\d+)\.npz")


def state_root(context: Context) -> Path | None:
    """The node's client-state directory: node config ``client-state-dir``, else ``$FEDADAPT_CLIENT_STATE_DIR``."""
    where = context.node_config.get(NODE_CONFIG_KEY) or os.environ.get(ENV_VAR)
    return Path(str(where)).expanduser() if where else None


class ClientStateStore:
    """The saved client state of one client (``client``) of one run (``token``) under ``root``."""

    def __init__(self, root: Path, token: str, client: int) -> None:
        if not _TOKEN.fullmatch(token):
            raise ValueError(f"{KEY} must be 8-64 lowercase hex digits, got {token!r}")
        self.token, self.client = token, int(client)
        self.dir = Path(root) / token / f"client-{self.client}"

    def rounds(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _FILE.fullmatch(p.name)))

    def path(self, server_round: int) -> Path:
        return self.dir / f"round-{server_round}.npz"

    def load(self, state: RecordDict, server_round: int) -> str:
        """Put the newest saved state from before ``server_round`` into ``state`` (replacing its ``fedadapt.*``
        records); delete files of rounds >= ``server_round``.  Returns ``"disk"`` (loaded), ``"memory"`` (nothing
        on disk, ``state`` already holds this run's records) or ``"fresh"``."""
        rounds = self.rounds()
        for r in rounds:
            if r >= server_round:  # written by the interrupted run after the checkpoint this run resumed from
                self.path(r).unlink(missing_ok=True)
        before = [r for r in rounds if r < server_round]
        held = any(name.startswith(R.STATE_PREFIX) for name in state.array_records)
        if not before:
            return "memory" if held else "fresh"
        try:
            records = self.read(self.path(before[-1]))
        except ValueError as err:
            log(WARNING, "fedadapt: unreadable client state %s (%s); this client continues without it", self.path(before[-1]), err)
            return "memory" if held else "fresh"
        for name in [n for n in state.array_records if n.startswith(R.STATE_PREFIX)]:
            del state[name]
        for name, arrays in records.items():
            state[name] = R.to_record(arrays)
        return "disk"

    def save(self, state: RecordDict, server_round: int, keep: int) -> None:
        """Write ``state``'s ``fedadapt.*`` records as the state after ``server_round`` (atomically); delete the
        files no resume can need (older than the newest one of a round <= ``keep``) and later ones."""
        records = {n: rec for n, rec in state.array_records.items() if n.startswith(R.STATE_PREFIX)}
        if not records:
            return
        write_atomic(self.path(server_round), self.encode(records, server_round))
        rounds = self.rounds()
        kept = [r for r in rounds if r <= keep]
        oldest = kept[-1] if kept else 0
        for r in rounds:
            if r < oldest or r > server_round:
                self.path(r).unlink(missing_ok=True)

    def encode(self, records: Mapping[str, ArrayRecord], server_round: int) -> bytes:
        import io

        members: dict[str, np.ndarray] = {}
        entries = []
        for name, rec in records.items():
            for key, arr in R.to_numpy(rec).items():
                members[str(len(entries))] = arr
                entries.append([name, key])
        meta = {"format": FORMAT, "token": self.token, "client": self.client, "round": int(server_round),
                "entries": entries}
        members["meta"] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
        buf = io.BytesIO()
        np.savez(buf, **members)
        return buf.getvalue()

    def read(self, path: Path) -> dict[str, dict[str, np.ndarray]]:
        """``{record name: {key: array}}`` of a file written by :meth:`save` (data only; ValueError if not one)."""
        try:
            with np.load(path, allow_pickle=False) as z:
                members = {name: z[name] for name in z.files}
        except (OSError, EOFError, ValueError, zipfile.BadZipFile, AttributeError) as err:
            raise ValueError(f"not a readable client-state file ({err})") from None
        try:
            meta: dict[str, Any] = json.loads(members.pop("meta").tobytes().decode("utf-8"))
            ok = (meta["format"] == FORMAT and meta["token"] == self.token and meta["client"] == self.client
                  and len(meta["entries"]) == len(members))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"bad metadata ({err!r})") from None
        if not ok:
            raise ValueError("written for another run or client, or members missing")
        out: dict[str, dict[str, np.ndarray]] = {}
        for i, (name, key) in enumerate(meta["entries"]):
            if not str(name).startswith(R.STATE_PREFIX) or members[str(i)].dtype.kind not in "biufc":
                raise ValueError(f"entry {name}/{key} is not client-state data")
            out.setdefault(str(name), {})[str(key)] = members[str(i)]
        return out


def store_for(config: Mapping[str, Any], context: Context, client: int) -> ClientStateStore | None:
    """The store of this round's client (``config`` = the round's ConfigRecord), or None when the server asks for no
    persistence (no :data:`KEY`: the run writes no checkpoints) or the node has no client-state directory."""
    token = config.get(KEY)
    if not token:
        return None
    root = state_root(context)
    if root is None:
        log(WARNING, "fedadapt: this node has no client-state directory (node config %s or $%s): its client state "
            "lives only as long as this run; a resumed run restarts it", NODE_CONFIG_KEY, ENV_VAR)
        return None
    return ClientStateStore(root, str(token), client)
