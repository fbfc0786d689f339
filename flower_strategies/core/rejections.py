"""Why the server did not use a train reply: a :class:`Rejection` (node, :class:`Kind`, detail).

The checks that refuse a reply (:mod:`.validation`, :mod:`.screen`, :mod:`.binding`, :mod:`.privacy`, the SecAgg+
adapter) say *what* kind of refusal it is; whoever acts on refusals (the run-failure policy, the divergence warning,
the client-half check) reads :attr:`Rejection.kind`, never the wording.  ``str(rejection)`` is the text the logs,
the metrics file and the failure messages show: ``"node <id>: <detail>"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any


class Kind(str, Enum):
    """The closed set of reasons a reply is not used, in the order the server decides them."""

    #: The ClientApp raised, or its reply carries an error.
    CLIENT_ERROR = "client-error"
    #: A ClientApp mod refused the message before the app ran (Flower's ``MOD_FAILED_PRECONDITION``: its DP mods
    #: refuse a message with several ArrayRecords).
    MOD_REFUSED = "mod-refused"
    #: Stale: the reply answers another round's message (:mod:`.binding`).
    STALE = "stale"
    #: Larger than ``max-reply-bytes`` (:mod:`.binding`).
    OVERSIZED = "oversized"
    #: The bytes of an earlier round's reply, after the global model changed (:mod:`.binding`).
    REPLAY = "replay"
    #: The reply names another method, or no method where only the method's client half could have built it.
    CLIENT_HALF = "client-half"
    #: The ``metrics`` MetricRecord is missing, or its ``num-examples`` / ``num-steps`` unusable.
    METRICS = "metrics"
    #: A declared uplink ArrayRecord is missing.
    MISSING_RECORD = "missing-record"
    #: A record has the wrong keys, or a key the wrong shape, dtype or payload.
    BAD_RECORD = "bad-record"
    #: A check met something it did not foresee (the last line of :func:`.validation.parse_reply`).
    UNREADABLE = "unreadable"
    #: A record holds NaN/Inf.
    NONFINITE = "nonfinite"
    #: A record breaks a structural invariant of its method (a negative second moment, a v̂ below the one sent).
    INVARIANT = "record-invariant"
    #: A record's norm exceeds ``max-update-norm``.
    MAX_NORM = "max-update-norm"
    #: A record's norm exceeds ``update-norm-ratio`` × the round's median.
    NORM_RATIO = "update-norm-ratio"
    #: A ClientApp mod rewrote the reply after fedadapt's client half built it (:mod:`.privacy`).
    REWRITTEN = "rewritten"
    #: The model update points against the round's robust centre (``update-cosine-floor``).
    DIRECTION = "update-cosine-floor"
    #: FLTrust (``fltrust`` / ``fltrust-gate``): the update's cosine with the server's root-set update is <= 0.
    UNTRUSTED = "fltrust-trust"
    #: Krum / multi-Krum left the reply out.
    LEFT_OUT = "left-out"
    #: The round has too few usable replies for the aggregator's ``byzantine-fraction``.
    TOO_FEW = "too-few-replies"
    #: The SecAgg+ adapter rejected the decoded aggregate of the round (no single node: ``node`` is ``None``).
    SECURE_AGGREGATE = "secure-aggregate"
    #: Read back from a checkpoint written before rejections were typed: its text only.
    RESTORED = "restored"


@dataclass(frozen=True)
class Rejection:
    """One refused reply: the node that sent it (``None``: no single node, or not yet known to the check that
    decided it), the :class:`Kind` of refusal, and ``detail``, the words that explain it."""

    node: int | None
    kind: Kind
    detail: str

    def __str__(self) -> str:
        return self.detail if self.node is None else f"node {self.node}: {self.detail}"

    def at(self, node: int) -> Rejection:
        """This rejection, of the reply that ``node`` sent."""
        return replace(self, node=node)

    def to_state(self) -> dict[str, Any]:
        """As JSON-able data (a checkpoint's round history)."""
        return {"node": self.node, "kind": self.kind.value, "detail": self.detail}

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | str) -> Rejection:
        """From :meth:`to_state`'s data, or from the text an older checkpoint kept (:attr:`Kind.RESTORED`)."""
        if isinstance(state, str):
            return cls(None, Kind.RESTORED, state)
        node = state["node"]
        return cls(None if node is None else int(node), Kind(state["kind"]), str(state["detail"]))
