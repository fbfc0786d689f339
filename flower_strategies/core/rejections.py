"""Why the server did not use a train reply: a :class:`Rejection` (node, :class:`Kind`, detail).

The checks that refuse a reply (:mod:`.validation`, :mod:`.screen`, :mod:`.binding`, :mod:`.privacy`, the SecAgg+
adapter) say *what* kind of refusal it is; whoever acts on refusals (the run-failure policy, the divergence warning,
the client-half check) reads :attr:`Rejection.kind`, never the wording.  ``str(rejection)`` is the text the logs,
the metrics file and the failure messages show: ``"node <id>: <detail>"``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: Flower's error reason for an exception in a ClientApp: ``<class 'ValueError'>:<'message'>``.
_FLOWER_REASON = re.compile(r"<class '([^']+)'>:<'(.*)'>", re.S)
#: A traceback's exception line: ``ValueError: message`` (a dotted name that ends as exception names do).
_RAISED = re.compile(r"([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|Failure|Fault))(?:: (.*))?")
_EXCEPTION_LINE = re.compile(r"([A-Za-z_][\w.]*)(?:: (.*))?")
#: A chained traceback's separator: the exception line before it is the cause (the user's).
_CAUSE = "The above exception was the direct cause of the following exception:"
#: What Flower's ClientAppException puts before the user's message (its Ray actor re-raises every exception so).
_WRAPPED = re.compile(r"Exception ClientAppException occurred\. Message: (.*)")


def client_error_text(reason: str | None) -> str:
    """A client's error reason, the user's exception first: ``"ValueError: message"``, then the transport that
    carried it (``[via RayTaskError(ClientAppException)]``); the transport's repr, pid, address and traceback frames
    are dropped, so that a reason cut to a line's width keeps the user's words.

    Flower reports an exception in a ClientApp as ``<class 'T'>:<'str(exception)'>``; under its Ray simulation
    backend ``T`` is ``ray.exceptions.RayTaskError(ClientAppException)`` and the string is Ray's: the actor's repr
    and the traceback, whose first exception line is the user's (the ClientAppException after it carries only its
    message).  Any other reason is returned with its whitespace collapsed."""
    text = _ANSI.sub("", str(reason or "")).strip()
    found = _FLOWER_REASON.fullmatch(text)
    if found is None:
        return " ".join(text.split())
    carrier, message = found.group(1).rsplit(".", 1)[-1], found.group(2)
    cause = _EXCEPTION_LINE.fullmatch(message.split(_CAUSE)[0].rstrip().rsplit("\n", 1)[-1].strip()) \
        if _CAUSE in message else None
    raised = [cause] if cause else [
        m for line in message.splitlines()
        if (m := _RAISED.fullmatch(line.rstrip())) and not m.group(1).endswith("ClientAppException")]
    wrapped = _WRAPPED.search(message)
    if raised:  # a traceback (Ray's): its first exception line, the one that caused the wrapping, is the user's
        user = f"{raised[0].group(1).rsplit('.', 1)[-1]}: {raised[0].group(2) or ''}"
    elif wrapped:  # only the message survived the wrapping
        user = wrapped.group(1)
    else:
        user = f"{carrier}: {message}"
    user = " ".join(user.split())
    return user if user.startswith(f"{carrier}:") else f"{user} [via {carrier}]"


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
