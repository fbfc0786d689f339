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

import io
import math
from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import TypeVar

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

MODEL = "arrays"
CONFIG = "config"
METRICS = "metrics"

# Metric keys every train reply carries.
NUM_EXAMPLES = "num-examples"
NUM_STEPS = "num-steps"
TRAIN_LOSS = "train-loss"
TRAIN_LOSS_BEFORE = "train-loss-before"

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

# Reply ConfigRecord naming the method whose client half produced the reply (``{"method": name}``).
REPLY_INFO = "fedadapt"

# Prefix of client persistent state in ``Context.state``.
STATE_PREFIX = "fedadapt."


def to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


_Rec = TypeVar("_Rec")


def get(content: RecordDict, name: str, kind: type[_Rec]) -> _Rec | None:
    """``content[name]`` if it is a ``kind`` record, else ``None`` — what ``content.metric_records.get(name)`` & co.
    answer, without building a new type-checked dict of every record per call (~20 µs each, several per message)."""
    rec = content.get(name)
    return rec if isinstance(rec, kind) else None


def of_type(content: RecordDict, kind: type[_Rec]) -> Iterator[tuple[str, _Rec]]:
    """``content``'s ``(name, record)`` pairs of type ``kind`` (``content.array_records.items()`` without the copy)."""
    return ((name, rec) for name, rec in content.items() if isinstance(rec, kind))


@lru_cache(maxsize=4096)
def _npy_header(prefix: bytes) -> tuple[tuple[int, ...], bool, np.dtype, int] | None:
    """``(shape, fortran_order, dtype, data offset)`` of a ``.npy`` payload from its header bytes (cached: every
    round's replies repeat the same few headers, and NumPy parses each with ``ast.literal_eval``)."""
    import io

    buf = io.BytesIO(prefix)
    try:
        version = np.lib.format.read_magic(buf)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read_header is None:
            return None
        shape, fortran, dtype = read_header(buf)
    except ValueError:  # truncated prefix (a header longer than the prefix): no fast path
        return None
    return tuple(shape), bool(fortran), dtype, buf.tell()


def view(array: Array) -> np.ndarray:
    """A read-only NumPy view of an Array's serialized bytes, without copying (falls back to a copy for arrays
    that are not plain C-ordered ``.npy`` data)."""
    data = array.data
    if array.stype == "numpy.ndarray" and data[:6] == b"\x93NUMPY":
        hlen = int.from_bytes(data[8:10], "little") if data[6] == 1 else int.from_bytes(data[8:12], "little")
        head = _npy_header(bytes(data[: (10 if data[6] == 1 else 12) + hlen]))
        if head is not None:
            shape, fortran, dtype, offset = head
            if not fortran and not dtype.hasobject and len(data) >= offset + dtype.itemsize * math.prod(shape):
                # one array object on the message's bytes (frombuffer + reshape would keep two alive per view)
                return np.ndarray(shape, dtype=dtype, buffer=data, offset=offset)
    return array.numpy()


def views(record: ArrayRecord) -> dict[str, np.ndarray]:
    """:func:`view` of every array of ``record`` (read-only; zero-copy for ``.npy`` payloads)."""
    return {k: view(v) for k, v in record.items()}


@lru_cache(maxsize=4096)
def _npy_prefix(dtype: np.dtype, shape: tuple[int, ...]) -> tuple[bytes, str]:
    """The ``.npy`` header ``np.save`` writes for a C-ordered array of ``dtype`` and ``shape``, and ``str(dtype)``
    (cached: both cost microseconds per call, and every round repeats the same few)."""
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                                "shape": shape})
    return head.getvalue(), str(dtype)


def to_array(arr: np.ndarray) -> Array:
    """``Array(arr)`` with the same ``.npy`` bytes, built with one copy and a cached header (Flower's constructor
    goes through ``np.save`` into a BytesIO buffer: a second, transient copy of the payload and a parsed header per
    call)."""
    arr = np.asarray(arr)
    if arr.dtype.hasobject or not arr.flags.c_contiguous:
        return Array(arr)  # exactly what Flower writes (e.g. fortran_order for a transposed tensor)
    prefix, dtype = _npy_prefix(arr.dtype, arr.shape)
    flat = memoryview(arr.reshape(-1)).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer
    data = b"".join((prefix, flat))
    return Array(dtype=dtype, shape=arr.shape, stype="numpy.ndarray", data=data)


def to_record(arrays: Mapping[str, np.ndarray], consume: bool = False) -> ArrayRecord:
    """Serialise named arrays into an ArrayRecord (filled key by key: ``ArrayRecord(dict)`` would build every
    Array a second time).  ``consume=True`` empties ``arrays`` (a dict) as it goes, so an array whose last reference
    was the dict is freed once serialised: the record replaces the arrays instead of doubling them."""
    out = ArrayRecord()
    if not consume:
        for k, v in arrays.items():
            out[k] = to_array(v)
        return out
    assert isinstance(arrays, dict)
    for k in list(arrays):
        out[k] = to_array(arrays.pop(k))
    return out


def record_nbytes(record: ArrayRecord) -> int:
    """Array payload bytes of an ArrayRecord, from shapes and dtypes (without deserialising it)."""
    return int(sum(np.dtype(arr.dtype).itemsize * math.prod(arr.shape) for arr in record.values()))
