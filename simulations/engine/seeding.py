"""Many seeded NumPy generators at once: ``np.random.default_rng(entropy)`` for every client of a round.

The vectorized engine draws each client's mini-batches exactly as the sequential ClientApp does
(:func:`~flower_strategies.core.client.batch_indices`: a fresh ``default_rng([seed, round, client])`` per client and
round).  Building that generator costs ≈ 25 µs (the ``SeedSequence`` hash, a ``PCG64`` and a ``Generator`` object),
more than drawing the client's permutations.  :func:`generators` gives the same generators for a whole list of
entropies: the ``SeedSequence`` hash of all of them in a few NumPy operations over uint32 arrays (one element per
entropy), then the ``PCG64`` seeding in Python integers, then one reused ``Generator`` whose bit generator is set to
each entropy's state in turn (≈ 1.5 µs).

Measured reason (docs/results/vectorized/README.md, "Seeding by NumPy itself"): without it the 100-client vectorized
benchmark round took 0.34 s instead of 0.26 s (3 rounds; 0.72 / 0.51 s at 10); its plain twin is ``default_rng``
itself (the fallback below), tested equal in tests/test_vectorized_plan.py.

NumPy documents both steps as stable (a seed gives the same stream in every release); the arithmetic here is
checked against ``default_rng`` itself at import (:data:`EXACT`), and an entropy this module does not handle
(a value outside ``[0, 2**32)``, entropies of unequal lengths) or a failed import check gives ``default_rng`` itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

# SeedSequence's hash (O'Neill's seed_seq_fe, as NumPy implements it): pool of 4 uint32 words.
_POOL = 4
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R, _SHIFT = 0xCA01F9DD, 0x4973F715, 16
_M32, _M64, _M128 = (1 << 32) - 1, (1 << 64) - 1, (1 << 128) - 1
#: PCG64's 128-bit LCG multiplier.
_PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645


class _Hash:
    """The running hash constant of one ``hashmix`` sequence (the same for every entropy: a Python int)."""

    def __init__(self, init: int, mult: int) -> None:
        self.value, self.mult = init, mult

    def mix(self, words: np.ndarray) -> np.ndarray:
        words = words ^ np.uint32(self.value)
        self.value = (self.value * self.mult) & _M32
        words = words * np.uint32(self.value)
        return words ^ (words >> np.uint32(_SHIFT))


def _combine(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.uint32(_MIX_L) * x - np.uint32(_MIX_R) * y
    return out ^ (out >> np.uint32(_SHIFT))


def _pool(entropy: np.ndarray) -> list[np.ndarray]:
    """SeedSequence's entropy pool of every row of ``entropy`` (uint32, shape (count, words))."""
    h = _Hash(_INIT_A, _MULT_A)
    zeros = np.zeros(len(entropy), np.uint32)
    pool = [h.mix(entropy[:, i] if i < entropy.shape[1] else zeros) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = _combine(pool[dst], h.mix(pool[src]))
    for src in range(_POOL, entropy.shape[1]):
        for dst in range(_POOL):
            pool[dst] = _combine(pool[dst], h.mix(entropy[:, src]))
    return pool


def pcg64_states(entropies: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """``(state, inc)`` of ``PCG64(SeedSequence(e))`` for every entropy ``e`` (a sequence of ints in ``[0, 2**32)``,
    all of one length): ``SeedSequence.generate_state(4, uint64)`` as two 128-bit numbers, then PCG64's seeding."""
    entropy = np.asarray(entropies, dtype=np.uint32).reshape(len(entropies), -1)
    with np.errstate(over="ignore"):
        pool = _pool(entropy)
        h = _Hash(_INIT_B, _MULT_B)
        words = [h.mix(pool[i % _POOL]).astype(np.uint64) for i in range(8)]  # 8 uint32 words = 4 uint64
    halves = [(words[2 * j] | (words[2 * j + 1] << np.uint64(32))).tolist() for j in range(4)]
    out = []
    for s_hi, s_lo, i_hi, i_lo in zip(*halves, strict=True):
        inc = ((((i_hi << 64) | i_lo) << 1) | 1) & _M128
        # PCG64's seeding: from state 0 one step (state = inc), add the seed, one more step
        state = (((inc + ((s_hi << 64) | s_lo)) & _M128) * _PCG_MULT + inc) & _M128
        out.append((state, inc))
    return out


def _handled(entropies: Sequence[Sequence[int]]) -> bool:
    if not entropies:
        return False
    length = len(entropies[0])
    return all(len(e) == length and all(type(v) is int and 0 <= v <= _M32 for v in e) for e in entropies)


def _check() -> bool:
    """Whether :func:`pcg64_states` agrees with NumPy's own seeding (a few entropies of the shapes used)."""
    samples = [[0, 1, 0], [7, 123, 99], [_M32, 0, 5], [3], [1, 2, 3, 4, 5, 6], [42, 1, 2, 1]]
    try:
        for e in samples:
            want = np.random.default_rng(e).bit_generator.state["state"]
            if pcg64_states([e])[0] != (want["state"], want["inc"]):
                return False
    except Exception:  # noqa: BLE001 - another NumPy: use default_rng
        return False
    return True


#: The import-time check of :func:`pcg64_states` against ``np.random.default_rng`` passed.
EXACT = _check()


def generators(entropies: Sequence[Sequence[int]]) -> Iterator[np.random.Generator]:
    """``np.random.default_rng(e)`` for each entropy ``e`` in turn, drawing the same numbers.  One ``Generator``
    object is re-seeded for every entropy: use each yielded generator before asking for the next."""
    if not (EXACT and _handled(entropies)):
        for e in entropies:
            yield np.random.default_rng(list(e))
        return
    bits = np.random.PCG64()
    gen = np.random.Generator(bits)
    for state, inc in pcg64_states(entropies):
        bits.state = {"bit_generator": "PCG64", "state": {"state": state, "inc": inc}, "has_uint32": 0,
                      "uinteger": 0}
        yield gen


__all__ = ["EXACT", "generators", "pcg64_states"]
