"""``parallel.compile``: each decoder layer compiled by inductor, and a run that goes on eagerly where
inductor cannot compile it.

Compilation can fail for reasons that have nothing to do with the run's correctness: no C++ compiler
or Triton on the machine, an op inductor cannot lower, a kernel that does not build. A failed graph
runs as the plain PyTorch code dynamo traced (the same computation, unfused), so the run trains to the
same result, only slower: one warning says so, and every later graph skips the failing compiler.

The failure must surface while its graph is compiled, not later: AOTAutograd otherwise compiles a
backward graph at its first backward pass, where a failure could no longer fall back to eager.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._functorch.config

from shardtune.distributed.shared_input_gemms import fuse_shared_input_linears
from shardtune.errors import first_line
from shardtune.rank_zero_log import SAID_BY_RANK_ZERO

log = logging.getLogger("shardtune")

# Compile each backward graph together with its forward graph (torch versions without the switch compile
# it at the first backward pass, where a failure is not caught here).
_BACKWARD_NOW = (
    {"force_non_lazy_backward_lowering": True}
    if hasattr(torch._functorch.config, "force_non_lazy_backward_lowering")
    else {}
)


class LayerCompiler:
    """The torch.compile backend of the decoder layers (and of the chunked loss's softmax): inductor, timed,
    with an eager fallback. Narrow trainable GEMMs that read one input (LoRA's down-projections of q, k and v)
    become one GEMM first (``shared_input_gemms``)."""

    def __init__(self) -> None:
        self.graphs = 0  # graphs inductor compiled
        self.fused_gemms = 0  # groups of GEMMs on one input made one, over those graphs
        self.seconds = 0.0  # time spent compiling them (tracing by dynamo not included)
        self.failure: str | None = None  # the first failure's one-line cause; from then on, eager

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if self.failure is not None:
            return graph.forward
        started = time.perf_counter()
        try:
            fused = fuse_shared_input_linears(graph)
            with torch._functorch.config.patch(**_BACKWARD_NOW):
                compiled = torch._dynamo.lookup_backend("inductor")(graph, example_inputs)
        except torch._dynamo.exc.RestartAnalysis:
            # dynamo's own signal to trace the frame again (e.g. to specialize a Python float it had made a tensor:
            # Phi-3.5-MoE's router), which it catches and follows: no failure
            raise
        except Exception as error:  # whatever inductor, Triton or the C++ toolchain raised
            self.failure = f"{type(error).__name__}: {first_line(error)}"
            log.warning(
                "parallel.compile: torch.compile failed (%s); the decoder layers run eagerly, the chunked "
                "loss's softmax too (same results, slower); set parallel.compile=false to skip the attempt",
                self.failure,
                extra=SAID_BY_RANK_ZERO,
            )
            return graph.forward
        finally:
            self.seconds += time.perf_counter() - started
        self.graphs += 1
        self.fused_gemms += fused
        return compiled

    def log_compile_time(self) -> None:
        """How long compiling took: called once, after the first step, which compiled every graph."""
        if self.graphs:
            log.info(
                "torch.compile: %d graph(s) compiled in %.1f s; %d group(s) of narrow trainable GEMMs reading one "
                "input (LoRA's down-projections) computed as one GEMM each",
                self.graphs, self.seconds, self.fused_gemms,
            )  # fmt: skip
