"""A run sized on a cluster that need not exist: the strategy training would choose, the peak memory per GPU,
whether that fits, and when it does not, which single change would make it fit, each found by sizing the
changed run the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from shardtune.config import Config, with_overrides
from shardtune.distributed.strategy import ParallelPlan, choose_parallelism
from shardtune.plan.memory import MemoryEstimate, estimate_memory, usable_memory
from shardtune.plan.shape import ModelShape

GIB = 2**30
# GiB of memory as torch reports it (its out-of-memory messages' "total capacity"), of the GPUs the benchmarks
# ran on (nvidia-smi: 81,559 and 143,771 MiB). plan's default is the H100's. The H100's is at least 79.17: a
# run there checkpointed 43 layers (``bench_h100_loss_qwen3-experts.json``), which its planner (then 6 bytes a
# chunked-loss logit) chose only for a GPU of that much or more; at 79.1 it would have taken 44.
GPU_MEMORY_GIB = {"H100 80GB": 79.19, "H200": 139.8}
DEFAULT_GPU_MEMORY_GIB = GPU_MEMORY_GIB["H100 80GB"]
# The search for more GPUs: a node's GPUs first (up to a common node's 8), then more nodes of as many.
COMMON_GPUS_PER_NODE = 8
MOST_NODES = 128
# A shorter context is searched in steps of this many tokens.
CONTEXT_STEP = 256


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory: int  # bytes per GPU

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class RunPlan:
    config: Config
    cluster: Cluster
    shape: ModelShape
    parallel: ParallelPlan
    memory: MemoryEstimate

    @property
    def usable(self) -> int:
        """Bytes of a GPU the run's tensors may take (``usable_memory``)."""
        return usable_memory(self.config, self.cluster.gpu_memory)

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.usable


def check_expert_parallel(config: Config, shape: ModelShape, cluster: Cluster) -> None:
    """``parallel.expert_parallel_size`` fits the cluster and the model, as training will check it."""
    from shardtune.distributed.mesh import ParallelDims  # imports torch: not for every command's parser

    dims = ParallelDims(cluster.world_size, 0, cluster.gpus_per_node, "cuda", config.parallel.expert_parallel_size)
    dims.check_model(shape.expert_counts, config.model.name_or_path)


def plan_run(config: Config, shape: ModelShape, cluster: Cluster) -> RunPlan:
    """``config`` on ``cluster``: the strategy by training's own rule, and the peak memory per GPU."""
    compiled = config.parallel.compiles_on("cuda")
    parallel = choose_parallelism(shape, config, cluster.world_size, cluster.gpu_memory, compiled)
    memory = estimate_memory(config, shape, parallel, compiled, cluster.gpu_memory)
    return RunPlan(config, cluster, shape, parallel, memory)


@dataclass(frozen=True)
class Change:
    """One way to a run that fits: what to type (options and ``section.key=value`` overrides), the run it makes."""

    what: str
    run: RunPlan


Reshape = Callable[[Config], ModelShape]


def _changed(run: RunPlan, overrides: list[str], reshape: Reshape | None = None, cluster: Cluster | None = None):
    config = with_overrides(run.config, overrides)
    return plan_run(config, reshape(config) if reshape else run.shape, cluster or run.cluster)


def larger_clusters(cluster: Cluster) -> Iterator[Cluster]:
    """Clusters of more GPUs, fewest first: a single node's GPUs up to 8, then more nodes of as many."""
    if cluster.nodes == 1:
        for gpus in range(cluster.gpus_per_node + 1, COMMON_GPUS_PER_NODE + 1):
            yield replace(cluster, gpus_per_node=gpus)
    per_node = max(cluster.gpus_per_node, COMMON_GPUS_PER_NODE) if cluster.nodes == 1 else cluster.gpus_per_node
    for nodes in range(cluster.nodes + 1, MOST_NODES + 1):
        yield replace(cluster, nodes=nodes, gpus_per_node=per_node)


def fsdp_or_more_gpus(run: RunPlan) -> Change | None:
    """FSDP over the run's GPUs, or else the fewest more GPUs (``larger_clusters``) that fit the run with FSDP."""
    replicated = run.cluster.world_size > 1 and run.parallel.strategy != "fsdp"
    for cluster in [*([run.cluster] if replicated else []), *larger_clusters(run.cluster)]:
        strategy: list[str] = []
        sized = _changed(run, strategy, cluster=cluster)
        if sized.parallel.strategy != "fsdp":  # auto would replicate: FSDP must be asked for
            strategy = ["parallel.strategy=fsdp"]
            sized = _changed(run, strategy, cluster=cluster)
        if not sized.fits:
            continue
        if cluster == run.cluster:
            return Change(f"parallel.strategy=fsdp (FSDP over the {cluster.world_size} GPUs)", sized)
        options = [f"--nodes {cluster.nodes}"] if cluster.nodes != run.cluster.nodes else []
        if cluster.gpus_per_node != run.cluster.gpus_per_node:
            options.append(f"--gpus-per-node {cluster.gpus_per_node}")
        return Change(f"needs ≥ {cluster.world_size} GPUs with FSDP: {' '.join([*options, *strategy])}", sized)
    return None


def shorter_context(run: RunPlan) -> Change | None:
    """The longest ``data.max_length`` (in steps of ``CONTEXT_STEP``) below the run's that fits."""
    low, high = 0, (run.config.data.max_length - 1) // CONTEXT_STEP  # in steps; low: fits (0: nothing found)
    while low < high:
        middle = (low + high + 1) // 2
        if _changed(run, [f"data.max_length={middle * CONTEXT_STEP}"]).fits:
            low = middle
        else:
            high = middle - 1
    if low == 0:
        return None
    length = low * CONTEXT_STEP
    return Change(f"data.max_length={length} (the longest that fits)", _changed(run, [f"data.max_length={length}"]))


def candidate_changes(run: RunPlan, reshape: Reshape) -> Iterator[Callable[[RunPlan], Change | None]]:
    """The changes worth trying on ``run``, in the order they cost a run's speed (least first)."""
    config = run.config
    training, parallel = config.training, config.parallel

    def overriding(what: str, overrides: list[str], new_shape: bool = False) -> Callable[[RunPlan], Change]:
        return lambda base: Change(what, _changed(base, overrides, reshape if new_shape else None))

    if not config.model.liger_kernel and training.loss_chunk_tokens == 0:
        yield overriding("training.loss_chunk_tokens=auto", ["training.loss_chunk_tokens=auto"])
    if not training.gradient_checkpointing:
        yield overriding("training.gradient_checkpointing=true", ["training.gradient_checkpointing=true"])
    if training.per_device_train_batch_size > 1:
        steps = training.per_device_train_batch_size * training.gradient_accumulation_steps
        overrides = ["training.per_device_train_batch_size=1", f"training.gradient_accumulation_steps={steps}"]
        yield overriding(f"{' '.join(overrides)} (the same global batch)", overrides)
    yield fsdp_or_more_gpus
    if not config.lora.enabled:
        yield overriding("lora.enabled=true", ["lora.enabled=true"], new_shape=True)
    if not parallel.cpu_offload:
        overrides = ["parallel.strategy=fsdp", "parallel.cpu_offload=true"]
        yield overriding(f"{' '.join(overrides)} (weights, gradients and Adam state in host memory)", overrides)
    yield shorter_context


def changes_that_fit(run: RunPlan, reshape: Reshape) -> tuple[list[Change], Change | None]:
    """Each single change that makes ``run`` fit; when none does alone, the fewest of them that fit together
    (taken in order, each kept while it lowers the peak, until the run fits; then each dropped again that
    the others do without), as one change, or None when even all of them do not fit."""
    makers = list(candidate_changes(run, reshape))
    changes = (make(run) for make in makers)
    single = [change for change in changes if change and change.run.fits]
    if single:
        return single, None
    chosen: list[Callable[[RunPlan], Change | None]] = []
    combined = run
    for make in makers:
        change = make(combined)
        if change and change.run.memory.peak < combined.memory.peak:
            chosen.append(make)
            combined = change.run
            if combined.fits:
                break
    else:
        return [], None
    for make in list(chosen[:-1]):
        fewer = _applied(run, [other for other in chosen if other is not make])
        if fewer is not None and fewer.run.fits:
            chosen.remove(make)
    return [], _applied(run, chosen)


def _applied(run: RunPlan, makers: list[Callable[[RunPlan], Change | None]]) -> Change | None:
    """The changes of ``makers`` made one after the other, as one change; None when one of them finds none."""
    words = []
    for make in makers:
        change = make(run)
        if change is None:
            return None
        run, words = change.run, [*words, change.what]
    return Change("; ".join(words), run)
