"""Node-local persistence of a method's client state, so that a resumed run continues it exactly.

In Flower 1.42 ``Context.state`` belongs to one run: a run resumed from a checkpoint (``resume=``, a new
``flwr run``) meets empty ``Context.state`` on every SuperNode, and SCAFFOLD's ``c_i`` or Fed-LAMB's ``m`` would
silently restart.  So the method's client state (the ``fedadapt.<name>`` records of ``Context.state``, see
:func:`flower_strategies.core.client.save_client_state`) is also kept on the node's disk, keyed by the *run*:

* The ServerApp (``checkpoint-every > 0``) sends in every round's ConfigRecord (keys: :mod:`app_common.wire`)
  ``client-state-key`` = the run token (hex, generated at the run's first start, kept in the checkpoint and sent
  again by a resumed run; a fresh run with the same ``run-name`` gets a new one, so it never picks up stale state)
  and ``client-state-keep`` = the last round whose checkpoint was written (a resume continues after it).
* The ClientApp of a node with a client-state directory (node config ``client-state-dir``, else the environment
  variable ``FEDADAPT_CLIENT_STATE_DIR``) keeps ``<dir>/<token>/client-<id>/round-<r>.base-<b>.run-<flwr run>.npz``
  (``id`` = partition id, else node id; ``b`` = ``client-state-base``, the round the run resumed after).  Before
  training round ``t`` it loads the newest valid file into ``Context.state``: one of this Flower run for a round
  ``< t``, or one of an earlier (interrupted) run for a round ``<= b``; what the interrupted run wrote after the
  checkpoint (possibly late, while its in-flight messages still ran) is deleted, never used.  After training it
  writes its file atomically and deletes those no resume can need any more (older than the newest one with
  ``r <= keep``).

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

from app_common.wire import CLIENT_STATE_KEY
from flower_strategies.core import records as R

NODE_CONFIG_KEY = "client-state-dir"
ENV_VAR = "FEDADAPT_CLIENT_STATE_DIR"
FORMAT = "fedadapt-client-state"
_TOKEN = re.compile(r"[0-9a-f]{8,64}")
_FILE = re.compile(r"round-(\d+)\.base-(\d+)\.run-(\d+)\.npz")


def state_root(context: Context) -> Path | None:
    """The node's client-state directory: node config ``client-state-dir``, else ``$FEDADAPT_CLIENT_STATE_DIR``."""
    where = context.node_config.get(NODE_CONFIG_KEY) or os.environ.get(ENV_VAR)
    return Path(str(where)).expanduser() if where else None


class ClientStateStore:
    """The saved client state of one client (``client``) of one run (``token``) under ``root``."""

    def __init__(self, root: Path, token: str, client: int) -> None:
        if not _TOKEN.fullmatch(token):
            raise ValueError(f"{CLIENT_STATE_KEY} must be 8-64 lowercase hex digits, got {token!r}")
        self.token, self.client = token, int(client)
        self.dir = Path(root) / token / f"client-{self.client}"

    def files(self) -> list[tuple[int, int, int, Path]]:
        """``(round, base, flwr run id, path)`` of every saved state, oldest first."""
        if not self.dir.is_dir():
            return []
        return sorted((int(m.group(1)), int(m.group(2)), int(m.group(3)), p)
                      for p in self.dir.iterdir() if (m := _FILE.fullmatch(p.name)))

    def rounds(self) -> list[int]:
        return [f[0] for f in self.files()]

    def path(self, server_round: int, base: int = 0, run_id: int = 0) -> Path:
        return self.dir / f"round-{server_round}.base-{base}.run-{run_id}.npz"

    def load(self, state: RecordDict, server_round: int, run_id: int = 0, base: int = 0) -> str:
        """Put the newest valid saved state from before ``server_round`` into ``state`` (replacing its
        ``fedadapt.*`` records) and delete the invalid files.  Valid: written by this Flower run (``run_id``) for an
        earlier round, or by an earlier run of the same run token for a round <= ``base`` (the round this run
        resumed after): what an interrupted run wrote after its checkpoint, even late, is never used.  Returns
        ``"disk"`` (loaded), ``"memory"`` (nothing on disk, ``state`` already holds this run's records) or
        ``"fresh"``."""
        valid = []
        for r, b, run, path in self.files():
            if r < server_round and (run == run_id or r <= base):
                valid.append(((r, run == run_id, b), path))
            else:
                path.unlink(missing_ok=True)
        held = any(name.startswith(R.STATE_PREFIX) for name in state.array_records)
        if not valid:
            return "memory" if held else "fresh"
        newest = max(valid)[1]
        try:
            records = self.read(newest)
        except ValueError as err:
            log(WARNING, "fedadapt: unreadable client state %s (%s); this client continues without it", newest, err)
            return "memory" if held else "fresh"
        for name in [n for n in state.array_records if n.startswith(R.STATE_PREFIX)]:
            del state[name]
        for name, arrays in records.items():
            state[name] = R.to_record(arrays)
        return "disk"

    def save(self, state: RecordDict, server_round: int, keep: int, run_id: int = 0, base: int = 0) -> None:
        """Write ``state``'s ``fedadapt.*`` records as the state after ``server_round`` (atomically); delete the
        files no resume can need (older than the newest one of a round <= ``keep``, the last checkpointed round)."""
        records = {n: rec for n, rec in state.array_records.items() if n.startswith(R.STATE_PREFIX)}
        if not records:
            return
        from flower_strategies.core.checkpoint import write_atomic  # the server's writer, loaded when first needed

        write_atomic(self.path(server_round, base, run_id), self.encode(records, server_round))
        files = self.files()
        kept = [f[0] for f in files if f[0] <= keep]
        oldest = kept[-1] if kept else 0
        for r, _, _, path in files:
            if r < oldest:
                path.unlink(missing_ok=True)

    def encode(self, records: Mapping[str, ArrayRecord], server_round: int) -> bytes:
        import io

        members: dict[str, np.ndarray] = {}
        entries: list[list[str]] = []
        for name, rec in records.items():
            for key, arr in R.to_numpy(rec).items():
                members[str(len(entries))] = arr
                entries.append([name, key])
        meta = {"format": FORMAT, "token": self.token, "client": self.client, "round": int(server_round),
                "entries": entries}
        members["meta"] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
        buf = io.BytesIO()
        np.savez(buf, **members)  # type: ignore[arg-type]  # numpy stubs type **kwds as its bool flag
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
    persistence (no ``client-state-key``: the run writes no checkpoints) or the node has no client-state
    directory."""
    token = config.get(CLIENT_STATE_KEY)
    if not token:
        return None
    root = state_root(context)
    if root is None:
        log(WARNING, "fedadapt: this node has no client-state directory (node config %s or $%s): its client state "
            "lives only as long as this run; a resumed run restarts it", NODE_CONFIG_KEY, ENV_VAR)
        return None
    return ClientStateStore(root, str(token), client)
