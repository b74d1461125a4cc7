"""``parallel.cuda_graphs``: the compiled decoder layers' forward and backward passes replayed as CUDA graphs.

Why: a compiled layer still launches each of its kernels from Python, one call at a time. In the forward of a
Qwen3-30B-A3B layer's attention half on one H200 that takes the host longer than the GPU takes to run the
kernels, and the GPU waits about 9% of a step (benchmarks/RESULTS.md, twentieth pass). A CUDA graph launches
a layer's hundred-odd kernels in one call.

How (the way Megatron-LM and Transformer Engine graph their layers; ``torch.cuda.make_graphed_callables`` is
the model): training forwards are watched; once two forwards in a row called every layer with the same
arguments (the first compiled the layers), the next one, before its first layer runs, captures every layer's
forward in order and every layer's backward in reverse order into one memory pool, and from then on each call
of that shape replays its layer's graphs. Written here rather than taken from ``make_graphed_callables``:

- the graphs are chained: a layer's input buffer is the previous layer's output buffer and its output-gradient
  buffer the next layer's input-gradient buffer, so nothing is copied between layers; tensors every layer gets
  (rotary cos/sin, the mask) share one buffer, filled once a forward;
- parameters' gradients leave the graph as new tensors. ``make_graphed_callables`` hands out its graph's own
  buffers: where a parameter has no gradient yet, autograd keeps that buffer as ``.grad``, and the next
  micro-batch's replay overwrites the gradient accumulated so far;
- the MoE blocks' routing record still reaches the ``RoutingRecorder`` (see ``fix_addresses`` there).

A graph replays the kernels it recorded on the addresses it recorded: a call replays only if its tensors have
the captured shapes, strides, dtypes and requires_grad and its other arguments are equal. Any other call
(evaluation, a batch of another shape) runs the compiled layer as before.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from shardtune.errors import first_line
from shardtune.model.moe import RoutingRecorder
from shardtune.rank_zero_log import SAID_BY_RANK_ZERO

log = logging.getLogger("shardtune")

# Training forwards with every layer called alike before the layers are captured: the first compiles them,
# the second runs the compiled code once more (cuBLAS and cuDNN set up their plans) on the default stream.
FORWARDS_BEFORE_CAPTURE = 2

_VALUES = (type(None), bool, int, float, str)


class MaskParts(NamedTuple):
    """A FlexAttention ``BlockMask`` as parts a graph can replay: its block tensors become tensor arguments like
    any other (copied into the captured ones before a replay), the rest plain values, its mask function compared
    by identity (``shardtune.model.packed_attention`` keeps one per batch shape, reading a buffer of its own)."""

    tensor_names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    value_names: tuple[str, ...]
    values: tuple


def masks_as_parts(tree: Any) -> Any:
    """``tree`` with every ``BlockMask`` in it as its ``MaskParts``."""

    def parts(leaf: Any) -> Any:
        if not isinstance(leaf, BlockMask):
            return leaf
        fields = sorted(vars(leaf).items())
        tensors = [(name, value) for name, value in fields if isinstance(value, torch.Tensor)]
        values = [(name, value) for name, value in fields if not isinstance(value, torch.Tensor)]
        return MaskParts(*zip(*tensors, strict=True), *(zip(*values, strict=True) if values else ((), ())))

    return tree_map(parts, tree)


def parts_as_masks(tree: Any) -> Any:
    """``tree`` with every ``MaskParts`` in it as the ``BlockMask`` it stands for."""

    def mask(leaf: Any) -> Any:
        if not isinstance(leaf, MaskParts):
            return leaf
        rebuilt = BlockMask.__new__(BlockMask)
        vars(rebuilt).update(zip(leaf.tensor_names, leaf.tensors, strict=True))
        vars(rebuilt).update(zip(leaf.value_names, leaf.values, strict=True))
        return rebuilt

    return tree_map(mask, tree, is_leaf=lambda node: isinstance(node, MaskParts))


@dataclass(frozen=True)
class LayerCall:
    """What a training forward (training mode, grad on) called a decoder layer with, as far as a graph is
    concerned: the argument structure, per leaf either a tensor's metadata or a plain value, where each tensor
    came from (``sources``), and the autocast state the compiled code was traced under."""

    spec: Any
    leaves: tuple
    # Per tensor leaf: ("output", k) the previous layer's k-th output, ("first", j) the first layer's j-th
    # argument (the same tensor object), ("own",) anything else.
    sources: tuple
    state: tuple


def describe_call(
    module: torch.nn.Module, leaves: list, spec: Any, first_ids: list[int], previous_output_ids: list[int]
) -> LayerCall | str | None:
    """A call from its flat arguments (``tree_flatten((args, kwargs))``); None where it is not a training call (no
    grad, or the module in eval mode); the type name of an argument a graph cannot replay (an object other than a
    tensor or a plain value, such as a key-value cache) where there is one."""
    if not (module.training and torch.is_grad_enabled()):
        return None
    described, sources = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            described.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad))
            ident = id(leaf)
            if ident in previous_output_ids:
                sources.append(("output", previous_output_ids.index(ident)))
            elif ident in first_ids:
                sources.append(("first", first_ids.index(ident)))
            else:
                sources.append(("own",))
        elif isinstance(leaf, _VALUES) or callable(leaf):  # a mask function (``MaskParts``): by identity
            described.append((type(leaf), leaf))
        else:
            return type(leaf).__name__
    state = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    return LayerCall(spec, tuple(described), tuple(sources), state)


@dataclass(eq=False)
class LayerGraph:
    """One decoder layer's captured forward and backward."""

    call: LayerCall
    buffers: list[torch.Tensor]  # the tensors the forward graph reads, at fixed addresses (its tensor arguments)
    params: list[torch.Tensor]  # the layer's trainable parameters
    outputs: list[torch.Tensor]  # the forward's output leaves (fixed addresses)
    out_spec: Any
    forward_graph: torch.cuda.CUDAGraph
    reported: list[torch.Tensor]  # the routing sums its MoE blocks reported while captured, rewritten by replays
    backward_graph: torch.cuda.CUDAGraph | None = None
    grad_outputs: list[torch.Tensor | None] = field(default_factory=list)  # per output leaf
    grad_inputs: list[torch.Tensor | None] = field(default_factory=list)  # per tensor input leaf
    param_grads: list[torch.Tensor | None] = field(default_factory=list)


class _Replay(torch.autograd.Function):
    """A captured layer as one autograd node: forward replays its forward graph, backward its backward graph."""

    @staticmethod
    def forward(ctx, graph: LayerGraph, filled: dict, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.graph = graph
        buffers = graph.buffers
        for buffer, tensor in zip(buffers, tensors[: len(buffers)], strict=True):  # the parameters follow
            if buffer.data_ptr() == tensor.data_ptr():
                continue  # chained: the previous layer's output buffer
            stamp = (id(tensor), tensor.data_ptr(), tensor._version)
            if filled.get(buffer.data_ptr()) != stamp:  # a buffer every layer shares is filled once a forward
                buffer.copy_(tensor)
                filled[buffer.data_ptr()] = stamp
        graph.forward_graph.replay()
        outputs = tuple(output.detach() for output in graph.outputs)
        constant = [out for out, grad in zip(outputs, graph.grad_outputs, strict=True) if grad is None]
        ctx.mark_non_differentiable(*constant)
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor | None) -> tuple:
        graph: LayerGraph = ctx.graph
        for buffer, grad in zip(graph.grad_outputs, grads, strict=True):
            if buffer is None:
                continue
            if grad is None:
                buffer.zero_()
            elif buffer.data_ptr() != grad.data_ptr():
                buffer.copy_(grad)
        graph.backward_graph.replay()
        inputs = [None if grad is None else grad.detach() for grad in graph.grad_inputs]
        present = [grad for grad in graph.param_grads if grad is not None]
        # New tensors, in one multi-tensor kernel: autograd may keep what it is handed as .grad (see above).
        fresh = iter(torch._foreach_mul(present, 1.0) if present else [])
        params = [None if grad is None else next(fresh) for grad in graph.param_grads]
        return (None, None, *inputs, *params)


class LayerGraphs:
    """Installed on the compiled decoder layers (``modules``: what the model calls) of a CUDA run in one process or
    under DDP (the parameters' gradients leave each replayed backward through autograd, where DDP's hooks reduce
    them as they do without graphs)."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules = modules
        self.compiled: list[Callable[..., Any]] = []
        for index, module in enumerate(modules):
            self.compiled.append(module._compiled_call_impl)
            module._compiled_call_impl = functools.partial(self._call, index)
        self.params: list[list[torch.Tensor]] = []  # per layer, its trainable parameters (at capture)
        self.seen: list[LayerCall | None] = [None] * len(modules)  # this forward's calls
        self.previous: list[LayerCall | None] | None = None  # the last complete forward's calls
        self.alike = 0  # complete forwards in a row whose calls were the same
        self.first_ids: list[int] = []  # this forward's first call's tensors, by id
        self.output_ids: list[int] = []  # the last layer call's output tensors, by id
        self.graphs: list[LayerGraph] | None = None
        self.given_up = False
        self.replaying = False
        self.filled: dict[int, tuple] = {}

    def _call(self, index: int, *args: Any, **kwargs: Any) -> Any:
        if torch.cuda.is_current_stream_capturing():
            return self.compiled[index](*args, **kwargs)
        leaves, spec = tree_flatten(masks_as_parts((args, kwargs)))
        if index == 0:  # the first layer's tensors are its own sources: ("first", j)
            self.output_ids = []
            self.first_ids = [id(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor)]
        call = describe_call(self.modules[index], leaves, spec, self.first_ids, self.output_ids)
        if isinstance(call, str) and not self.given_up:  # any layer's: none is captured without all of them
            log.info("cuda graphs: the decoder layers are called with a %s, which a graph cannot replay; they run "
                     "without graphs", call)  # fmt: skip
            self.graphs, self.given_up, self.replaying = None, True, False
        if index == 0:
            self._begin_forward(call, leaves)
        if self.replaying and self.graphs is not None and self.graphs[index].call != call:
            self._release()
        if self.replaying and self.graphs is not None:
            graph = self.graphs[index]
            tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
            outputs = _Replay.apply(graph, self.filled, *tensors, *graph.params)
            self._report(graph)
            self.output_ids = [id(output) for output in outputs]
            return tree_unflatten(list(outputs), graph.out_spec)
        if self.graphs is None:
            self.seen[index] = call
        result = self.compiled[index](*args, **kwargs)
        self.output_ids = [id(leaf) for leaf in tree_flatten(result)[0] if isinstance(leaf, torch.Tensor)]
        return result

    def _begin_forward(self, call: LayerCall | str | None, leaves: list) -> None:
        """A training forward's first layer call (an argument a graph cannot replay has given the graphs up)."""
        self.replaying = False
        self.filled = {}
        if call is None or self.given_up:
            return  # not a training forward (evaluation runs the compiled layers), or graphs given up
        if self.graphs is not None:
            self.replaying = True  # unless a layer's call differs (_call)
            return
        if all(seen is not None for seen in self.seen):
            self.alike = self.alike + 1 if self.seen == self.previous else 1
            self.previous = self.seen
        else:
            self.alike = 0
        self.seen = [None] * len(self.modules)
        if self.alike >= FORWARDS_BEFORE_CAPTURE and self.previous is not None and self.previous[0] == call:
            self._capture(self.previous, leaves)
            self.replaying = self.graphs is not None

    def _release(self) -> None:
        """A training forward of another shape: the graphs go (their memory pool holds a step's activations,
        which that forward would need again beside it), and the layers run without graphs from now on. Layers
        this forward already replayed keep their graphs until its backward is over (autograd holds them)."""
        log.info(
            "cuda graphs: a training batch of another shape than the captured one; the decoder layers run without "
            "graphs from now on (data.pad_to: max_length gives every batch one shape)"
        )
        self.graphs, self.given_up, self.replaying = None, True, False

    def _report(self, graph: LayerGraph) -> None:
        recorder = RoutingRecorder.current
        if recorder is not None and recorder.records_now():
            for sums in graph.reported:
                recorder.report(sums)

    def _capture(self, calls: list[LayerCall], first_leaves: list) -> None:
        started = time.perf_counter()
        recorder = RoutingRecorder.current
        if recorder is not None and recorder.records_now():
            first = next(leaf for leaf in first_leaves if isinstance(leaf, torch.Tensor))
            recorder.fix_addresses(first.shape[:-1].numel())
        self.params = [[p for p in module.parameters() if p.requires_grad] for module in self.modules]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # Per layer, what the warm-up and the capture read its trainable parameters through (see _stand_ins).
        stand_ins = [[torch.nn.Parameter(p.detach(), requires_grad=True) for p in params] for params in self.params]
        try:
            with torch.cuda.stream(stream):
                self._warm_up(calls, first_leaves, recorder, stand_ins)
                pool = torch.cuda.graph_pool_handle()  # one memory pool for every graph
                graphs = self._capture_forwards(calls, first_leaves, recorder, stand_ins, pool)
                self._capture_backwards(graphs, stand_ins, pool)
        except Exception as error:  # an op that cannot be captured (a host sync), or memory
            self.given_up = True
            log.warning(
                "cuda graphs: capturing the decoder layers failed (%s: %s); they run without graphs (same results); "
                "set parallel.cuda_graphs=false to skip the attempt",
                type(error).__name__,
                first_line(error),
                extra=SAID_BY_RANK_ZERO,
            )
        finally:
            torch.cuda.current_stream().wait_stream(stream)
        if self.given_up:
            # The graphs captured before the failure hold the pool, and the failure's traceback holds them in a
            # reference cycle: without a collection, the GPU unit test found the pool still held on one H100. The
            # emptied cache then hands the pool's memory back at once.
            gc.collect()
            torch.cuda.empty_cache()
            return
        self.graphs = graphs
        log.info(
            "cuda graphs: %d decoder layers captured (forward and backward) in %.1f s; training forwards of this "
            "shape replay them",
            len(graphs),
            time.perf_counter() - started,
        )

    def _inputs(self, call: LayerCall, first: list, previous_outputs: list) -> list:
        """Flat leaves for a layer's call: per tensor leaf, where it came from in the forward watched."""
        leaves, tensor_index = [], 0
        for described in call.leaves:
            if len(described) == 2:  # a plain value
                leaves.append(described[1])
                continue
            source = call.sources[tensor_index]
            tensor_index += 1
            if source[0] == "output":
                tensor = previous_outputs[source[1]].detach()
            elif source[0] == "first":
                tensor = first[source[1]].detach()
            else:
                shape, stride, dtype, device, _ = described
                tensor = torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
            leaves.append(tensor.requires_grad_(described[4]))
        return leaves

    def _warm_up(
        self, calls: list[LayerCall], first_leaves: list, recorder: RoutingRecorder | None, stand_ins: list[list]
    ) -> None:
        """Each layer's forward and backward once on the capture stream, the layers chained, nothing recorded."""
        first = [leaf for leaf in first_leaves if isinstance(leaf, torch.Tensor)]
        outputs: list[torch.Tensor] = []
        with recorder.paused() if recorder is not None else contextlib.nullcontext():
            for index, call in enumerate(calls):
                leaves = self._inputs(call, first, outputs)
                args, kwargs = parts_as_masks(tree_unflatten(leaves, call.spec))
                standing_in = stand_ins[index]
                with _stand_ins(self.modules[index], self.params[index], standing_in):
                    result = self.compiled[index](*args, **kwargs)
                outputs = [leaf for leaf in tree_flatten(result)[0] if isinstance(leaf, torch.Tensor)]
                wanted = [output for output in outputs if output.requires_grad]
                sources = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
                if wanted and sources + standing_in:
                    grads = torch.autograd.grad(wanted, sources + standing_in, [torch.zeros_like(o) for o in wanted],
                                                allow_unused=True)  # fmt: skip
                    # A parameter the layer reads other than as its module's attribute would get no gradient
                    # through its stand-in, and none from the replays: the graphs are given up instead.
                    module = self.modules[index]
                    names = [name for name, param in module.named_parameters() if param.requires_grad]
                    missing = [name for name, grad in zip(names, grads[len(sources) :], strict=True) if grad is None]
                    if missing:
                        raise ValueError(
                            f"decoder layer {index}'s parameter {missing[0]} got no gradient in the warm-up (unused, "
                            "or read other than as its module's attribute)"
                        )
                outputs = [output.detach() for output in outputs]

    def _capture_forwards(
        self, calls: list[LayerCall], first_leaves: list, recorder: RoutingRecorder | None, stand_ins: list[list],
        pool: tuple,
    ) -> list[LayerGraph]:  # fmt: skip
        # The first layer's tensors, at addresses of their own (its callers' tensors are new every forward).
        first = [leaf.detach().clone() for leaf in first_leaves if isinstance(leaf, torch.Tensor)]
        graphs: list[LayerGraph] = []
        outputs: list[torch.Tensor] = []
        for index, call in enumerate(calls):
            leaves = self._inputs(call, first, outputs)
            args, kwargs = parts_as_masks(tree_unflatten(leaves, call.spec))
            graph = torch.cuda.CUDAGraph()
            reporting = recorder.capturing() if recorder is not None else contextlib.nullcontext()
            with (
                _stand_ins(self.modules[index], self.params[index], stand_ins[index]),
                reporting as reported,
                _capturing(graph, pool),
            ):
                result = self.compiled[index](*args, **kwargs)
            flat, out_spec = tree_flatten(result)
            if not all(isinstance(leaf, torch.Tensor) for leaf in flat):
                raise TypeError(f"{type(self.modules[index]).__name__} returned something other than tensors")
            buffers = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
            graphs.append(LayerGraph(call, buffers, self.params[index], flat, out_spec, graph, list(reported or [])))
            outputs = flat
        return graphs

    def _capture_backwards(self, graphs: list[LayerGraph], stand_ins: list[list], pool: tuple) -> None:
        after: LayerGraph | None = None
        for graph, standing_in in zip(reversed(graphs), reversed(stand_ins), strict=True):
            # An output the next layer takes as an input that needs a gradient: its gradient buffer is that
            # layer's input-gradient buffer.
            chained: dict[int, torch.Tensor] = {}
            if after is not None:
                for source, leaf_grad in zip(after.call.sources, after.grad_inputs, strict=True):
                    if source[0] == "output" and leaf_grad is not None:
                        chained[source[1]] = leaf_grad
            graph.grad_outputs = [
                (chained[k] if k in chained else torch.zeros_like(output)) if output.requires_grad else None
                for k, output in enumerate(graph.outputs)
            ]
            wanted = [output for output in graph.outputs if output.requires_grad]
            buffers = [buffer for buffer in graph.grad_outputs if buffer is not None]
            sources = [leaf for leaf in graph.buffers if leaf.requires_grad]
            grads: tuple = (None,) * (len(sources) + len(standing_in))
            if wanted and sources + standing_in:
                backward = torch.cuda.CUDAGraph()
                with _capturing(backward, pool):
                    grads = torch.autograd.grad(wanted, sources + standing_in, buffers, allow_unused=True)
                graph.backward_graph = backward
            by_input = iter(grads[: len(sources)])
            graph.grad_inputs = [next(by_input) if leaf.requires_grad else None for leaf in graph.buffers]
            graph.param_grads = list(grads[len(sources) :])
            # The capture's autograd graph goes (the outputs keep their storage, the graphs the parameters' memory).
            graph.outputs = [output.detach() for output in graph.outputs]
            after = graph


@contextlib.contextmanager
def _capturing(graph: torch.cuda.CUDAGraph, pool: tuple) -> Iterator[None]:
    """``torch.cuda.graph`` on the current stream, into ``pool``. Where the capture fails, what torch's capture_end
    then leaves undone is done here, so that the run goes on without graphs as if none had been tried. Measured
    without it (torch 2.11, one H100): the pool stayed held, with every graph captured into it before, and the
    default generator refused every later random op ("Offset increment outside graph capture encountered
    unexpectedly"): dropout would have ended the run."""
    device = torch.cuda.current_device()
    try:
        # Only this thread's calls can spoil the capture: the run's other threads (heartbeat, NCCL's watchdog)
        # are not stopped for it.
        with torch.cuda.graph(graph, pool, torch.cuda.current_stream(), capture_error_mode="thread_local"):
            yield
    except BaseException:
        try:
            graph.pool()  # the capture ended (the error came after it): the graph lets its pool go when it goes
        except RuntimeError:  # it did not end: the allocator still counts it as capturing into the pool
            torch._C._cuda_endAllocateToPool(device, pool)
            torch._C._cuda_releasePool(device, pool)
            generator = torch.cuda.default_generators[device]
            generator.graphsafe_set_state(generator.clone_state())  # its own state, no longer marked capturing
        raise


@contextlib.contextmanager
def _stand_ins(module: torch.nn.Module, params: list[torch.Tensor], stand_ins: list[torch.Tensor]) -> Iterator[None]:
    """``module`` runs with its trainable parameters (``params``) swapped for ``stand_ins``: new leaf tensors on the
    same memory, whose gradients the captured backward asks for.

    Why: autograd hands a parameter's gradient over on the stream its gradient accumulator was made on. DDP makes
    the accumulators when it is built, on the default (legacy) stream, and keeps them, and a capture may not make
    that stream wait on the capturing one ("operation would make the legacy stream depend on a capturing blocking
    stream", measured on 2 H100s). Stand-ins get accumulators of their own on the capture stream, and the
    parameters' own ones (DDP's hooks) only ever see the replays' gradients, on the default stream."""
    by_id = {id(param): stand_in for param, stand_in in zip(params, stand_ins, strict=True)}
    swapped = [
        (owner, name, param)
        for owner in module.modules()
        for name, param in owner._parameters.items()
        if param is not None and id(param) in by_id
    ]
    try:
        for owner, name, param in swapped:
            owner._parameters[name] = by_id[id(param)]
        yield
    finally:
        for owner, name, param in swapped:
            owner._parameters[name] = param


def installed_graphs(model: torch.nn.Module) -> LayerGraphs | None:
    """The ``LayerGraphs`` installed on ``model``'s decoder layers, found through the calls it installed; None."""
    for module in model.modules():
        call = getattr(module, "_compiled_call_impl", None)
        owner = getattr(getattr(call, "func", None), "__self__", None)
        if isinstance(owner, LayerGraphs):
            return owner
    return None


def replayed_layers(model: torch.nn.Module) -> int:
    """How many of ``model``'s decoder layers training forwards replay as CUDA graphs now (0: graphs off, not
    captured yet, or given up)."""
    graphs = installed_graphs(model)
    return len(graphs.graphs) if graphs is not None and graphs.graphs is not None else 0
