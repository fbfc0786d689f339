"""Atomic, bit-exact, data-only checkpoints of a federated run (server side).

A checkpoint is ONE ``.npz`` archive (NumPy's zip of ``.npy`` files; no pickle anywhere):

* ``arrays/<key>``: the global arrays after round ``round`` (dtypes and shapes preserved);
* ``state/<path>``: every array of :meth:`FedAdaptStrategy.state_dict` (the server state's named arrays:
  server-optimizer moments, momentum buffers, controllers, …), ``<path>`` being its place in the state dict;
* ``meta``: one UTF-8 JSON document (stored as a ``uint8`` array) with ``format``/``version``, ``round``,
  ``num_rounds``, ``method``, ``strategy_class``, ``run_config``, ``metrics_rows``, ``app`` (the app's own JSON
  values, e.g. the fedadapt ServerApp's run token), the global array keys in order, and the strategy state with
  each array replaced by ``{"__array__": "<member name>"}`` (so the scalars, the sampling RNG state, the counters
  and the per-round history are plain JSON).

It is written atomically (temporary file in the same directory, ``fsync``, ``os.replace``), so a crash or a
``kill -9`` at any moment leaves either the previous or the new checkpoint, never a torn one.  It is read member by
member (``np.lib.format.read_array(allow_pickle=False)``) and validated before anything is used (:func:`load`,
:func:`check_arrays`): a pickle, an object array, a member larger uncompressed than the run's model allows (checked
from the zip entry and the ``.npy`` header before it is inflated), a missing or extra member, metadata of the wrong
type or range, a wrong key/shape/dtype or a NaN/Inf is a :class:`CheckpointError` naming the problem.  Loading a
checkpoint therefore never executes code.

Client-side persistent state (``Context.state`` of each node, e.g. Fed-LAMB's local momentum) is *not* in the
server checkpoint: it lives on the nodes, and Flower's ``Context.state`` lives only as long as one run.  The fedadapt
apps keep it on the nodes' disks keyed by the run token stored under ``app`` here (``client_app.client_state``);
a node restarted with an empty disk starts its client again from the method's initial state the next time it is
sampled (as a client sampled for the first time).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "fedadapt-checkpoint"
VERSION = 2  # 1 = the former pickle format (no longer readable)

#: Run-config keys that may differ between the checkpointed run and the resumed one.
RESUMABLE_CHANGES = frozenset({
    "num-server-rounds", "resume", "checkpoint-every", "round-timeout", "output-dir", "run-name", "learning-curve",
    "grid-pull-interval",
})

META = "meta"
ARRAY_REF = "__array__"
#: dtype kinds a checkpoint may hold: bool, signed/unsigned int, float, complex (never object, str, void).
DATA_KINDS = frozenset("biufc")

_counter = itertools.count()


class CheckpointError(ValueError):
    """A checkpoint cannot be read, is not data-only, or does not belong to this run."""


# ------------------------------------------------------------------------------------------ encode
def _split(value: Any, path: str, arrays: dict[str, np.ndarray]) -> Any:
    """``value`` as JSON with every ndarray moved to ``arrays[name]`` and replaced by ``{ARRAY_REF: name}``."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in DATA_KINDS:
            raise TypeError(f"checkpoint: {path} has dtype {value.dtype}; only numeric arrays are stored")
        if path in arrays:
            raise ValueError(f"checkpoint: two arrays map to the member name {path!r}")
        arrays[path] = np.array(value, copy=True)
        return {ARRAY_REF: path}
    if isinstance(value, Mapping):
        return {str(k): _split(v, f"{path}/{k}", arrays) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_split(v, f"{path}/{i}", arrays) for i, v in enumerate(value)]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"checkpoint: {path} is a {type(value).__name__}; a state dict holds arrays, numbers and strings")


def _join(value: Any, members: Mapping[str, np.ndarray]) -> Any:
    """Inverse of :func:`_split`."""
    if isinstance(value, dict):
        if set(value) == {ARRAY_REF}:
            return members[value[ARRAY_REF]]
        return {k: _join(v, members) for k, v in value.items()}
    if isinstance(value, list):
        return [_join(v, members) for v in value]
    return value


def encode(
    *, server_round: int, num_rounds: int, arrays: Mapping[str, np.ndarray], strategy: Any,
    metrics_rows: list[dict[str, Any]], run_config: Mapping[str, Any], app: Mapping[str, Any] | None = None,
) -> bytes:
    """The checkpoint of round ``server_round`` as ``.npz`` bytes (see the module docstring for the layout)."""
    members: dict[str, np.ndarray] = {}
    keys = list(arrays)
    for k in keys:
        _split(np.asarray(arrays[k]), f"arrays/{k}", members)
    state = _split(strategy.state_dict(), "state", members)
    cls = type(strategy)
    meta = {
        "format": FORMAT, "version": VERSION, "round": int(server_round), "num_rounds": int(num_rounds),
        "method": strategy.method, "strategy_class": f"{cls.__module__}.{cls.__qualname__}",
        "run_config": dict(run_config), "metrics_rows": [dict(r) for r in metrics_rows], "app": dict(app or {}),
        "arrays": keys, "strategy_state": state,
    }
    text = json.dumps(_split(meta, "meta", {}), allow_nan=True)  # _split: numpy scalars → Python numbers
    members[META] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **members)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle
    return buf.getvalue()


# ------------------------------------------------------------------------------------------ write
def write_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file in the same directory + fsync + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(_counter)}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # pragma: no cover - e.g. filesystems without directory fsync
        pass
    return path


# ------------------------------------------------------------------------------------------ read + validate
#: Bound on the uncompressed size of the ``meta`` member (JSON: rows, history, RNG state), checked before inflating.
META_MAX_BYTES = 256 * 2**20
#: Bound on each array member's uncompressed size: this many times the run's model (all its arrays together) ...
MEMBER_MARGIN = 16
#: ... and at least this (tiny models).
MEMBER_MIN_BYTES = 2**20


def member_limit(like: Mapping[str, Any]) -> int:
    """The largest uncompressed array member :func:`load` accepts for a run whose model ``state_dict`` is ``like``."""
    total = sum(int(np.prod(tuple(v.shape))) * _np_dtype(v).itemsize for v in like.values())
    return max(MEMBER_MARGIN * total, MEMBER_MIN_BYTES)


def _read_header(fh: Any) -> tuple[tuple[int, ...], np.dtype]:
    version = np.lib.format.read_magic(fh)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
    elif version == (2, 0):
        shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
    else:
        raise ValueError(f"unsupported .npy format version {version}")
    return shape, dtype


def _read_members(path: Path, where: str, max_member_bytes: int | None) -> dict[str, np.ndarray]:
    """Every member of the ``.npz`` at ``path``, each checked before it is inflated: its uncompressed size (the zip
    entry's ``file_size``) within the bound, its ``.npy`` header a numeric dtype whose data fits that size."""
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, EOFError, zipfile.BadZipFile, ValueError) as err:  # pickles, .npy files, junk: never unpickled
        raise CheckpointError(f"{where}: not a fedadapt checkpoint (checkpoints are .npz archives of numeric "
                              f"arrays; {err})") from None
    members: dict[str, np.ndarray] = {}
    with zf:
        infos = zf.infolist()
        names = [i.filename[:-4] if i.filename.endswith(".npy") else i.filename for i in infos]
        if len(set(names)) != len(names) or not all(i.filename.endswith(".npy") for i in infos):
            raise CheckpointError(f"{where}: not a fedadapt checkpoint (its members are not distinct .npy arrays)")
        for name, info in zip(names, infos, strict=True):
            limit = META_MAX_BYTES if name == META else max_member_bytes
            if limit is not None and info.file_size > limit:
                raise CheckpointError(f"{where}: member {name!r} is {info.file_size} bytes uncompressed, more than "
                                      f"the {limit} bytes a checkpoint of this run can hold; refused unread")
            try:
                with zf.open(info) as fh:
                    shape, dtype = _read_header(fh)
                    header = fh.tell()
                if dtype.hasobject:
                    raise ValueError(f"dtype {dtype} holds Python objects (pickles)")
                if dtype.kind not in DATA_KINDS:
                    raise CheckpointError(f"{where}: member {name!r} has dtype {dtype}; "
                                          "checkpoints hold numeric arrays only")
                if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize > info.file_size - header:
                    raise CheckpointError(f"{where}: member {name!r} declares shape {shape} {dtype}, more data than "
                                          f"its {info.file_size} bytes hold")
                with zf.open(info) as fh:
                    members[name] = np.lib.format.read_array(fh, allow_pickle=False)
            except CheckpointError:
                raise
            except ValueError as err:  # object arrays need pickle: refused; a malformed header
                raise CheckpointError(f"{where}: member {name!r} is not plain data ({err})") from None
            except (OSError, EOFError, zipfile.BadZipFile, RuntimeError, NotImplementedError) as err:
                raise CheckpointError(f"{where}: member {name!r} is unreadable ({err})") from None
    return members


def _check_meta(meta: dict[str, Any], where: str) -> None:
    """Types and ranges of the metadata fields (a forged value is a :class:`CheckpointError`, never a raw error)."""
    def bad(field: str, what: str) -> CheckpointError:
        return CheckpointError(f"{where}: checkpoint metadata {field!r} must be {what}, not {meta.get(field)!r:.80}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for field, kind, what in (("method", str, "a string"), ("strategy_class", str, "a string"),
                              ("run_config", dict, "a JSON object"), ("metrics_rows", list, "a list"),
                              ("app", dict, "a JSON object"), ("arrays", list, "a list of array keys"),
                              ("strategy_state", dict, "a JSON object")):
        if field not in meta:
            raise CheckpointError(f"{where}: incomplete checkpoint metadata (no {field!r})")
        if not isinstance(meta[field], kind):
            raise bad(field, what)
    if not is_int(meta.get("num_rounds")) or meta["num_rounds"] < 1:
        raise bad("num_rounds", "an integer >= 1")
    if not is_int(meta.get("round")) or not 0 <= meta["round"] <= meta["num_rounds"]:
        raise bad("round", f"an integer in 0..num_rounds ({meta['num_rounds']})")
    if not all(isinstance(k, str) for k in meta["arrays"]) or len(set(meta["arrays"])) != len(meta["arrays"]):
        raise bad("arrays", "a list of distinct array keys")
    previous: Any = -1
    for row in meta["metrics_rows"]:
        r: Any = row.get("round") if isinstance(row, dict) else None
        if not is_int(r) or not previous < r <= meta["round"]:
            raise CheckpointError(f"{where}: checkpoint metadata 'metrics_rows' must be rows with increasing rounds "
                                  f"in 0..{meta['round']}, not {row!r:.80}")
        previous = r


def load(path: str | os.PathLike[str], *, max_member_bytes: int | None = None) -> dict[str, Any]:
    """Read and validate a checkpoint written by :func:`encode`.

    Returns ``{"round", "num_rounds", "method", "strategy_class", "run_config", "metrics_rows", "app", "arrays"
    (ordered ``{key: ndarray}``), "strategy_state" (for ``strategy.load_state_dict``)}``.  Raises
    :class:`CheckpointError` for a missing file, a non-checkpoint (pickles included: they are never
    unpickled), another format version, missing/extra members, non-numeric arrays, NaN/Inf values, metadata
    of the wrong type or range, or a member larger than ``max_member_bytes`` uncompressed (:func:`member_limit`;
    ``meta``: :data:`META_MAX_BYTES`), refused before it is inflated.
    """
    path = Path(path).expanduser()
    where = f"resume = {str(path)!r}"
    if not path.is_file():
        raise CheckpointError(f"{where}: no such checkpoint file")
    members = _read_members(path, where, max_member_bytes)
    raw = members.pop(META, None)
    if raw is None or raw.dtype != np.uint8 or raw.ndim != 1:
        raise CheckpointError(f"{where}: not a fedadapt checkpoint (no '{META}' entry)")
    try:
        meta = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise CheckpointError(f"{where}: not a fedadapt checkpoint (bad metadata: {err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a fedadapt checkpoint")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{where}: checkpoint version {meta.get('version')!r}, expected {VERSION}")
    meta.setdefault("app", {})
    _check_meta(meta, where)
    keys = list(meta["arrays"])
    try:
        expected = {f"arrays/{k}" for k in keys} | _refs(meta["strategy_state"])
    except (TypeError, RecursionError) as err:
        raise CheckpointError(f"{where}: checkpoint metadata 'strategy_state' is malformed ({err})") from None
    if expected != set(members):
        missing, extra = sorted(expected - set(members)), sorted(set(members) - expected)
        raise CheckpointError(f"{where}: checkpoint members do not match its metadata "
                              f"(missing {missing}, extra {extra})")
    for name, arr in members.items():
        if arr.dtype.kind not in DATA_KINDS:
            raise CheckpointError(f"{where}: member {name!r} has dtype {arr.dtype}; "
                                  "checkpoints hold numeric arrays only")
        if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
            raise CheckpointError(f"{where}: member {name!r} holds NaN/Inf")
    return {
        "round": meta["round"], "num_rounds": meta["num_rounds"], "method": meta["method"],
        "strategy_class": meta["strategy_class"], "run_config": dict(meta["run_config"]),
        "metrics_rows": list(meta["metrics_rows"]), "app": dict(meta["app"]),
        "arrays": {k: members[f"arrays/{k}"] for k in keys},
        "strategy_state": _join(meta["strategy_state"], members),
    }


def check_round(payload: Mapping[str, Any], num_rounds: int) -> None:
    """Raise :class:`CheckpointError` unless the checkpoint's round is within ``0..num_rounds`` (the resuming
    run's ``num-server-rounds``)."""
    if payload["round"] > num_rounds:
        raise CheckpointError(f"the checkpoint is of round {payload['round']}, beyond this run's num-server-rounds = "
                              f"{num_rounds}: nothing would be trained; resume with num-server-rounds >= "
                              f"{payload['round']}")


def _refs(value: Any) -> set[str]:
    if isinstance(value, dict):
        if set(value) == {ARRAY_REF}:
            if not isinstance(value[ARRAY_REF], str):
                raise TypeError(f"array reference {value[ARRAY_REF]!r:.80} is not a member name")
            return {value[ARRAY_REF]}
        return set().union(*(_refs(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_refs(v) for v in value))
    return set()


def check_compatible(payload: Mapping[str, Any], run_config: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Raise :class:`CheckpointError` naming every run-config key that differs from the checkpointed run
    (except :data:`RESUMABLE_CHANGES`)."""
    old = {**defaults, **payload["run_config"]}
    new = {**defaults, **run_config}
    diff = sorted(k for k in set(old) | set(new) if k not in RESUMABLE_CHANGES and old.get(k) != new.get(k))
    if diff:
        pairs = ", ".join(f"{k}: checkpoint {old.get(k)!r} vs now {new.get(k)!r}" for k in diff)
        raise CheckpointError(f"the checkpoint was written by a run with other settings ({pairs}); "
                              f"only {', '.join(sorted(RESUMABLE_CHANGES))} may change on resume")


def check_arrays(payload: Mapping[str, Any], like: Mapping[str, Any]) -> None:
    """Raise :class:`CheckpointError` unless the checkpoint's global arrays have exactly the keys, shapes and
    dtypes of ``like`` (the run's model ``state_dict``, tensors or arrays)."""
    got = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in payload["arrays"].items()}
    want = {k: (tuple(v.shape), _np_dtype(v)) for k, v in like.items()}
    if got.keys() != want.keys():
        raise CheckpointError(f"the checkpoint's model keys differ from this run's model (missing "
                              f"{sorted(want.keys() - got.keys())}, unexpected {sorted(got.keys() - want.keys())})")
    bad = [f"{k}: checkpoint {got[k][0]} {got[k][1]} vs model {want[k][0]} {want[k][1]}"
           for k in want if got[k] != want[k]]
    if bad:
        raise CheckpointError(f"the checkpoint's arrays do not fit this run's model ({'; '.join(bad)})")


def _np_dtype(v: Any) -> np.dtype:
    if isinstance(v, np.ndarray):
        return v.dtype
    import torch  # a model state_dict

    return torch.empty((), dtype=v.dtype).numpy().dtype


def restore_strategy(strategy: Any, payload: Mapping[str, Any]) -> None:
    """``strategy.load_state_dict`` with the checkpoint's state, after checking it is the same strategy class."""
    cls = type(strategy)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if payload["strategy_class"] != name:
        raise CheckpointError(f"checkpoint holds the state of {payload['strategy_class']}, this run uses {name}")
    try:
        strategy.load_state_dict(payload["strategy_state"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as err:
        raise CheckpointError(f"the checkpoint's strategy state does not fit {name} ({err!r})") from None
