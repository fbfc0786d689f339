"""The server's own update on a trusted root set (FLTrust; ``defence = "robust"``): what
:attr:`FedAdaptStrategy.root_update <.strategy.FedAdaptStrategy.root_update>` must be, and a helper that builds it.

:func:`root_update_from` builds the callable from a library user's own model, DataLoader of trusted examples and
loss: each round it copies the round's broadcast model into a private copy of the user's model, runs the method's
own client half on the loader (:func:`.client.train_reply`, exactly what the clients run, with the round's settings)
and returns the reply's array records as NumPy arrays — the trained model, not its difference.

:func:`root_records` is what the strategy does with whatever the callable returns: a ``RecordDict`` (e.g.
:func:`.client.train_reply`'s reply itself) or a mapping of record names to ``ArrayRecord`` / named arrays /
tensors, made named NumPy arrays and checked against the layout the clients' replies must have, so that a wrong
return fails before round 1's replies are screened, with the contract in the message.
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from . import records as R
from .client import ClientRound, train_reply
from .hparams import ConfigError
from .ops import NamedArrays
from .validation import RecordSpec, layout

#: The callable's type: a round's train content → ``{record name: named arrays}`` (see :func:`root_records`).
RootUpdate = Callable[[RecordDict], Any]
#: The root run's client key: its batch order is seeded apart from every client's (partition ids are small).
ROOT_KEY = 2**32 - 1

CONTRACT = (
    "root_update(content) receives the round's train content (what every client receives: the global model under "
    "'arrays', the method's downlink records, the 'config' ConfigRecord), must train a model *loaded from "
    "content['arrays']* with the method's client half on the server's trusted examples, and return the reply's "
    "array records — at least {names} — each with the layout the clients send: the trained model (not its "
    "difference) with the global model's keys, shapes and dtypes; flower_strategies.root_update_from(model, "
    "loader, loss_fn) builds it (docs/robustness.md, 'Turn it on in your own app')")


def _named(value: Any) -> NamedArrays | None:
    """A record's arrays as named NumPy arrays (``None``: not an array record, e.g. a MetricRecord)."""
    if isinstance(value, ArrayRecord):
        return {k: np.asarray(v.numpy()) for k, v in value.items()}
    if isinstance(value, Mapping):
        out: NamedArrays = {}
        for k, v in value.items():
            if isinstance(v, torch.Tensor):
                out[k] = v.detach().cpu().numpy()
            elif hasattr(v, "numpy") and not isinstance(v, np.ndarray):  # a Flower Array
                out[k] = np.asarray(v.numpy())
            else:
                out[k] = np.asarray(v)
        return out
    return None


def root_records(returned: Any, specs: Sequence[RecordSpec], current: Mapping[str, np.ndarray],
                 trainable: Sequence[str]) -> dict[str, NamedArrays]:
    """``returned`` (what a root update gave) as ``{record name: named NumPy arrays}``, checked: every record the
    uplink ``specs`` name that is present has exactly the layout of the clients' replies (``current``'s keys,
    shapes and dtypes; ``trainable`` keys for ``keys="params"`` records), and the first of them is present.  A
    :class:`~.hparams.ConfigError` stating the contract otherwise."""
    names = [s.name for s in specs]
    if isinstance(returned, RecordDict):
        items: Iterable[tuple[str, Any]] = returned.items()
    elif isinstance(returned, Mapping):
        items = returned.items()
    else:
        raise ConfigError(f"root_update returned a {type(returned).__name__}; " + CONTRACT.format(names=names))
    out: dict[str, NamedArrays] = {}
    for name, value in items:
        named = _named(value)
        if named is not None:
            out[str(name)] = named
    for spec in specs:
        got = out.get(spec.name)
        if got is None:
            continue
        expected = layout(current, trainable if spec.keys == "params" else None)
        have = {k: (tuple(np.shape(v)), np.asarray(v).dtype) for k, v in got.items()}
        if have != expected:
            wrong = sorted(set(have) ^ set(expected)) or [k for k in expected if have[k] != expected[k]]
            raise ConfigError(f"root_update's record '{spec.name}' does not have the layout of the clients' replies "
                              f"(keys/shapes/dtypes differ at {wrong[:4]}); " + CONTRACT.format(names=names))
    if specs and specs[0].name not in out:
        raise ConfigError(f"root_update returned the records {sorted(out)}, without '{specs[0].name}'; "
                          + CONTRACT.format(names=names))
    return out


def root_update_from(model: torch.nn.Module, loader: Iterable[Any], loss_fn: Callable[..., torch.Tensor], *,
                     train: Callable[..., Any] | None = None, batch_fn: Callable[[Any], Any] | None = None,
                     seed: int | None = None) -> RootUpdate:
    """The :attr:`~.strategy.FedAdaptStrategy.root_update` of a library user's app:
    ``strategy.root_update = flower_strategies.root_update_from(Net(), root_loader, F.cross_entropy)``.

    ``model``: an instance of the clients' model class (copied once: the callable trains its private copy, loaded
    from each round's broadcast model, and never touches ``model``).  ``loader``: the server's trusted examples, any
    iterable of batches the clients' loop could read (a DataLoader; ``batch_fn`` maps a batch to ``(inputs,
    targets)`` where :func:`.client.train_reply` cannot: dict batches with ``img``/``label``-like keys and pairs
    already work).  ``loss_fn``: the clients' loss.  Each round runs the method's client half
    (:func:`.client.train_reply`) with the round's learning rate, epochs/steps and batch size — the clients' own
    settings — keeping the method's client state (e.g. SCAFFOLD's control variate) across rounds, and returns the
    reply's array records (the trained model under ``"arrays"``, plus e.g. FedLADA's v̂).  ``train``: your
    clients' own loop, ``train(model, loader, lr, optimizer)`` as :class:`~flower_strategies.FedAdaptNumPyClient`
    takes it (``optimizer`` is the method's client half, or ``None`` where the method has none and your loop
    builds its own, e.g. the quickstart's momentum SGD): the root run then trains exactly as your clients do
    (:class:`.client.ClientRound`); default: :func:`.client.train_reply`'s loop.  ``seed``: the batch
    order of tensors / the loss-before sample (default: fresh :mod:`secrets` bits; a loader shuffles itself — keep
    the server's examples and that order to the server: a client that can recompute the root update can steer
    inside the gate)."""
    own = copy.deepcopy(model)
    state = RecordDict()  # the root run's client state, kept across rounds like a client's Context.state
    key = secrets.randbits(63) if seed is None else int(seed)

    def update(content: RecordDict) -> dict[str, NamedArrays]:
        if train is None:
            reply = train_reply(own, content, loader, loss_fn, state=state, seed=key, client_key=ROOT_KEY,
                                batch_fn=batch_fn, loss_before=False)
        else:  # the clients' own loop, as FedAdaptNumPyClient runs it
            rnd = ClientRound(content, state, loader, loss_fn, seed=key, client_key=ROOT_KEY, unpack=batch_fn)
            rnd.load_model(own)
            opt = rnd.optimizer(own) if rnd.needs_client_half else None
            train(own, rnd.loader, rnd.lr, opt)
            reply = rnd.reply(own, opt)
        return {name: {k: np.asarray(v.numpy()) for k, v in record.items()}
                for name, record in R.of_type(reply, ArrayRecord)}
    return update


class RootUpdateSlot:
    """The strategy's :attr:`root_update` (a base of :class:`~.strategy.FedAdaptStrategy`): the contract of the
    callable, and a setter that refuses anything that cannot be called."""

    _root_update: RootUpdate | None = None


    @property
    def root_update(self) -> RootUpdate | None:
        """The server's own training round on its trusted root set, which ``defence = "robust"`` (``aggregator =
        fltrust-gate`` / ``fltrust``) compares every reply with; ``None`` until set (such a run then stops before
        round 1 with a :class:`ConfigError`).  The fedadapt ServerApp sets it from the task (``server_app/root.py``);
        in your own app: ``strategy.root_update = flower_strategies.root_update_from(Net(), root_loader, loss_fn)``.

        Contract of a callable of your own, ``root_update(content)``:

        * **receives** the round's train content, exactly what every sampled client receives: the global model
          x_t under ``"arrays"`` (an ArrayRecord), the method's downlink records (e.g. FedLADA's ``"v-hat"``), and
          the ``"config"`` ConfigRecord (the round's learning rate, epochs/steps, batch size, method);
        * **starts from that model**: load ``content["arrays"]`` into the model before training, every round (a
          model object kept from the last round, with its optimizer's momentum, is not the round's start; the
          clients' replies then point elsewhere and are all rejected);
        * **trains like a client**: the method's client half (:func:`.client.train_reply` / :class:`ClientRound`
          with ``rnd.optimizer(model)``), with the clients' loss and the round's settings, on the server's trusted
          examples (a small clean sample of the clients' distribution; keep it and its batch order secret);
        * **returns** the reply's array records, ``{record name: named arrays}`` — at least the first record of
          :meth:`uplink_specs` (for most methods ``"arrays"``: the **trained model**, not the difference x − x_t),
          each with the layout the clients send (the global model's keys, shapes and dtypes; ``keys="params"``
          records the trainable keys).  A ``RecordDict`` (``train_reply``'s reply itself), ArrayRecords, NumPy
          arrays or tensors are all accepted (:func:`.rootset.root_records`; a wrong layout is a ConfigError
          stating this contract);
        * **keeps** across rounds the method's client state a client would keep (``train_reply(..., state=...)``
          with one ``RecordDict`` for the whole run: SCAFFOLD's control variate, Fed-LAMB's momentum), and nothing
          else.

        A root update that gets this wrong rejects every honest reply: a run whose first round rejects every reply
        for its trust fails at once, saying what to check (:func:`.policy.check_progress`)."""
        return self._root_update

    @root_update.setter
    def root_update(self, fn: RootUpdate | None) -> None:
        if fn is not None and not callable(fn):
            raise TypeError(f"root_update must be a callable (round's train content → reply records), got "
                            f"{type(fn).__name__}")
        self._root_update = fn
