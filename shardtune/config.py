"""The run configuration: a YAML file plus ``section.key=value`` overrides, typed and validated.

Everything here runs before any process group, tokenizer or model exists, so a typo costs the user
a second, not a queue slot on a cluster. Key names follow Hugging Face ``TrainingArguments`` where
one exists.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import types
from pathlib import Path
from typing import Any, Literal, Union, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from shardtune.checkpoint.layout import enclosing_checkpoint, not_a_checkpoint
from shardtune.errors import ConfigError

log = logging.getLogger(__name__)


def _home_expanded(value: object) -> object:
    """A path written as ``~/...`` (``~user/...``) is the user's home, as in a shell: never a directory named ``~`` in
    the working directory. A hub id, ``auto`` or any other name is left as it is."""
    if isinstance(value, list):
        return [_home_expanded(item) for item in value]
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


class _Section(BaseModel):
    # extra="forbid": an unknown key is an error (with a suggestion), never silently ignored. allow_inf_nan=False: YAML
    # reads .inf and .nan as numbers, which no count, rate, size or timeout can be.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# Router weights of a randomly drawn MoE model (shardtune/model/init_routing.py); bench --routing offers the same.
Routing = Literal["balanced", "skewed", "random"]


class ModelConfig(_Section):
    name_or_path: str = Field(description="Local model directory or Hugging Face hub id.")
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    attn_implementation: Literal["auto", "sdpa", "eager", "flex_attention", "flash_attention_2"] = Field(
        "auto", description="auto: flex_attention for packed sequences on GPUs, sdpa otherwise"
    )
    trust_remote_code: bool = False
    init: Literal["pretrained", "random"] = "pretrained"
    init_routing: Routing = Field(
        "random",
        description="with init: random, MoE models: router weights for an even or a trained-like long-tailed "
        "expert load (shardtune/model/init_routing.py); random: as drawn",
    )
    revision: str | None = None
    experts_implementation: Literal["auto", "fused", "eager", "grouped_mm", "batched_mm"] = Field(
        "auto",
        description="MoE expert computation in training: fused (shardtune's grouped-GEMM block), or "
        "transformers' eager, grouped_mm or batched_mm; auto (or null): fused where the architecture is "
        "supported, else transformers' default",
    )
    grouped_gemm: Literal["auto", "quack", "torch"] = Field(
        "auto",
        description="the fused MoE block's grouped GEMM for frozen expert weights: quack (quack-kernels' varlen "
        "GEMM, Hopper GPUs, pip install 'shardtune[quack]') or torch (torch._grouped_mm); auto: quack where it "
        "runs (measured faster), else torch. Float8 experts (float8_experts) take shardtune's Triton kernel on "
        "Hopper GPUs (the same output as torch's, faster) unless this is torch (torch._scaled_grouped_mm)",
    )
    liger_kernel: bool = Field(
        False, description="liger-kernel's Triton RMSNorm, SwiGLU, RoPE and fused linear cross-entropy (CUDA)"
    )
    float8_experts: bool = Field(
        False,
        description="LoRA on MoE models (fused experts): the frozen routed experts' GEMMs in float8 e4m3 with "
        "rowwise scales (Hopper GPUs; emulated on CPUs), faster at float8's precision: each expert product "
        "about 4e-2 from fp32 where bf16's is 2e-3 (shardtune/model/float8.py)",
    )
    float8_linear: bool = Field(
        False,
        description="LoRA: the decoder layers' frozen linear layers (the adapted projections' base layers, and "
        "those LoRA leaves alone; routers excepted) in float8 e4m3 with rowwise scales, as float8_experts",
    )

    @property
    def float8_keys(self) -> list[str]:
        """The float8 options that are on, by their keys (``model.float8_experts``, ``model.float8_linear``)."""
        return [f"model.{key}" for key in ("float8_experts", "float8_linear") if getattr(self, key)]

    @model_validator(mode="after")
    def _check_init_routing(self) -> ModelConfig:
        if self.init_routing != "random" and self.init != "random":
            raise ValueError(f"init_routing: {self.init_routing} sets up random weights; needs init: random")
        return self

    _model_path_at_home = field_validator("name_or_path", mode="before")(_home_expanded)

    @field_validator("experts_implementation", mode="before")
    @classmethod
    def _null_is_auto(cls, value: object) -> object:
        return "auto" if value is None else value  # null was the default of earlier releases' config.yaml


FORMAT_FIELDS = {"alpaca": ("instruction", "input", "output"), "messages": ("messages",), "text": ("text",)}


class DataConfig(_Section):
    dataset_path: str | list[str] = Field(
        description="file(s) (.jsonl, .json, .csv, .tsv, .parquet) or hub dataset id(s)"
    )
    dataset_weights: list[float] | None = Field(None, description="per source: times each row is used per epoch")
    dataset_split: str = "train"
    dataset_subset: str | None = None
    format: Literal["alpaca", "messages", "text"] = "alpaca"
    columns: dict[str, str] = Field(default_factory=dict, description="format field -> dataset column")
    train_on_prompt: bool = False
    max_length: int = Field(2048, gt=0)
    truncation: Literal["truncate", "drop"] = "truncate"
    on_bad_row: Literal["error", "skip"] = "error"
    subset_size: int | None = Field(None, gt=0)
    packing: bool = False
    pad_to: Literal["longest", "max_length"] = Field(
        "longest",
        description="training batches padded to their longest row or to data.max_length; packed batches are always "
        "padded to data.max_length",
    )
    eval_path: str | None = None
    eval_split_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    cache_dir: str | None = Field(None, description="token store root; default $SHARDTUNE_CACHE or ~/.cache/shardtune")
    prepare_timeout_s: float = Field(
        4 * 3600.0, gt=0, description="how long a process waits for another to build the token store"
    )

    _data_paths_at_home = field_validator("dataset_path", "eval_path", "cache_dir", mode="before")(_home_expanded)

    @property
    def paths(self) -> list[str]:
        return [self.dataset_path] if isinstance(self.dataset_path, str) else list(self.dataset_path)

    @property
    def weights(self) -> list[float]:
        return self.dataset_weights or [1.0] * len(self.paths)

    @property
    def batch_length(self) -> int | None:
        """The length every training batch is padded to; None: each batch to its longest row. Packed rows are
        filled up to max_length and padded the rest of the way (as torchtune's and axolotl's packing do): a few pad
        tokens a row buy one shape for every batch, so compiled layers never meet a new length and CUDA graphs
        replay."""
        return self.max_length if self.pad_to == "max_length" or self.packing else None

    @property
    def resolved_cache_dir(self) -> Path:
        default = os.environ.get("SHARDTUNE_CACHE") or Path.home() / ".cache" / "shardtune"
        return Path(self.cache_dir or default).expanduser()

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if not self.paths:
            raise ValueError("dataset_path: name at least one dataset")
        if self.dataset_weights is not None:
            if len(self.dataset_weights) != len(self.paths):
                raise ValueError(
                    f"dataset_weights: {len(self.dataset_weights)} weights for {len(self.paths)} dataset paths"
                )
            if any(weight <= 0 for weight in self.dataset_weights):
                raise ValueError("dataset_weights: every weight must be > 0")
        unknown = sorted(set(self.columns) - set(FORMAT_FIELDS[self.format]))
        if unknown:
            fields = ", ".join(FORMAT_FIELDS[self.format])
            raise ValueError(f"columns: {', '.join(unknown)} is not a field of format {self.format} ({fields})")
        if self.eval_path and self.eval_split_ratio > 0:
            raise ValueError("eval_split_ratio: set either eval_path or eval_split_ratio, not both")
        return self


class TrainingConfig(_Section):
    output_dir: str = "output"
    overwrite_output_dir: bool = False
    num_train_epochs: float = Field(1.0, gt=0)
    max_steps: int = Field(-1, ge=-1, description="-1: derive from num_train_epochs")
    learning_rate: float = Field(1e-4, gt=0)
    per_device_train_batch_size: int = Field(1, gt=0)
    per_device_eval_batch_size: int | None = Field(None, gt=0)
    gradient_accumulation_steps: int = Field(1, gt=0)
    warmup_ratio: float = Field(0.0, ge=0.0, le=1.0)
    warmup_steps: int | None = Field(None, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    adam_epsilon: float = Field(1e-8, gt=0)
    max_grad_norm: float = Field(1.0, ge=0.0, description="0 disables clipping")
    fused_optimizer: bool | Literal["auto"] = Field(
        "auto",
        description="AdamW as one fused kernel, which also skips a non-finite step without a host sync; "
        "auto: on CUDA (on CPU the foreach implementation, bit-equal to a plain PyTorch loop)",
    )
    seed: int = 42
    bf16: bool | None = Field(None, description="bf16 autocast; null follows model.dtype")
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto",
        description="recompute decoder layers' activations in backward; auto: on a GPU, the fewest layers that "
        "make the step's estimated peak fit the device's memory (none when it fits without), off on CPU",
    )
    gradient_checkpointing_every: int = Field(
        1, gt=0, description="with gradient_checkpointing: true, checkpoint every k-th decoder layer"
    )
    gradient_checkpointing_granularity: Literal["auto", "attention", "mlp", "sublayers", "layer"] = Field(
        "auto",
        description="what a checkpointed decoder layer recomputes: attention, mlp (its MLP or MoE block), "
        "sublayers (both), layer (all of it); auto: gradient_checkpointing auto takes the cheapest that fits "
        "(attention first, then the MLP too, then whole layers), true whole layers",
    )
    memory_budget_gib: float | None = Field(
        None,
        gt=0,
        description="GPU memory per device the step's estimated peak may take: gradient_checkpointing auto "
        "checkpoints the fewest layers that fit it, plan and doctor check against it; null: 90% of the GPU's",
    )
    logging_steps: int = Field(10, gt=0)
    eval_steps: int | None = Field(None, gt=0)
    eval_on_start: bool = False
    eval_dataset_type: Literal["full", "subset"] | None = None
    eval_subset_size: int | None = Field(None, gt=0)
    save_steps: int | None = Field(None, gt=0)
    save_total_limit: int | None = Field(None, gt=0)
    checkpoint_mode: Literal["lite", "full"] = "lite"
    loss_chunk_tokens: int | Literal["auto"] = Field(
        "auto",
        description="compute the loss and its gradient this many tokens at a time, in the forward pass, never "
        "holding all logits; 0: off (all logits at once); auto: chunks of at most 2**28 logits when a batch "
        "holds more, for models whose logits come straight from a linear head",
    )
    mlp_chunk_tokens: int = Field(
        0, ge=0, description="run each dense MLP over this many tokens at a time, recomputed in backward; 0: off"
    )
    activation_offloading: bool = Field(
        False, description="keep each checkpointed decoder layer's input in host memory until backward"
    )
    moe_aux_loss_coef: float = Field(
        0.0, ge=0.0, description="MoE models: weight of the router load-balancing loss added to the LM loss"
    )
    resume_from_checkpoint: str | None = Field(None, description="auto, a checkpoint directory, or null")
    merge_final: bool = Field(
        False, description="LoRA: also write final-merged/, the base model with the adapter merged (from_pretrained)"
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="a step with a non-finite loss or gradient is skipped; stop: stop after max_nonfinite_steps"
    )
    max_nonfinite_steps: int = Field(3, gt=0, description="on_nonfinite: stop after this many such steps in a row")
    heartbeat_interval_s: float = Field(
        1.0, ge=0.0, description="rewrite each rank's heartbeat/rank-<r>.json at most this often; 0: every phase"
    )
    hang_timeout_s: float | None = Field(
        None,
        ge=0.0,
        description="a rank without progress this long: dump stacks and collectives, exit; null: half of "
        "parallel.timeout_s; 0: off",
    )

    _run_paths_at_home = field_validator("output_dir", "resume_from_checkpoint", mode="before")(_home_expanded)

    @field_validator("loss_chunk_tokens", mode="before")
    @classmethod
    def _chunk_tokens(cls, value: Any) -> Any:
        # One message for any bad value (a union's validation would print one per member).
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError(f"should be auto, 0 (all logits at once) or a number of tokens (got {value!r})")

    @model_validator(mode="after")
    def _check(self) -> TrainingConfig:
        if self.max_steps == 0:
            raise ValueError("max_steps: must be a positive number of steps, or -1 to use num_train_epochs")
        if self.warmup_steps is not None and self.warmup_ratio > 0:
            raise ValueError("warmup_steps: set either warmup_steps or warmup_ratio, not both")
        if self.eval_dataset_type == "subset" and self.eval_subset_size is None:
            raise ValueError("eval_subset_size: required when eval_dataset_type is subset")
        if self.activation_offloading and self.gradient_checkpointing is not True:
            raise ValueError("activation_offloading: needs gradient_checkpointing: true (it offloads what that keeps)")
        parts = self.gradient_checkpointing_granularity
        if self.activation_offloading and parts not in ("auto", "layer"):
            raise ValueError(
                f"activation_offloading: offloads the inputs of whole checkpointed layers, which "
                f"gradient_checkpointing_granularity: {parts} does not checkpoint; set it to layer (or auto)"
            )
        if self.mlp_chunk_tokens and parts in ("mlp", "sublayers"):
            raise ValueError(
                f"gradient_checkpointing_granularity: {parts} recomputes the MLPs that mlp_chunk_tokens already "
                "recomputes slice by slice; set it to layer (or auto), or mlp_chunk_tokens to 0"
            )
        if self.eval_dataset_type == "full" and self.eval_subset_size is not None:
            raise ValueError("eval_subset_size: set, but eval_dataset_type is full; drop one of them")
        return self

    @property
    def uses_eval_subset(self) -> bool:
        return self.eval_subset_size is not None


MOE_LORA_TARGETS = ("attention", "dense_mlp", "shared_experts", "routed_experts", "router")
DEFAULT_MOE_TARGETS = ["attention"]
# The MoE groups whose weights PEFT adapts directly (target_parameters): there is no layer input to drop out.
PARAMETER_TARGETS = ("routed_experts", "router")


class LoraConfig(_Section):
    enabled: bool = True
    r: int = Field(16, gt=0)
    lora_alpha: float = Field(32.0, gt=0)
    target_modules: list[str] | Literal["all-linear"] | None = Field(
        None, description="module names (PEFT); null: all-linear for dense models, lora.moe_targets for MoE models"
    )
    moe_targets: list[Literal[MOE_LORA_TARGETS]] = Field(  # type: ignore[valid-type]
        DEFAULT_MOE_TARGETS,
        description=f"MoE models, when target_modules is null: any of {', '.join(MOE_LORA_TARGETS)}",
    )
    lora_dropout: float | None = Field(
        None,
        validate_default=True,  # null resolves to a number by the targets
        ge=0.0,
        lt=1.0,
        description="dropout on the adapted layers' inputs; null: 0.05, or 0 when lora.moe_targets names "
        f"{' or '.join(PARAMETER_TARGETS)} (weights PEFT adapts directly, with no layer input to drop out)",
    )
    shared_expert_adapter: bool = Field(
        False,
        description="routed_experts: one adapter shared by all experts of a layer (the fused experts "
        "implementation), saved in PEFT's per-expert layout with every expert's copy equal",
    )

    @model_validator(mode="after")
    def _check(self) -> LoraConfig:
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError('target_modules: must name at least one module, or be "all-linear"')
        if not self.moe_targets:
            raise ValueError(f"moe_targets: name at least one of {', '.join(MOE_LORA_TARGETS)}")
        # Compared with the default, not "was it written": a saved config.yaml spells out every key.
        if self.target_modules is not None and self.moe_targets != DEFAULT_MOE_TARGETS:
            raise ValueError("moe_targets: set either target_modules or moe_targets, not both")
        if self.shared_expert_adapter and not self.adapts_routed_experts:
            raise ValueError(
                "shared_expert_adapter: needs routed_experts in lora.moe_targets, with target_modules null"
            )
        return self

    @field_validator("lora_dropout")
    @classmethod
    def _dropout_where_there_is_an_input(cls, dropout: float | None, info: ValidationInfo) -> float:
        # Declared after target_modules and moe_targets, so both are in info.data here (when valid).
        direct = [] if info.data.get("target_modules") is not None else info.data.get("moe_targets", [])
        direct = [group for group in direct if group in PARAMETER_TARGETS]
        if dropout is None:
            return 0.0 if direct else 0.05
        if direct and dropout > 0:
            raise ValueError(
                f"must be 0 with lora.moe_targets {', '.join(direct)}: PEFT adapts those weights directly, so there "
                f"is no layer input to drop out (got {dropout}; leave it unset or set 0)"
            )
        return dropout

    @property
    def adapts_routed_experts(self) -> bool:
        """Whether LoRA adapts an MoE model's routed experts (moe_targets, with target_modules null)."""
        return self.target_modules is None and "routed_experts" in self.moe_targets


class ParallelConfig(_Section):
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    compile: bool | Literal["auto"] = Field(
        "auto",
        description="torch.compile each decoder layer (after checkpointing, before FSDP); auto: on CUDA, off on "
        "CPU; where compilation fails, one warning and the run goes on eagerly",
    )
    cuda_graphs: bool | Literal["auto"] = Field(
        "auto",
        description="replay each compiled decoder layer's forward and backward as CUDA graphs once training batches "
        "keep one shape; auto: on CUDA with parallel.compile, one process or DDP (not FSDP), where batches keep "
        "one shape (data.pad_to: max_length, or data.packing) and flex_attention, if it is the attention, has packed "
        "batches; layers recomputed whole run without graphs",
    )
    timeout_s: float = Field(1800.0, gt=0, description="timeout of every collective and wait")
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="MoE: ranks of one expert-parallel group, each holding num_experts / this many routed experts "
        "and exchanging tokens by all-to-all; groups are consecutive ranks (inside a node); 1: off",
    )

    def compiles_on(self, device_type: str) -> bool:
        """Whether decoder layers are compiled on this device type ("auto": on CUDA only, where it pays)."""
        return device_type == "cuda" if self.compile == "auto" else self.compile

    def graphs_on(self, device_type: str, strategy: str, one_shape: bool, attention: str, packed: bool) -> bool:
        """Whether compiled decoder layers are replayed as CUDA graphs (``shardtune.distributed.layer_graphs``);
        ``strategy``: the run's ("single", "ddp" or "fsdp"; "auto" before it is chosen); ``one_shape``: training
        batches keep one shape. Graphs are captured once two forwards have one shape and given up at the first
        training batch of another. ``attention``: the model's attention implementation; ``packed``: training
        batches are packed rows."""
        if self.cuda_graphs is False:
            return False
        needs = None
        if device_type != "cuda":
            needs = "a CUDA GPU"
        elif not self.compiles_on(device_type):
            needs = "parallel.compile"
        elif strategy == "fsdp":
            # FSDP gathers each layer's weights into new memory before the layer runs and frees them after: a graph
            # would read them at the addresses of the capture.
            needs = "one process or parallel.strategy: ddp (this run shards the weights with FSDP)"
        elif attention == "flex_attention" and not packed:
            # Packed rows get shardtune's BlockMask, whose mask function reads a buffer each batch refills
            # (``shardtune.model.packed_attention``); transformers' mask of padded rows closes over a new tensor
            # every batch, which a graph would read at its captured address.
            needs = "data.packing where model.attn_implementation is flex_attention"
        if needs is not None and self.cuda_graphs is True:
            raise ConfigError(f"parallel.cuda_graphs: true needs {needs}; set parallel.cuda_graphs: auto or false")
        return needs is None and (one_shape or self.cuda_graphs is True)

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if self.cpu_offload and self.strategy != "fsdp":
            # DDP (and auto, which may choose it) keeps a whole replica on each device: nothing to offload.
            raise ValueError(f"cpu_offload: needs parallel.strategy: fsdp (got {self.strategy})")
        if self.expert_parallel_size > 1 and self.strategy == "ddp":
            # The experts differ across an EP group: DDP's replicas (and its all-world gradient average) cannot
            # hold them; FSDP2 shards dense weights over all ranks and each expert over its holders.
            raise ValueError(
                f"expert_parallel_size: {self.expert_parallel_size} needs parallel.strategy: fsdp or auto (got ddp)"
            )
        return self


class NetworkConfig(_Section):
    """How the workers talk across nodes: set as NCCL_*/GLOO_* variables in every worker's environment."""

    socket_ifname: str | None = Field(
        None, description="interface(s) for NCCL and gloo sockets, e.g. eth0 or ^lo,docker0 (NCCL syntax)"
    )
    ib: bool | Literal["auto"] = Field("auto", description="InfiniBand: true, false (sockets only) or auto")
    nccl_debug: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = None
    nccl_socket_nthreads: int | None = Field(None, ge=1, le=16)
    nccl_nsocks_perthread: int | None = Field(None, ge=1, le=64)
    env: dict[str, str] = Field(default_factory=dict, description="more NCCL_*/GLOO_*/TORCH_NCCL_* variables")

    @field_validator("ib", mode="before")
    @classmethod
    def _ib(cls, value: Any) -> Any:
        return "auto" if value is None else value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        prefixes = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "UCX_", "FI_")
        for key in value:
            if not key.startswith(prefixes):
                raise ValueError(f"env: {key} is not a network variable (expected a name starting with {prefixes})")
        return value


class WandbConfig(_Section):
    enabled: bool = False
    project: str = "shardtune"
    entity: str | None = None
    name: str | None = None
    mode: Literal["online", "offline"] = "online"
    tags: list[str] = Field(default_factory=list)


class LoggingConfig(_Section):
    tensorboard: bool = False
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    progress_bar: bool | Literal["auto"] = Field("auto", description="auto: a bar when stderr is a terminal")
    peak_tflops: float | None = Field(
        None, gt=0, description="dense bf16 peak per device for MFU; default: known from the device name"
    )
    profile_steps: tuple[int, int] | None = Field(
        None, description="[first, last]: the PyTorch profiler over these steps, into output_dir/profile"
    )
    profile_host: bool = Field(
        True,
        description="with profile_steps: record the host's operators too (the report's host table, what the host "
        "did when the device waited); false on GPUs: the device's kernels alone, the host kept at its unprofiled "
        "pace, so the trace's idle time between kernels is a real step's",
    )

    @field_validator("profile_steps")
    @classmethod
    def _profile_steps(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not 1 <= value[0] <= value[1]:
            raise ValueError(f"[first, last] with 1 <= first <= last, got {list(value)}")
        return value


class Config(_Section):
    model: ModelConfig
    data: DataConfig
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @property
    def hang_timeout_s(self) -> float:
        """The watchdog's timeout (0: off); by default half the collective timeout, so it fires first."""
        setting = self.training.hang_timeout_s
        return self.parallel.timeout_s / 2 if setting is None else setting

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.training.bf16 is False and self.model.dtype == "bfloat16":
            raise ValueError(
                "training.bf16: false contradicts model.dtype: bfloat16; set model.dtype: float32 (or auto) for "
                "full precision, or drop training.bf16"
            )
        if self.training.merge_final and not self.lora.enabled:
            raise ValueError(
                "training.merge_final: needs lora.enabled: true; a full fine-tune's final/ is already the whole model"
            )
        expert_parallel = self.parallel.expert_parallel_size
        for key in self.model.float8_keys:
            # The quantized weights replace the bf16 ones on each rank: they are frozen, and whole.
            if not self.lora.enabled:
                raise ValueError(f"{key}: quantizes frozen weights; needs lora.enabled: true")
            if self.parallel.strategy == "fsdp" or expert_parallel > 1:
                raise ValueError(
                    f"{key}: needs the weights whole on every rank (one GPU, or parallel.strategy: ddp); "
                    "FSDP and expert parallelism split them"
                )
            if self.training.merge_final and self.model.init == "random":
                raise ValueError(
                    f"training.merge_final: a random init's base weights exist only in the run, which holds them in "
                    f"float8 ({key}); merge a checkpoint with shardtune export CHECKPOINT --merge, which "
                    "draws the init again"
                )
        if expert_parallel > 1 and self.model.experts_implementation not in ("auto", "fused"):
            raise ValueError(
                f"parallel.expert_parallel_size: {expert_parallel} needs model.experts_implementation: fused "
                f"(or auto), which dispatches tokens to the experts' ranks (got {self.model.experts_implementation})"
            )
        if expert_parallel > 1 and self.lora.shared_expert_adapter:
            # Each EP rank would train its own experts' copies of the one adapter from its own tokens.
            raise ValueError(
                f"parallel.expert_parallel_size: {expert_parallel} cannot train lora.shared_expert_adapter "
                "(its copies would drift apart across the EP group); set one of them off"
            )
        hang, collective = self.training.hang_timeout_s, self.parallel.timeout_s
        if hang and hang >= collective:
            # The collective timeout would end the run first, without the watchdog's diagnosis.
            raise ValueError(
                f"training.hang_timeout_s: {hang:g} must be below parallel.timeout_s ({collective:g}), or 0 to disable"
            )
        return self


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key written twice in one mapping (YAML requires keys to be unique), which
    PyYAML reads as its last value: a second ``training:`` section dropped every key of the first without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}  # each key's first line
        for key_node, _ in node.value:
            # A merge (``<<: *defaults``) may be overridden by the keys beside it; a config has no key but a scalar.
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in lines:
                raise yaml.constructor.ConstructorError(
                    problem=f"duplicate key {key!r}, first on line {lines[key]}", problem_mark=key_node.start_mark
                )
            lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The CONFIG file and ``section.key=value`` overrides every config-reading command takes."""
    parser.add_argument("config", help="YAML config file")
    add_override_arguments(parser)


def add_override_arguments(parser: argparse.ArgumentParser) -> None:
    """Any number of ``section.key=value`` overrides; the default makes argparse list them as optional (without
    it, a missing CONFIG was reported as "required: config, section.key=value")."""
    parser.add_argument("overrides", nargs="*", default=[], metavar="section.key=value", help="override config values")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``training.learning_rate=1e-4`` -> (["training", "learning_rate"], 1e-4); values are YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value")
    dotted, raw = text.split("=", 1)
    path = [part for part in dotted.strip().split(".")]
    if len(path) < 2 or not all(path):
        raise ConfigError(f"override {text!r}: expected section.key=value, e.g. training.max_steps=10")
    try:
        value = _load_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {dotted}: value {raw!r} is not valid YAML ({exc.problem})") from exc
    return path, value


def _apply_override(tree: dict[str, Any], path: list[str], value: Any, source: str) -> None:
    node = tree
    for depth, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: {'.'.join(path[: depth + 1])} is not a section")
        node = child
    node[path[-1]] = value


def _fields_at(location: tuple[Any, ...]) -> list[str]:
    """Field names valid at a location of the config tree, for did-you-mean suggestions."""
    model: type[BaseModel] = Config
    for part in location:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None) if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _union_tag_at(location: tuple[Any, ...]) -> int | None:
    """Where pydantic put the name of one type of a key's union (``parallel.compile.bool``, ``....literal['auto']``,
    one error per type the value is not) in an error's location, or None."""
    model: type[BaseModel] = Config
    for index, part in enumerate(location[:-1]):
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None) if field else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
            continue
        return index + 1 if get_origin(annotation) in (Union, types.UnionType) else None
    return None


def _error_lines(errors: list[dict[str, Any]]) -> list[str]:
    """One line per problem. A union key's value that is none of its types comes from pydantic as one error per
    type, each at the key plus the type's name (which is no key): it is one line naming every type
    (``parallel.compile: Input should be a valid boolean or 'auto' (got 'maybe')``), or, where the value has one
    type's shape (a list with a number in it), that type's errors alone."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for number, error in enumerate(errors):
        location = tuple(error["loc"])
        tag = _union_tag_at(location)
        # A union key's errors gather under it; any other error is a group of its own.
        group = ("union", location[:tag]) if tag is not None else ("one", number)
        loc = location[:tag] + location[tag + 1 :] if tag is not None else location
        groups.setdefault(group, []).append({**error, "loc": loc})
    lines = []
    for (kind, key), group in groups.items():
        inside = [error for error in group if len(error["loc"]) > len(key)] if kind == "union" else []
        if kind == "one" or inside or len(group) == 1:
            lines += [_format_error(error) for error in inside or group]
            continue
        # Each type's own words, without their detail ("a valid boolean, unable to interpret input").
        expected = " or ".join(error["msg"].removeprefix("Input should be ").split(", ")[0] for error in group)
        lines.append(f"{'.'.join(map(str, key))}: Input should be {expected} (got {group[0].get('input')!r})")
    return lines


def _format_error(error: dict[str, Any]) -> str:
    location = tuple(error["loc"])
    key = ".".join(str(part) for part in location)
    if error["type"] == "extra_forbidden":
        hint = difflib.get_close_matches(str(location[-1]), _fields_at(location[:-1]), n=1)
        suggestion = f" (did you mean '{'.'.join([*map(str, location[:-1]), hint[0]])}'?)" if hint else ""
        return f"{key}: unknown key{suggestion}"
    if error["type"] == "missing":
        return f"{key}: required key is missing"
    message = error["msg"].removeprefix("Value error, ")
    # Cross-field checks raise "key: why"; attach that key to the section for a full dotted name.
    named = re.match(r"(\w+): (.*)", message)
    if error["type"] == "value_error" and named and named.group(1) in _fields_at(location):
        return f"{key}.{named.group(1)}: {named.group(2)}"
    if error["type"].startswith("value_error") or not location:
        return f"{key}: {message}" if key else message
    return f"{key}: {message} (got {error.get('input')!r})"


def _check_paths(config: Config) -> list[str]:
    from shardtune.data.sources import is_local

    problems = []
    locals_ = [("data.dataset_path", path) for path in config.data.paths if is_local(path)]
    if config.data.eval_path:
        locals_.append(("data.eval_path", config.data.eval_path))
    for key, value in locals_:
        if not Path(value).expanduser().exists():
            problems.append(f"{key}: file not found: {value}")
    resume = config.training.resume_from_checkpoint
    problem = not_a_checkpoint(Path(resume)) if resume not in (None, "auto") else None
    if problem:
        problems.append(f"training.resume_from_checkpoint: {resume} {problem}")
    # A run writes its config, logs and checkpoints there, and clears them for a fresh run; a checkpoint is never
    # written to (and its own run's rotation would remove this one with it).
    output_dir = Path(config.training.output_dir)
    if checkpoint := enclosing_checkpoint(output_dir):
        where = "is the checkpoint" if checkpoint == output_dir.resolve() else "lies inside the checkpoint"
        problems.append(
            f"training.output_dir: {output_dir} {where} {checkpoint}, which is never written to; choose another "
            "output_dir"
        )
    problem = model_path_problem(config.model)
    return problems + ([problem] if problem else [])


def model_path_problem(model: ModelConfig) -> str | None:
    """What is wrong with a local ``model.name_or_path`` that is not there, or None."""
    if looks_local(model.name_or_path) and not Path(model.name_or_path).is_dir():
        return f"model.name_or_path: directory not found: {model.name_or_path}"
    return None


def looks_local(name_or_path: str) -> bool:
    """A hub id is ``name`` or ``org/name``; anything else (or anything that exists) is a path."""
    if Path(name_or_path).exists():
        return True
    return name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1


def load_config(path: str | Path, overrides: list[str] | None = None, check_paths: bool = True) -> Config:
    """Read, override and validate a config; raise ``ConfigError`` naming every bad key."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(path.glob("*.yaml")) + sorted(path.glob("*.yml"))
        hint = f": name a config file in it ({', '.join(map(str, inside[:3]))})" if inside else ""
        raise ConfigError(f"config file {path} is a directory{hint}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot be read ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not valid UTF-8 ({exc.reason}); save the config as UTF-8") from None
    try:
        tree = _load_yaml(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from exc
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (model, data, training, ...)")
    config = _validated(tree, overrides or [])
    if check_paths:
        problems = _check_paths(config)
        if problems:
            raise ConfigError(problems)
    return config


def _validated(tree: dict[str, Any], overrides: list[str]) -> Config:
    for text in overrides:
        keys, value = parse_override(text)
        _apply_override(tree, keys, value, text)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_error_lines(exc.errors())) from None


def with_overrides(config: Config, overrides: list[str]) -> Config:
    """``config`` with ``section.key=value`` overrides applied and validated, as on the command line."""
    return _validated(config.to_dict(), overrides)


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
