"""The vectorized engine's per-round plan: every client's mini-batches and round exactly as the sequential ClientApp
has them.

``simulations.engine.seeding.generators`` re-seeds one NumPy generator per entropy instead of building
``np.random.default_rng(entropy)``; ``simulations.engine.vectorized._batch_plan`` draws each client's epochs in one
call.
Both must give the sequential engine's numbers bit for bit (NumPy itself is the reference).  The clients of one
round content share its parsed ClientRound (``_for_client``)."""

from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from flower_strategies.core.client import ClientRound, batch_indices
from simulations.engine import seeding
from simulations.engine.vectorized import _batch_plan, _for_client
from tests.helpers import client_keys

WORD = st.integers(0, 2**32 - 1)


def test_the_import_check_passed():
    assert seeding.EXACT  # else every plan silently takes the slow path: NumPy changed its seeding


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6).flatmap(lambda k: st.lists(st.lists(WORD, min_size=k, max_size=k), min_size=1,
                                                      max_size=8)))
def test_generators_are_default_rng(entropies):
    """Same PCG64 state (also for entropies longer than SeedSequence's pool of 4 words) and the same draws."""
    for e, gen in zip(entropies, seeding.generators(entropies), strict=True):
        want = np.random.default_rng(e)
        assert gen.bit_generator.state == want.bit_generator.state
        assert (gen.permutation(17) == want.permutation(17)).all()


@pytest.mark.parametrize("entropies", [[[0, 1, 2**32]], [[0, 1], [0, 1, 2]], [[np.int64(3), 1, 2]], []])
def test_entropies_the_fast_path_does_not_handle_get_default_rng(entropies):
    gens = list(seeding.generators(entropies))
    assert len(gens) == len(entropies) and len({id(g) for g in gens}) == len(gens)  # each its own default_rng
    for e, gen in zip(entropies, gens, strict=True):
        assert gen.bit_generator.state == np.random.default_rng([int(v) for v in e]).bit_generator.state


def _rnd(batch: int, key: int, server_round: int = 3, seed: int = 0, full: bool = False):
    return types.SimpleNamespace(full_batch=full, config={"batch-size": batch}, seed=seed, server_round=server_round,
                                 client_key=key)


@pytest.mark.parametrize("batch, sizes, steps", [
    (32, [14, 15, 14], [5, 5, 5]),          # one batch per epoch (the benchmark's case)
    (4, [10, 12, 3], [9, 7, 2]),            # several batches per epoch, short last batches, partial epochs
    (5, [10, 7, 1], [6, 0, 3]),             # a client without steps; a client of one example
    (8, [20, 9], [1, 1]),                   # full-batch round (below)
])
def test_the_batch_plan_is_every_clients_batch_indices(batch, sizes, steps):
    full = steps == [1, 1]
    rnds = [_rnd(batch, key, full=full) for key in (7, 0, 123456)[: len(sizes)]]
    index, count = _batch_plan(rnds, sizes, steps)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    assert index.shape[:2] == count.shape == (max(steps), len(sizes))
    for c, (rnd, n, k) in enumerate(zip(rnds, sizes, steps, strict=True)):
        want = batch_indices(n, n if full else batch, k, rnd.seed, rnd.server_round, rnd.client_key)
        assert count[:, c].tolist() == [len(b) for b in want] + [0] * (max(steps) - k)
        for s in range(max(steps)):
            real = want[s] + offsets[c] if s < k else np.zeros(0, np.int64)
            assert index[s, c, : len(real)].tolist() == real.tolist()
            assert (index[s, c, len(real):] == offsets[c]).all()  # padding: the client's first example


def test_a_client_of_the_same_round_content_is_a_freshly_built_client_round():
    config = {"method": "scaffold", "server-round": 4, "client-lr": 0.1, **client_keys("scaffold")}
    content = RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord(config)})
    first = ClientRound(content, RecordDict(), seed=3, client_key=1)
    state = RecordDict()
    other = _for_client(first, state, 5, 9)
    assert vars(other) == vars(ClientRound(content, state, seed=5, client_key=9))
    assert other.state is state and first.client_key == 1 and first.seed == 3
