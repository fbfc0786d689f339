"""Round preparation for the robust aggregators: what they compare a round's replies with, and whether the round's
sample is large enough for them.

* FLTrust (``aggregator`` in :data:`.robust.TRUST_RULES`): the server's own update on its trusted root set, from the
  strategy's ``root_update`` on the round's train content;
* centered clipping / bucketing (:data:`.robust.VECTOR_RULES`): the centre, the last round's model update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from logging import WARNING

import numpy as np
from flwr.app import RecordDict
from flwr.common import log

from .ops import NamedArrays, is_float
from .params import ConfigError
from .robust import TRUST_RULES, VECTOR_RULES, TooFewReplies, byzantine_count, check_replies
from .rootset import RootUpdate, root_records
from .validation import RecordSpec


def root_reference(aggregator: str, root_update: RootUpdate | None, content: RecordDict, specs: Sequence[RecordSpec],
                   current: Mapping[str, np.ndarray], trainable: Sequence[str]) -> dict[str, NamedArrays] | None:
    """FLTrust's root-set reply of the round (``root_update`` on the round's train ``content``, its records checked
    against the method's uplink ``specs`` and the ``current`` model's layout: :func:`.rootset.root_records`);
    ``None`` under the other aggregators.  A trust rule without ``root_update`` is a :class:`ConfigError` naming the
    fix."""
    if aggregator not in TRUST_RULES:
        return None
    if root_update is None:
        raise ConfigError(
            f"aggregator {aggregator} (defence = robust) needs the server's own update on a trusted root set: "
            f"set root-set-size > 0 (the fedadapt ServerApp), or give the strategy a root_update callable "
            f"(docs/robustness.md); or choose another aggregator")
    return root_records(root_update(content), specs, current, trainable)


def centre_reference(aggregator: str, current: Mapping[str, np.ndarray], previous: NamedArrays | None,
                     ) -> tuple[NamedArrays | None, NamedArrays | None]:
    """Centered clipping's ``(centre, previous)``: the last round's model update (``current − previous``, float64;
    ``None`` in the first round) and this round's model, kept for the next; ``(None, previous)`` under the other
    aggregators."""
    if aggregator not in VECTOR_RULES:
        return None, previous
    centre = None if previous is None else {k: np.asarray(v, np.float64) - previous[k] for k, v in current.items()
                                            if is_float(np.asarray(v)) and k in previous}
    return centre, {k: np.array(v, np.float64) for k, v in current.items() if is_float(np.asarray(v))}


def check_sample_size(aggregator: str, byzantine_fraction: float, num_sampled: int, first_round: bool) -> None:
    """A robust ``aggregator`` whose sample is too small for its ``byzantine-fraction`` (:func:`.robust.min_replies`)
    would refuse every round: before the run's first round that is a :class:`ConfigError` naming the fix (nothing has
    been sent); later (nodes lost) a warning, and the round's replies are refused with the reason as they arrive."""
    if aggregator == "mean" or num_sampled <= 0:
        return
    try:
        check_replies(aggregator, byzantine_count(byzantine_fraction, num_sampled), num_sampled, byzantine_fraction)
    except TooFewReplies as err:
        if first_round:
            raise ConfigError(f"{err} (with {num_sampled} sampled nodes every round would be refused)") from None
        log(WARNING, "%s (%d nodes sampled this round)", err, num_sampled)
