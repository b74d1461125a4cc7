"""Expert parallelism (``parallel.expert_parallel_size``): each rank of an EP group holds ``num_experts /
ep_size`` routed experts of every MoE layer, and the fused MoE block moves tokens to them instead of
gathering the experts (see ``mesh.py`` for which ranks form the groups).

Inside ``routed_experts``, after the routing and the one sort by expert, :meth:`ExpertDispatch.send`
exchanges the per-expert row counts (all-to-all of a small tensor), sends each rank the rows of its experts
(all-to-all with uneven splits), and orders the received rows by local expert for the grouped GEMMs; the
returned ``receive_back`` undoes both after the experts ran. Both all-to-alls are autograd functions whose
backward is the reverse exchange. A rank whose experts receive no row, or that routes nothing (a padding
batch), still takes part with empty splits: every rank of the group runs every exchange of every layer.

The experts' tensors on a rank are its own run of experts (the ``local`` tensors below); a checkpoint and a
final export see them as slices of the whole layer's tensors (:func:`expert_state_views`), so DCP can load
them into any EP size and world size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardtune.checkpoint.names import without_wrappers
from shardtune.distributed.mesh import ParallelDims, rank_run
from shardtune.errors import ConfigError
from shardtune.model.fused_moe import (
    EXPERT_PARALLEL_LAYOUTS,
    SLAB_EXPERTS,
    FusedMoeBlock,
    Permute,
    expert_activation,
    expert_slabs,
    identity_experts,
    identity_rows,
    input_projection,
    routed_expert_count,
    unsupported_layout,
)
from shardtune.model.moe import EXPERT_PAIR_NAMES, ExpertPair, expert_pair


class AllToAll(torch.autograd.Function):
    """Rows sent to the ranks of ``group`` in ``input_splits`` runs, received in ``output_splits`` runs;
    the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    received = rows.new_empty(sum(output_splits), *rows.shape[1:])
    dist.all_to_all_single(received, rows.contiguous(), output_splits, input_splits, group=group)
    return received


@dataclass(frozen=True)
class ExpertDispatch:
    """One MoE layer's token exchange over an EP group of ``ep_size`` ranks, each holding ``local_experts``."""

    group: dist.ProcessGroup
    ep_size: int
    local_experts: int

    def send(
        self, rows: torch.Tensor, row_weights: torch.Tensor, bounds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """``rows`` sorted by (global) expert, their routing weights, ``bounds`` the rows of each (global) expert e,
        bounds[e]:bounds[e + 1]: (the rows this rank's experts must compute, ordered by local expert; their
        routing weights; their bounds per local expert (int32), as the grouped GEMMs take them; the function
        that sends those rows' outputs back, in ``rows``' order). Rows after the last expert's (identity experts'
        pairs: ``bounds`` covers the GEMM experts alone) stay here: they are not sent, and their outputs come back
        as zeros."""
        ep, local = self.ep_size, self.local_experts
        counts = torch.diff(bounds.long())  # rows per expert; the experts of rank k are run k
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)  # (source rank, local expert)
        # The one host sync of a dispatch: all-to-all takes its split sizes as Python ints (the step of an EP 2
        # run on 2 GPUs waits on the host at every MoE layer for it: benchmarks/RESULTS.md, issue 23).
        sizes = torch.cat([counts.view(ep, local).sum(1), received_counts.view(ep, local).sum(1)]).tolist()
        send_splits, receive_splits = sizes[:ep], sizes[ep:]
        kept = rows.shape[0] - sum(send_splits)  # the identity experts' rows, last in expert order
        if kept:
            rows, row_weights = rows[: rows.shape[0] - kept], row_weights[: rows.shape[0] - kept]
        received = AllToAll.apply(rows, receive_splits, send_splits, self.group)
        received_weights = AllToAll.apply(row_weights, receive_splits, send_splits, self.group)
        # Received rows come by source rank, each source's sorted by expert: sort them by local expert.
        local_ids = torch.arange(local, device=rows.device).repeat(ep)
        # The output's size given, repeat_interleave needs no second host sync to find it.
        expert_of_received = torch.repeat_interleave(local_ids, received_counts, output_size=sum(receive_splits))
        _, order = torch.sort(expert_of_received, stable=True)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        by_expert = Permute.apply(received, order, inverse)
        weights_by_expert = Permute.apply(received_weights, order, inverse)
        bounds = F.pad(received_counts.view(ep, local).sum(0).cumsum(0), (1, 0)).to(torch.int32)

        def receive_back(outputs: torch.Tensor) -> torch.Tensor:
            by_source = Permute.apply(outputs, inverse, order)
            returned = AllToAll.apply(by_source, send_splits, receive_splits, self.group)
            return F.pad(returned, (0, 0, 0, kept)) if kept else returned

        return by_expert, weights_by_expert, bounds, receive_back


def fused_blocks(model: torch.nn.Module) -> list[FusedMoeBlock]:
    return [module for module in model.modules() if isinstance(module, FusedMoeBlock)]


def shard_experts(model: torch.nn.Module, dims: ParallelDims) -> int:
    """Keep only this rank's run of routed experts (weights and their LoRA adapters) in every fused MoE block
    and give each block its token exchange; returns the number of blocks. Every layout of ``EXPERT_PARALLEL_LAYOUTS`` is
    taken (DBRX's 2-D slabs keep the rows of the rank's experts); the block's other children (router, shared experts,
    Nemotron-H's latent projections) stay whole, and so does the rest of a decoder layer whose experts sit beside its
    router (Gemma 4's: ``FusedRouter``), and of a block holding its experts as two modules of its own (JetMoE's
    ``ExpertPair``: its input_linear's and output_linear's weights and adapters are sharded, its router and output bias
    stay whole). Identity experts (LongCat-Flash's) are no rank's work: the GEMM experts split as any layout's, and the
    gate_up_proj rows (and adapters) of the identity experts, which nothing reads, split evenly too, each rank's after
    its GEMM experts' (``expert_runs``). The tensors may be on the meta device (before their weights arrive, see
    ``parallelize``)."""
    blocks = fused_blocks(model)
    if not blocks:
        raise ConfigError(
            f"parallel.expert_parallel_size: {dims.ep_size} needs the MoE blocks to run fused "
            "(model.experts_implementation: fused); this model's architecture has no fused MoE block; set it to 1"
        )
    for block in blocks:
        if (layout := unsupported_layout(block.experts, EXPERT_PARALLEL_LAYOUTS)) is not None:
            raise ConfigError(
                f"parallel.expert_parallel_size: {dims.ep_size} does not shard {block.replaced}'s experts ({layout}) "
                "yet; set it to 1"
            )
        identities = block.experts.identity_experts
        gemm_experts = dims.check_experts(block.num_routed_experts, type(model).__name__, identities)
        pair = isinstance(block.experts, ExpertPair)
        root = _experts_root(block)
        for name, tensor in expert_tensors(block).items():
            owner, attribute = _owner(root, name)
            with_identities = identity_rows(_base_experts(block.experts), _adapted_weight(root, name))
            experts = expert_runs(gemm_experts + with_identities, with_identities, dims.ep_rank, dims.ep_size)
            local = _local_slice(tensor_kind(name, pair), tensor, gemm_experts + with_identities, experts)
            setattr(owner, attribute, torch.nn.Parameter(local, requires_grad=tensor.requires_grad))
        block.experts.expert_dispatch = ExpertDispatch(dims.ep_group, dims.ep_size, gemm_experts // dims.ep_size)
    return len(blocks)


def expert_runs(num_experts: int, identities: int, ep_rank: int, ep_size: int) -> list[int]:
    """The (global) ids of the experts whose rows EP rank ``ep_rank`` of ``ep_size`` holds, in its tensors' order, of a
    tensor with a row (or factor) for each of ``num_experts`` experts, the last ``identities`` of them identity
    experts: its run of the GEMM experts (``rank_run``), then (LongCat-Flash's gate_up_proj and its adapters) its run
    of the identity experts."""
    gemm = num_experts - identities
    return [*rank_run(gemm, ep_rank, ep_size), *(gemm + expert for expert in rank_run(identities, ep_rank, ep_size))]


def _adapted_weight(root: torch.nn.Module, name: str) -> str:
    """The routed-expert weight a tensor named ``name`` under ``root`` is or adapts: its own last name, or for a LoRA
    factor the ``parameter_name`` of PEFT's wrapper holding it (``weight`` for any other module's)."""
    parts = name.split(".")
    factor = next((i for i, part in enumerate(parts) if part in ("lora_A", "lora_B")), None)
    if factor is None:
        return parts[-1]
    return getattr(root.get_submodule(".".join(parts[:factor])), "parameter_name", "weight")


def expert_tensors(block: FusedMoeBlock) -> dict[str, torch.Tensor]:
    """The block's routed-expert parameters by name under its ``experts`` module (a pair of expert modules': under
    the block, ``_experts_root``): the weights and the per-expert LoRA factors."""
    pair = isinstance(block.experts, ExpertPair)
    return {
        name: param for name, param in _experts_root(block).named_parameters() if tensor_kind(name, pair) is not None
    }


def _experts_root(block: FusedMoeBlock) -> torch.nn.Module:
    """The module whose parameters hold ``block``'s routed experts: its experts module (under PEFT's wrappers), or
    the block itself where it holds them as two modules of its own (JetMoE's ``ExpertPair``, which is not in the
    module tree: its weights keep their names under the block, their adapters are on the block's modules)."""
    return block if isinstance(block.experts, ExpertPair) else block.experts


# The routed experts' weights of every layout in EXPERT_PARALLEL_LAYOUTS, by name under the experts module: gated
# experts' gate_up_proj, ungated ones' up_proj (Nemotron-H's), and down_proj, and GPT-OSS's biases of the two. Each
# holds expert e at index e of its first dimension, whether (E, out, in) or transposed (E, in, out) (Llama 4's), or
# (E, out) for a bias: a run of experts is a run of that dimension.
EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
# Slab experts' weights (fused_moe.SLAB_EXPERTS: DBRX's mlp.w1, mlp.v1, mlp.w2), by their last two names: 2-D
# (E*I, H) slabs, expert e's rows e*I..(e+1)*I, so a run of experts is a run of rows (the same kind, ``experts``).
SLAB_WEIGHTS = {(holder, name) for holder, *names in SLAB_EXPERTS.values() for name in names}


def tensor_kind(name: str, pair: bool = False) -> str | None:
    """The kind of a routed-expert tensor, by its parameter name under the experts module: ``experts``
    (E, ..., one of ``EXPERT_WEIGHTS``; or E*I rows, a slab of ``SLAB_WEIGHTS``), ``lora_A`` (r*E, in: expert e's rows
    e*r..(e+1)*r), ``lora_B`` (out, r*E: expert e's columns e, e+E, ...), as PEFT lays out the factors of any of them
    (of a transposed weight too, whose in and out it swaps); None for others. With ``pair``, ``name`` is under a block
    holding its experts as two modules (JetMoE's ``ExpertPair``, ``EXPERT_PAIR_NAMES``): their ``weight`` (E, out, in)
    is ``experts``, the block's other tensors (router, bias) None."""
    last = without_wrappers(name).split(".")
    if pair and last[0] not in EXPERT_PAIR_NAMES:
        return None
    if last[-1] in EXPERT_WEIGHTS or tuple(last[-2:]) in SLAB_WEIGHTS:
        return "experts"
    if len(last) >= 3 and last[-3] in ("lora_A", "lora_B") and last[-1] == "weight":
        return last[-3]
    return "experts" if pair and last[-1] == "weight" else None


def _owner(root: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, attribute = name.rpartition(".")
    return (root.get_submodule(path) if path else root), attribute


def _local_slice(kind: str, tensor: torch.Tensor, num_experts: int, experts: list[int]) -> torch.Tensor:
    """``tensor``'s rows (factors) of ``experts`` (global ids, in this order), as the rank holding them keeps them."""
    index = torch.tensor(experts, device=tensor.device)
    if kind in ("experts", "lora_A"):  # a row of the first dimension per expert, or a slab's (or A's) rows of each
        rows = tensor.shape[0] // num_experts
        return tensor.view(num_experts, rows, *tensor.shape[1:])[index].reshape(-1, *tensor.shape[1:])
    rank = tensor.shape[1] // num_experts
    return tensor.view(tensor.shape[0], rank, num_experts)[:, :, index].reshape(tensor.shape[0], rank * len(experts))


def expert_state_names(model: torch.nn.Module) -> dict[str, tuple[str, int, int]]:
    """State-dict name -> (kind, the number of the layer's experts the tensor has a row or factor for, how many of
    those are identity experts) of every routed-expert tensor: those of each ``experts`` module holding 3-D
    ``gate_up_proj`` weights (ungated experts: ``up_proj``; DBRX's: 2-D slabs), and of each block holding its experts
    as two modules of its own (JetMoE's ``moe.expert_pair``), fused or not (an export's model is not). LongCat-Flash's
    gate_up_proj and its adapters may have the identity experts' (the last ones) beside the GEMM experts'
    (``identity_rows``); its down_proj and its adapters the GEMM experts' alone."""
    names: dict[str, tuple[str, int, int]] = {}
    for module_name, module in model.named_modules():
        if all(hasattr(module, name) for name in EXPERT_PAIR_NAMES) and (pair := expert_pair(module)) is not None:
            # The fused block's count (this rank holds a run of them); an unfused block's experts are all there.
            num_experts = getattr(module, "num_routed_experts", None) or pair.gate_up_proj.shape[0]
            for name, _ in module.named_parameters():
                kind = tensor_kind(name, pair=True)
                if kind is not None:
                    names[without_wrappers(f"{module_name}.{name}")] = (kind, num_experts, 0)
            continue
        if module_name.rpartition(".")[2] != "experts":
            continue
        base = _base_experts(module)
        slabs = expert_slabs(base)
        first = slabs[0] if slabs is not None else getattr(base, input_projection(expert_activation(base)), None)
        if not isinstance(first, torch.Tensor):
            continue
        parent = model.get_submodule(module_name.rpartition(".")[0])
        # The fused block's count (this rank holds a run of them): the parent's, or for experts beside their router in
        # the decoder layer (Gemma 4's) the FusedRouter child's; an unfused model's experts are all there.
        fused = (block for block in (parent, *parent.children()) if isinstance(block, FusedMoeBlock))
        num_experts = next((block.num_routed_experts for block in fused if block.experts is module), None)
        if num_experts is None:
            num_experts = routed_expert_count(base)
        identities = identity_experts(base)
        for name, _ in module.named_parameters():
            kind = tensor_kind(name)
            if kind is not None:
                held = identity_rows(base, _adapted_weight(module, name))
                names[without_wrappers(f"{module_name}.{name}")] = (kind, num_experts - identities + held, held)
    return names


def _base_experts(module: torch.nn.Module) -> torch.nn.Module:
    """The experts module under PEFT's parameter wrappers."""
    while hasattr(module, "parameter_name") and hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def expert_state_views(state: dict, names: dict[str, tuple[str, int, int]], dims: ParallelDims) -> dict:
    """``state`` (a model state dict, or an optimizer state dict's per-parameter ``state``, whose entries are
    dicts of moments) with every routed-expert tensor as a view of the whole layer's tensor:

    - under EP, a DTensor over the world (``dims.expert_state_mesh``) whose global shape is the layer's, split
      over the EP group and then over FSDP's shards (this rank's local tensor, no copy);
    - a LoRA B (out, r*E) always as (out, r, E): expert e's columns e, e+E, ... are then a box of the tensor
      (the last index), which DCP can split and reassemble across EP sizes;
    - under EP, a tensor with identity experts' rows (LongCat-Flash's gate_up_proj and its adapters) holds two runs of
      the whole tensor (the rank's GEMM experts', then its identity experts'): DCP sees the two boxes
      (``_identity_boxes``), the whole tensor keeps transformers' (PEFT's) order in the checkpoint.

    Views share storage with ``state``'s tensors, so DCP's in-place load fills them."""
    viewed = dict(state)
    for name, value in state.items():
        if without_wrappers(name) not in names:
            continue
        kind, num_experts, identities = names[without_wrappers(name)]
        if isinstance(value, dict):  # an optimizer's moments of the parameter (and its step count, left as is)
            viewed[name] = {
                key: _saved_view(moment, kind, num_experts, dims, identities) if _is_like_parameter(moment) else moment
                for key, moment in value.items()
            }
        else:
            viewed[name] = _saved_view(value, kind, num_experts, dims, identities)
    return viewed


def _saved_view(tensor: torch.Tensor, kind: str, num_experts: int, dims: ParallelDims, identities: int) -> torch.Tensor:
    """``expert_view``, with the boxes of the whole tensor that DCP sees where the tensor has identity experts'
    rows under EP (``_identity_boxes``)."""
    viewed = expert_view(tensor, kind, num_experts, dims)
    if identities and dims.ep_enabled:
        _identity_boxes(viewed, kind, num_experts, identities, dims.ep_size)
    return viewed


def _expert_dim(kind: str) -> int:
    """The dimension of ``expert_view``'s tensor that runs over the experts: a LoRA B's last, the others' first."""
    return 2 if kind == "lora_B" else 0


def _rank_major_order(num_experts: int, identities: int, ep_size: int) -> torch.Tensor:
    """For a tensor of ``num_experts`` experts, the last ``identities`` identity experts, split over ``ep_size`` ranks
    by ``expert_runs``: the (global) expert at each position of the ranks' tensors laid end to end (rank 0's GEMM
    experts, its identity experts, rank 1's GEMM experts, ...), the order of ``expert_view``'s DTensor under EP."""
    return torch.tensor(
        [expert for rank in range(ep_size) for expert in expert_runs(num_experts, identities, rank, ep_size)]
    )


def _positions(order: torch.Tensor, size: int) -> torch.Tensor:
    """``order`` (one entry per expert) spread over the ``size`` positions of a dimension with as many per expert."""
    per = size // order.numel()
    return (order.unsqueeze(-1) * per + torch.arange(per)).reshape(-1)


def _identity_boxes(viewed: DTensor, kind: str, num_experts: int, identities: int, ep_size: int) -> None:
    """Make DCP save and load ``viewed`` (``expert_view``'s DTensor of a tensor with identity experts' rows, under EP)
    as the boxes of the whole tensor in transformers' order that its local tensor holds.

    ``viewed`` lays the ranks' tensors end to end (``_rank_major_order``): a shard of that is one run of positions,
    which in the whole tensor are up to two runs (its GEMM experts', its identity experts'). DTensor asks its local
    tensor for its checkpoint chunks first (``__create_chunk_list__``, ``__create_write_items__``,
    ``__get_tensor_shard__``); those of this view's local tensor name the runs, so checkpoints of every EP size and
    of one process hold the same tensor, and DCP moves the pieces between any two."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = viewed._local_tensor
    dim = _expert_dim(kind)
    sizes, offsets = compute_local_shape_and_global_offset(viewed.shape, viewed.device_mesh, viewed.placements)
    whole = _positions(_rank_major_order(num_experts, identities, ep_size), viewed.shape[dim])
    mine = whole[offsets[dim] : offsets[dim] + sizes[dim]].tolist()
    boxes: list[tuple[torch.Size, int, int]] = []  # (offsets in the whole tensor, start in the local tensor, length)
    for start, position in enumerate(mine):
        if boxes and boxes[-1][0][dim] + boxes[-1][2] == position:
            boxes[-1] = (boxes[-1][0], boxes[-1][1], boxes[-1][2] + 1)
        else:
            boxes.append((torch.Size([*offsets[:dim], position, *offsets[dim + 1 :]]), start, 1))

    def chunk(box) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=box[0], sizes=torch.Size([*sizes[:dim], box[2], *sizes[dim + 1 :]]))

    def create_write_items(fqn: str, _) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(local)
        return [
            WriteItem(index=MetadataIndex(fqn, box[0]), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=chunk(box), properties=properties, size=viewed.shape))
            for box in boxes
        ]  # fmt: skip

    def tensor_shard(index: MetadataIndex) -> torch.Tensor:
        box = next(box for box in boxes if box[0] == index.offset)
        return local.narrow(dim, box[1], box[2])

    local.__create_chunk_list__ = lambda: [chunk(box) for box in boxes]
    local.__create_write_items__ = create_write_items
    local.__get_tensor_shard__ = tensor_shard


def _is_like_parameter(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2


def expert_view(tensor: torch.Tensor, kind: str, num_experts: int, dims: ParallelDims) -> torch.Tensor:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if kind == "lora_B":
        local = local.view(local.shape[0], -1, num_experts // dims.ep_size)
    if not dims.ep_enabled:
        if not isinstance(tensor, DTensor):
            return local
        shape = (tensor.shape[0], tensor.shape[1] // num_experts, num_experts) if kind == "lora_B" else tensor.shape
        return DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False, shape=shape,
                                  stride=_contiguous_strides(shape))  # fmt: skip
    # Under EP every expert tensor is FSDP-sharded (dim 0) over the ranks holding the same experts.
    assert isinstance(tensor, DTensor), "routed experts under expert parallelism are FSDP units"
    ep_local = tensor.shape  # the shape FSDP sees: this EP rank's run of experts
    if kind == "experts":
        shape, split = (ep_local[0] * dims.ep_size, *ep_local[1:]), 0
    elif kind == "lora_A":
        shape, split = (ep_local[0] * dims.ep_size, ep_local[1]), 0
    else:
        shape, split = (ep_local[0], ep_local[1] * dims.ep_size // num_experts, num_experts), 2
    return DTensor.from_local(local, dims.expert_state_mesh, (Shard(split), Shard(0)), run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_strides(shape))  # fmt: skip


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def whole_expert_tensor(
    tensor: torch.Tensor, kind: str, num_experts: int, dims: ParallelDims, identities: int = 0
) -> torch.Tensor:
    """The whole layer's tensor in its own layout (a collective over the world under EP, as FSDP's full state
    dict is over its mesh); with ``identities`` (LongCat-Flash's gate_up_proj and its adapters) the ranks' runs put
    back in transformers' order."""
    viewed = expert_view(tensor, kind, num_experts, dims)
    whole = _gathered(viewed) if isinstance(viewed, DTensor) else viewed
    if identities and dims.ep_enabled:
        dim = _expert_dim(kind)
        order = _positions(_rank_major_order(num_experts, identities, dims.ep_size), whole.shape[dim])
        whole = whole.index_select(dim, torch.argsort(order).to(whole.device))
    return whole.reshape(whole.shape[0], -1) if kind == "lora_B" else whole


def _gathered(tensor: DTensor) -> torch.Tensor:
    """``tensor.full_tensor()``, one mesh dimension at a time, the inner shards first. Asked to gather both
    dimensions of ``expert_state_mesh`` at once, torch 2.11 flattens the two into one and cannot (``ep`` comes
    first there but is the inner dimension of the ranks: "Mesh dim indices should be in ascending order"; the
    final save of an EP run on 2 H100s stopped on it); torch 2.13 gathers them one after the other anyway. The
    whole experts are gathered only for the final save and an export, once per tensor."""
    placements = list(tensor.placements)
    for dim in reversed(range(len(placements))):
        placements[dim] = Replicate()
        tensor = tensor.redistribute(tensor.device_mesh, placements)
    return tensor.to_local()


def distribute_expert_weights(
    model: torch.nn.Module, full_state: dict[str, torch.Tensor], dims: ParallelDims, src: int = 0
) -> None:
    """Every rank's part of the routed experts, from ``full_state`` on rank ``src`` (whole tensors, keyed by
    state-dict name; empty elsewhere): one broadcast of each whole tensor, each rank copies its box."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    names = expert_state_names(model)
    current = {without_wrappers(name): value for name, value in model.state_dict().items()}
    for name, (kind, num_experts, identities) in names.items():
        viewed = expert_view(current[name], kind, num_experts, dims)
        whole = full_state[name].to(viewed.device) if dims.rank == src else None
        shape = viewed.shape
        if whole is None:
            whole = torch.empty(shape, dtype=viewed.dtype, device=viewed.device)
        whole = whole.reshape(shape)
        if dims.world_size > 1:
            dist.broadcast(whole, src=src)
        if identities and dims.ep_enabled:  # in the ranks' order (expert_runs), of which each takes its box
            dim = _expert_dim(kind)
            whole = whole.index_select(dim, _positions(_rank_major_order(num_experts, identities, dims.ep_size),
                                                       shape[dim]).to(whole.device))  # fmt: skip
        if isinstance(viewed, DTensor):
            local_shape, offset = compute_local_shape_and_global_offset(shape, viewed.device_mesh, viewed.placements)
            box = tuple(slice(start, start + size) for start, size in zip(offset, local_shape, strict=True))
            viewed.to_local().copy_(whole[box])
        else:
            viewed.copy_(whole)
