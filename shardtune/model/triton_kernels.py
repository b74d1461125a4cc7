"""Where shardtune's Triton kernels run (``weighted_silu_kernel``, ``routing_kernels``,
``float8_grouped_kernel``)."""

from __future__ import annotations

import os

import torch

# Set before Triton is imported, TRITON_INTERPRET=1 makes its kernels run on CPU tensors (as numpy).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Whether to import the kernels at all. Triton ships with torch's CUDA and ROCm builds; on a CPU build only its
# interpreter can run them, so they are not imported there: importing them (Triton, inductor's utilities, and
# torch.library parsing each kernel's source) would add about 1.3 s to the start of every command.
KERNELS_MAY_RUN = INTERPRETED or torch.version.cuda is not None or torch.version.hip is not None


def runs_on(device: torch.device) -> bool:
    """Whether the kernels run on tensors of ``device``: CUDA devices, and eagerly any under Triton's
    interpreter (inductor would build the interpreted kernel into a CPU graph)."""
    return device.type == "cuda" or (INTERPRETED and not torch.compiler.is_compiling())
