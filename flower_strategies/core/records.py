"""Wire protocol: record names, config keys and ArrayRecord ⇄ named-array conversion.

A train message (server → client) is a ``RecordDict``::

    "arrays"          ArrayRecord   the global model x_t (state_dict keys)
    "<extra>"         ArrayRecord   zero or more named downlink extras (e.g. "momentum", "v_hat")
    "config"          ConfigRecord  server-round, method, client-lr, local-steps/epochs, batch-size, method keys

A train reply (client → server)::

    "arrays"          ArrayRecord   the local model x_{i,K} (unless the method replaces it)
    "<extra>"         ArrayRecord   the method's named uplink arrays
    "metrics"         MetricRecord  num-examples, num-steps, train-loss, train-loss-before

Records are addressed by name, never by position.
"""

from __future__ import annotations

import inspect
import io
import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import lru_cache
from logging import INFO
from typing import Any, TypeVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, Metadata, MetricRecord, RecordDict
from flwr.common import log

MODEL = "arrays"
CONFIG = "config"
METRICS = "metrics"

# Metric keys every train reply carries.
NUM_EXAMPLES = "num-examples"
NUM_STEPS = "num-steps"
TRAIN_LOSS = "train-loss"
TRAIN_LOSS_BEFORE = "train-loss-before"
#: Reply metric of the plug-in path (:class:`~.client.ClientRound` with its ``loader``): the received model's loss on
#: the round's first batch, the reference of :func:`.rounds.loss_alarm` where no ``train-loss-before`` is reported.
FIRST_BATCH_LOSS = "train-loss-first-batch"

# Config keys every train message carries.
SERVER_ROUND = "server-round"
METHOD = "method"
CLIENT_LR = "client-lr"
LOCAL_STEPS = "local-steps"
LOCAL_EPOCHS = "local-epochs"
BATCH_SIZE = "batch-size"
FULL_BATCH = "full-batch"
# Optional: clients estimate train-loss-before on a seeded sample of at most this many examples (absent/0 = all).
LOSS_BEFORE_MAX = "loss-before-max-examples"
# What the client half must know, decided by the server (``FedAdaptStrategy.round_config``) and sent every round, so
# that a client imports no server-side module: whether the method's local optimizer must train, its name
# (``core.local.LOCAL_OPTIMIZERS``), whether the server reads train-loss-before, whether it needs the full gradient.
CLIENT_HALF = "client-half"
LOCAL_OPTIMIZER = "local-optimizer"
LOSS_BEFORE = "loss-before"
FULL_GRADIENT = "full-gradient"

#: Train-config key set by fedadapt's own round loops on the config they hand ``configure_train``
#: (:func:`.loop.own_loop_config`); not sent to clients.  A round whose config lacks it runs in another loop, e.g.
#: Flower's ``Strategy.start`` of a wrapper such as a DP wrapper (:func:`.privacy.flower_dp_wrapper`).
OWN_LOOP = "fedadapt-own-loop"

# Reply ConfigRecord naming the method whose client half produced the reply (``{"method": name}``).
REPLY_INFO = "fedadapt"

# Prefix of client persistent state in ``Context.state``.
STATE_PREFIX = "fedadapt."


def train_content(model: ArrayRecord, extras: Mapping[str, Mapping[str, np.ndarray]], config: ConfigRecord,
                  ) -> RecordDict:
    """A train message's content: the model (:data:`MODEL`), the named downlink extras, the round's
    ConfigRecord (:data:`CONFIG`).  An extra named like one of the two is a ValueError."""
    clash = set(extras) & {MODEL, CONFIG}
    if clash:
        raise ValueError(f"downlink record names clash with reserved names: {sorted(clash)}")
    return RecordDict({MODEL: model, **{k: to_record(v) for k, v in extras.items()}, CONFIG: config})


def to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


_Rec = TypeVar("_Rec")


def get(content: RecordDict, name: str, kind: type[_Rec]) -> _Rec | None:
    """``content[name]`` if it is a ``kind`` record, else ``None`` — what ``content.metric_records.get(name)`` & co.
    answer, without building a new type-checked dict of every record per call (~20 µs each, several per message).
    On the fast path (:data:`FAST`) a RecordDict's own dict is read directly (``Mapping.get`` goes through a
    ``__getitem__`` and a ``try`` per call, and the server asks several times per reply)."""
    rec = content.__dict__["_data"].get(name) if FAST and type(content) is RecordDict else content.get(name)
    return rec if isinstance(rec, kind) else None


def of_type(content: RecordDict, kind: type[_Rec]) -> Iterator[tuple[str, _Rec]]:
    """``content``'s ``(name, record)`` pairs of type ``kind`` (``content.array_records.items()`` without the copy)."""
    return ((name, rec) for name, rec in content.items() if isinstance(rec, kind))


#: Longest ``.npy`` header accepted from a client (NumPy's own default ``max_header_size``).
MAX_HEADER_BYTES = 10000

#: The ``.npy`` format versions a payload may use, and the width of their header-length field.
_NPY_VERSIONS = {1: 2, 2: 4}


@lru_cache(maxsize=256)
def _dtype_named(name: str) -> np.dtype:
    """``np.dtype(name)`` of an Array's dtype string (cached: every array of every message names one of a few)."""
    return np.dtype(name)


@lru_cache(maxsize=4096)
def _npy_header(prefix: bytes) -> tuple[tuple[int, ...], bool, np.dtype, int] | None:
    """``(shape, fortran_order, dtype, data offset)`` of a ``.npy`` payload from its header bytes, ``None`` when they
    do not parse (cached: every round's replies repeat the same few headers, and NumPy parses each with
    ``ast.literal_eval``)."""
    buf = io.BytesIO(prefix)
    try:
        version = np.lib.format.read_magic(buf)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read_header is None:
            return None
        shape, fortran, dtype = read_header(buf, max_header_size=MAX_HEADER_BYTES)
    except Exception:  # noqa: BLE001  # a client's bytes: whatever NumPy raises on them, the header is unusable
        return None
    return tuple(shape), bool(fortran), dtype, buf.tell()


def _header_of(data: bytes) -> tuple[tuple[int, ...], bool, np.dtype, int] | str:
    """:func:`_npy_header` of a payload's leading bytes, or why they are not a ``.npy`` header (cheap: only the
    header bytes are read)."""
    if data[:6] != b"\x93NUMPY" or len(data) < 10:
        return "is not a .npy payload (bad magic)"
    width = _NPY_VERSIONS.get(data[6])
    if width is None or data[7] != 0:
        return f"has unsupported .npy version {data[6]}.{data[7]}"
    hlen = int.from_bytes(data[8 : 8 + width], "little")
    start = 8 + width
    if hlen > MAX_HEADER_BYTES or len(data) < start + hlen:
        return f"has a truncated or oversized .npy header ({hlen} bytes)"
    head = _npy_header(bytes(data[: start + hlen]))
    if head is None:
        return "has an unparsable .npy header"
    return head


def checked_view(array: Array, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | str:
    """A read-only zero-copy view of a client's Array when its payload is exactly a ``.npy`` array of ``shape`` and
    ``dtype`` that agrees with the Array's own metadata, else the reason it is not (nothing here raises, and
    nothing reads more than the header: the byte length is compared, not the data).

    Checked: ``stype == "numpy.ndarray"``; metadata ``dtype``/``shape`` == the expected ones; the ``.npy`` magic,
    version and header parse; the header's dtype (not an object dtype) and shape == the expected ones; the payload
    length == header + ``prod(shape)·itemsize`` exactly.  A Fortran-ordered payload (Flower's ``Array`` of a
    transposed ndarray) is checked the same way and read into one C-ordered read-only copy (the screen's norm pass
    flattens every array: a non-C-contiguous view would be copied there again)."""
    try:
        if array.stype != "numpy.ndarray":
            return f"has stype {array.stype!r}, expected 'numpy.ndarray'"
        named = array.dtype
        if (_dtype_named(named) if type(named) is str else np.dtype(named)) != dtype:
            return f"has dtype {array.dtype}, expected {dtype}"
        if tuple(array.shape) != tuple(shape):
            return f"has shape {tuple(array.shape)}, expected {tuple(shape)}"
        data = array.data
        if not isinstance(data, bytes):
            return f"has a payload of type {type(data).__name__}, expected bytes"
        head = _header_of(data)
        if isinstance(head, str):
            return head
        got_shape, fortran, got_dtype, offset = head
        if got_dtype.hasobject:
            return f"has a payload of object dtype {got_dtype}"
        if got_dtype != dtype:
            return f"has a payload of dtype {got_dtype} under metadata dtype {array.dtype}"
        if got_shape != tuple(shape):
            return f"has a payload of shape {got_shape} under metadata shape {tuple(array.shape)}"
        size = offset + dtype.itemsize * math.prod(got_shape)
        if len(data) != size:
            return f"has a payload of {len(data)} bytes, its .npy header says {size}"
        out = np.ndarray(got_shape, dtype=dtype, buffer=data, offset=offset, order="F" if fortran else "C")
        if fortran and not out.flags.c_contiguous:  # one C-ordered copy: the norm pass flattens it
            out = np.ascontiguousarray(out)
            out.flags.writeable = False
        return out
    except Exception as err:  # noqa: BLE001  # e.g. an unknown dtype name or a shape that is not a sequence
        return f"has unusable metadata ({type(err).__name__}: {err})"


def view(array: Array) -> np.ndarray:
    """A read-only NumPy view of an Array's serialized bytes, without copying (falls back to a copy for arrays
    that are not plain C-ordered ``.npy`` data).  For the server's own arrays; a client's go through
    :func:`checked_view`.  On the public path (:data:`FAST` false) the read-only ``array.numpy()``."""
    data = array.data
    if FAST and array.stype == "numpy.ndarray" and isinstance(data, bytes):
        head = _header_of(data)
        if not isinstance(head, str):
            shape, fortran, dtype, offset = head
            if not fortran and not dtype.hasobject and len(data) >= offset + dtype.itemsize * math.prod(shape):
                # one array object on the message's bytes (frombuffer + reshape would keep two alive per view)
                return np.ndarray(shape, dtype=dtype, buffer=data, offset=offset)
    out = array.numpy()
    out.flags.writeable = False  # the same contract on both paths: the server math never writes into x_t
    return out


def views(record: ArrayRecord) -> dict[str, np.ndarray]:
    """:func:`view` of every array of ``record`` (read-only; zero-copy for ``.npy`` payloads)."""
    return {k: view(v) for k, v in record.items()}


@lru_cache(maxsize=4096)
def npy_prefix(dtype: np.dtype, shape: tuple[int, ...]) -> tuple[bytes, str]:
    """The ``.npy`` header ``np.save`` writes for a C-ordered array of ``dtype`` and ``shape``, and ``str(dtype)``
    (cached: both cost microseconds per call, and every round repeats the same few)."""
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                                "shape": shape})
    return head.getvalue(), str(dtype)


Rec = TypeVar("Rec", ArrayRecord, MetricRecord, ConfigRecord, RecordDict)


# ------------------------------------------------------------------ fast paths and their public twins
# Flower's ``Array(...)`` type-checks and sorts its arguments and ``Array(ndarray)`` goes through ``np.save`` into a
# BytesIO buffer; record item assignment type-checks every key and value.  The fast paths below build the same
# objects by setting Flower's fields directly (``Array.__dict__``, a record's ``_data``): private attributes, so they
# are used only where a probe at import (:func:`_fast_path_matches`) finds they give exactly what the public path
# gives on the running Flower; otherwise every call takes the public twin next to it.
# Measured reason (flwr 1.42, 2-core x86-64 VM, timeit of to_record / views under record_path(True/False)): a
# 100k-float32 ArrayRecord of 100 arrays builds in 0.46 ms instead of 7.3 ms and reads in 0.66 ms instead of 9.1 ms
# (one array of 100k: 0.013 vs 0.050 ms, and 0.002 vs 0.16 ms: the view copies nothing).


def _set_fields(dtype: str, shape: tuple[int, ...], data: bytes) -> Array:
    """Fast: an ``Array`` with its fields set directly (no argument checks)."""
    out = Array.__new__(Array)
    out.__dict__.update(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data, _is_dirty=True)
    return out


def _construct(dtype: str, shape: tuple[int, ...], data: bytes) -> Array:
    """Public twin of :func:`_set_fields`: Flower's constructor."""
    return Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data)


def _fill_data(record: Rec, items: Iterable[tuple[str, object]]) -> Rec:
    """Fast: the items put into the record's dict directly (no per-item checks), an ArrayRecord marked dirty."""
    record.__dict__["_data"].update(items)
    if isinstance(record, ArrayRecord):
        record.is_dirty = True
    return record


def _assign(record: Rec, items: Iterable[tuple[str, object]]) -> Rec:
    """Public twin of :func:`_fill_data`: item assignment."""
    for key, value in items:
        record[key] = value  # type: ignore[assignment]
    return record


def _same_array(a: Array, b: Array) -> bool:
    return (a.dtype, tuple(a.shape), a.stype, a.data) == (b.dtype, tuple(b.shape), b.stype, b.data) and (
        vars(a) == vars(b))


def _same_object_id(a: object, b: object) -> bool:
    """Equal content hashes where this Flower has them (``object_id``, Flower ≥ 1.2x's inflatable records)."""
    return not hasattr(b, "object_id") or getattr(a, "object_id", None) == b.object_id


def _fast_path_matches() -> str | None:
    """``None`` when every fast path gives exactly what its public twin gives on the running Flower, else why not
    (never raises: an attribute a release lacks, a different layout or serialization is a reason, not a crash).
    Checked: :func:`to_array` of C-ordered float32/float64/int64/0-d arrays == ``Array(ndarray)`` (fields, payload
    bytes, dtype, shape, content hash); :func:`view` of them == ``.numpy()``; :func:`filled` ArrayRecord /
    MetricRecord / ConfigRecord / RecordDict == item assignment (same ``vars``, dirty flag, content hash)."""
    global FAST
    saved, FAST = FAST, True
    try:
        for arr in (np.arange(12, dtype=np.float32).reshape(3, 4), np.linspace(-1, 1, 5), np.array(7, np.int64)):
            ours, theirs = to_array(arr), Array(arr)
            if not _same_array(ours, theirs) or not _same_object_id(ours, theirs):
                return f"a directly built Array differs from Array(ndarray) for {arr.dtype}{arr.shape}"
            got, want = view(theirs), theirs.numpy()
            if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
                return f"a zero-copy view differs from Array.numpy() for {arr.dtype}{arr.shape}"
        array = Array(np.zeros(1, np.float32))
        samples: list[tuple[type, dict[str, object]]] = [
            (ArrayRecord, {"a": array}), (MetricRecord, {"m": 1, "n": 2.0}), (ConfigRecord, {"c": "x"}),
            (RecordDict, {"r": MetricRecord({"m": 1})})]
        for cls, items in samples:
            if not isinstance(cls().__dict__.get("_data"), dict):
                return f"{cls.__name__} keeps no '_data' dict"
            ours, theirs = _fill_data(cls(), items.items()), _assign(cls(), items.items())
            if vars(ours) != vars(theirs) or not _same_object_id(ours, theirs):
                return f"a directly filled {cls.__name__} differs from one filled by item assignment"
        return None
    except Exception as err:  # noqa: BLE001  # any failure of a private layout means: use the public path
        return f"{type(err).__name__}: {err}"
    finally:
        FAST = saved


#: Which path this module takes: ``True`` — the fast paths; ``False`` — their public twins.  Chosen once at import
#: (:func:`_fast_path_matches`, at the end of this module); :func:`record_path` forces one (tests run every round
#: trip through both).
FAST = False
#: Why the fast paths are off on this Flower (``None``: they are on).
FAST_PATH_FAILURE: str | None = None


@contextmanager
def record_path(fast: bool) -> Iterator[None]:
    """Force the fast paths (``fast=True``; refused where the import probe found they do not match) or their
    public twins inside the ``with`` block."""
    global FAST
    if fast and FAST_PATH_FAILURE is not None:
        raise RuntimeError(f"the fast record paths do not match this Flower: {FAST_PATH_FAILURE}")
    saved, FAST = FAST, fast
    try:
        yield
    finally:
        FAST = saved


def filled(record: Rec, items: Iterable[tuple[str, object]]) -> Rec:
    """``record[key] = value`` for every item, without Flower's per-item type checks of key and value (a few µs
    per item; a reply sets a dozen, a model record one per tensor).  Only for values the caller built itself with
    the types Flower requires (str keys; ``Array``s; int/float metrics; str configs; records in a RecordDict) —
    values from a user go through item assignment.  The result is the one item assignment gives (an ArrayRecord is
    marked dirty, as ``__setitem__`` does); on the public path (:data:`FAST` false), and for items with a key that
    is not a str (Flower's error names it), the items are assigned one by one."""
    items = list(items)
    if not FAST or not all(type(key) is str for key, _ in items):
        return _assign(record, items)
    return _fill_data(record, items)


def array_from_buffer(prefix: bytes, dtype: str, shape: tuple[int, ...], buffer: memoryview | bytes) -> Array:
    """The ``Array`` of a C-ordered array given as its ``.npy`` header ``prefix`` (:func:`npy_prefix`) and its raw
    bytes ``buffer`` (one copy: the payload ``np.save`` writes; none for a whole payload already in ``bytes``, i.e.
    an empty ``prefix``: bytes are immutable, Arrays may share them)."""
    data = buffer if not prefix and isinstance(buffer, bytes) else b"".join((prefix, buffer))
    return (_set_fields if FAST else _construct)(dtype, shape, data)


def to_array(arr: np.ndarray) -> Array:
    """``Array(arr)`` with the same ``.npy`` bytes, built with one copy and a cached header (Flower's constructor
    goes through ``np.save`` into a BytesIO buffer: a second, transient copy of the payload and a parsed header per
    call)."""
    arr = np.asarray(arr)
    if not FAST or arr.dtype.hasobject or not arr.flags.c_contiguous:
        return Array(arr)  # the public path; exactly what Flower writes (e.g. fortran_order for a transposed tensor)
    prefix, dtype = npy_prefix(arr.dtype, arr.shape)
    return array_from_buffer(prefix, dtype, arr.shape, memoryview(arr.reshape(-1)).cast("B"))  # type: ignore[arg-type]


def to_record(arrays: Mapping[str, np.ndarray], consume: bool = False) -> ArrayRecord:
    """Serialise named arrays into an ArrayRecord (filled key by key: ``ArrayRecord(dict)`` would build every
    Array a second time).  ``consume=True`` empties ``arrays`` (a dict) as it goes, so an array whose last reference
    was the dict is freed once serialised: the record replaces the arrays instead of doubling them."""
    if not consume:
        return filled(ArrayRecord(), [(k, to_array(v)) for k, v in arrays.items()])
    assert isinstance(arrays, dict)
    return filled(ArrayRecord(), ((k, to_array(arrays.pop(k))) for k in list(arrays)))


def record_nbytes(record: ArrayRecord) -> int:
    """Array payload bytes of an ArrayRecord, from shapes and dtypes (without deserialising it); an Array whose
    metadata does not describe an array (a client's) counts its raw payload length."""
    return sum(_array_nbytes(arr) for arr in record.values())


def arrays_nbytes(content: RecordDict) -> int:
    """:func:`record_nbytes` of every ArrayRecord of a message: the array values a round moves (its ``bytes-down``
    per sampled node, its ``bytes-up`` per reply)."""
    return sum(record_nbytes(rec) for _, rec in of_type(content, ArrayRecord))


def payload(data: Any) -> bytes | bytearray | memoryview:
    """An Array's payload as a buffer (what a malformed Array holds instead of bytes counts as empty)."""
    return data if isinstance(data, (bytes, bytearray, memoryview)) else b""


def _value_nbytes(value: Any) -> int:
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, list):  # Flower's record lists are homogeneous
        return sum(map(len, value)) if value and isinstance(value[0], (str, bytes)) else 8 * len(value)
    return 8


def content_nbytes(content: RecordDict) -> int:
    """The bytes a reply carries as received, trusting none of its metadata (the binder's size bound): array
    payloads as they arrived, plus keys and values of its config/metric records (numbers: 8)."""
    total = 0
    for rec in content.values():
        if isinstance(rec, ArrayRecord):
            for arr in rec.values():
                data = arr.data
                total += len(data) if type(data) is bytes else memoryview(payload(data)).nbytes
        else:
            for key, value in rec.items():
                total += len(key) + (8 if type(value) in (int, float) else _value_nbytes(value))
    return total


def _itemsize(dtype: str) -> int:
    """``np.dtype(dtype).itemsize`` (cached for strings, see :func:`_dtype_named`)."""
    return (_dtype_named(dtype) if type(dtype) is str else np.dtype(dtype)).itemsize


def _array_nbytes(arr: Array) -> int:
    try:
        n = _itemsize(arr.dtype) * math.prod(arr.shape)
        if isinstance(n, int) and n >= 0:
            return n
    except Exception:  # noqa: BLE001  # a client's metadata: anything may fail to describe an array
        pass
    return len(arr.data) if isinstance(arr.data, bytes) else 0


# ------------------------------------------------------------------ a message's id
# Flower's Metadata has no public setter for ``message_id``: the SuperLink and Flower's own grids write the private
# field ``__dict__["_message_id"]``, and the in-process grids (simulations/engine/grid.py) do what they do.  Public
# twin: Metadata's constructor run again on the same object with every other field as it is.  The import probe
# (:func:`_message_id_path`) checks that the private write gives exactly what the twin gives; if not, the twin.


def _write_message_id(metadata: Metadata, message_id: str) -> None:
    """Private: the field Flower's own grids write."""
    metadata.__dict__["_message_id"] = message_id


#: The fields Metadata's constructor takes in this Flower (1.23 has no ``src_task_id`` / ``dst_task_id``).
_METADATA_FIELDS = tuple(n for n in inspect.signature(Metadata.__init__).parameters if n not in ("self", "message_id"))


def _construct_message_id(metadata: Metadata, message_id: str) -> None:
    """Public twin of :func:`_write_message_id`: the constructor again, every other field kept."""
    Metadata.__init__(metadata, message_id=message_id, **{n: getattr(metadata, n) for n in _METADATA_FIELDS})


def _message_id_path() -> tuple[bool, str | None]:
    """``(private write matches, why not)``: the write and the twin give the same fields and ``message_id`` on a
    sample Metadata of this Flower (never raises)."""
    try:
        ours, theirs = (Metadata(run_id=3, message_id="", src_node_id=0, dst_node_id=5, reply_to_message_id="",
                                 group_id="g", created_at=1.5, ttl=60.0, message_type="train") for _ in range(2))
        _write_message_id(ours, "m-1")
        _construct_message_id(theirs, "m-1")
        if ours.message_id == "m-1" and vars(ours) == vars(theirs):
            return True, None
        return False, "writing Metadata's '_message_id' does not give what its constructor gives"
    except Exception as err:  # noqa: BLE001  # a different layout or signature means: take the other path
        return False, f"{type(err).__name__}: {err}"


def set_message_id(message: Message, message_id: str) -> None:
    """Give ``message`` the id a SuperLink gives a pushed message (its replies then name it in
    ``reply_to_message_id``): the private write where the import probe found it matches, else the public twin."""
    (_write_message_id if MESSAGE_ID_WRITE else _construct_message_id)(message.metadata, message_id)


FAST_PATH_FAILURE = _fast_path_matches()
FAST = FAST_PATH_FAILURE is None
MESSAGE_ID_WRITE, MESSAGE_ID_WRITE_FAILURE = _message_id_path()
if not FAST:
    log(INFO, "fedadapt: Flower's record internals differ from flwr 1.42's (%s); using the public Array/record API",
        FAST_PATH_FAILURE)
