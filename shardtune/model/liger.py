"""liger-kernel's Triton kernels in place of transformers' RMSNorm, SwiGLU MLP and rotary embedding.

The fourth kernel, fused linear cross-entropy, is applied by the loss (``shardtune.train.loss``), which
owns how the loss is computed; this module patches only the model's own layers, on this instance (plus
the rotary function of the model's transformers module, which liger replaces module-wide).
"""

from __future__ import annotations

import logging

import torch

from shardtune.errors import ConfigError

log = logging.getLogger("shardtune")


def check_liger_kernel(device: torch.device, model_type: str) -> None:
    """``model.liger_kernel`` can run here: a CUDA device, the package, and kernels for ``model_type``.
    Run in the preflight, before anything is loaded, and again by ``apply_liger_kernels``."""
    if device.type != "cuda":
        raise ConfigError("model.liger_kernel: liger-kernel's Triton kernels need a CUDA device; turn it off")
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as error:
        raise ConfigError(
            f"model.liger_kernel: liger-kernel is not installed ({error}); pip install 'shardtune[liger]'"
        ) from None
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ConfigError(f"model.liger_kernel: liger-kernel has no kernels for model type {model_type!r}; turn it off")


def apply_liger_kernels(model: torch.nn.Module, device: torch.device) -> None:
    """Patch ``model`` (a transformers causal LM, before LoRA) with liger's kernels, or say why not."""
    model_type = model.config.model_type
    check_liger_kernel(device, model_type)
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    # The loss is not liger's concern here: shardtune computes it itself (fused when liger is on).
    _apply_liger_kernel_to_instance(
        model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
    log.info("liger-kernel: RMSNorm, SwiGLU and RoPE kernels on %s, fused linear cross-entropy loss", model_type)
