"""The grouped GEMM of the fused MoE block: ``rows @ weight[e]`` for the rows of each expert ``e``.

Three kernels compute it, each with the same result:

- quack-kernels' varlen GEMM (CuTe DSL, ``pip install 'shardtune[quack]'``) for the frozen expert
  projections on Hopper GPUs, where it measures faster than ``torch._grouped_mm`` with bit for bit the same
  output: on one H200, with the tile configurations measured for these GEMMs (``_import_quack``),
  5-25% less device time per GEMM than CUTLASS at the shapes of Qwen3-30B-A3B and GLM-4.5-Air, 1-4% at
  Mixtral-8x7B's (``benchmarks/moe_kernels.py --quack-configs``). Where the rows are looked up from the
  tokens (``gathered_grouped_mm``), its kernel gathers them itself;
- ``torch._grouped_mm`` (CUTLASS) for everything else it takes: bf16 on GPUs, and on CPUs fp32 eagerly
  or bf16 compiled;
- a loop of one GEMM per expert for the dtypes neither takes.

``model.grouped_gemm`` picks: ``auto`` (quack where it runs, else torch),
``quack`` (required) or ``torch``. quack is used only for weights that take no gradient (the frozen
experts of LoRA: their forward and their input gradient); trainable weights (LoRA factors, full
fine-tuning) go through ``torch._grouped_mm``, whose weight gradient quack's path would need a second
kernel for.
"""

from __future__ import annotations

import logging

import torch

from shardtune.errors import ConfigError, first_line
from shardtune.rank_zero_log import SAID_BY_RANK_ZERO

log = logging.getLogger("shardtune")


class _Quack:
    """quack's GEMM once imported (its entry point that takes a tile configuration), the configurations the
    fused block's GEMMs run with, and whether it has failed at run time."""

    gemm = None
    config = None  # rows given
    gathered_config = None  # rows gathered by the kernel (cluster_n must be 1 there)
    failure: str | None = None


def quack_unavailable(device: torch.device) -> str | None:
    """Why quack's grouped GEMM cannot run on ``device``, or None (and then it is imported)."""
    if device.type != "cuda":
        return "its kernels need a CUDA device"
    capability = torch.cuda.get_device_capability(device)
    if capability[0] != 9:
        # Measured on Hopper only; elsewhere torch._grouped_mm stays until quack is measured faster there.
        return f"it is used on Hopper GPUs (compute capability 9.x), this one is {capability[0]}.{capability[1]}"
    if _Quack.gemm is None:
        try:
            _import_quack()
        except Exception as error:  # not installed, its CUDA runtime does not load, or a release without these
            why = f"{type(error).__name__}: {first_line(error)}"
            return f"quack-kernels does not import ({why}); pip install 'shardtune[quack]'"
    return None


def _import_quack() -> None:
    """quack's GEMM and the tile configurations the fused block's GEMMs run with, into ``_Quack``."""
    from quack.gemm_config import GemmConfig
    from quack.gemm_interface import gemm_tuned

    # The tile configurations, measured against every SM90 configuration quack has, on the gate/up and down
    # projections' forward and input gradient at the shapes of Qwen3-30B-A3B, GLM-4.5-Air and Mixtral-8x7B,
    # skewed and uniform loads (one H200, ``benchmarks/moe_kernels.py --quack-configs``). 192x128 tiles,
    # pingpong, a 1x2 cluster: over each model's GEMMs 1-3% slower than the fastest configuration of each GEMM,
    # and 2-9% faster than quack's default (128x192, a 2x1 cluster), which its untuned calls take (one GEMM's
    # time spreads by up to 10% between runs). quack's autotuner would measure again for every new row count,
    # and picks by an L2-cold timing. Gathering its rows, the kernel needs a cluster 1 wide in N; 128x256
    # cooperative was the fastest there on every GEMM.
    common = dict(cluster_k=1, is_dynamic_persistent=False, swap_ab=False, device_capacity=9)
    _Quack.config = GemmConfig(tile_m=192, tile_n=128, pingpong=True, cluster_m=1, cluster_n=2, **common)
    _Quack.gathered_config = GemmConfig(tile_m=128, tile_n=256, pingpong=False, cluster_m=2, cluster_n=1, **common)
    _Quack.gemm = gemm_tuned.fn  # the GEMM itself, without the autotuner in front


def resolve_grouped_gemm(requested: str, device: torch.device) -> str:
    """``model.grouped_gemm`` for this run: ``quack`` or ``torch``. ``auto`` takes quack wherever it runs: with
    its measured tile configurations it was faster than torch._grouped_mm on every GEMM of Qwen3-30B-A3B,
    GLM-4.5-Air and Mixtral-8x7B (see _import_quack)."""
    if requested == "torch":
        return "torch"
    reason = quack_unavailable(device)
    if reason is None:
        return "quack"
    if requested == "quack":
        raise ConfigError(f"model.grouped_gemm: quack cannot run here: {reason}; set it to auto or torch")
    return "torch"


def describe(backend: str) -> str:
    """The grouped GEMM kernels in use, for the log."""
    if not hasattr(torch, "_grouped_mm"):
        return "a loop over experts (this torch has no torch._grouped_mm)"
    fallback = "torch._grouped_mm for bf16 (and eager fp32 on CPUs), a loop over experts otherwise"
    if backend == "quack":
        return f"quack-kernels' varlen GEMM for the frozen expert weights; {fallback}"
    return fallback


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """(rows, K) @ weight[e] (K, N) for the rows of each expert e, rows bounds[e]:bounds[e + 1] (``bounds``: int32,
    0 and then the cumulative row counts, as quack's varlen GEMM takes them; torch._grouped_mm takes bounds[1:])."""
    if _kernel_takes(rows, weight):
        if backend == "quack" and not weight.requires_grad and rows.is_cuda:
            return torch.ops.shardtune.quack_grouped_mm(rows, weight, bounds)
        return torch._grouped_mm(rows, weight, offs=bounds[1:])
    return torch.ops.shardtune.grouped_mm_loop(rows, weight, bounds)


# An opaque op: quack launches its own compiled kernels, which torch.compile neither traces nor needs to.
@torch.library.custom_op("shardtune::quack_grouped_mm", mutates_args=(), device_types="cuda")
def _quack_grouped_mm(rows: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    if _Quack.failure is None:
        try:
            return _quack_gemm(rows, weight, bounds)
        except Exception as error:  # a kernel that does not build or launch on this machine
            _quack_failed(error)
    return torch._grouped_mm(rows, weight, offs=bounds[1:])


@_quack_grouped_mm.register_fake
def _(rows: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weight.shape[2])


def _quack_setup(ctx, inputs, output) -> None:
    _, weight, bounds = inputs
    ctx.save_for_backward(weight, bounds)


def _quack_backward(ctx, grad: torch.Tensor):
    """The input gradient, grad @ weight[e]^T per expert; the weight takes none (see grouped_mm)."""
    weight, bounds = ctx.saved_tensors
    return torch.ops.shardtune.quack_grouped_mm(grad.contiguous(), weight.transpose(-2, -1), bounds), None, None


_quack_grouped_mm.register_autograd(_quack_backward, setup_context=_quack_setup)


def gathered_grouped_mm(
    tokens: torch.Tensor,
    token_of_row: torch.Tensor,
    weight: torch.Tensor,
    bounds: torch.Tensor,
    backend: str = "torch",
) -> torch.Tensor:
    """``grouped_mm(tokens[token_of_row], weight, bounds)`` for a weight that takes no gradient. quack's kernel
    loads each row from ``tokens`` itself (its gather_A), so the gathered rows are never written; elsewhere they
    are gathered first. fused_moe uses it for the down projection's input gradient, whose rows are each
    token's output gradient: at Qwen3-30B-A3B's shapes on one H200, in quack's default tiles, 491 against 504 us
    with the gather (``benchmarks/moe_kernels.py``), and 1% a training step. Gate/up's forward, the other GEMM
    whose rows are the tokens, measured slower this way (911 against 849 us; in the tiles of ``_import_quack``
    faster in one call and slower in another), so it keeps its gather. No autograd: the caller
    (fused_moe's ProjectionSummed) states the backward."""
    if backend == "quack" and tokens.is_cuda and _kernel_takes(tokens, weight):
        return torch.ops.shardtune.quack_gathered_grouped_mm(tokens, token_of_row, weight, bounds)
    return grouped_mm(tokens.index_select(0, token_of_row), weight, bounds, backend)


@torch.library.custom_op("shardtune::quack_gathered_grouped_mm", mutates_args=(), device_types="cuda")
def _quack_gathered_grouped_mm(
    tokens: torch.Tensor, token_of_row: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor
) -> torch.Tensor:
    if _Quack.failure is None:
        try:
            return _quack_gemm(tokens, weight, bounds, token_of_row)
        except Exception as error:
            _quack_failed(error)
    return torch._grouped_mm(tokens.index_select(0, token_of_row), weight, offs=bounds[1:])


@_quack_gathered_grouped_mm.register_fake
def _(tokens: torch.Tensor, token_of_row: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    return tokens.new_empty(token_of_row.shape[0], weight.shape[2])


def _quack_gemm(
    a: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor, row_of_a: torch.Tensor | None = None
) -> torch.Tensor:
    """quack's varlen GEMM of the rows of ``a`` (``a[row_of_a]`` where given, gathered by the kernel) by
    ``weight[e]`` for the rows of each expert e, with the tile configuration measured for it."""
    out = a.new_empty(a.shape[0] if row_of_a is None else row_of_a.shape[0], weight.shape[2])
    if out.numel():  # quack's tile scheduler divides by the row count
        config = _Quack.config if row_of_a is None else _Quack.gathered_config
        _Quack.gemm(a, weight, out, cu_seqlens_m=bounds, A_idx=row_of_a, config=config)
    return out


def _quack_failed(error: Exception) -> None:
    """Hand the experts over to torch._grouped_mm for the rest of the run, saying so once."""
    _Quack.failure = f"{type(error).__name__}: {first_line(error)}"
    log.warning(
        "model.grouped_gemm: quack's kernel failed (%s); torch._grouped_mm computes the experts from "
        "here on (the same results); set model.grouped_gemm: torch to skip quack",
        _Quack.failure,
        extra=SAID_BY_RANK_ZERO,
    )


def grouped_mm_weight_grad(
    rows: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """The gradient of ``weight`` in ``grouped_mm(rows, weight, bounds)`` for the output gradient ``grad``
    (``rows_e^T @ grad_e`` for each expert e), for a backward that has ``rows`` again without autograd having
    kept them."""
    if _kernel_takes(rows, weight):
        return torch._grouped_mm(rows.transpose(0, 1), grad, offs=bounds[1:])
    return torch.ops.shardtune.grouped_mm_loop_backward(rows, weight, bounds, grad.contiguous())[1]


# torch._grouped_mm on GPUs: Hopper only up to torch 2.8, compute capability 8.0 and newer since 2.9.
_GPU_KERNEL = (
    (lambda capability: capability >= (8, 0))
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 9)
    else (lambda capability: capability[0] == 9)
)


def _kernel_takes(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs these operands: bf16 on GPUs (and compiled anywhere); CPUs also
    run fp32 eagerly. Rows and columns must be 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm") or rows.dtype != weight.dtype:
        return False
    if rows.dtype != torch.bfloat16 and (rows.device.type != "cpu" or torch.compiler.is_compiling()):
        return False
    if rows.device.type == "cuda" and not _GPU_KERNEL(torch.cuda.get_device_capability(rows.device)):
        return False
    size = rows.element_size()
    return (rows.shape[1] * size) % 16 == 0 and (weight.shape[2] * size) % 16 == 0


@torch.library.custom_op("shardtune::grouped_mm_loop", mutates_args=())
def _grouped_mm_loop(rows: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """One GEMM per expert: the fallback for dtypes the grouped kernel does not take. An opaque op, so
    that torch.compile keeps it whole (its loop bounds come from the host)."""
    output = rows.new_zeros(rows.shape[0], weight.shape[2])
    start = 0
    for expert, end in enumerate(bounds[1:].tolist()):  # the one host sync of the fallback
        if end > start:
            torch.mm(rows[start:end], weight[expert], out=output[start:end])
        start = end
    return output


@_grouped_mm_loop.register_fake
def _(rows: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weight.shape[2])


@torch.library.custom_op("shardtune::grouped_mm_loop_backward", mutates_args=())
def _grouped_mm_loop_backward(
    rows: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_rows = torch.zeros_like(rows)
    grad_weight = weight.new_zeros(weight.shape)
    start = 0
    for expert, end in enumerate(bounds[1:].tolist()):
        if end > start:
            torch.mm(grad[start:end], weight[expert].T, out=grad_rows[start:end])
            torch.mm(rows[start:end].T, grad[start:end], out=grad_weight[expert])
        start = end
    return grad_rows, grad_weight


@_grouped_mm_loop_backward.register_fake
def _(rows, weight, bounds, grad):
    return torch.empty_like(rows), weight.new_empty(weight.shape)


def _loop_setup(ctx, inputs, output) -> None:
    rows, weight, bounds = inputs
    ctx.save_for_backward(rows, weight, bounds)


def _loop_backward(ctx, grad):
    rows, weight, bounds = ctx.saved_tensors
    grad_rows, grad_weight = torch.ops.shardtune.grouped_mm_loop_backward(rows, weight, bounds, grad.contiguous())
    return grad_rows, grad_weight, None


_grouped_mm_loop.register_autograd(_loop_backward, setup_context=_loop_setup)
