"""Vectorized in-process engine: the sampled clients of a round train together, stacked on a client axis.

:class:`VectorGrid` is a :class:`~simulations.engine.inprocess.LoopbackGrid` whose train messages are not handed one by
one to the ClientApp: each round's clients are grouped (same round content, settings, device and saved-state layout),
split by step count where it differs a lot (:func:`step_buckets`) and into chunks that fit a memory budget, and every
chunk trains in one pass per local step —

* parameters of shape ``(C, *shape)`` (C clients of the chunk, all starting at the received ``x_t``);
* the task's own model per client through ``torch.func`` (``vmap`` over ``functional_call``; a model of linear
  layers through :func:`linear_stack`, the same products without ``vmap``), the per-example losses
  of all clients' outputs in one call, and the gradients from one backward pass of the clients' losses' sum (client
  c's loss depends only on its own parameter rows), each client on its own mini-batch, drawn exactly as the
  sequential ClientApp draws it (:func:`~flower_strategies.core.client.batch_indices`, same seeds; for the whole
  chunk at once, :func:`_batch_plan`); batches shorter than the step's longest are padded and the padding gets
  weight 0, so each client's loss is the mean over its real examples;
* the method's **own** local optimizer over the stacked tensors (``LocalOptimizer.clients = C``: downlink tensors are
  repeated along the client axis, the clients' saved state is stacked, norms are per client);
* unequal step counts (epochs mode) by masking: once a client has taken its K_i steps, later steps leave its
  parameters and optimizer state as they were.

Every client then gets a real reply: its slice of the parameters and optimizer state goes into one per-client
optimizer of the same class, and the sequential ClientApp's own code builds the reply and saves the client state
(:meth:`~flower_strategies.core.client.ClientRound.reply`, :func:`client_app.app.finish_train`), so the Strategy
validates, screens and aggregates them exactly as before.  ``train-loss-before`` comes from one forward pass over
the chunk's examples at ``x_t`` (each client's mean over its own examples or its seeded sample), MimeLite's
full-batch gradient from one stacked gradient step whose batches are the clients' whole partitions.  Evaluate and
query messages, and any chunk whose stacked pass fails, go to the sequential ClientApp.

Where a chunk runs is one seam: :func:`run_chunk` takes a picklable :class:`ChunkJob` (round content, the clients'
state, keys and data) and returns the replies' contents with the states written; :meth:`VectorGrid.train_chunks`
runs the chunks here, :class:`simulations.engine.vectorized_ray.RayVectorGrid` on Ray actors.

``nn.LSTM`` (``shakespeare-lstm``) is stacked through :class:`StackableLSTM` (explicit cells: ``vmap`` has no batching
rule for ``aten::lstm``); exact, but slower than the sequential engine on CPU (docs/vectorized.md), so
:func:`vectorizable` leaves such tasks to the sequential engine where a tool picks the engine.

Dropout (``mnist-mlp``, ``mnist-cnn``) runs under ``vmap(..., randomness="different")``: each client gets its own
masks, drawn from torch's generator seeded per chunk and round (:func:`app_common.task.dropout_rng`); they are not the
masks the sequential ClientApp draws for the same client (it seeds per client), so with dropout the two engines give
equally distributed, not equal, results (docs/vectorized.md).

Limits: models with BatchNorm running statistics or other recurrent layers are refused with an error naming
``--engine inprocess``; a parameter that gets no gradient at all is stepped with a zero gradient (the sequential loop
would skip it — none of the tasks has one).
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from collections.abc import Callable, Mapping
from itertools import pairwise
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.common import MessageType, log
from torch import Tensor, nn
from torch.func import functional_call, vmap

from flower_strategies.core.client import (
    EVAL_CHUNK,
    ClientRound,
    TensorPartition,
    load_client_state,
    loss_before_sample,
)
from flower_strategies.core import records as R
from flower_strategies.core.local import ROUND, LocalOptimizer

from .grid import LoopbackGrid
from .seeding import generators

#: Default memory budget of one chunk's stacked pass (MiB); ``VectorGrid(memory_mb=…)`` / ``--vector-memory-mb``.
DEFAULT_MEMORY_MB = 1024
#: Bytes per client of a chunk, as multiples of the model's parameter bytes (parameters, gradients, optimizer
#: state, the frozen clients' snapshot) and of one step's input bytes (activations): the chunk-size estimate.
PARAM_FACTOR, INPUT_FACTOR = 12, 32


class NotVectorizable(ValueError):
    """The task's model cannot be trained with stacked clients."""


def check_vectorizable(model: nn.Module, task: str) -> None:
    """Refuse models whose training is not a pure function of (parameters, batch, random masks).  ``nn.LSTM`` is
    trained through :class:`StackableLSTM` when :func:`stackable_lstm` accepts it; dropout draws per-client masks
    (``vmap``'s ``randomness="different"``)."""
    bad = sorted({type(m).__name__ for m in model.modules()
                  if isinstance(m, nn.modules.batchnorm._BatchNorm)
                  or (isinstance(m, nn.RNNBase) and not stackable_lstm(m))})
    if bad:
        raise NotVectorizable(
            f"task {task!r} cannot run on the vectorized engine: its model has {', '.join(bad)} (running statistics "
            "or recurrent kernels are not per-client functions of the parameters); use --engine "
            "inprocess (the sequential in-process engine) or --engine ray"
        )


def stackable_lstm(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.LSTM`` that :class:`StackableLSTM` computes: unidirectional, no projection, no
    dropout between layers, with biases."""
    return (type(module) is nn.LSTM and not module.bidirectional and not module.proj_size and not module.dropout
            and module.bias)


class StackableLSTM(nn.Module):
    """The forward pass of an ``nn.LSTM`` (:func:`stackable_lstm`) as explicit per-time-step cells, on the same
    ``Parameter`` objects under the same names.  ``torch.func.vmap`` has no batching rule for ``aten::lstm``; these
    cells (linear maps, sigmoid, tanh) it batches over clients.  The gates are computed as ATen's CPU kernel does
    (input projections of all time steps first, then per step ``h W_hhᵀ + b_hh`` plus that projection; gates in the
    order i, f, g, o); only the summation order of the products can differ (rounding)."""

    def __init__(self, lstm: nn.LSTM) -> None:
        super().__init__()
        self.num_layers, self.batch_first = lstm.num_layers, lstm.batch_first
        for name in lstm._flat_weights_names:
            setattr(self, name, getattr(lstm, name))

    def forward(self, x: Tensor, hx: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        if not self.batch_first:
            x = x.transpose(0, 1)
        hs, cs = [], []
        for layer in range(self.num_layers):
            w_hh, b_hh = getattr(self, f"weight_hh_l{layer}"), getattr(self, f"bias_hh_l{layer}")
            projected = torch.nn.functional.linear(x, getattr(self, f"weight_ih_l{layer}"),
                                                   getattr(self, f"bias_ih_l{layer}"))
            if hx is None:
                h = c = x.new_zeros(x.shape[0], w_hh.shape[1])
            else:
                h, c = hx[0][layer], hx[1][layer]
            outputs = []
            for step in projected.unbind(1):  # unbind: one stack in the backward pass, not a zero-fill per step
                i, f, g, o = (torch.nn.functional.linear(h, w_hh, b_hh) + step).chunk(4, 1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                outputs.append(h)
            x = torch.stack(outputs, 1)
            hs.append(h)
            cs.append(c)
        return (x if self.batch_first else x.transpose(0, 1)), (torch.stack(hs), torch.stack(cs))


def _swapped(module: nn.Module, swap: Callable[[nn.Module], nn.Module | None]) -> nn.Module:
    """``swap(module)``, or a shallow copy of ``module`` whose children are swapped the same way (same parameter
    objects: the view and the model share parameters, names and state dict)."""
    new = swap(module)
    if new is not None:
        return new
    view = copy.copy(module)
    view._modules = {name: _swapped(child, swap) for name, child in module._modules.items() if child is not None}
    return view


def stackable(model: nn.Module) -> nn.Module:
    """``model`` itself, or (when it holds an ``nn.LSTM``) a shallow copy whose LSTMs are :class:`StackableLSTM` on
    the same parameters: same parameter names, same state dict, trained by ``vmap``."""
    if not any(isinstance(m, nn.LSTM) for m in model.modules()):
        return model
    return _swapped(model, lambda m: StackableLSTM(m) if isinstance(m, nn.LSTM) else None)


def per_client_forward(model: nn.Module) -> Callable[[tuple[Tensor, ...], Tensor], Tensor]:
    """``f(params, x)``: ``model`` run per client by ``vmap`` over ``functional_call``, the stacked parameters as a
    tuple in ``named_parameters()`` order (a tuple, not a dict: vmap flattens its inputs at every call)."""
    names = [n for n, _ in model.named_parameters()]
    # dropout: each client its own masks (without it the forward draws nothing and the option changes nothing)
    return vmap(lambda ps, x: functional_call(model, dict(zip(names, ps, strict=True)), (x,)), randomness="different")


class _Slots:
    """The stacked parameters of the current call of a :func:`linear_stack` view (a tuple in parameter order)."""

    current: tuple[Tensor, ...] = ()


class _StackedLinearFn(torch.autograd.Function):
    """``x Wᵀ + b`` per client (``x``: ``(C, N, in)``, ``W``: ``(C, out, in)``, ``b``: ``(C, out)`` or ``None``) with
    its backward written out as three batched products: autograd's own backward of ``baddbmm`` on a transposed
    weight took 1.36 ms for a digits-MLP step of 100 clients, these 0.89 ms (same gradients up to float rounding)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        w = weight.transpose(1, 2)
        return torch.bmm(x, w) if bias is None else torch.baddbmm(bias.unsqueeze(1), x, w)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor, Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        return grad_x, torch.bmm(grad.transpose(1, 2), x), grad.sum(1) if ctx.has_bias else None


class _StackedLinear(nn.Module):
    """An ``nn.Linear``'s forward for the C clients of a chunk at once: input ``(C, …, in)``, each client's rows of
    the stacked weight ``(C, out, in)`` and bias ``(C, out)`` (one ``baddbmm``)."""

    def __init__(self, slots: _Slots, weight: int, bias: int | None) -> None:
        super().__init__()
        self.slots, self.weight_at, self.bias_at = slots, weight, bias

    def forward(self, x: Tensor) -> Tensor:
        params = self.slots.current
        weight = params[self.weight_at]
        out = _StackedLinearFn.apply(x.reshape(x.shape[0], -1, x.shape[-1]), weight,
                                     None if self.bias_at is None else params[self.bias_at])
        return out.view(*x.shape[:-1], weight.shape[1])


#: :func:`linear_stack`'s result per model: (the ids of the parameters it was built on, the forward or ``None``); the
#: probe runs once per model object, again only if its parameters were replaced.
_LINEAR_STACK: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], Callable | None]] = \
    weakref.WeakKeyDictionary()


def linear_stack(model: nn.Module, example: Tensor) -> Callable[[tuple[Tensor, ...], Tensor], Tensor] | None:
    """A forward pass of C clients at once without ``vmap``, for a model whose parameters all belong to
    ``nn.Linear`` layers (digits-mlp, leaf-synthetic, synthetic-linear): the model's own ``forward`` on a shallow
    copy whose linear layers take a ``(C, …, in)`` input and multiply it by each client's rows
    (:class:`_StackedLinear`).  ``f(params, x)`` takes the parameters in ``named_parameters()`` order.  The same
    arithmetic as ``vmap`` over ``functional_call`` without its per-call work (about half of a digits-MLP step).

    The model's forward must treat the leading axis as it treats the batch axis.  That is checked once per model:
    one probe on ``example`` (a few inputs, two clients with random parameters) must equal ``vmap``'s outputs; a
    forward that mixes clients, reshapes by ``x.size(0)`` or reaches into its layers' weights fails the probe (or
    raises in it), and the model keeps ``vmap``.  ``None`` when the model is not made of linear layers or fails."""
    params = dict(model.named_parameters())
    ids = tuple(id(p) for p in params.values())
    known = _LINEAR_STACK.get(model)
    if known is not None and known[0] == ids:
        return known[1]
    _LINEAR_STACK[model] = (ids, _linear_forward(model, params, example))
    return _LINEAR_STACK[model][1]


def _linear_forward(model: nn.Module, params: Mapping[str, nn.Parameter], example: Tensor,
                    ) -> Callable[[tuple[Tensor, ...], Tensor], Tensor] | None:
    """:func:`linear_stack`'s forward of ``model``, built and probed (``None``: keep ``vmap``)."""
    index = {id(p): i for i, p in enumerate(params.values())}
    linear = {id(p) for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    if not params or set(index) != linear or any(True for _ in model.buffers()):
        return None
    slots = _Slots()
    view = _swapped(model, lambda m: _StackedLinear(slots, index[id(m.weight)],
                                                    None if m.bias is None else index[id(m.bias)])
                    if isinstance(m, nn.Linear) else None)

    def forward(stacked: tuple[Tensor, ...], x: Tensor) -> Tensor:
        slots.current = stacked
        try:
            return view(x)
        finally:
            slots.current = ()

    return forward if _probe(model, forward, example) else None


def _probe(model: nn.Module, forward: Callable[[tuple[Tensor, ...], Tensor], Tensor], example: Tensor) -> bool:
    """Whether ``forward`` equals ``vmap`` over ``functional_call`` on two clients with random parameters."""
    gen = torch.Generator().manual_seed(0)
    stacked = tuple(torch.randn((2, *p.shape), generator=gen, dtype=p.dtype).to(p.device) for p in model.parameters())
    x = torch.stack([example, example.flip(0)])
    was_training = model.training
    model.eval()  # dropout off: the probe compares the arithmetic, not random masks
    try:
        with torch.no_grad():
            want = per_client_forward(model)(stacked, x)
            try:
                got = forward(stacked, x)
            except Exception:  # noqa: BLE001 - any failure means: keep vmap
                return False
    finally:
        model.train(was_training)
    if not isinstance(got, Tensor) or not isinstance(want, Tensor) or got.shape != want.shape:
        return False
    scale = float(want.abs().max()) if want.numel() else 0.0
    return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4 * scale + 1e-30))


def vectorizable(fed: Any) -> bool:
    """Whether the task of ``fed`` (an :class:`~app_common.config.AppConfig`) is worth the vectorized engine: it
    can run there and has no LSTM (stacked exactly, but slower than the sequential engine on CPU)."""
    from app_common.task import build_model

    model = build_model(fed.task, fed.seed, fed.synthetic_dim)
    try:
        check_vectorizable(model, fed.task)
    except NotVectorizable:
        return False
    return not any(isinstance(m, nn.LSTM) for m in model.modules())


class VectorGrid(LoopbackGrid):
    """A :class:`LoopbackGrid` that trains each round's clients together (see the module docstring).

    ``chunk``: clients per stacked pass (0 = as many as ``memory_mb`` allows by the estimate
    ``PARAM_FACTOR·parameter bytes + INPUT_FACTOR·batch input bytes`` per client)."""

    def __init__(self, client_app: Any, num_nodes: int, run_config: Mapping[str, Any] | None = None, *,
                 chunk: int = 0, memory_mb: float = DEFAULT_MEMORY_MB, **kwargs: Any) -> None:
        super().__init__(client_app, num_nodes, run_config, **kwargs)
        if chunk < 0 or memory_mb <= 0:
            raise ValueError(f"chunk must be >= 0 and memory_mb > 0, got {chunk}, {memory_mb}")
        self.chunk, self.memory_mb = int(chunk), float(memory_mb)
        #: Client rounds trained stacked and stacked passes (chunks) so far (for logs and tests).
        self.stacked_clients, self.chunks = 0, 0

    def prepared_replies(self, messages: list[Message]) -> dict[int, Message]:
        from client_app.app import begin_train, device_of, model_for

        groups: dict[Any, list[tuple[int, Any]]] = {}
        # by object (the run's settings and the round's content are one object for all of its clients; two equal
        # objects only give separate chunks): one model per settings and device, each found stackable in this call,
        # and each content's ClientRound, whose parsed config the content's clients share (_for_client)
        models: dict[tuple[int, torch.device], nn.Module] = {}
        rounds: dict[int, ClientRound] = {}
        for i, msg in enumerate(messages):
            if msg.metadata.message_type != MessageType.TRAIN:
                continue
            ctx = self.contexts[msg.metadata.dst_node_id]
            try:
                job = begin_train(msg, ctx)
                device = device_of(ctx, job.fed.device)
                model = models.get((id(job.fed), device))
                if model is None:
                    model = model_for(job.fed, device)
                first = rounds.get(id(msg.content))
                rnd = (ClientRound(msg.content, ctx.state, seed=job.fed.seed, client_key=job.pid) if first is None
                       else _for_client(first, ctx.state, job.fed.seed, job.pid))
            except Exception:  # noqa: BLE001 - the sequential ClientApp turns it into this client's error reply
                continue
            rounds.setdefault(id(msg.content), rnd)
            if (id(job.fed), device) not in models:
                check_vectorizable(model, job.fed.task)
                models[id(job.fed), device] = model
            key = (id(msg.content), id(job.fed), str(device), _layout(rnd, len(job.x)))
            groups.setdefault(key, []).append((i, (msg, ctx, job, rnd, model)))
        parts: list[list[tuple[int, Any]]] = []
        for members in groups.values():
            _, (_, _, job, rnd, model) = members[0]
            size = self.chunk or self._auto_chunk(model, job, rnd)
            for bucket in step_buckets([m[3].num_steps(len(m[2].x)) for _, m in members]):
                chosen = [members[j] for j in bucket]
                parts += [chosen[a:b] for a, b in chunk_bounds(len(chosen), size, self.workers)]
        replies = self.train_chunks(parts)
        self.stacked_clients, self.chunks = self.stacked_clients + len(replies), self.chunks + len(parts)
        if replies:
            log(INFO, "vectorized engine: %d clients trained in %d stacked chunk(s)", len(replies), len(parts))
        return replies

    #: Stacked passes a round is spread over at least (:func:`chunk_bounds`): 1 here, one per actor on Ray.
    workers = 1

    def _auto_chunk(self, model: nn.Module, job: Any, rnd: ClientRound) -> int:
        whole = rnd.full_batch or rnd.needs_full_gradient  # a pass over whole partitions
        batch = len(job.x) if whole else int(rnd.config.get("batch-size", 32))
        return max(1, int(self.memory_mb // memory_estimate_mb(model, job.x[0], batch, 1)))

    def train_chunks(self, parts: list[list[tuple[int, tuple]]]) -> dict[int, Message]:
        """The replies of every chunk's clients (by message position), the chunks trained one after another in this
        process; a chunk whose stacked pass fails gives none (its clients go to the sequential ClientApp).
        :class:`simulations.engine.vectorized_ray.RayVectorGrid` runs the same :func:`run_chunk` on Ray actors."""
        replies: dict[int, Message] = {}
        for part in parts:
            job = chunk_job(part)
            try:
                contents = run_chunk(job)
            except NotVectorizable:
                raise
            except Exception as err:  # noqa: BLE001 - the sequential ClientApp answers (or reports the error per client)
                _chunk_failed(len(part), err)
                # as if the stacked pass had never run
                for (_, (_, ctx, *_)), before in zip(part, job.before, strict=True):
                    replace_state(ctx.state, before)
                continue
            replies.update(finish_chunk(part, contents))
        return replies


@dataclass
class ChunkJob:
    """What one stacked pass needs, picklable (a Ray actor gets it whole): the run's settings, the device, the round
    content its clients received, each client's ``Context.state`` (read, and written by the pass), client key and
    data.  ``before``: each state's records when the job was made (to undo a failed pass; not sent)."""

    fed: Any
    device: str
    content: RecordDict
    states: list[RecordDict]
    keys: list[int]
    x: list[Tensor]
    y: list[Tensor]
    before: list[dict[str, Any]] = field(default_factory=list, repr=False)


def chunk_job(part: list[tuple[int, tuple]]) -> ChunkJob:
    """The :class:`ChunkJob` of a chunk (``(position, (msg, ctx, job, rnd, model))`` per client, one round content,
    settings, device and state layout)."""
    msg, _, job, _, model = part[0][1]
    ctxs, jobs = [m[1] for _, m in part], [m[2] for _, m in part]
    return ChunkJob(job.fed, str(next(model.parameters()).device), msg.content, [c.state for c in ctxs],
                    [j.pid for j in jobs], [j.x for j in jobs], [j.y for j in jobs],
                    before=[dict(c.state.items()) for c in ctxs])  # records are replaced, never mutated, by a reply


def run_chunk(job: ChunkJob) -> list[RecordDict]:
    """Train one chunk stacked (:func:`train_stacked`): each client's reply content, in order; each client's state
    is written into ``job.states``.  The one seam between the engine and where a chunk runs: this process
    (:meth:`VectorGrid.train_chunks`) or a Ray actor (:mod:`simulations.engine.vectorized_ray`)."""
    from client_app.app import model_for
    from app_common.task import TASK_SPECS, dropout_rng

    device = torch.device(job.device)
    model = stackable(model_for(job.fed, device))
    seed = job.fed.seed
    first = ClientRound(job.content, job.states[0], seed=seed, client_key=job.keys[0])
    rnds = [first, *(_for_client(first, s, seed, k) for s, k in zip(job.states[1:], job.keys[1:], strict=True))]
    data = [TensorPartition(x.to(device), y.to(device)) for x, y in zip(job.x, job.y, strict=True)]
    with dropout_rng(model, seed, first.server_round, job.keys[0], stacked=True):
        return train_stacked(model, rnds, data, TASK_SPECS[job.fed.task].example_losses(),
                             loss_before=job.fed.train_loss_before)


def finish_chunk(part: list[tuple[int, tuple]], contents: list[RecordDict]) -> dict[int, Message]:
    """Every client's reply message (the sequential ClientApp's :func:`client_app.app.finish_train`), by position."""
    from client_app.app import finish_train

    return {i: finish_train(job, content, msg, ctx)
            for (i, (msg, ctx, job, _, _)), content in zip(part, contents, strict=True)}


def replace_state(state: RecordDict, records: Mapping[str, Any]) -> None:
    """Make ``state`` (a node's ``Context.state``) hold exactly ``records`` (no-op when they are its own)."""
    if records is state:
        return
    for name in list(state.keys()):
        del state[name]
    for name, record in records.items():
        state[name] = record


def _chunk_failed(clients: int, err: BaseException) -> None:
    log(WARNING, "vectorized engine: a chunk of %d clients failed (%s: %s); training it sequentially",
        clients, type(err).__name__, err)


def chunk_bounds(n: int, size: int, workers: int = 1) -> list[tuple[int, int]]:
    """``(start, stop)`` of the chunks of ``n`` clients: at most ``size`` per chunk and at least ``workers`` chunks
    (when there are that many clients), sizes as equal as possible (they differ by at most one), in order."""
    if n < 0 or size < 1 or workers < 1:
        raise ValueError(f"chunk_bounds needs n >= 0, size >= 1, workers >= 1, got {n}, {size}, {workers}")
    count = min(n, max(-(-n // size), workers))
    edges = [n * k // count for k in range(count + 1)] if count else [0]
    return list(pairwise(edges))


#: A stacked step's own cost (Python, autograd, one kernel launch per operation), in clients' worth of stacked work
#: (:func:`step_buckets`).  Measured on digits-mlp, one thread: a step takes 0.28 ms for 10 clients and 0.95 ms for
#: 100, i.e. about as long as ``C + 28`` clients' share of the arithmetic.
STEP_COST_CLIENTS = 32


def step_buckets(steps: list[int], step_cost: float | None = None) -> list[list[int]]:
    """The clients of one group (positions in ``steps``, each client's planned local steps) in the stacked passes
    they train in, longest first.  A pass takes as many steps as its longest client and carries the others, masked,
    through the steps they do not take; with power-law client sizes (LEAF, Synthetic(α, β)) one pass would spend
    most of its work on such steps.  The buckets hold clients of consecutive step counts and minimise
    ``Σ longest · (step_cost + clients)`` over buckets (dynamic programming over the distinct step counts); clients
    of equal steps (IID sizes, ``local-steps``) stay in one bucket.  Which clients share a pass does not change any
    client's result.  ``step_cost``: default :data:`STEP_COST_CLIENTS`."""
    step_cost = STEP_COST_CLIENTS if step_cost is None else step_cost
    order = sorted(range(len(steps)), key=lambda j: -steps[j])
    values, counts = np.unique(-np.asarray(steps, dtype=np.int64), return_counts=True)
    if len(values) <= 1:
        return [order] if order else []
    longest = -values.astype(np.float64)  # distinct step counts, descending
    upto = np.concatenate([[0], np.cumsum(counts)])  # clients with more steps than longest[j]: upto[j]
    best, cut = np.zeros(len(values) + 1), np.zeros(len(values) + 1, dtype=np.int64)
    for j in range(1, len(values) + 1):  # best[j]: the first j step counts in buckets; the last bucket starts at cut[j]
        costs = best[:j] + longest[:j] * (step_cost + upto[j] - upto[:j])
        cut[j] = int(np.argmin(costs))
        best[j] = costs[cut[j]]
    edges, j = [], len(values)
    while j > 0:
        edges.append(int(upto[j]))
        j = int(cut[j])
    bounds = [0, *reversed(edges)]
    return [order[a:b] for a, b in pairwise(bounds)]


def _for_client(rnd: ClientRound, state: Any, seed: int, client_key: int) -> ClientRound:
    """``ClientRound(rnd.content, state, seed=seed, client_key=client_key)`` for another client of the same round
    content, without parsing the content again: a copy of ``rnd`` (taken before any training, so its per-round
    counters are the constructor's) sharing its config, method and content, which a round only reads."""
    out = copy.copy(rnd)
    out.state, out.seed, out.client_key = state, int(seed), int(client_key)
    return out


def _layout(rnd: ClientRound, n: int) -> tuple:
    """What must be equal for clients trained in one stacked pass besides the round content and settings: the saved
    client state's records, entries and shapes (a client sampled for the first time has none), and K when the
    optimizer needs the planned number of steps in advance (FedLADA's family)."""
    state = tuple(sorted((rec, tuple(sorted((k, tuple(v.shape)) for k, v in arrays.items())))
                         for rec, arrays in load_client_state(rnd.state).items()))
    planned = rnd.num_steps(n) if rnd.local_optimizer.needs_planned_steps else None
    return state, planned


def _stack_state(states: list[dict[str, dict[str, Tensor]]]) -> dict[str, dict[str, Tensor]]:
    """The clients' saved state, every entry stacked on a client axis (its layout is equal within a chunk)."""
    return {rec: {k: torch.stack([s[rec][k] for s in states]) for k in arrays} for rec, arrays in states[0].items()}


def _per_client(value: Any, clients: int) -> bool:
    """Whether an optimizer-state value is stacked on the client axis."""
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == clients


def _stacked_entries(opt: LocalOptimizer, clients: int, rows: Tensor) -> list[tuple[dict, str, Tensor, Tensor]]:
    """``(state dict, key, tensor, saved rows)`` of every stacked optimizer-state tensor (the frozen ``rows``)."""
    out = []
    for key, st in opt.state.items():
        if key == ROUND:
            continue
        for name, v in st.items():
            if _per_client(v, clients):
                out.append((st, name, v, v.index_select(0, rows)))
    return out


def _restore_frozen(params: Mapping[str, Tensor], saved_params: Mapping[str, Tensor],
                    entries: list[tuple[dict, str, Tensor, Tensor]], rows: Tensor) -> None:
    """Put back the parameters and optimizer state of the clients ``rows`` (finished: frozen in this step); the work
    is in proportion to the frozen clients, not the chunk."""
    with torch.no_grad():
        for name, p in params.items():
            p.index_copy_(0, rows, saved_params[name])
        for st, key, before, old in entries:
            cur = st[key]
            if cur is before:
                cur.index_copy_(0, rows, old)  # in place: entries that alias one another stay aliased
            else:
                st[key] = cur.index_copy(0, rows, old)


def _batch_plan(rnds: list[ClientRound], sizes: list[int], steps: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(index, count)``: ``index[s, c]`` = positions (in the chunk's concatenated data) of client c's batch at step
    s, padded with its first example; ``count[s, c]`` = the real batch size (0 after its last step).

    The batches of :func:`~flower_strategies.core.client.batch_indices` (a permutation per epoch from
    ``default_rng([seed, round, client])``, cut into batches, the last of an epoch possibly shorter), drawn for all
    clients at once: the generators from :func:`.seeding.generators`, each client's permutations in one
    ``Generator.permuted`` call (the same draws as one ``permutation`` per epoch), cut by a reshape."""
    widths = [min(n if rnd.full_batch else int(rnd.config.get("batch-size", 32)), n)
              for rnd, n in zip(rnds, sizes, strict=True)]
    width = max(w for w, k in zip(widths, steps, strict=True) if k > 0)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    index = np.repeat(offsets[None, :, None], max(steps), axis=0).repeat(width, axis=2)
    count = np.zeros((max(steps), len(rnds)), dtype=np.int64)
    entropies = [[rnd.seed, rnd.server_round, rnd.client_key] for rnd in rnds]
    ordered: dict[tuple[int, int], np.ndarray] = {}  # (n, epochs) → rows 0..n-1 (permuted copies them)
    for c, (rng, n, w, k) in enumerate(zip(generators(entropies), sizes, widths, steps, strict=True)):
        if k == 0:
            continue
        per_epoch = -(-n // w)  # batches per epoch
        epochs = -(-k // per_epoch)
        if (n, epochs) not in ordered:
            ordered[n, epochs] = np.tile(np.arange(n), (epochs, 1))
        perms = rng.permuted(ordered[n, epochs], axis=1)  # one row per epoch
        if per_epoch == 1:  # the usual case at small n: one batch per epoch, its whole permutation
            index[:k, c, :n] = perms[:k] + offsets[c]
            count[:k, c] = n
            continue
        if per_epoch * w != n:  # the epoch's last batch is shorter: pad it (position 0 = the client's first example)
            perms = np.pad(perms, ((0, 0), (0, per_epoch * w - n)))
        index[:k, c, :w] = perms.reshape(-1, w)[:k] + offsets[c]
        lengths = np.full(per_epoch, w)
        lengths[-1] = n - (per_epoch - 1) * w
        count[:k, c] = np.tile(lengths, epochs)[:k]
    return index, count


def _whole_plan(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(index, count)`` of one step in which every client's batch is all of its examples, in order (padded with
    the client's first example: weight 0)."""
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    width = np.arange(max(sizes))
    index = offsets[:, None] + np.where(width[None, :] < np.asarray(sizes)[:, None], width[None, :], 0)
    return index, np.asarray(sizes, dtype=np.int64)


def _plan_tensors(index_np: np.ndarray, count_np: np.ndarray, device: torch.device,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(index, weight, divisor)`` of a batch plan (:func:`_batch_plan`, :func:`_whole_plan`; any leading step axes),
    made once for all its steps: the positions, each position's weight (``dtype``; 0 = padding) and each client's
    loss divisor (its real batch size, at least 1)."""
    idx = torch.from_numpy(index_np).to(device)
    count = torch.from_numpy(count_np).to(device)
    weight = (torch.arange(idx.shape[-1], device=device) < count[..., None]).to(dtype)
    return idx, weight, count.clamp(min=1)


def _losses_before(model: nn.Module, rnds: list[ClientRound], x_all: Tensor, y_all: Tensor, sizes: list[int],
                   example_losses: Callable[[Tensor, Tensor], Tensor]) -> list[float]:
    """``train-loss-before`` of every client of the chunk (all hold the received model): one forward pass over the
    chunk's examples (:data:`EVAL_CHUNK` at a time, eval mode, as :func:`~flower_strategies.core.client.mean_loss`),
    then each client's mean over its own examples or its ``loss-before-max-examples`` sample
    (:func:`~flower_strategies.core.client.loss_before_sample`), summed in float64."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        per = torch.cat([example_losses(model(x_all[s : s + EVAL_CHUNK]), y_all[s : s + EVAL_CHUNK])
                         for s in range(0, len(x_all), EVAL_CHUNK)])
    model.train(was_training)
    values = per.double().cpu().numpy()
    out, start = [], 0
    for rnd, n in zip(rnds, sizes, strict=True):
        own, start = values[start : start + n], start + n
        sample = loss_before_sample(n, rnd.config, rnd.seed, rnd.client_key)
        chosen = own if sample is None else own[sample]
        out.append(float(chosen.sum()) / len(chosen))
    return out


def _model_records(model: nn.Module, params: Mapping[str, Tensor], clients: int) -> list[ArrayRecord] | None:
    """Every client's model record, as ``tensor_record(model.state_dict())`` writes it once the client's rows are
    in the model, built from the stacked parameters at once: one NumPy view per stacked tensor, the ``.npy`` header
    once per tensor, one bytes copy per client and array (the buffers, equal for all clients, are serialised once and
    share their bytes).  ``None`` when the state dict holds anything else (extra state) or a non-contiguous
    parameter: the reply then serialises the model itself."""
    owner = {id(p): n for n, p in model.named_parameters()}
    entries: list[tuple[str, str, tuple[int, ...], bytes, Any]] = []  # (key, dtype, shape, header, rows | payload)
    for key, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, Tensor) or (id(value) in owner and not value.is_contiguous()):
            return None
        if id(value) in owner:
            stacked = params[owner[id(value)]].detach().cpu().contiguous().numpy()
            prefix, dtype = R.npy_prefix(stacked.dtype, tuple(value.shape))
            entries.append((key, dtype, tuple(value.shape), prefix, stacked.reshape(clients, -1)))
        else:  # a buffer: the received value, unchanged by training
            arr = R.to_array(value.detach().cpu().numpy())
            entries.append((key, arr.dtype, arr.shape, b"", arr.data))
    return [R.filled(ArrayRecord(), [(key, R.array_from_buffer(prefix, dtype, shape, memoryview(rows[c]).cast("B"))
                                      if prefix else R.array_from_buffer(b"", dtype, shape, rows))  # shared bytes
                                     for key, dtype, shape, prefix, rows in entries])
            for c in range(clients)]


def train_stacked(
    model: nn.Module,
    rnds: list[ClientRound],
    data: list[TensorPartition],
    example_losses: Callable[[Tensor, Tensor], Tensor],
    *,
    loss_before: bool = True,
) -> list[RecordDict]:
    """One round of ``len(rnds)`` clients that received the same content, trained together; returns each client's
    reply content exactly as :func:`~flower_strategies.core.client.train_reply` builds it (and saves each client's
    state into its ``rnd.state``).  ``example_losses``: per-example losses whose batch mean is the task's loss."""
    clients, rnd0 = len(rnds), rnds[0]
    rnd0.load_model(model)
    device = next(model.parameters()).device
    sizes = [len(d) for d in data]
    x_all, y_all = torch.cat([d.x for d in data]), torch.cat([d.y for d in data])
    befores = (_losses_before(model, rnds, x_all, y_all, sizes, example_losses) if loss_before
               else [None] * clients)
    steps = [r.num_steps(n) for r, n in zip(rnds, sizes, strict=True)]
    named = dict(model.named_parameters())
    params = {n: p.detach().unsqueeze(0).expand(clients, *p.shape).clone() for n, p in named.items()}
    weight_dtype = x_all.dtype if x_all.is_floating_point() else torch.float32

    names = list(params)
    # per client: its parameters and its batch; a model of linear layers runs stacked without vmap (linear_stack)
    outputs_fn = linear_stack(model, x_all[: min(4, len(x_all))]) or per_client_forward(model)

    def stacked_grads(idx: Tensor, weight: Tensor, divisor: Tensor) -> tuple[list[Tensor], Tensor]:
        """Per-client gradients (in ``names`` order) and losses of one step: ``idx[c]`` = client c's (padded) batch
        positions, ``weight[c]`` their weights, ``divisor[c]`` its real batch size (at least 1).
        Only the model runs per client (``vmap``); the per-example losses of all clients' outputs are one call, and
        each client's loss is the mean over its real examples (padding weighted 0).  Client c's loss depends only on
        its own rows of the stacked parameters, so the gradient of the sum of the clients' losses is every client's
        own gradient: one backward pass through the batched forward."""
        leaves = tuple(p.detach().requires_grad_(True) for p in params.values())
        with torch.enable_grad():
            rows = idx.reshape(-1)  # index_select: the same rows as x_all[idx], a quarter of the time on CPU
            outputs = outputs_fn(leaves, x_all.index_select(0, rows).view(*idx.shape, *x_all.shape[1:]))
            per_example = example_losses(outputs.flatten(0, 1), y_all.index_select(0, rows)).view(idx.shape)
            losses = (per_example * weight).sum(1) / divisor
            grads = torch.autograd.grad(losses.sum(), leaves, allow_unused=True, materialize_grads=True)
        return list(grads), losses.detach()

    # MimeLite's gradient over all local data at x_t: every client's whole partition as one (padded) batch
    full = (dict(zip(names, stacked_grads(*_plan_tensors(*_whole_plan(sizes), device, weight_dtype))[0], strict=True))
            if rnd0.needs_full_gradient else None)
    opt = rnd0.build_optimizer(
        params.items(), client_state=_stack_state([load_client_state(r.state) for r in rnds]),
        full_gradient=None if full is None else {n: g.clone() for n, g in full.items()},
        planned_steps=steps[0] if len(set(steps)) == 1 else None,
    )
    opt.clients = clients

    index_np, count_np = _batch_plan(rnds, sizes, steps)
    index, weight, divisor = _plan_tensors(index_np, count_np, device, weight_dtype)
    model.train()
    losses = []
    for s in range(max(steps)):
        grads, loss = stacked_grads(index[s], weight[s], divisor[s])
        for p, g in zip(params.values(), grads, strict=True):
            p.grad = g
        done = np.flatnonzero(count_np[s] == 0)  # clients past their last step: frozen
        if len(done):
            frozen = torch.from_numpy(done).to(device)
            saved_params = {n: p.detach().index_select(0, frozen) for n, p in params.items()}
            entries = _stacked_entries(opt, clients, frozen)
        opt.step()
        if len(done):
            _restore_frozen(params, saved_params, entries, frozen)
        losses.append(loss)
    per_step = torch.stack(losses).cpu().tolist()

    # per-client views, split once per chunk (the stacked tensors are not written to any more)
    rows = [(p, params[n].detach().unbind(0)) for n, p in named.items()]
    # each parameter's optimizer state: (key, the clients' rows or None, value): a stacked entry gives each client
    # its row, any other is cloned per client
    state_rows = [(p, [(k, v.unbind(0) if _per_client(v, clients) else None, v)
                       for k, v in opt.state[params[n]].items()]) for n, p in named.items()]
    fulls = [None] * clients if full is None else [{n: g[c] for n, g in full.items()} for c in range(clients)]
    records = _model_records(model, params, clients) if opt.sends_model else None
    replies = []
    opt_c: LocalOptimizer | None = None
    for c, rnd in enumerate(rnds):
        with torch.no_grad():
            for p, row in rows:
                p.copy_(row[c])
        if opt_c is None:
            opt_c = rnd.optimizer(model, num_examples=sizes[c], full_gradient=fulls[c])
        else:
            opt_c.rebind(load_client_state(rnd.state), fulls[c], steps[c])
        for p, state_entries in state_rows:
            opt_c.state[p] = {k: split[c] if split is not None else (v.clone() if isinstance(v, Tensor) else v)
                              for k, split, v in state_entries}
        opt_c.state[ROUND]["steps"] = steps[c]  # type: ignore[index]
        total = 0.0
        for s in range(steps[c]):  # the sequential loop's float sum, in its order
            total += per_step[s][c]
        replies.append(rnd.reply(model, opt_c, num_examples=sizes[c], train_loss=total / max(steps[c], 1),
                                 train_loss_before=befores[c], model_record=None if records is None else records[c]))
    return replies


def memory_estimate_mb(model: nn.Module, example: Tensor, batch: int, clients: int) -> float:
    """The chunk-size estimate (MiB) for ``clients`` clients: see :data:`PARAM_FACTOR`."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return clients * (PARAM_FACTOR * params + INPUT_FACTOR * batch * example.numel() * example.element_size()) / 2**20


__all__ = ["DEFAULT_MEMORY_MB", "ChunkJob", "NotVectorizable", "StackableLSTM", "VectorGrid", "check_vectorizable",
           "chunk_bounds", "chunk_job", "finish_chunk", "memory_estimate_mb", "replace_state", "run_chunk", "stackable",
           "step_buckets", "train_stacked", "vectorizable"]
