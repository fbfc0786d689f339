"""One round of a method's client half, inside any training loop: :class:`ClientRound`.

Your own loop (your DataLoader, device, augmentation, batch objects)::

    from flower_strategies import ClientRound

    @app.train()
    def train(msg, context):
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())   # the global model x_t
        rnd = ClientRound(msg.content, context.state, trainloader, loss_fn)   # method, lr, plan, downlink, loader
        opt = rnd.optimizer(model) if rnd.needs_client_half else None         # None: keep your own optimizer
        train_loss = my_train(model, rnd.loader, rnd.lr, optimizer=opt)       # your loop over rnd.loader
        return Message(rnd.reply(model, opt, train_loss=train_loss), reply_to=msg)

``rnd.loader`` yields your loader's own batch objects — exactly the round's planned steps in its first pass (one
batch of every example in FedDA's full-batch rounds), nothing in later passes — and MimeLite's full gradient is
computed from the loader and ``loss_fn`` by :meth:`ClientRound.optimizer`.

The round's ConfigRecord says what the client must know (:mod:`.wire`): the method, whether it has a client half,
which local optimizer (looked up in :data:`~flower_strategies.core.local.LOCAL_OPTIMIZERS`), whether the server
reads ``train-loss-before`` and whether the optimizer needs the full local gradient; the optimizer is built from
the server-owned hyper-parameters in the same ConfigRecord.  Or the one-call loop: :func:`.loop.train_reply`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import Tensor, nn

from .. import records as R
from ...optimizers import BUILT_IN  # noqa: F401 - the built-in local optimizers, registered client-side
from ..local import LocalOptimizer, local_optimizer_named
from ..dpmods import guard_reply
from .data import (
    Batch, LossFn, TensorPartition, batch_indices, concat_batches, full_gradient_from, loss_before_sample, mean_loss,
    num_examples_of, num_local_steps,
)
from .wire import (
    downlink_records, load_client_state, read_round_config, record_tensors, save_client_state, tensor_record,
)


class ClientRound:
    """One round of a method's client half, read from the train message; your loop drives it.

    Parameters
    ----------
    content
        The train message's ``RecordDict`` (``msg.content``).
    state
        The node's ``Context.state`` (persistent client state of methods such as SCAFFOLD and Fed-LAMB is read from
        it and written back by :meth:`reply`); ``None`` for methods without one.
    loader, loss_fn
        Your training data (a DataLoader or any re-iterable of batches, or a :class:`TensorPartition`) and loss
        (``loss_fn(model(inputs), targets)``, averaging over its batch): with them the round plans its steps from
        ``len(loader.dataset)``, :attr:`loader` yields the round's batches, and :meth:`optimizer` computes the full
        local gradient for methods that need one (MimeLite).  Optional: without them pass ``num_examples=`` and
        ``full_gradient=`` yourself.
    seed, client_key
        Seed the mini-batch order of a :class:`TensorPartition` and the ``loss-before-max-examples`` sample
        (with the round number).
    unpack
        ``unpack(batch) -> (inputs, targets)`` for the library's own passes over ``loader`` (full gradient,
        :meth:`loss_before`, :func:`train_reply`); tensors are then moved to the model's device.  Default
        (:func:`as_xy`): ``(x, y, ...)`` sequences, and mappings with one key of :data:`INPUT_KEYS` and one of
        :data:`TARGET_KEYS` (e.g. flwr-datasets' ``{"img": ..., "label": ...}``).  Your loop always gets the
        loader's own batch objects.
    """

    def __init__(self, content: RecordDict, state: RecordDict | None = None, loader: Iterable[Any] | None = None,
                 loss_fn: LossFn | None = None, *, seed: int = 0, client_key: int = 0,
                 unpack: Callable[[Any], Batch] | None = None) -> None:
        self.content = content
        self.state = state
        self.config: dict[str, Any] = read_round_config(content)
        #: The method's local optimizer class, named by the round's ``local-optimizer``.
        self.local_optimizer: type[LocalOptimizer] = local_optimizer_named(str(self.config[R.LOCAL_OPTIMIZER]))
        self.seed, self.client_key = int(seed), int(client_key)
        self.data, self.loss_fn, self.unpack = loader, loss_fn, unpack
        self.batches_yielded = 0
        self.loss_before_value: float | None = None
        self._round_loader: RoundLoader | None = None

    # ----------------------------------------------------------------- the round's plan
    @property
    def method(self) -> str:
        """The method's registry name (``method``)."""
        return str(self.config[R.METHOD])

    @property
    def lr(self) -> float:
        """The client learning rate η_l of this round (the server may schedule it)."""
        return float(self.config[R.CLIENT_LR])

    @property
    def server_round(self) -> int:
        return int(self.config.get(R.SERVER_ROUND, 0))

    @property
    def full_batch(self) -> bool:
        """FedDA's stabilization phase: one full-batch step this round (:meth:`batches` yields one batch)."""
        return bool(self.config.get(R.FULL_BATCH, False))

    def num_steps(self, num_examples: int) -> int:
        """The planned local steps K for ``num_examples`` examples (``local-steps``, else epochs·⌈n/B⌉)."""
        return num_local_steps(num_examples, self.config)

    def batches(self, loader: Iterable[Any] | None = None, num_examples: int | None = None,
                batch_fn: Callable[[Any], Any] | None = None) -> Iterator[Any]:
        """Yield exactly the round's planned number of batches from ``loader`` (default: the one given to the
        constructor), re-iterating it (epochs) as needed; in the full-batch phase yield one batch holding every
        example (the loader's batches concatenated, same structure: tensors, ``(x, y)`` sequences, dicts).

        The batches are the loader's own objects (``batch_fn``, if given, is applied to each; e.g.
        ``lambda b: (b["img"], b["label"])``).  A :class:`TensorPartition` yields seeded ``(x, y)`` mini-batches
        (a permutation per epoch, :func:`batch_indices`).  ``num_examples`` defaults to ``len(loader.dataset)``."""
        loader = self._data(loader, "batches")
        if isinstance(loader, TensorPartition):
            n = len(loader)
            size = n if self.full_batch else int(self.config.get(R.BATCH_SIZE, 32))
            for idx in batch_indices(n, size, self.num_steps(n), self.seed, self.server_round, self.client_key):
                self.batches_yielded += 1
                yield loader.take(idx) if batch_fn is None else batch_fn(loader.take(idx))
            return
        def one_pass() -> Iterable[Any]:
            return loader if batch_fn is None else map(batch_fn, loader)

        if self.full_batch:
            self.batches_yielded += 1
            yield concat_batches(list(one_pass()), self.method)
            return
        n = num_examples if num_examples is not None else num_examples_of(loader)
        remaining = self.num_steps(n)
        while remaining > 0:
            produced = 0
            for item in one_pass():
                self.batches_yielded += 1
                yield item
                produced += 1
                remaining -= 1
                if remaining == 0:
                    return
            if produced == 0:
                raise ValueError("the loader yielded no batch")

    @property
    def loader(self) -> RoundLoader:
        """The constructor's loader as the round sees it: its first pass yields :meth:`batches` (every planned step,
        all local epochs), later passes yield nothing — so your ``for epoch in range(E): for batch in loader``
        loop takes exactly the round's steps.  Other attributes (``.dataset``, …) are the loader's."""
        if self._round_loader is None:
            self._round_loader = RoundLoader(self, self._data(None, "loader"))
        return self._round_loader

    def _data(self, loader: Iterable[Any] | None, what: str) -> Iterable[Any]:
        if loader is not None:
            return loader
        if self.data is None:
            raise ValueError(
                f"ClientRound.{what} needs your training data: ClientRound(msg.content, context.state, trainloader, "
                "loss_fn)"
            )
        return self.data

    def loss_before(self, model: nn.Module, loader: Iterable[Any] | None = None, loss_fn: LossFn | None = None,
                    num_examples: int | None = None, batch_fn: Callable[[Any], Batch] | None = None) -> float:
        """``train-loss-before``: the mean loss of ``model`` (call it before training: the received model) over one
        pass of ``loader`` — or, when the round's config sets ``loss-before-max-examples = m > 0`` (and m < n), over
        a sample of m of the pass's example positions seeded by ``(seed, round, client_key)``
        (:func:`loss_before_sample`); the pass then stops after the last sampled position.  ``loader``,
        ``loss_fn`` and ``batch_fn`` default to the constructor's ``loader``, ``loss_fn`` and ``unpack``."""
        loader = self._data(loader, "loss_before")
        loss_fn = self._loss(loss_fn, "loss_before")
        n = num_examples if num_examples is not None else num_examples_of(loader)
        sample = loss_before_sample(n, self.config, self.seed, self.client_key)
        return mean_loss(model, loader, loss_fn, batch_fn or self.unpack, sample=sample)

    def _loss(self, loss_fn: LossFn | None, what: str) -> LossFn:
        if loss_fn is not None:
            return loss_fn
        if self.loss_fn is None:
            raise ValueError(
                f"ClientRound.{what} needs your loss: ClientRound(msg.content, context.state, trainloader, loss_fn)"
            )
        return self.loss_fn

    # ----------------------------------------------------------------- model, optimizer, reply
    def load_model(self, model: nn.Module) -> None:
        """Load the global model x_t into ``model`` (on whatever device it lives)."""
        model.load_state_dict(record_tensors(self._received(), copy=False), strict=True)

    def _received(self) -> ArrayRecord:
        received = R.get(self.content, R.MODEL, ArrayRecord)
        if received is None:
            raise ValueError(f"the train message has no '{R.MODEL}' ArrayRecord (the global model x_t)")
        return received

    @property
    def needs_client_half(self) -> bool:
        """The round's ``client-half``: whether the method runs more than plain local SGD on the client (a method
        optimizer, or a non-zero client hyper-parameter such as FedProx's ``mu``; the server decides,
        :func:`~flower_strategies.core.local.has_client_half`); ``False``: your own optimizer (e.g. SGD with
        momentum) may train, as with a stock Flower client."""
        return bool(self.config[R.CLIENT_HALF])

    @property
    def needs_full_gradient(self) -> bool:
        """The round's ``full-gradient``: whether the local optimizer needs the gradient over all local data at the
        received model (MimeLite)."""
        return bool(self.config[R.FULL_GRADIENT])

    @property
    def needs_loss_before(self) -> bool:
        """The round's ``loss-before``: whether the method's server reads ``train-loss-before`` (the received
        model's loss before training)."""
        return bool(self.config[R.LOSS_BEFORE])

    def optimizer(
        self, model: nn.Module, *, num_examples: int | None = None, full_gradient: Mapping[str, Tensor] | None = None
    ) -> LocalOptimizer:
        """The method's local optimizer for ``model`` (holding the received model x_t) with this round's lr,
        downlink records, saved client state and client hyper-parameters.  ``num_examples`` (default:
        ``len(loader.dataset)`` of the constructor's loader) plans the steps of methods that need the plan
        (LocalUpdate, FedLADA's ``K-1``); ``full_gradient`` (default: computed from the constructor's loader and
        loss by :func:`full_gradient_from`) is MimeLite's gradient over all local data at x_t.  For a method whose
        server reads ``train-loss-before`` (LocalUpdateDecay) it also computes that (:meth:`loss_before`) for
        :meth:`reply`."""
        if num_examples is None and self.data is not None:
            num_examples = num_examples_of(self.data)
        if self.needs_full_gradient and full_gradient is None:
            full_gradient = self._full_gradient(model)
        if self.needs_loss_before and self.loss_before_value is None and self.data is not None \
                and self.loss_fn is not None:
            self.loss_before_value = self.loss_before(model)  # at x_t: before any step
        planned = None if num_examples is None else self.num_steps(num_examples)
        return self.build_optimizer(model.named_parameters(), client_state=load_client_state(self.state),
                                    full_gradient=full_gradient, planned_steps=planned)

    def build_optimizer(
        self, named_params: Iterable[tuple[str, Tensor]], *, client_state: Mapping[str, Mapping[str, Tensor]],
        full_gradient: Mapping[str, Tensor] | None, planned_steps: int | None,
    ) -> LocalOptimizer:
        """The method's local optimizer over ``named_params`` (what :meth:`optimizer` builds for a model; the
        vectorized engine passes parameters stacked on a client axis and the clients' stacked state)."""
        return self.local_optimizer(
            named_params,
            lr=self.lr,
            downlink=downlink_records(self.content),
            client_state=client_state,
            full_gradient=full_gradient,
            planned_steps=planned_steps,
            **self.local_optimizer.hparams_class.client_kwargs_from_wire(self.config, self.method),
        )

    def _full_gradient(self, model: nn.Module) -> dict[str, Tensor]:
        if self.data is None or self.loss_fn is None:
            raise ValueError(
                f"{self.method} needs the gradient of the mean loss over all local data at the received model: pass "
                "your loader and loss, ClientRound(msg.content, context.state, trainloader, loss_fn), or "
                "ClientRound.optimizer(model, full_gradient=flower_strategies.full_gradient_from(model, "
                "trainloader, loss_fn))"
            )
        own = dict(model.named_parameters())
        received = R.views(self._received())
        stale = [k for k, p in own.items() if k in received and not np.array_equal(
            p.detach().cpu().numpy(), received[k])]
        if stale:
            raise ValueError(
                f"{self.method}'s full gradient is taken at the received model, but the model's {stale[0]!r} differs "
                "from it: load the global model first (ClientRound.load_model(model)), then call "
                "ClientRound.optimizer(model)"
            )
        return full_gradient_from(model, self.data, self.loss_fn, self.unpack)

    def reply(
        self,
        model: nn.Module,
        optimizer: LocalOptimizer | None,
        *,
        num_examples: int | None = None,
        train_loss: float | None = None,
        train_loss_before: float | None = None,
        metrics: Mapping[str, float] | None = None,
        model_record: ArrayRecord | None = None,
    ) -> RecordDict:
        """The reply content: model (if the method sends it), the optimizer's uplink records, ``metrics``
        (``num-examples``, ``num-steps`` = steps actually taken, losses) and the method marker; saves the
        client state into ``state``.

        ``optimizer=None`` (your own optimizer trained; only for a round without a client half,
        :attr:`needs_client_half`): the reply is the model and the metrics, ``num-steps`` = the batches
        :meth:`batches` / :attr:`loader` yielded.  ``train_loss_before`` defaults to the one :meth:`optimizer`
        computed (methods that need it).  ``num_examples`` defaults to ``len(loader.dataset)`` of the
        constructor's loader.  A full-batch round (FedDA) must have taken its one full-batch step (iterate
        :attr:`loader`), else this raises.  ``model_record``: the model's record when the caller has already
        serialised it (it must be byte-identical to ``tensor_record(model.state_dict())``; the vectorized engine
        builds every client's from the stacked parameters at once)."""
        if num_examples is None and self.data is not None:
            num_examples = num_examples_of(self.data)
        if not isinstance(num_examples, int) or isinstance(num_examples, bool) or num_examples <= 0:
            raise ValueError(f"num_examples must be a positive int, got {num_examples!r}")
        steps = self._check_steps(optimizer)
        if train_loss_before is None:
            train_loss_before = self.loss_before_value
        if train_loss_before is None and self.needs_loss_before:
            raise ValueError(
                f"{self.method}'s server reads train-loss-before (the received model's loss): pass your loader and "
                "loss, ClientRound(msg.content, context.state, trainloader, loss_fn), or before training compute "
                "before = ClientRound.loss_before(model, trainloader, loss_fn) and pass "
                "ClientRound.reply(..., train_loss_before=before)"
            )
        reply: dict[str, Any] = {}  # the records, in their order; built into the RecordDict at the end

        def model_arrays() -> ArrayRecord:
            return tensor_record(model.state_dict()) if model_record is None else model_record

        if optimizer is None:
            reply[R.MODEL] = model_arrays()
        else:
            check_bound(optimizer, model)
            uplink = optimizer.uplink()
            if self.state is not None:
                save_client_state(self.state, optimizer.client_state())
            if optimizer.sends_model:
                reply[R.MODEL] = model_arrays()
            for name, arrays in uplink.items():
                reply[name] = tensor_record({k: v.detach().cpu().contiguous() for k, v in arrays.items()})
        ours = self._metrics(model, num_examples, steps, train_loss, train_loss_before)
        info = guard_reply(self.method, reply, self.config)  # Flower's DP mods (core/privacy.py); array records only
        # the caller's metrics are type-checked by Flower; the values built here are an int, floats and a str
        reply[R.METRICS] = R.filled(MetricRecord(dict(metrics)) if metrics else MetricRecord(), ours.items())
        reply[R.REPLY_INFO] = R.filled(ConfigRecord(), [(R.METHOD, self.method), *info])
        return R.filled(RecordDict(), reply.items())

    def _metrics(self, model: nn.Module, num_examples: int, steps: int, train_loss: float | None,
                 train_loss_before: float | None) -> dict[str, Any]:
        """The reply's own metrics: ``num-examples``, ``num-steps`` (when any), the losses; without the loss before
        training, the first batch's loss (the divergence warning's reference) when it is known."""
        ours: dict[str, Any] = {R.NUM_EXAMPLES: int(num_examples)}
        if steps:
            ours[R.NUM_STEPS] = float(steps)
        if train_loss is not None:
            ours[R.TRAIN_LOSS] = float(train_loss)
        if train_loss_before is not None:
            ours[R.TRAIN_LOSS_BEFORE] = float(train_loss_before)
        elif train_loss is not None:
            start = self._first_batch_loss(model)
            if start is not None:
                ours[R.FIRST_BATCH_LOSS] = start
        return ours

    def _first_batch_loss(self, model: nn.Module) -> float | None:
        """The received model's loss on the first batch :attr:`loader` yielded (a copy of ``model`` holding x_t; one
        forward pass): the server's reference for a training loss that explodes (:func:`.rounds.loss_alarm`) where
        no ``train-loss-before`` is reported.  ``None`` when the loop did not iterate :attr:`loader`, no loss was
        given, or the batch cannot be read by ``unpack`` (a diagnostic only: the reply goes out without it)."""
        first = None if self._round_loader is None else self._round_loader.first
        if first is None or self.loss_fn is None:
            return None
        try:
            start = copy.deepcopy(model)
            self.load_model(start)
            return mean_loss(start, [first], self.loss_fn, self.unpack)
        except (TypeError, ValueError, RuntimeError, KeyError, AttributeError, copy.Error):
            return None

    def _check_steps(self, optimizer: LocalOptimizer | None) -> int:
        """The steps taken; raises when the round's plan was not followed where the method depends on it."""
        if optimizer is None:
            if self.needs_client_half:
                raise ValueError(
                    f"{self.method} needs its client half: train with opt = ClientRound.optimizer(model) and pass "
                    "that optimizer to ClientRound.reply(model, opt)"
                )
            steps = self.batches_yielded
        else:
            steps = optimizer.steps_taken
        if self.full_batch and steps != 1:
            raise ValueError(
                f"{self.method}: this round is a full-batch round (one step on all local examples) but {steps} steps "
                "were taken: iterate ClientRound.loader (or ClientRound.batches(trainloader)) in your loop, not your "
                "own DataLoader"
            )
        return steps


def check_bound(optimizer: LocalOptimizer, model: nn.Module) -> None:
    """Refuse an optimizer whose parameters are not ``model``'s own tensors (identity, not equal values): its steps
    and uplink records would describe another model instance than the one sent back."""
    own = dict(model.named_parameters())
    foreign = [name for name, p, _ in optimizer.named_params() if own.get(name) is not p]
    if foreign:
        raise ValueError(
            f"{type(optimizer).__name__} is bound to parameters that are not this {type(model).__name__}'s own "
            f"({', '.join(foreign[:3])}{', …' if len(foreign) > 3 else ''}): it was built for another model instance "
            "(a copy, or a model rebuilt after the optimizer). Fix: build it with ClientRound.optimizer(model) on the "
            "model you train, and reply with that same model"
        )


class RoundLoader:
    """:attr:`ClientRound.loader`: the first pass yields the round's batches (:meth:`ClientRound.batches`), later
    passes nothing; ``len()`` is the number of batches the round iterates (its planned steps K: ``local-steps``, else
    ``local-epochs``·⌈n/``batch-size``⌉; 1 in a full-batch round) divided by the passes the app's loop has made over
    it (rounded; K until a second pass starts).  So both ways a loop divides its summed loss report the mean loss
    per step: Flower quickstart-pytorch's ``running_loss / (epochs * len(trainloader))`` after its ``epochs``
    passes (exact when ``epochs`` divides K), and ``running_loss / len(trainloader)`` after one pass.
    ``.dataset`` and ``.batch_size`` are the wrapped loader's, :attr:`wrapped` is that loader itself."""

    def __init__(self, rnd: ClientRound, loader: Iterable[Any]) -> None:
        self._round, self._loader, self._passes = rnd, loader, 0

    @property
    def wrapped(self) -> Iterable[Any]:
        """Your loader, as given to :class:`ClientRound`."""
        return self._loader

    @property
    def dataset(self) -> Any:
        """Your loader's ``.dataset``."""
        return self._loader.dataset  # type: ignore[attr-defined]

    @property
    def batch_size(self) -> Any:
        """Your loader's ``.batch_size``."""
        return self._loader.batch_size  # type: ignore[attr-defined]

    #: The first batch the round yielded (its loss at the received model is the reply's train-loss-first-batch).
    first: Any = None

    def __iter__(self) -> Iterator[Any]:
        self._passes += 1
        if self._passes == 1:
            for item in self._round.batches(self._loader):
                if self.first is None:
                    self.first = item
                yield item

    def __len__(self) -> int:
        if self._round.full_batch:
            return 1
        if not isinstance(self._loader, TensorPartition) and getattr(self._loader, "dataset", None) is None:
            raise TypeError("len(ClientRound.loader) counts the round's planned steps from len(loader.dataset), and "
                            "this loader has no .dataset")
        planned = self._round.num_steps(num_examples_of(self._loader))
        return max(1, round(planned / max(self._passes, 1)))
