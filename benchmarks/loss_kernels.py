"""The loss alone on one GPU: all logits at once (``training.loss_chunk_tokens: 0``) against the chunked loss
that computes each chunk's gradients in the forward pass (``auto``, the default), its softmax eager
(``parallel.compile: false``) and compiled (``compiled_softmax_gradient``, the default on CUDA), at 8,192
tokens:

    python benchmarks/loss_kernels.py [--out FILE]

For each model's head (hidden x vocabulary, bf16 weights under bf16 autocast, frozen as in a LoRA run, and
trainable as in full fine-tuning): the time of forward + backward (CUDA events, median of 5 runs of 5
calls), the peak memory above the inputs (``max_memory_allocated``), and how far the chunked loss and the
head input's gradient are from the standard ones (the largest difference, relative to the largest value).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from shardtune.distributed.compile import LayerCompiler
from shardtune.train.loss import LinearCrossEntropy, auto_chunk_tokens, compiled_softmax_gradient, softmax_gradient_

# (name, hidden, vocabulary)
SHAPES = [("qwen3-30b-a3b", 2048, 151_936), ("llama3-8b", 4096, 128_256), ("mistral-7b", 4096, 32_000)]
TOKENS = 8192


def standard(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def chunked(softmax_gradient):
    def loss_of(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        chunk = auto_chunk_tokens(weight.shape[0])
        return LinearCrossEntropy.apply(hidden, weight, None, targets, chunk, True, softmax_gradient)

    return loss_of


def run(loss_of, hidden, weight, targets) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    hidden.grad = weight.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_of(hidden, weight, targets)
    (loss / TOKENS).backward()
    return loss.detach(), hidden.grad, weight.grad


def measure(loss_of, hidden, weight, targets) -> tuple[float, float]:
    """Milliseconds a call (forward + backward) and the peak GiB above what was allocated before."""
    run(loss_of, hidden, weight, targets)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            run(loss_of, hidden, weight, targets)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 5)
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    lines = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {TOKENS} tokens",
        "| head | weights | chunk | standard ms | eager chunks ms | compiled chunks ms | standard GiB | "
        "eager chunks GiB | compiled chunks GiB | loss diff | grad diff |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    compiler = LayerCompiler()
    losses = {"eager": chunked(softmax_gradient_), "compiled": chunked(compiled_softmax_gradient(compiler))}
    for name, width, vocab in SHAPES:
        torch._dynamo.reset()  # each head's vocabulary compiles as a run's would: static, not dynamic
        for trainable in (False, True):
            hidden = torch.randn(TOKENS, width, device="cuda", dtype=torch.bfloat16).requires_grad_()
            weight = (torch.randn(vocab, width, device="cuda") / width**0.5).to(torch.bfloat16)
            weight.requires_grad_(trainable)
            targets = torch.randint(0, vocab, (TOKENS,), device="cuda")
            reference = run(standard, hidden, weight, targets)
            reference = tuple(None if t is None else t.clone() for t in reference)
            # The differences: the compiled chunks' (the default) from the standard loss.
            mine = run(losses["compiled"], hidden, weight, targets)
            loss_diff = ((mine[0] - reference[0]).abs() / reference[0].abs()).item()
            grad_diff = ((mine[1].float() - reference[1].float()).abs().max() / reference[1].float().abs().max()).item()
            timings = [measure(loss_of, hidden, weight, targets) for loss_of in (standard, *losses.values())]
            lines.append(
                f"| {name} ({width} x {vocab:,}) | {'trainable' if trainable else 'frozen'} | "
                f"{auto_chunk_tokens(vocab):,} | {' | '.join(f'{ms:.2f}' for ms, _ in timings)} | "
                f"{' | '.join(f'{gib:.2f}' for _, gib in timings)} | {loss_diff:.1e} | {grad_diff:.1e} |"
            )
            print(lines[-1], flush=True)
            del hidden, weight, targets, reference, mine
            torch.cuda.empty_cache()
    if compiler.failure:
        lines.append(f"compiled chunks ran eagerly: {compiler.failure}")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text)


if __name__ == "__main__":
    main()
