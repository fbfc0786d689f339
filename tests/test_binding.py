"""A reply is bound to its round (``flower_strategies.core.binding``): a stale reply (answering an earlier round's
message), an oversized reply (beyond ``max-reply-bytes``) and a replayed reply (the bytes of an earlier round's reply,
sent again after the global model changed) are rejected with their reason and counted; the model is what it is
without them.  In-process (``LoopbackGrid`` and its ``intercept`` hook), stock Message-API clients."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import flower_strategies as fs
from flower_strategies.core import records as R
from flower_strategies.core.binding import (REPLY_BYTES_FACTOR, REPLY_BYTES_SLACK, ReplyBinder, content_nbytes,
                                            expected_reply_bytes, reply_digest)
from flower_strategies.core.hparams import ConfigError
from flower_strategies.core.rejections import Kind
from flower_strategies.core.screen import ReplyScreen
from flower_strategies.core.validation import RecordSpec
from simulations.engine.inprocess import LoopbackGrid

INIT = {"w": np.zeros(3, np.float32), "b": np.zeros(1, np.float32)}
ROUNDS = 4


def stock_client() -> ClientApp:
    """A plain Flower client (no fedadapt import): node ``p`` answers model + 0.1·(p+1) with 10 + p examples."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        p = int(context.node_config["partition-id"])
        step = np.float32(0.1 * (p + 1))
        arrays = {k: (v.numpy() + step).astype(np.float32) for k, v in msg.content["arrays"].items()}
        content = RecordDict({"arrays": R.to_record(arrays), "metrics": MetricRecord({"num-examples": 10 + p})})
        return Message(content=content, reply_to=msg)

    return app


def run(intercept, **settings):
    """FedAvg, 3 nodes, ``ROUNDS`` rounds: ``(final arrays, history)``."""
    strategy = fs.FedAvg(min_available_nodes=3, min_train_nodes=3, fraction_evaluate=0.0, **settings)
    grid = LoopbackGrid(stock_client(), 3, {}, intercept=intercept)
    result = strategy.start(grid=grid, initial_arrays=R.to_record(INIT), num_rounds=ROUNDS)
    return R.to_numpy(result.arrays), strategy.history


def replaying(partitions, *, stale=False):
    """``intercept``: from round 2 on, ``partitions`` re-send their round-1 reply — its content as the answer to this
    round's message (a Byzantine client), or (``stale``) the round-1 reply message itself."""
    first: dict[int, Message] = {}

    def intercept(request, reply, p):
        if p not in partitions:
            return reply
        if int(request.content["config"]["server-round"]) == 1:
            first[p] = reply
            return reply
        return first[p] if stale else Message(content=first[p].content, reply_to=request)

    return intercept


def dropping(partitions):
    """``intercept``: from round 2 on, ``partitions`` answer with a client error (the run without them)."""
    def intercept(request, reply, p):
        if p in partitions and int(request.content["config"]["server-round"]) > 1:
            return Message(Error(code=0, reason="left"), reply_to=request)
        return reply

    return intercept


@pytest.mark.parametrize("stale", [False, True], ids=["replayed-content", "stale-message"])
def test_one_client_replaying_its_round1_reply_is_rejected_and_the_model_is_as_without_it(stale):
    arrays, history = run(replaying({0}, stale=stale))
    reference, ref_history = run(dropping({0}))  # the same rounds without node 0's replies after round 1
    for key in INIT:
        np.testing.assert_array_equal(arrays[key], reference[key])
    assert [h.updated for h in history] == [True] * ROUNDS
    assert [h.replies_used for h in history] == [3] + [2] * (ROUNDS - 1)
    assert [h.replies_rejected for h in history] == [0] + [1] * (ROUNDS - 1)
    reason = "stale: it answers message" if stale else "replay: byte-identical to a reply to an earlier round"
    assert all(str(h.rejections[0]).startswith(f"node 1: {reason}") for h in history[1:]), history[1].rejections
    clean, _ = run(None)
    assert not np.array_equal(arrays["w"], clean["w"])  # node 0's fresh replies would have moved the model


def test_every_client_replaying_updates_nothing_after_round1_and_is_counted():
    arrays, history = run(replaying({0, 1, 2}), max_idle_rounds=0, max_rejected_rounds=0)
    assert [h.updated for h in history] == [True] + [False] * (ROUNDS - 1)
    assert [h.replies_rejected for h in history] == [0] + [3] * (ROUNDS - 1)
    assert all(r.kind is Kind.REPLAY and r.detail.startswith("replay:") for h in history[1:] for r in h.rejections)
    # the model is round 1's: the example-weighted mean of 0.1·(p+1), weights 10, 11, 12
    expected = np.float32(sum(np.float32(0.1 * (p + 1)) * (10 + p) for p in range(3)) / 33)
    np.testing.assert_allclose(arrays["w"], expected, rtol=1e-6)


def reply_to(request: Message, arrays: dict[str, np.ndarray], node: int = 1, **records) -> Message:
    content = RecordDict({"arrays": R.to_record(arrays), "metrics": MetricRecord({"num-examples": 10}), **records})
    reply = Message(content=content, reply_to=request)
    reply.metadata.__dict__["_src_node_id"] = node
    return reply


def train_request(node: int = 1) -> Message:
    msg = Message(RecordDict(), node, "train")
    msg.metadata.__dict__["_message_id"] = f"m{node}-{np.random.default_rng().integers(1 << 62)}"
    return msg


def check(binder: ReplyBinder, current, replies, max_reply_bytes=0, sent=()):
    """One round of the binder's checks, FedAvg's screen and the binder's memory, as ``aggregate_train`` runs them:
    ``(the replies kept, the rejections)``."""
    binder.expect(sent)
    specs = (RecordSpec(R.MODEL, "mean", "model"),)
    bound = binder.check(1, replies, current, specs, list(current), max_reply_bytes)
    screened = ReplyScreen(current, specs, list(current)).run(1, bound.passed)
    binder.remember(bound, [r.msg for r in screened.kept])
    return [r.msg for r in screened.kept], [str(r) for r in bound.rejections + screened.rejections]


def test_identical_bytes_are_a_replay_only_when_the_global_model_changed():
    """An unchanged model (a round without update; client-lr = 0) may get the same bytes again: no replay."""
    binder = ReplyBinder()
    x0 = {"w": np.zeros(3, np.float32)}
    x1 = {"w": np.ones(3, np.float32)}
    answer = {"w": np.full(3, 0.5, np.float32)}
    kept, rejected = check(binder, x0, [reply_to(train_request(), answer)])
    assert len(kept) == 1 and not rejected
    kept, rejected = check(binder, x0, [reply_to(train_request(), answer)])  # same model again: legitimate
    assert len(kept) == 1 and not rejected
    kept, rejected = check(binder, x1, [reply_to(train_request(), answer, node=4)])  # any node's old bytes
    assert not kept and rejected == ["node 4: replay: byte-identical to a reply to an earlier round's (different) "
                                     "global model"]
    same_round = [reply_to(train_request(), {"w": np.full(3, 2.0, np.float32)}, node=n) for n in (1, 2)]
    kept, rejected = check(binder, x1, same_round)  # two nodes with identical data and seeds in one round
    assert len(kept) == 2 and not rejected
    # the digests survive a checkpoint (data only: hex strings) and a forged entry is refused
    restored = ReplyBinder()
    restored.load_state_dict(binder.state_dict())
    assert restored.seen == binder.seen and len(restored.seen) == 2
    with pytest.raises(ValueError, match="reply_digests must be hex strings of 32 bytes"):
        restored.load_state_dict({"reply_digests": ["00ff"]})


def test_a_reply_must_answer_this_rounds_message_to_its_own_node():
    binder = ReplyBinder()
    x0 = {"w": np.zeros(3, np.float32)}
    mine, other, old = train_request(1), train_request(2), train_request(1)
    replies = [reply_to(mine, x0, node=1), reply_to(old, x0, node=1), reply_to(other, x0, node=3)]
    kept, rejected = check(binder, x0, replies, sent=[mine, other])
    assert kept == replies[:1]
    assert rejected == [f"node 1: stale: it answers message '{old.metadata.message_id}', not this round's message to "
                        f"node 1", f"node 3: stale: it answers message '{other.metadata.message_id}', not this "
                        f"round's message to node 3"]


def test_an_oversized_reply_is_refused_before_its_payload_is_read():
    binder = ReplyBinder()
    x0 = {"w": np.zeros(3, np.float32), "b": np.zeros(1, np.float32)}
    spec = (RecordSpec(R.MODEL, "mean", "model"),)
    assert expected_reply_bytes(x0, spec, list(x0)) == 16
    derived = REPLY_BYTES_FACTOR * 16 + REPLY_BYTES_SLACK
    garbage = ArrayRecord({"w": Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=b"\0" * derived),
                           "b": Array(dtype="float32", shape=(1,), stype="numpy.ndarray", data=b"junk")})
    huge = Message(RecordDict({"arrays": garbage, "metrics": MetricRecord({"num-examples": 10})}),
                   reply_to=train_request())
    huge.metadata.__dict__["_src_node_id"] = 1
    kept, rejected = check(binder, x0, [huge])  # never parsed: its malformed payload is not what it is rejected for
    size = derived + 4 + len("num-examples") + 8
    assert not kept and rejected == [f"node 1: oversized: {size} bytes > max-reply-bytes {derived}"]
    small = reply_to(train_request(), x0)
    payload = sum(len(a.data) for a in small.content["arrays"].values())  # .npy bytes: 16 of data + 2 headers
    assert payload == 16 + 2 * 128 and content_nbytes(small.content) == payload + len("num-examples") + 8
    big_metrics = reply_to(train_request(), x0, extra=MetricRecord({"spam": [1.0] * 20}),
                           info=ConfigRecord({"note": "x" * 10}))
    assert content_nbytes(big_metrics.content) == payload + 20 + (4 + 160) + (4 + 10)
    kept, rejected = check(binder, x0, [small, big_metrics], max_reply_bytes=300)
    assert kept == [small] and rejected == [f"node 1: oversized: {payload + 198} bytes > max-reply-bytes 300"]
    with pytest.raises(ConfigError, match="max_reply_bytes = -1 is out of range"):
        fs.FedAvg(max_reply_bytes=-1)


# empty, tail only, one word, words + tail, several fingerprint blocks + tail
@pytest.mark.parametrize("size", [0, 7, 8, 4096 * 8 + 3, (1 << 18) * 8 * 2 + 5])
def test_the_reply_digest_is_equal_for_equal_bytes_and_changes_with_any_bit(size):
    rng = np.random.default_rng(size)
    data = rng.integers(0, 256, size=size, dtype=np.uint8)

    def digest(buf: np.ndarray) -> bytes:
        arr = Array(dtype="uint8", shape=(buf.size,), stype="numpy.ndarray", data=buf.tobytes())
        return reply_digest(RecordDict({R.MODEL: ArrayRecord({"w": arr})}))

    assert digest(data) == digest(data.copy())
    for pos in sorted({0, size // 2, size - 1}) if size else []:
        for bit in (0, 7):
            flipped = data.copy()
            flipped[pos] ^= np.uint8(1 << bit)
            assert digest(flipped) != digest(data), (pos, bit)
    if size >= 16:  # two words swapped: a plain sum would not see it
        swapped = data.copy()
        swapped[:8], swapped[8:16] = data[8:16], data[:8].copy()
        assert (digest(swapped) == digest(data)) == bool((data[:8] == data[8:16]).all())


def test_changes_that_cancel_in_a_sum_are_seen_unless_a_lane_period_apart():
    """One word one up and another one down (a near-replay's nudges, sparse updates of one ulp): seen anywhere in a
    block, except exactly 2**14 words (128 KiB) apart, the documented limit of the lanes."""
    words = np.random.default_rng(1).integers(1, 2**62, size=(1 << 18) + 100, dtype=np.uint64)

    def digest(w: np.ndarray) -> bytes:
        arr = Array(dtype="uint64", shape=(w.size,), stype="numpy.ndarray", data=w.tobytes())
        return reply_digest(RecordDict({R.MODEL: ArrayRecord({"w": arr})}))

    base = digest(words)
    for a, b in ((0, 1), (5, 4096), (7, (1 << 14) + 8), (3, (1 << 18) + 2), (10, (1 << 14) + 10)):
        nudged = words.copy()
        nudged[a] += np.uint64(1)
        nudged[b] -= np.uint64(1)
        assert (digest(nudged) == base) == ((b - a) % (1 << 14) == 0 and b < (1 << 18)), (a, b)


def _reference_block(words: list[int]) -> bytes:
    """One block of the documented fingerprint in Python integers: the lanes (words added by position mod 2**14),
    then their sum and their sum weighted by the fixed multipliers, mod 2**64."""
    import operator

    from flower_strategies.core.binding import _LANES, _WEIGHTS

    lanes = [0] * min(len(words), _LANES)
    for at, word in enumerate(words):
        lanes[at % _LANES] += word
    weighted = sum(map(operator.mul, lanes, _WEIGHTS[: len(lanes)].tolist()))
    return (sum(lanes) % 2**64).to_bytes(8, "little") + (weighted % 2**64).to_bytes(8, "little")


@pytest.mark.parametrize("size", [0, 7, 8, 4096 * 8 + 3, (1 << 14) * 8, (1 << 14) * 8 + 24, (1 << 18) * 8,
                                  (1 << 18) * 8 + 8, (1 << 18) * 8 * 2 + (1 << 14) * 8 + 16])
def test_the_fingerprint_is_its_definition_block_by_block(size):
    """Digests are checkpointed: the fingerprint (one-block and stacked paths included) stays exactly the documented
    one — length, the tail past the last whole word, then per block of 2**18 words the sum and the weighted sum of
    its 2**14 lanes."""
    import hashlib

    from flower_strategies.core.binding import _BLOCK, _absorb

    data = np.random.default_rng(size).integers(0, 256, size=size, dtype=np.uint8).tobytes()
    ours, ref = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)
    _absorb(ours, data)
    whole = size - size % 8
    ref.update(size.to_bytes(8, "little") + data[whole:])
    words = np.frombuffer(data[:whole], "<u8").tolist()  # Python ints: exact products and sums
    for start in range(0, len(words), _BLOCK):
        ref.update(_reference_block(words[start:start + _BLOCK]))
    assert ours.digest() == ref.digest()


def _reference_digest(content: RecordDict) -> bytes:
    """The documented reply digest, array by array, with Python integers (no fingerprint code of the module)."""
    import hashlib

    from flower_strategies.core.binding import _BLOCK

    h = hashlib.blake2b(digest_size=16)
    for name, rec in sorted((n, r) for n, r in content.items() if isinstance(r, ArrayRecord)):
        for key, arr in rec.items():
            data = arr.data if isinstance(arr.data, (bytes, bytearray, memoryview)) else b""
            data = bytes(data)
            h.update(repr((name, key, arr.dtype, arr.shape, arr.stype, type(arr.data), len(data))).encode())
            whole = len(data) - len(data) % 8
            h.update(len(data).to_bytes(8, "little") + data[whole:])
            words = np.frombuffer(data[:whole], "<u8").tolist()
            for start in range(0, len(words), _BLOCK):
                h.update(_reference_block(words[start:start + _BLOCK]))
    return h.digest()


def test_a_rounds_digests_computed_together_are_each_replys_own(monkeypatch):
    """``reply_digests`` stacks equal-length arrays of many replies (in matrices of at most ``_STACK_BYTES``): each
    digest is still its reply's documented one — for equal and unequal lengths, tails, several blocks, empty and
    malformed payloads, and replies with several records."""
    from flower_strategies.core import binding

    monkeypatch.setattr(binding, "_STACK_BYTES", 3 * 256)  # a stack of 256-byte arrays holds 3 rows
    rng = np.random.default_rng(5)

    def arr(nbytes: int, data=None) -> Array:
        out = Array(dtype="uint8", shape=(1,), stype="numpy.ndarray", data=b"x")
        payload = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes() if data is None else data
        out.__dict__.update(shape=(nbytes,), data=payload)  # any length, or what a malformed reply may hold
        return out

    contents = []
    for i in range(8):
        model = {"w": arr(256), "b": arr(40 + i % 3), "t": arr(3)}  # stacked; some lengths shared, tails
        if i == 2:
            model["big"] = arr((1 << 18) * 8 + 24)  # more than one block
        if i == 5:
            model["e"] = arr(0)
            model["odd"] = arr(8, data="not bytes")  # a malformed payload counts as empty
        contents.append(RecordDict({"arrays": R.filled(ArrayRecord(), model.items()), "m": ArrayRecord({"x": arr(256)}),
                                    "metrics": MetricRecord({"num-examples": 1})}))
    contents.append(contents[0])  # the same reply twice
    got = binding.reply_digests(contents)
    assert got == [_reference_digest(c) for c in contents]
    assert got == [reply_digest(c) for c in contents] and got[0] == got[-1] and len(set(got)) == 8


def test_a_round_mixing_every_rejection_reports_them_in_reply_order():
    """Stale, oversized and replayed replies, a client error and good replies in one round: each decided as alone,
    the rejections in the order of the replies."""
    LoopbackGrid(stock_client(), 1, {})  # the message factory's task identity
    binder = ReplyBinder()
    x0, x1 = {"w": np.zeros(3, np.float32)}, {"w": np.ones(3, np.float32)}
    old = {"w": np.full(3, 0.5, np.float32)}
    check(binder, x0, [reply_to(train_request(), old)])  # remembered for round 2
    requests = [train_request(n) for n in range(1, 7)]
    replies = [reply_to(requests[0], {"w": np.full(3, 2.0, np.float32)}, node=1),
               reply_to(requests[1], old, node=2),                                          # replay
               reply_to(train_request(3), x1, node=3),                                      # stale
               reply_to(requests[3], {"w": np.zeros(100, np.float32)}, node=4),             # oversized
               Message(Error(code=0, reason="left"), reply_to=requests[4]),                 # client error
               reply_to(requests[5], {"w": np.full(3, 3.0, np.float32)}, node=6)]
    replies[4].metadata.__dict__["_src_node_id"] = 5
    kept, rejected = check(binder, x1, replies, max_reply_bytes=300, sent=requests)
    assert kept == [replies[0], replies[5]]
    assert [r.split(":")[:2] for r in rejected] == [["node 2", " replay"], ["node 3", " stale"],
                                                     ["node 4", " oversized"], ["node 5", " client error"]]
