"""Make a model ready for its mesh, in one fixed order: activation memory (tiled MLPs, checkpointing,
offloading), compile, then data parallelism (DDP, or FSDP2 ``fully_shard`` per decoder layer and at the
root), then weights on every rank. Under expert parallelism the model is first emptied (meta) like every
FSDP model, each rank keeps its run of routed experts (the structure: layers are compiled lazily, at their
first call, so they compile the sharded experts), the dense weights are sharded over all ranks and the
experts over the ranks that hold the same ones; their weights then come from rank 0.

Weights are read from disk once per job: global rank 0 holds the loaded model, the other ranks build
the same architecture on the meta device (no memory), and after wrapping every rank gets its part
from rank 0 over the process group. Host memory per node stays at about one copy of the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from shardtune.checkpoint.names import without_wrappers
from shardtune.config import Config
from shardtune.distributed.activations import apply_activation_checkpointing, tile_mlps
from shardtune.distributed.compile import LayerCompiler
from shardtune.distributed.env import DistributedEnv
from shardtune.distributed.expert_parallel import (
    distribute_expert_weights,
    expert_state_names,
    shard_experts,
    whole_expert_tensor,
)
from shardtune.distributed.layer_graphs import LayerGraphs
from shardtune.distributed.mesh import ParallelDims
from shardtune.distributed.strategy import ParallelPlan, choose_parallelism
from shardtune.errors import ConfigError
from shardtune.model.float8 import describe_float8_grouped_gemm, require_float8, use_float8_linears
from shardtune.model.fused_moe import FusedMoeBlock, use_float8_experts
from shardtune.model.moe import ExpertPair, find_moe_blocks
from shardtune.plan.memory import Checkpointing, describe_checkpointing, estimate_memory, usable_memory
from shardtune.plan.shape import ModelShape

log = logging.getLogger("shardtune")


def device_memory(env: DistributedEnv) -> int | None:
    """Bytes of this rank's GPU; None on CPU."""
    return torch.cuda.get_device_properties(env.device).total_memory if env.device.type == "cuda" else None


def plan_parallelism(shape: ModelShape, config: Config, env: DistributedEnv) -> ParallelPlan:
    """The strategy for a model of ``shape`` (``read_model_shape`` of the built model) on ``env``'s devices, by
    ``choose_parallelism``'s rule."""
    return choose_parallelism(
        shape, config, env.world_size, device_memory(env), config.parallel.compiles_on(env.device.type)
    )


def plan_checkpointing(shape: ModelShape, config: Config, env: DistributedEnv, plan: ParallelPlan) -> Checkpointing:
    """What each decoder layer of a model of ``shape`` recomputes in backward, by the memory estimate's rule
    (``choose_checkpointing``: with ``auto``, the least recomputation that makes the step fit the GPU)."""
    if config.training.gradient_checkpointing is False:
        return Checkpointing.uniform(len(shape.layers), None)
    memory = device_memory(env)
    estimate = estimate_memory(config, shape, plan, config.parallel.compiles_on(env.device.type), memory)
    checkpointing = describe_checkpointing(config, estimate.checkpointed)
    if memory is None:
        log.info("%s", checkpointing)
    else:
        gib = 2**30
        budget = config.training.memory_budget_gib
        limit = "" if budget is None else f" (training.memory_budget_gib: {usable_memory(config, memory) / gib:.1f})"
        log.info(
            "%s: estimated peak %.1f GiB of the GPU's %.1f GiB%s",
            checkpointing,
            estimate.peak / gib,
            memory / gib,
            limit,
        )
    return estimate.checkpointed


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks, found by the class names transformers marks as unsplittable.

    A class counts under its own name or a base class's: FSDP2 renames the classes it shards
    (``FSDPLlamaDecoderLayer``), so the layers are found again after sharding."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    layers = [module for module in model.modules() if any(cls.__name__ in names for cls in type(module).__mro__)]
    if not layers:
        raise ConfigError(f"cannot find the decoder layers of {type(model).__name__} (no _no_split_modules)")
    return layers


def parallelize(
    model: torch.nn.Module,
    plan: ParallelPlan,
    config: Config,
    env: DistributedEnv,
    compute_dtype: torch.dtype,
    materialized: bool,
    compiler: LayerCompiler | None = None,
    checkpointing: Checkpointing | None = None,
) -> torch.nn.Module:
    """Activation memory (what each decoder layer recomputes: ``plan_checkpointing``; default nothing), compile
    (with ``compiler``, by default a new one), then DDP or FSDP2, then weights from rank 0 onto every rank's
    device."""
    training = config.training
    float8 = config.model.float8_keys
    if float8 and plan.strategy == "fsdp":
        raise ConfigError(
            f"{float8[0]}: needs the weights whole on every rank, and this run shards them with FSDP "
            f"({plan.describe(env.world_size)}); set parallel.strategy: ddp if the model fits each GPU, or "
            f"{float8[0]}: false"
        )
    # Found once: wrappers added below (checkpointing, compile) sit around these same modules.
    layers = decoder_layers(model)
    if training.mlp_chunk_tokens:
        count = tile_mlps(model, layers, training.mlp_chunk_tokens)
        log.info("tiled MLPs: %d decoder MLPs run %d tokens at a time", count, training.mlp_chunk_tokens)
    if checkpointing is not None and checkpointing.count:
        apply_activation_checkpointing(model, layers, checkpointing, training.activation_offloading,
                                       config.parallel.compiles_on(env.device.type))  # fmt: skip
        if training.activation_offloading:
            log.info("activation offloading: checkpointed layers keep their inputs in host memory")
    if config.parallel.compiles_on(env.device.type):
        # Per decoder layer, not the whole model: every layer runs the same code, so one compiled
        # graph serves them all, and FSDP's hooks between layers stay outside the graphs.
        if plan.strategy == "ddp":
            # Dynamo's DDP optimizer would split each layer's graph where a gradient bucket ends, so
            # that reduction could start inside the graph. With one graph per layer, DDP already
            # reduces between layers; the splits only cost fusions (extra dtype copies, unfused
            # SiLU): on 2xH200 at seq 4096 they made a DDP step 5% slower than one GPU's.
            torch._dynamo.config.optimize_ddp = False
        compiler = compiler if compiler is not None else LayerCompiler()
        for layer in layers:
            # Dense layers are compiled around their checkpoint wrapper (the recomputation is part of the
            # graph). A fused MoE layer compiled so kept 17% more memory at its peak than HF's path on one
            # H200 (Qwen3-30B-A3B, seq 4096: 84.6 GiB against 72.6; the partitioner saves routing tensors
            # past the checkpoint); compiled inside its wrapper, the recomputation replays its graphs and
            # nothing but the layer's input is kept. A layer that recomputes only its sublayers is compiled
            # whole, their checkpoints inside its graph: its backward graph recomputes them, fused with the
            # rest of the backward.
            is_moe = any(isinstance(module, FusedMoeBlock) for module in layer.modules())
            (layer if is_moe else _outer_wrapper(model, layer)).compile(backend=compiler)
        log.info("torch.compile on %d decoder layers", len(layers))
    # Asked of every run, compiled or not: `parallel.cuda_graphs: true` where graphs cannot run is one clear line.
    one_shape = config.data.batch_length is not None
    attention = model.config._attn_implementation
    if config.parallel.graphs_on(env.device.type, plan.strategy, one_shape, attention, config.data.packing):
        graph_layers(model, layers)
    if plan.strategy == "fsdp":
        return _shard(model, layers, config, env, compute_dtype, materialized)
    if plan.strategy == "ddp":
        _materialize_replica(model, env, materialized)
        # DDP's constructor broadcasts parameters from rank 0: the other ranks' empty tensors get rank
        # 0's weights. Buffers (rotary frequencies) are constants, sent once here rather than before
        # every forward (before torch 2.13, turning that off also kept the constructor from sending them).
        # Gradients are averaged over ranks (the loss is scaled for it) in the all-reduce buckets
        # themselves, with no copy in or out.
        _broadcast_buffers(model, None, env)
        model = DistributedDataParallel(
            model,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            init_sync=True,
            gradient_as_bucket_view=True,
            **_NO_BUFFER_SYNC_BEFORE_FORWARD,
        )
    else:
        model = model.to(env.device)
    if float8:
        # Every rank has rank 0's weights by now and quantizes them alike.
        model_config = config.model
        use_float8(
            model, env.device, model_config.float8_experts, model_config.float8_linear, model_config.grouped_gemm
        )
    return model


def use_float8(
    model: torch.nn.Module, device: torch.device, experts: bool, linear: bool, grouped_gemm: str = "auto"
) -> None:
    """``model.float8_experts`` and ``model.float8_linear``: the frozen routed experts, and the frozen linear
    layers of the decoder layers (routers excepted: they route in fp32), quantized to float8 on ``device``
    (``shardtune/model/float8.py``); the experts' grouped GEMM as ``model.grouped_gemm`` (``grouped_gemm``)
    picks."""
    on = {"model.float8_experts": experts, "model.float8_linear": linear}
    require_float8([key for key, wanted in on.items() if wanted], device)
    cuda = device.type == "cuda"
    if experts:
        blocks, backend = use_float8_experts(model, grouped_gemm)
        how = describe_float8_grouped_gemm(backend, device) + (", fast accumulation" if cuda else "")
        log.info("float8: the frozen routed experts of %d MoE layers in e4m3, rowwise scales (%s)", blocks, how)
    if linear:
        fused = [module for module in model.modules() if isinstance(module, FusedMoeBlock)]
        routers = {module for block in fused for module in block.get_submodule(block.router_name).modules()}
        count = use_float8_linears(decoder_layers(model), skip=routers)
        if not count:
            raise ConfigError(
                "model.float8_linear: the decoder layers have no frozen linear layer (every weight trains: full "
                "fine-tuning?); set it to false"
            )
        how = "torch._scaled_mm, fast accumulation" if cuda else "emulated in fp32 on the CPU"
        log.info("float8: %d frozen linear layers of the decoder layers in e4m3, rowwise scales (%s)", count, how)


def _materialize_replica(model: torch.nn.Module, env: DistributedEnv, materialized: bool) -> None:
    if materialized:
        model.to(env.device)
    else:
        _to_empty(model, env.device)


@contextlib.contextmanager
def _keeping_ties() -> Iterator[None]:
    """Move tensors between devices without replacing Parameter objects, so tied weights stay tied.

    A plain ``to("meta")`` or ``to_empty`` gives each module a new Parameter, so an output layer
    tied to the input embedding becomes a separate tensor (and the ranks' parameter lists differ).
    Swapping tensor contents in place keeps every Parameter object.
    """
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def _to_empty(model: torch.nn.Module, device: torch.device | str) -> None:
    with _keeping_ties():
        model.to_empty(device=device)


def _shard(
    model: torch.nn.Module,
    layers: list[torch.nn.Module],
    config: Config,
    env: DistributedEnv,
    compute_dtype: torch.dtype,
    materialized: bool,
) -> torch.nn.Module:
    dims = env.mesh
    # Rank 0's whole weights wait in host memory while the shards are made: random weights drawn on its GPU would
    # otherwise share it with this rank's shards (Qwen3-30B-A3B on 2 H100s: 61 GB drawn + 30 GB of shards, out of
    # memory), where pretrained weights are read into host memory anyway. The model is at most one GPU's size here:
    # it was drawn on one.
    full_state = {name: value.cpu() for name, value in model.state_dict().items()} if materialized else {}
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()} if materialized else {}
    if materialized:
        with _keeping_ties():
            model.to("meta")  # every rank shards the same empty model; rank 0's weights arrive below
    expert_names = {}
    if dims.ep_enabled:
        # The routed experts' whole tensors stay in rank 0's full_state; each rank's run of them arrives below.
        blocks = shard_experts(model, dims)
        expert_names = expert_state_names(model)
        log.info("expert parallel: %d MoE layers; %s", blocks, dims.describe())
    mixed = MixedPrecisionPolicy(
        param_dtype=compute_dtype if compute_dtype != torch.float32 else None, reduce_dtype=torch.float32
    )
    # The experts take their inputs as the block gives them: the routing weights in fp32 (the fused block casts the
    # tokens to its compute dtype itself). FSDP's cast of a unit's inputs to the parameters' dtype would round those
    # weights to bf16, and torch 2.11's FSDP skips that cast when a checkpointed layer recomputes (it unshards in
    # its pre-backward hook then): the recomputation saw fp32 where the forward had saved bf16, and backward
    # stopped (CheckpointError; Qwen3-30B-A3B, FSDP over 2 H100s).
    experts_policy = dataclasses.replace(mixed, cast_forward_inputs=False)
    options = {
        "mp_policy": mixed,
        "reshard_after_forward": config.parallel.reshard_after_forward,
        **({"offload_policy": CPUOffloadPolicy()} if config.parallel.cpu_offload else {}),
    }
    for block in find_moe_blocks(model, layers):
        # The routed experts are most of an MoE layer's weights: as a unit of their own they are
        # gathered just before they run and freed (and their gradients reduced) as soon as they are
        # done, instead of living as long as the attention of the same layer. Under expert parallelism
        # a unit holds this rank's experts, sharded over the ranks that hold the same ones; their
        # gradients sum over those ranks and are divided by the world size, as the dense weights' are
        # averaged over it: each rank's loss is scaled for an average over all ranks (see the loop).
        mesh = dims.expert_mesh if dims.ep_enabled else dims.dense_mesh
        if isinstance(block.experts, ExpertPair):
            experts = _shard_expert_pair(block.experts, mesh, {**options, "mp_policy": experts_policy})
        else:
            experts = block.block.get_submodule("experts")
            fully_shard(experts, mesh=mesh, **{**options, "mp_policy": experts_policy})
        if dims.ep_enabled:
            experts.set_gradient_divide_factor(float(dims.world_size))
            if env.device.type == "cpu" and dims.expert_dp_size > 1:
                # gloo has no PREMUL_SUM (NCCL's divide-inside-the-reduction): sum, then divide. Not on a
                # mesh of one rank, which reduces nothing: there FSDP (torch 2.13) would divide twice.
                experts.set_force_sum_reduction_for_comms(True)
    for layer in layers:
        fully_shard(_outer_wrapper(model, layer), mesh=dims.dense_mesh, **options)
    fully_shard(model, mesh=dims.dense_mesh, **options)
    _to_empty(model, "cpu" if config.parallel.cpu_offload else env.device)
    set_model_state_dict(
        model,
        {name: value for name, value in full_state.items() if without_wrappers(name) not in expert_names},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not expert_names),
    )
    if expert_names:
        distribute_expert_weights(model, {without_wrappers(name): value for name, value in full_state.items()}, dims)
    _broadcast_buffers(model, buffers, env)
    return model


def _shard_expert_pair(pair: ExpertPair, mesh, options: dict) -> FSDPModule:
    """A block's pair of expert modules (JetMoE's ``ExpertPair``: its input_linear and output_linear as it holds
    them, PEFT's wrappers and their adapters included) as one FSDP unit on ``mesh``, gathered around the pair's
    computation; returns the unit. The pair is not in the module tree and runs no forward of those modules (it reads
    their weights and adapters), so the unit's forward hooks would never fire: FSDP runs them around the pair's own
    forward instead (``register_fsdp_forward_method``). The block's router and output bias stay in their decoder
    layer's unit, on the dense mesh: under expert parallelism every rank routes its own tokens with them."""
    units = list(pair.adapted().values())
    fully_shard(units, mesh=mesh, **options)
    units[0].expert_pair_forward = pair.forward  # routed_experts of the pair (use_routed_experts)
    register_fsdp_forward_method(units[0], "expert_pair_forward")
    pair.forward = units[0].expert_pair_forward
    return units[0]


def graph_layers(model: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
    """``parallel.cuda_graphs``: the compiled layers replayed as CUDA graphs, but those recomputed whole (their
    checkpoint wrapper runs eagerly around the compiled layer; sublayers recomputed inside a layer's graph are
    captured with it) and those that run hooks (a router seen through a forward hook records in Python)."""
    graphed = [
        layer
        for layer in layers
        if _outer_wrapper(model, layer) is layer
        and not any(module._forward_hooks or module._forward_pre_hooks for module in layer.modules())
    ]
    if graphed:
        LayerGraphs(graphed)
    others = len(layers) - len(graphed)
    log.info("cuda graphs: %d of %d decoder layers, once training batches keep one shape%s", len(graphed),
             len(layers), f" ({others} recompute whole layers or run hooks)" if others else "")  # fmt: skip


def _outer_wrapper(model: torch.nn.Module, layer: torch.nn.Module) -> torch.nn.Module:
    """The checkpoint wrapper around ``layer`` if there is one: FSDP must wrap outside checkpointing."""
    for module in model.modules():
        if getattr(module, "_checkpoint_wrapped_module", None) is layer:
            return module
    return layer


# torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers, and warns on every rank of every run where
# the old name is given; earlier versions know only the old one.
_NO_BUFFER_SYNC_BEFORE_FORWARD = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


def _broadcast_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor] | None, env: DistributedEnv) -> None:
    """Buffers (e.g. rotary frequencies) are not in the state dict; send rank 0's to everyone: those
    saved in ``buffers``, or (None) those rank 0's model holds."""
    for name, buffer in model.named_buffers():
        if env.rank == 0 and buffers is not None:
            buffer.copy_(buffers[name].to(buffer.device))
        if env.world_size > 1:
            dist.broadcast(buffer, src=0)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, sync: bool) -> Iterator[None]:
    """Reduce gradients only on the last micro-batch of a step: the others just accumulate locally."""
    if isinstance(model, DistributedDataParallel) and not sync:
        with model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    yield


def local_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds (its shards, for a sharded model)."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        total += local.numel() * local.element_size()
    return total


@torch.no_grad()
def clip_gradients(params: list[torch.nn.Parameter], max_norm: float, dims: ParallelDims) -> torch.Tensor:
    """Scale the gradients of ``params`` to a total 2-norm of at most ``max_norm``; returns the norm before.

    ``clip_grad_norm_`` computes one norm over tensors of one mesh; under expert parallelism the routed
    experts' gradients are sharded over another (the ranks holding the same experts). So: one norm per mesh
    (a reduction over that mesh), the experts' squared norms summed over the EP group (whose ranks hold
    different experts), and one scale for all. Without EP there is one mesh, and this is clip_grad_norm_."""
    grads_by_mesh: dict[object, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            grads_by_mesh.setdefault(mesh, []).append(param.grad)
    norms = []
    for mesh, grads in grads_by_mesh.items():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        if dims.ep_enabled and mesh == dims.expert_mesh:
            square = norm.float() ** 2
            dist.all_reduce(square, group=dims.ep_group)
            norm = square.sqrt()
        norms.append(norm.float())
    if not norms:
        return torch.zeros(())
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if math.isfinite(max_norm):
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in grads_by_mesh.values():
            torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], scale)
    return total


def full_state_dict(
    model: torch.nn.Module, dims: ParallelDims, trainable_only: bool = False
) -> dict[str, torch.Tensor] | None:
    """The model's weights, whole, on rank 0's CPU (a collective for sharded models); None elsewhere.

    ``trainable_only``: the trained tensors alone. A LoRA adapter's save needs no more, and gathering the
    frozen base too would copy the whole model through rank 0's host memory (58 GiB and over a minute for
    Qwen3-30B-A3B; more than a host holds for the largest MoE models) to write a few hundred MB."""
    if isinstance(model, FSDPModule):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
        state = get_model_state_dict(model, options=options)
        if dims.ep_enabled:
            # FSDP gathered each rank's run of experts; the whole layer's come from every EP group's.
            sharded = {without_wrappers(name): value for name, value in model.state_dict().items()}
            trained = {without_wrappers(name) for name, p in model.named_parameters() if p.requires_grad}
            for name, (kind, num_experts, identities) in expert_state_names(model).items():
                if trainable_only and name not in trained:
                    continue
                whole = whole_expert_tensor(sharded[name], kind, num_experts, dims, identities).cpu()
                if dims.is_main:
                    state[next(key for key in state if without_wrappers(key) == name)] = whole
        if not dims.is_main:
            return None
        # Gathered copies of a tied weight no longer share storage, so save_pretrained cannot see the
        # tie: keep each Parameter under its first name only, as an unsharded model saves it.
        first_name: dict[int, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            if first_name.setdefault(id(param), name) != name:
                state.pop(name, None)
        return state
    return None
