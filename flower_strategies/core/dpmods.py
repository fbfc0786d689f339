"""What Flower's DP layer and fedadapt's client half agree on, shared by the client half (:func:`guard_reply`,
before a reply leaves) and the server (:mod:`.privacy`, which checks the reply's CRC and refuses Flower's DP wrappers):
the config key of Flower's client-side clipping, the reply CRC, the refusal texts.  It imports nothing of the server
side.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

from . import records as R
from .params import ConfigError

#: What a refused combination says to do instead.
FIX = ("use fedadapt's native user-level DP instead: dp-clip = C > 0 and dp-noise-multiplier = z in the run config "
       "(or FedAdaptStrategy(..., dp_clip=C, dp_noise_multiplier=z)), which clips each client's whole uplink and "
       "noises every aggregate; see docs/privacy.md")

#: The config key Flower's client-side clipping wrappers add to every train config (Message API: before calling the
#: wrapped strategy's ``configure_train``; legacy: into each FitIns) and that ``fixedclipping_mod`` /
#: ``adaptiveclipping_mod`` require (``flwr.supercore.differential_privacy.KEY_CLIPPING_NORM`` in Flower 1.42).
CLIPPING_NORM_KEY = "clipping_norm"

#: ``ReplyInfo`` key: a CRC-32 of a reply's only ArrayRecord when that record is not the model — the one reply shape
#: Flower's DP mods process without refusing it themselves; the server checks it
#: (:func:`.privacy.rewritten_reply_reason`).
UPLINK_CRC = "uplink-crc32"

#: Flower's DP components that clip a reply as the model, for the refusal messages.
CLIENT_WRAPPERS = "DifferentialPrivacyClientSide{Fixed,Adaptive}Clipping"
MODS = "LocalDpMod / fixedclipping_mod / adaptiveclipping_mod"


def reply_crc(record: Any) -> int:
    """CRC-32 of a record's keys and array bytes, in order."""
    crc = 0
    for key, arr in record.items():
        crc = zlib.crc32(arr.data if isinstance(arr.data, bytes) else b"", zlib.crc32(key.encode(), crc))
    return crc


def guard_reply(method: str, reply: Mapping[str, Any], config: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The client half's check before its reply leaves (:meth:`~.client.ClientRound.reply`; ``reply``: the array
    records by name).  A model-only reply composes with every Flower DP mod (``LocalDpMod`` is local DP of everything
    the client sends; the clipping mods need a server wrapper, refused by :func:`.privacy.refuse_flower_dp`).
    Otherwise:

    * the train config carries :data:`CLIPPING_NORM_KEY` (a client-side clipping wrapper sent it; the clipping mods
      act only then): raise :class:`~.hparams.ConfigError`;
    * the reply is one ArrayRecord that is not the model (the one shape the mods clip and noise as if it were the
      model instead of refusing it): the returned ``ReplyInfo`` entry carries its CRC-32, and the server rejects a
      reply whose record no longer matches it (a mod rewrote it: :func:`.privacy.rewritten_reply_reason`).

    A reply with several ArrayRecords needs nothing: Flower's mods refuse it themselves
    (:func:`.privacy.mod_refusal_hint`)."""
    names = list(reply)
    if names == [R.MODEL]:
        return []
    if CLIPPING_NORM_KEY in config:
        raise ConfigError(
            f"Flower's fixedclipping_mod / adaptiveclipping_mod (the train config carries '{CLIPPING_NORM_KEY}', sent "
            f"by {CLIENT_WRAPPERS}) cannot wrap the client half of fedadapt method '{method}': it clips (and noises) "
            f"the reply as one model update, but the reply carries the records {names}. Fix: remove the mod and {FIX}")
    return [(UPLINK_CRC, reply_crc(reply[names[0]]))] if len(names) == 1 else []
