"""Populations of 100,000 clients in the in-process engines: node contexts made on demand, client state out of core.

A run of N nodes used to build N ``Context`` objects (each with its own ``RecordDict``) before round 1 and keep every
client's saved state (SCAFFOLD's ``c_i``, Fed-LAMB's ``m``, …) in them for the whole run.  Here:

* :class:`NodeContexts` (the grids' ``contexts``) is a mapping over the node ids that makes a node's ``Context`` when
  the node is first addressed (node ``i`` of ``1..N`` has ``partition-id = i-1``: the partition is an index, its
  data is loaded or generated when the node trains);
* with a :class:`RowStore` (``LoopbackGrid(state_dir=…)``, automatic above :data:`RESIDENT_LIMIT` nodes), the
  contexts of a round's sampled nodes are released after the round: their ``fedadapt.*`` records are written to the
  store and the ``Context`` is dropped; the next time the node is sampled its context is made again and its state
  read back.  Memory thus grows with the clients sampled per round, not with the population.

:class:`RowStore` keeps one memory-mapped ``.npy`` file per record entry, shape ``(N, *entry shape)``, a row per
client (rows of clients never sampled are never written: the files are sparse, their disk use is what
:meth:`RowStore.disk_bytes` reports), plus ``present.npy`` per record layout (which rows hold state).  The arrays go
in and come out with their dtype and bytes unchanged, so a run with the store gives the same bits as one without it.
Resuming a run is what it always was: runs that write checkpoints also keep each client's state in the node's
client-state directory (:mod:`client_app.client_state`), which :func:`client_app.app.begin_train` reads; the store is
flushed (:meth:`RowStore.flush`) whenever the grid releases contexts.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, RecordDict

from flower_strategies.core import records as R

#: Above this many nodes the in-process grids keep client state out of core by default (a temporary store).
RESIDENT_LIMIT = 10_000

Layout = tuple[tuple[str, str, tuple[int, ...]], ...]  # ((key, dtype, shape), …) of one record


class RowStore:
    """Per-client state of ``population`` clients under ``root`` (see the module docstring).

    ``write(row, records)`` replaces client ``row``'s state by ``records`` (``{record name: {key: array}}``);
    ``read(row)`` gives it back (``{}`` for a client without state)."""

    def __init__(self, root: str | Path, population: int) -> None:
        self.root, self.population = Path(root), int(population)
        self.root.mkdir(parents=True, exist_ok=True)
        index = self.root / "index.json"
        saved: dict[str, Any] = (json.loads(index.read_text()) if index.is_file()
                                 else {"population": self.population, "slots": []})
        if saved["population"] != self.population:
            raise ValueError(f"{self.root} holds the state of {saved['population']} clients, not {self.population}")
        #: (record name, layout) of every slot, by slot number (its directory name)
        self.slots: list[tuple[str, Layout]] = [(name, tuple((k, d, tuple(s)) for k, d, s in layout))
                                                for name, layout in saved["slots"]]
        self._open: dict[int, tuple[np.memmap, list[np.memmap]]] = {}

    def _slot(self, name: str, layout: Layout, create: bool) -> int | None:
        try:
            return self.slots.index((name, layout))
        except ValueError:
            if not create:
                return None
        self.slots.append((name, layout))
        (self.root / f"slot-{len(self.slots) - 1}").mkdir(exist_ok=True)
        body = {"population": self.population, "slots": [[n, [list(e) for e in lay]] for n, lay in self.slots]}
        tmp = self.root / "index.json.tmp"
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.root / "index.json")
        return len(self.slots) - 1

    def _files(self, slot: int) -> tuple[np.memmap, list[np.memmap]]:
        opened = self._open.get(slot)
        if opened is None:
            where, (_, layout) = self.root / f"slot-{slot}", self.slots[slot]

            def mapped(path: Path, dtype: Any, shape: tuple[int, ...]) -> np.memmap:
                if path.is_file():
                    return np.lib.format.open_memmap(path, mode="r+")
                return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(self.population, *shape))

            present = mapped(where / "present.npy", np.uint8, ())
            opened = self._open[slot] = (present, [mapped(where / f"{i}.npy", np.dtype(d), s)
                                                   for i, (_, d, s) in enumerate(layout)])
        return opened

    def read(self, row: int) -> dict[str, dict[str, np.ndarray]]:
        out: dict[str, dict[str, np.ndarray]] = {}
        for slot, (name, layout) in enumerate(self.slots):
            present, files = self._files(slot)
            if present[row]:
                out[name] = {key: np.array(f[row]) for (key, _, _), f in zip(layout, files, strict=True)}
        return out

    def write(self, row: int, records: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        chosen = set()
        for name, arrays in records.items():
            layout = tuple((k, np.asarray(a).dtype.str, tuple(np.shape(a))) for k, a in arrays.items())
            slot = self._slot(name, layout, create=True)
            assert slot is not None
            present, files = self._files(slot)
            for f, a in zip(files, arrays.values(), strict=True):
                f[row] = a
            present[row] = 1
            chosen.add(slot)
        for slot in range(len(self.slots)):  # the client's records not in ``records`` (or in another layout) go
            if slot not in chosen:
                present, _ = self._files(slot)
                if present[row]:
                    present[row] = 0

    def flush(self) -> None:
        for present, files in self._open.values():
            present.flush()
            for f in files:
                f.flush()

    def disk_bytes(self) -> int:
        """Bytes the store's files occupy on disk (allocated blocks: the files are sparse)."""
        return sum(p.stat().st_blocks * 512 for p in self.root.rglob("*") if p.is_file())

    def rows_held(self) -> int:
        """Clients with saved state."""
        held = np.zeros(self.population, dtype=bool)
        for slot in range(len(self.slots)):
            held |= self._files(slot)[0].astype(bool)
        return int(held.sum())


class NodeContexts(Mapping[int, Context]):
    """The nodes' ``Context`` objects, each made when its node is first addressed (see the module docstring).

    ``ids``: the node ids (node ``ids[p]`` has ``partition-id = p``); ``store``: where :meth:`release` puts the state
    of the contexts made so far (None: contexts stay for the whole run, as before)."""

    def __init__(self, ids: Sequence[int], run_config: Mapping[str, Any], store: RowStore | None = None) -> None:
        self.ids, self.run_config, self.store = ids, dict(run_config), store
        self._range = isinstance(ids, range) and ids.step == 1
        self._pos: dict[int, int] = {} if self._range else {n: p for p, n in enumerate(ids)}
        self.live: dict[int, Context] = {}
        #: Contexts made so far (tests: the unsampled nodes never get one).
        self.made = 0

    def partition(self, node: int) -> int:
        if self._range:
            assert isinstance(self.ids, range)
            if node not in self.ids:
                raise KeyError(node)
            return node - self.ids.start
        return self._pos[node]

    def __getitem__(self, node: int) -> Context:
        ctx = self.live.get(node)
        if ctx is None:
            pid = self.partition(node)
            state = RecordDict()
            if self.store is not None:
                for name, arrays in self.store.read(pid).items():
                    state[name] = R.to_record(arrays)
            ctx = self.live[node] = Context(
                run_id=1, node_id=node, state=state, run_config=dict(self.run_config),
                node_config={"partition-id": pid, "num-partitions": len(self.ids)})
            self.made += 1
        return ctx

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, node: object) -> bool:
        return node in self.ids if self._range else node in self._pos

    def release(self) -> None:
        """With a store: write every live context's client state to it and drop the context (a context whose state
        holds anything but the method's ``fedadapt.*`` ArrayRecords stays in memory)."""
        if self.store is None:
            return
        for node, ctx in list(self.live.items()):
            records = dict(ctx.state.items())
            if any(not (n.startswith(R.STATE_PREFIX) and isinstance(r, ArrayRecord)) for n, r in records.items()):
                continue
            pid = self.partition(node)
            if records or self.store.read(pid):
                self.store.write(pid, {n: R.views(r) for n, r in records.items()})  # type: ignore[arg-type]
            del self.live[node]
        self.store.flush()


def population_store(num_nodes: int, state_dir: str | Path | None) -> tuple[RowStore | None, Any]:
    """The grid's store: under ``state_dir`` if given, else a temporary one above :data:`RESIDENT_LIMIT` nodes, else
    none.  Returns ``(store, keep-alive)`` (the temporary directory, removed when the grid goes)."""
    if state_dir is not None:
        return RowStore(state_dir, num_nodes), None
    if num_nodes <= RESIDENT_LIMIT:
        return None, None
    tmp = tempfile.TemporaryDirectory(prefix="fedadapt-population-")
    return RowStore(tmp.name, num_nodes), tmp


__all__ = ["RESIDENT_LIMIT", "NodeContexts", "RowStore", "population_store"]
