"""Reply binding: a train reply counts only as the answer to this round's message to its node, never as an earlier
reply sent again, and never beyond the round's size bound.

:class:`ReplyBinder` checks every train reply before anything reads its payload (the :class:`.screen.ReplyScreen`
comes after), in this order, and rejects with a reason that starts with the check's name:

1. **stale** — the reply's ``reply_to_message_id`` must name the message this round sent to the reply's source node
   (Flower assigns message ids when the grid pushes the messages; a runtime that assigns none — the legacy API's
   adapter — skips this check).  A reply to an earlier round's message, or to another node's, is stale.
2. **oversized** — the reply's bytes (array payloads, plus the strings, bytes and numbers of its config/metric
   records) must not exceed ``max-reply-bytes``; 0 (default) derives the cap from the model:
   :data:`REPLY_BYTES_FACTOR` × the bytes of the records the method's uplink declares + :data:`REPLY_BYTES_SLACK`.
   Counted from the lengths Flower already holds: nothing is viewed or parsed.
3. **replay** — a reply whose array records are byte-identical to a reply used in an earlier round is rejected when
   the global model it answered then differs from this round's.  The replies the screen keeps are remembered as
   digests (16 bytes: BLAKE2b over each array's metadata and a fast fingerprint of its bytes, see :func:`_absorb`;
   the reply's array records; the global model).  An honest client answers
   a changed model with changed bytes, while an unchanged model (a round that did not update; ``client-lr = 0`` on
   a model that stayed put) may legitimately be answered with the same bytes again, and is accepted.
   Byte-identical replies of two nodes in the same round are not replays (identical data and seeds give them).  A
   reply the screen rejected is not remembered: sent again, it is rejected again for its own reason (e.g. NaN/Inf),
   not as a replay.

:meth:`ReplyBinder.check` is the round's first step; after the screen, :meth:`ReplyBinder.remember` keeps the digests
of the replies it kept.

A replayed reply with some bytes changed is not recognised: no check on content can tell it from a slow honest
client's update; it is left to the screen's norm bounds and robust aggregation (docs/robustness.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.common import log

from .ops import NamedArrays
from .records import content_nbytes, payload
from .rejections import Kind, Rejection
from .validation import RecordSpec, layout

#: A derived ``max-reply-bytes`` is this many times the bytes of the method's declared uplink records …
REPLY_BYTES_FACTOR = 2
#: … plus this much for ``.npy`` headers, metrics and configs.
REPLY_BYTES_SLACK = 2**20
#: Bytes of one digest (reply or model).
DIGEST_BYTES = 16


def expected_reply_bytes(current: NamedArrays, specs: Sequence[RecordSpec], trainable: Sequence[str]) -> int:
    """Payload bytes of the uplink records ``specs`` declare (``keys="params"``: ``trainable`` only) for the global
    arrays ``current``."""
    total = 0
    for spec in specs:
        for shape, dtype in layout(current, trainable if spec.keys == "params" else None).values():
            total += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return total


def reply_cap(max_reply_bytes: int, current: NamedArrays, specs: Sequence[RecordSpec],
              trainable: Sequence[str]) -> int:
    """``max_reply_bytes`` when > 0, else the cap derived from the model (see the module docstring)."""
    if max_reply_bytes > 0:
        return max_reply_bytes
    return REPLY_BYTES_FACTOR * expected_reply_bytes(current, specs, trainable) + REPLY_BYTES_SLACK


#: Fingerprint block (64-bit words), its lanes, and the lanes' odd multipliers (fixed: digests are checkpointed).
_BLOCK = 1 << 18
_LANES = 1 << 14
_WEIGHTS = np.random.default_rng(0x5EED).integers(0, 2**62, size=_BLOCK, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


#: The bulk fingerprint (:func:`_fingerprints`) stacks equal-length buffers of at most :data:`_LANES` words into
#: matrices of at most this many bytes.
_STACK_BYTES = 1 << 24


def _absorb(h: Any, data: Any) -> None:
    """Feed ``h`` a fingerprint of the bytes ``data``: their length, the bytes past the last whole 64-bit word, and
    per block of :data:`_BLOCK` words its lanes' sum and their sum weighted by fixed odd multipliers (mod 2**64),
    where lane j is the sum of the block's words at positions ≡ j (mod :data:`_LANES`).  A buffer of at most
    :data:`_LANES` words is its own lanes: the sum and the position-weighted sum of its words.

    Equal bytes give equal fingerprints, which is all a replay check needs; two different honest replies agree only
    by chance (≈ 2**-64 per block).  Changes that cancel in a plain sum (one value one ulp up, another one ulp down:
    sparse honest updates can do that, and the near-replay attack does) are seen unless their positions in a block
    are a multiple of 128 KiB apart.  No collision resistance against a chosen input is needed: a client that alters
    the bytes of an old reply is not recognised anyway (module docstring).  One addition per word and one
    multiplication per lane of each block: 4–5 GB/s on the project's development machine, about twice the
    per-word weighted sums this replaced (2026-11-29; digests of arrays of more than 128 KiB changed then), against
    SHA-256's 1.5 GB/s with SHA extensions."""
    h.update(_fingerprints([data])[0])


def _fingerprints(datas: Sequence[Any]) -> list[bytes]:
    """The bytes :func:`_absorb` feeds the hash, for every buffer of ``datas``.  A round's replies carry many small
    arrays of equal lengths (one per reply and tensor): those of at most :data:`_LANES` words are stacked, up to
    :data:`_STACK_BYTES` at a time, and summed row by row in one NumPy operation per matrix instead of one per
    array (integer sums mod 2**64: the same values in any order).  A ``bytes`` payload (every Flower Array's) is
    read as it is; any other buffer through a NumPy view of its bytes."""
    raws: dict[int, np.ndarray] = {}  # the buffers that are not bytes, as uint8 views
    out: list[bytes] = []
    stacks: dict[int, list[int]] = {}  # whole words (1 … _LANES) → positions in datas
    for i, data in enumerate(datas):
        if type(data) is bytes:
            size = len(data)
            tail = data[size - size % 8:]
        else:
            raw = raws[i] = np.frombuffer(data, np.uint8) if memoryview(data).nbytes else np.zeros(0, np.uint8)
            size = raw.size
            tail = raw[size - size % 8:].tobytes()
        out.append(size.to_bytes(8, "little") + tail)
        words = size // 8
        if words > _LANES:
            raw = raws[i] if i in raws else np.frombuffer(data, np.uint8)
            out[i] += _block_sums(raw[: 8 * words].view(np.uint64))
        elif words:
            stacks.setdefault(words, []).append(i)
    for words, members in stacks.items():
        rows = max(1, _STACK_BYTES // (8 * words))
        for start in range(0, len(members), rows):
            part = members[start:start + rows]
            rows_of: list[Any] = [raws[i][: 8 * words] if i in raws else memoryview(datas[i])[: 8 * words]
                                  for i in part]
            joined = b"".join(rows_of)
            mat = np.frombuffer(joined, np.uint64).reshape(len(part), words)
            sums = np.stack((mat.sum(axis=1, dtype=np.uint64), mat @ _WEIGHTS[:words]), axis=1).tobytes()
            for j, i in enumerate(part):
                out[i] += sums[16 * j:16 * j + 16]
    return out


def _block_sums(words: np.ndarray) -> bytes:
    """Per block of :data:`_BLOCK` words: its lanes' sum and weighted sum mod 2**64 (:func:`_absorb`)."""
    sums = np.empty(2 * -(-words.size // _BLOCK), np.uint64)
    for j, start in enumerate(range(0, words.size, _BLOCK)):
        lanes = _lanes(words[start:start + _BLOCK])
        sums[2 * j] = lanes.sum(dtype=np.uint64)
        sums[2 * j + 1] = np.dot(lanes, _WEIGHTS[:lanes.size])  # NumPy's integer dot: one pass, mod 2**64
    return sums.tobytes()


def _lanes(block: np.ndarray) -> np.ndarray:
    """The block's words added into :data:`_LANES` lanes by position (mod 2**64); a block of fewer words is its own
    lanes."""
    rows, rest = divmod(block.size, _LANES)
    if not rows:
        return block
    lanes = block[: rows * _LANES].reshape(rows, _LANES).sum(axis=0, dtype=np.uint64)
    lanes[:rest] += block[rows * _LANES:]
    return lanes


def reply_digest(content: RecordDict) -> bytes:
    """Digest of a reply's array records (names, keys, dtypes, shapes and the payload fingerprints)."""
    return reply_digests([content])[0]


def reply_digests(contents: Sequence[RecordDict]) -> list[bytes]:
    """:func:`reply_digest` of every reply of ``contents``, their payloads fingerprinted together
    (:func:`_fingerprints`)."""
    metas: list[list[bytes]] = []
    datas: list[Any] = []
    for content in contents:
        described: list[bytes] = []
        metas.append(described)
        for name, rec in sorted(((n, r) for n, r in content.items() if isinstance(r, ArrayRecord)),
                                key=lambda x: x[0]):
            for key, arr in rec.items():
                raw = arr.data
                data = payload(raw)
                nbytes = len(data) if type(data) is bytes else memoryview(data).nbytes
                described.append(repr((name, key, arr.dtype, arr.shape, arr.stype, type(raw), nbytes)).encode())
                datas.append(data)
    prints = iter(_fingerprints(datas))
    # per array its metadata, then its fingerprint: the hash of the whole stream in one update
    return [hashlib.blake2b(b"".join([d + next(prints) for d in reply]), digest_size=DIGEST_BYTES).digest()
            for reply in metas]


def model_digest(arrays: NamedArrays) -> bytes:
    """Digest of the global arrays (keys, dtypes, shapes, value fingerprints)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    flat = {key: np.ascontiguousarray(value) for key, value in arrays.items()}
    for (key, arr), fingerprint in zip(flat.items(), _fingerprints([a.reshape(-1).view(np.uint8)
                                                                    for a in flat.values()]), strict=True):
        h.update(repr((key, arr.dtype.str, arr.shape)).encode() + fingerprint)
    return h.digest()


@dataclass(frozen=True)
class Bound:
    """What :meth:`ReplyBinder.check` decided: the replies that pass (in order), the rejections, each passing
    reply's digest (by ``id``) and the digest of the global model they answer."""

    passed: list[Message]
    rejections: list[Rejection]
    digests: Mapping[int, bytes]
    model: bytes


class ReplyBinder:
    """The binding checks of a run (module docstring); the digests of earlier replies are checkpointed
    (:meth:`state_dict`)."""

    def __init__(self) -> None:
        self._sent: list[Message] = []
        #: ``{reply digest: digest of the global model that reply answered}`` of every earlier round.
        self.seen: dict[bytes, bytes] = {}

    def expect(self, messages: Iterable[Message]) -> list[Message]:
        """Remember this round's train messages (their ids are assigned in place when the grid pushes them)."""
        self._sent = list(messages)
        return self._sent

    def remember(self, bound: Bound, kept: Iterable[Message]) -> None:
        """The digests of the replies the screen ``kept`` (of those ``bound`` passed) join :attr:`seen` (after the
        round: two nodes' identical replies in one round are no replay)."""
        self.seen.update({bound.digests[id(msg)]: bound.model for msg in kept})

    def check(self, server_round: int, replies: Sequence[Message], current: NamedArrays, specs: Sequence[RecordSpec],
              trainable: Sequence[str], max_reply_bytes: int) -> Bound:
        """The checks (module docstring) of this round's replies to the global arrays ``current``, whose uplink the
        method declares as ``specs`` (the size bound, :func:`reply_cap`); client errors pass (the screen counts
        them); each rejection is logged."""
        model = model_digest(current)
        cap = reply_cap(max_reply_bytes, current, specs, trainable)
        sent = {m.metadata.message_id: m.metadata.dst_node_id for m in self._sent if m.metadata.message_id}
        self._sent = []
        reasons = {id(msg): self._reason(msg, sent, cap) for msg in replies if not msg.has_error()}
        fresh = [msg for msg in replies if id(msg) in reasons and reasons[id(msg)] is None]
        digests: dict[int, bytes] = {}
        round_digests = reply_digests([msg.content for msg in fresh])  # all of the round at once
        for msg, digest in zip(fresh, round_digests, strict=True):
            then = self.seen.get(digest)
            if then is not None and then != model:
                reasons[id(msg)] = Rejection(None, Kind.REPLAY, "replay: byte-identical to a reply to an earlier "
                                                                "round's (different) global model")
            else:
                digests[id(msg)] = digest
        kept: list[Message] = []
        rejections: list[Rejection] = []
        for msg in replies:
            reason = reasons.get(id(msg))
            if reason is None:
                kept.append(msg)
                continue
            rejections.append(reason.at(msg.metadata.src_node_id))
            log(WARNING, "Round %d: rejected reply from node %s: %s", server_round, msg.metadata.src_node_id,
                reason.detail)
        return Bound(kept, rejections, digests, model)

    @staticmethod
    def _reason(msg: Message, sent: Mapping[str, int], cap: int) -> Rejection | None:
        """The stale and oversized checks of one reply (the replay check follows for all replies at once)."""
        md = msg.metadata
        if sent and sent.get(md.reply_to_message_id) != md.src_node_id:
            return Rejection(None, Kind.STALE, f"stale: it answers message {md.reply_to_message_id!r}, not this "
                                               f"round's message to node {md.src_node_id}")
        size = content_nbytes(msg.content)
        if size > cap:
            return Rejection(None, Kind.OVERSIZED, f"oversized: {size} bytes > max-reply-bytes {cap}")
        return None

    def state_dict(self) -> dict[str, list[str]]:
        """:attr:`seen` as data: one hex string per reply, its digest then its model's."""
        return {"reply_digests": [(reply + model).hex() for reply, model in self.seen.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (a checkpoint without the entry: nothing remembered)."""
        rows = [bytes.fromhex(row) for row in state.get("reply_digests", [])]
        if any(len(row) != 2 * DIGEST_BYTES for row in rows):
            raise ValueError(f"reply_digests must be hex strings of {2 * DIGEST_BYTES} bytes")
        self.seen = {row[:DIGEST_BYTES]: row[DIGEST_BYTES:] for row in rows}
