"""Frozen weights in float8 (``model.float8_experts``, ``model.float8_linear``): e4m3 values with one fp32
scale per row.

LoRA leaves the base weights frozen, so each is quantized once, when training starts, in the two layouts its
GEMMs need (a tensor-core float8 GEMM takes both operands laid out along the summed dimension):

- for the forward, W (out, in) scaled per output row;
- for the input gradient, W^T (in, out) scaled per input column,

two bytes per weight in all, what the bf16 weight took, which they replace. The rows (tokens, and the
gradients in backward) are quantized as they come, one scale per row, and a grouped GEMM (the routed experts,
``Float8Product``: on Hopper GPUs shardtune's Triton kernel, ``float8_grouped_kernel.py``, elsewhere
``torch._scaled_grouped_mm``, the same output bit for bit) or ``torch._scaled_mm`` (linear layers,
``Float8Linear``) multiplies with fast accumulation. This is the rowwise recipe of torchao's float8 training,
with the weights' quantization done once because they do not change.

Why: on one H100 at Qwen3-30B-A3B's shapes, the four grouped GEMMs of an expert layer take 1,570 us against
2,312 in bf16 (1.5x; GLM-4.5-Air 1.6x, Mixtral-8x7B 1.6x), and its attention's q_proj 104 against 184 us,
each output 3.7e-2 from the fp32 product where bf16's is 1.7e-3 (``benchmarks/moe_kernels.py --float8``).
Without fast accumulation the grouped float8 kernels are slower than bf16's. A Qwen3-30B-A3B LoRA step is 10%
faster with both options, a Llama-3-8B one 34% (``benchmarks/RESULTS.md``, sixteenth pass). The results
change by float8's error, so these are options, off by default.

On a CPU, which has no float8 GEMM, the same quantized values are multiplied in fp32 (``emulated``): tests run
the quantization GPUs run, at the same precision up to summation order.
"""

from __future__ import annotations

import contextlib

import torch

from shardtune.errors import ConfigError
from shardtune.model.casts import in_dtype
from shardtune.model.triton_kernels import KERNELS_MAY_RUN

float8_grouped_kernel = None  # without Triton, or on a CPU build of torch, torch._scaled_grouped_mm runs
if KERNELS_MAY_RUN:
    with contextlib.suppress(ImportError):
        from shardtune.model import float8_grouped_kernel

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = torch.finfo(FLOAT8).max  # 448


def rowwise_float8(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scale of each row): ``tensor`` ~= values * scale[..., None], each row scaled so that
    its largest magnitude is e4m3's largest. A row of zeros has scale ~0 and zero values."""
    amax = tensor.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-30)
    values = (tensor.float() * (FLOAT8_MAX / amax)).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8)
    return values, (amax / FLOAT8_MAX).squeeze(-1)


def quantize_expert_weight(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """transformers' (E, out, in) expert weight as (values, scales) for the forward, W_e scaled per output row,
    and (values, scales) for the input gradient, W_e^T scaled per input column; one expert at a time, so the
    fp32 temporaries stay one expert's size."""
    experts, fan_out, fan_in = weight.shape
    values = torch.empty(experts, fan_out, fan_in, dtype=FLOAT8, device=weight.device)
    values_t = torch.empty(experts, fan_in, fan_out, dtype=FLOAT8, device=weight.device)
    scales = torch.empty(experts, fan_out, dtype=torch.float32, device=weight.device)
    scales_t = torch.empty(experts, fan_in, dtype=torch.float32, device=weight.device)
    for expert in range(experts):
        values[expert], scales[expert] = rowwise_float8(weight[expert])
        values_t[expert], scales_t[expert] = rowwise_float8(weight[expert].t())
    return values, scales, values_t, scales_t


def quantize_gate_and_up(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Gate and up expert weights held apart, (E, I, H) each (DBRX's slabs), quantized as ``quantize_expert_weight``
    quantizes their (E, 2I, H) concatenation [gate | up], which is never built: the forward's (values, scales) of gate
    and of up apart (rows of the concatenation's, each scaled per row), then (values, scales) of [gate | up]^T
    (E, H, 2I), whose columns' scales span both, for the input gradient's one GEMM; one expert at a time."""
    experts, width, fan_in = gate.shape
    gate_values, up_values = (torch.empty(experts, width, fan_in, dtype=FLOAT8, device=gate.device) for _ in range(2))
    gate_scales, up_scales = (torch.empty(experts, width, dtype=torch.float32, device=gate.device) for _ in range(2))
    values_t = torch.empty(experts, fan_in, 2 * width, dtype=FLOAT8, device=gate.device)
    scales_t = torch.empty(experts, fan_in, dtype=torch.float32, device=gate.device)
    for expert in range(experts):
        gate_values[expert], gate_scales[expert] = rowwise_float8(gate[expert])
        up_values[expert], up_scales[expert] = rowwise_float8(up[expert])
        values_t[expert], scales_t[expert] = rowwise_float8(torch.cat([gate[expert], up[expert]]).t())
    return gate_values, gate_scales, up_values, up_scales, values_t, scales_t


def resolve_float8_grouped_gemm(requested: str, device: torch.device) -> str:
    """The float8 experts' grouped GEMM for ``model.grouped_gemm`` ``requested`` on ``device``: ``triton``
    (shardtune's kernel, ``float8_grouped_kernel.py``: the same output as torch's, faster where it was measured)
    where it runs, unless ``torch`` is requested; else ``torch`` (``torch._scaled_grouped_mm`` on GPUs, the fp32
    emulation on CPUs)."""
    if requested != "torch" and float8_grouped_kernel is not None and float8_grouped_kernel.runs_on(device):
        return "triton"
    return "torch"


def describe_float8_grouped_gemm(backend: str, device: torch.device) -> str:
    """The kernel of ``resolve_float8_grouped_gemm``'s ``backend``, for the log."""
    if backend == "triton":
        return "shardtune's Triton grouped GEMM" + ("" if device.type == "cuda" else ", interpreted")
    return "torch._scaled_grouped_mm" if device.type == "cuda" else "emulated in fp32 on the CPU"


def float8_grouped_mm(
    rows: torch.Tensor, row_scales: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bounds: torch.Tensor,
    out_dtype: torch.dtype, backend: str = "torch",
) -> torch.Tensor:  # fmt: skip
    """(rows * row_scales) @ (values[e] * scales[e])^T for the rows of each expert e, rows bounds[e]:bounds[e + 1];
    ``values`` (E, N, K) e4m3, ``scales`` (E, N). Written in ``out_dtype``, by ``backend``
    (``resolve_float8_grouped_gemm``); operands the Triton kernel cannot take go to torch's."""
    if backend == "triton" and out_dtype == torch.bfloat16 and float8_grouped_kernel.kernel_takes(rows):
        return torch.ops.shardtune.float8_grouped_mm(rows, row_scales, values, scales, bounds)
    if rows.is_cuda:
        return torch._scaled_grouped_mm(
            rows, values.transpose(-2, -1), row_scales, scales, offs=bounds[1:], out_dtype=out_dtype,
            use_fast_accum=True,
        )  # fmt: skip
    return in_dtype(torch.ops.shardtune.float8_grouped_mm_emulated(rows, row_scales, values, scales, bounds), out_dtype)


@torch.library.custom_op("shardtune::float8_grouped_mm_emulated", mutates_args=())
def _emulated(
    rows: torch.Tensor, row_scales: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bounds: torch.Tensor
) -> torch.Tensor:
    """The float8 product in fp32 from the dequantized operands, one GEMM per expert. An opaque op: its loop
    bounds come from the host."""
    dequantized = rows.float() * row_scales.unsqueeze(-1)
    output = dequantized.new_zeros(rows.shape[0], values.shape[1])
    start = 0
    for expert, end in enumerate(bounds[1:].tolist()):
        if end > start:
            weight = values[expert].float() * scales[expert].unsqueeze(-1)
            torch.mm(dequantized[start:end], weight.t(), out=output[start:end])
        start = end
    return output


@_emulated.register_fake
def _(rows, row_scales, values, scales, bounds):
    return rows.new_empty(rows.shape[0], values.shape[1], dtype=torch.float32)


def float8_unavailable(device: torch.device, grouped: bool = True) -> str | None:
    """Why float8 GEMMs cannot run on ``device``, or None: the experts' grouped ones (``grouped``) or the linear
    layers' dense ones. On a GPU, a small product is tried: each kernel runs on some compute capabilities only (the
    grouped one on Hopper's; the dense one on Ada's too; neither on Ampere's)."""
    if device.type != "cuda":
        return None  # emulated
    kernel = "torch._scaled_grouped_mm" if grouped else "torch._scaled_mm"
    if not hasattr(torch, kernel.removeprefix("torch.")):
        return f"torch {torch.__version__} has no {kernel}"
    rows = torch.zeros(16, 16, dtype=FLOAT8, device=device)
    row_scales = rows.new_ones(16, dtype=torch.float32)
    try:
        if grouped:
            values = torch.zeros(2, 16, 16, dtype=FLOAT8, device=device)
            bounds = torch.tensor([0, 8, 16], dtype=torch.int32, device=device)
            float8_grouped_mm(rows, row_scales, values, values.new_ones(2, 16, dtype=torch.float32), bounds,
                              torch.bfloat16)  # fmt: skip
        else:
            float8_mm(rows, row_scales, rows, row_scales, torch.bfloat16)
        torch.cuda.synchronize(device)
    except RuntimeError as error:
        major, minor = torch.cuda.get_device_capability(device)
        what = "grouped GEMM" if grouped else "GEMM"
        return f"this GPU (compute capability {major}.{minor}) has no float8 {what} in torch: {error}"
    return None


def require_float8(keys: list[str], device: torch.device) -> None:
    """The float8 options ``keys`` (``ModelConfig.float8_keys``) can run on ``device``, or a ``ConfigError``
    naming the first that cannot and why: ``model.float8_experts`` needs the grouped GEMM, ``model.float8_linear``
    the dense one."""
    for key in keys:
        reason = float8_unavailable(device, grouped=key == "model.float8_experts")
        if reason is not None:
            raise ConfigError(f"{key}: {reason}; set it to false")


def gathered_rowwise_float8(tensor: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rowwise_float8(tensor.index_select(0, index))``, quantizing each row of ``tensor`` once and gathering the
    e4m3 rows with their scales (a gathered row's rowwise scale is its source row's): bit for bit the same, from
    less quantization work where rows repeat, and half the gathered bytes."""
    values, scales = rowwise_float8(tensor)
    return torch.ops.shardtune.gather_float8_rows(values, index), scales.index_select(0, index)


# Defined with the dispatcher directly, not by torch.library.custom_op, for the host time a call: see
# float8_grouped_kernel.py's float8_grouped_mm. Its operands take no gradient.
torch.library.define("shardtune::gather_float8_rows", "(Tensor values, Tensor index) -> Tensor")


@torch.library.impl("shardtune::gather_float8_rows", ["CUDA", "CPU"])
def _gather_float8_rows(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values.index_select(0, index)`` for e4m3 rows, as an op inductor cannot fuse with the quantization before
    it: fused, it gathered the bf16 rows and quantized each copy, reading two bytes a value for every row (top_k
    times a token's), where gathering the quantized rows reads one, mostly from the L2 cache."""
    return values.view(torch.uint8).index_select(0, index).view(values.dtype)


@torch.library.register_fake("shardtune::gather_float8_rows")
def _(values, index):
    return values.new_empty(index.shape[0], values.shape[1])


class Float8Product(torch.autograd.Function):
    """``rows @ W_e^T`` for each row's expert e, W frozen and quantized (``quantize_expert_weight``); the rows
    quantized here, the output gradient in backward. Gives the rows' gradient only."""

    @staticmethod
    def forward(ctx, rows, values, scales, values_t, scales_t, bounds, backend: str):
        ctx.save_for_backward(values_t, scales_t, bounds)
        ctx.backend = backend
        return float8_grouped_mm(*rowwise_float8(rows), values, scales, bounds, rows.dtype, backend)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        values_t, scales_t, bounds = ctx.saved_tensors
        grad_rows = float8_grouped_mm(*rowwise_float8(grad), values_t, scales_t, bounds, grad.dtype, ctx.backend)
        return grad_rows, None, None, None, None, None, None


def float8_mm(rows: torch.Tensor, row_scales: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """(rows * row_scales) @ (values * scales)^T, ``values`` (N, K) e4m3 and ``scales`` (N,); ``float8_grouped_mm``
    for one weight."""
    if rows.is_cuda:
        return torch._scaled_mm(
            rows, values.t(), row_scales.unsqueeze(-1), scales.unsqueeze(0), out_dtype=out_dtype, use_fast_accum=True
        )
    dequantized = rows.float() * row_scales.unsqueeze(-1)
    return in_dtype(dequantized @ (values.float() * scales.unsqueeze(-1)).t(), out_dtype)


class Float8Matmul(torch.autograd.Function):
    """``rows @ W^T`` for a frozen W quantized by ``rowwise_float8`` as W and as W^T; ``Float8Product`` for one
    weight. Gives the rows' gradient only."""

    @staticmethod
    def forward(ctx, rows, values, scales, values_t, scales_t):
        ctx.save_for_backward(values_t, scales_t)
        return float8_mm(*rowwise_float8(rows), values, scales, rows.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        values_t, scales_t = ctx.saved_tensors
        return float8_mm(*rowwise_float8(grad), values_t, scales_t, grad.dtype), None, None, None, None


class Float8Linear(torch.nn.Module):
    """A frozen ``nn.Linear`` computed in float8 (``model.float8_linear``): ``weight`` holds the forward's e4m3
    values (W scaled per output row) under the Linear's own name and shape, with their scales and the input
    gradient's copy (W^T scaled per input column) as buffers; the bias, if any, stays as it was."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        values, scales = rowwise_float8(weight)
        # Contiguous: a float8 GEMM takes its weight laid out along the summed dimension (the input gradient's,
        # W^T's columns), and the quantization would keep the transposed view's strides.
        values_t, scales_t = rowwise_float8(weight.t().contiguous())
        # The Linear's own parameter object, holding the float8 values, as use_float8_experts keeps the experts'
        # (DDP's list of the parameters would keep a new one's bf16 weight alive).
        linear.weight.data = values
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("weight_scale", scales, persistent=False)
        self.register_buffer("weight_t", values_t, persistent=False)
        self.register_buffer("weight_t_scale", scales_t, persistent=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8 e4m3, rowwise scales"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        output = Float8Matmul.apply(rows, self.weight, self.weight_scale, self.weight_t, self.weight_t_scale)
        output = output.view(*x.shape[:-1], self.out_features)
        return output if self.bias is None else output + self.bias.to(output.dtype)


def use_float8_linears(layers: list[torch.nn.Module], skip: set[torch.nn.Module]) -> int:
    """Swap every frozen ``nn.Linear`` inside ``layers`` (the decoder layers: under LoRA, PEFT's base layers of
    the adapted projections, and the projections it leaves alone), except the modules in ``skip``, for a
    ``Float8Linear``; returns how many. Rows of a width float8 GEMMs cannot take (not a multiple of 16) stay."""
    swapped = 0
    for layer in layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if (
                    type(child) is torch.nn.Linear
                    and child not in skip
                    and not child.weight.requires_grad
                    and child.in_features % 16 == 0
                    and child.out_features % 16 == 0
                ):
                    parent.register_module(name, Float8Linear(child))
                    swapped += 1
    return swapped
