"""LoRA's down-projections that read one input as one GEMM (``shardtune/distributed/shared_input_gemms.py``)
against a GEMM each, in one compiled decoder layer on one GPU:

    python benchmarks/shared_input_gemms.py [--float8-linear] [--iterations 40] [--out FILE]

Two layers, 2 x 4,096 tokens, bf16 autocast, LoRA r=16 (fp32 adapters, as training keeps them), compiled by
shardtune's layer compiler with and without the rewrite:
- Qwen3-30B-A3B's attention (hidden 2,048, 32 query and 4 key/value heads of 128) with LoRA on q, k, v and o; a
  frozen dense MLP of 768 stands in for the experts (the MoE block has no shared-input GEMMs);
- Llama-3-8B's layer (hidden 4,096, 32/8 heads, MLP 14,336), LoRA on every linear layer (q/k/v and gate/up).

Per forward + backward: "device" is the kernels' summed time (the profiler's, over 5 iterations), "host" the time
Python takes to launch them (two iterations launched behind a sleep kernel, so no launch waits on the device),
"alone" the wall time of iterations back to back (the larger of the two where neither hides the other), and the
kernels launched.
"""

from __future__ import annotations

import argparse
import sys
import time
from unittest import mock

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from shardtune.config import LoraConfig
from shardtune.distributed import compile as layer_compile
from shardtune.distributed.parallelize import decoder_layers
from shardtune.model.float8 import use_float8_linears
from shardtune.model.lora import apply_lora

TOKENS = 8192
PROFILED = 5  # iterations whose kernels the profiler times
# One decoder layer of each model, a small vocabulary: the sizes that differ are the models' own.
ONE_LAYER = {"vocab_size": 1024, "num_hidden_layers": 1, "num_attention_heads": 32, "tie_word_embeddings": False}
SHAPES = {
    "qwen3-30b-a3b attention": (
        Qwen3Config(**ONE_LAYER, hidden_size=2048, num_key_value_heads=4, head_dim=128, intermediate_size=768),
        ["q_proj", "k_proj", "v_proj", "o_proj"],
    ),
    "llama3-8b layer": (
        LlamaConfig(**ONE_LAYER, hidden_size=4096, num_key_value_heads=8, intermediate_size=14336),
        "all-linear",
    ),
}


def one_layer(config, targets, float8_linear: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the LoRA model, its decoder layer) on the GPU, adapters in fp32 (``apply_lora``: PEFT's on a bf16 base)."""
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = apply_lora(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0, target_modules=targets))
    layers = decoder_layers(model)
    if float8_linear:
        use_float8_linears(layers, skip=set())
    return model.train(), layers[0]


def measure(shape: str, fused: bool, float8_linear: bool, iterations: int) -> dict[str, float]:
    torch._dynamo.reset()
    config, targets = SHAPES[shape]
    model, layer = one_layer(config, targets, float8_linear)
    compiler = layer_compile.LayerCompiler()
    rewrite = layer_compile.fuse_shared_input_linears if fused else (lambda graph: 0)
    with mock.patch.object(layer_compile, "fuse_shared_input_linears", rewrite):
        layer.compile(backend=compiler)
        hidden = torch.randn(2, TOKENS // 2, config.hidden_size, dtype=torch.bfloat16, device="cuda")
        hidden.requires_grad_(True)
        positions = torch.arange(TOKENS // 2, device="cuda").unsqueeze(0).expand(2, -1)
        rotary = model.get_base_model().model.rotary_emb(hidden, positions)
        grad = torch.randn_like(hidden)

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = layer(hidden, position_ids=positions, position_embeddings=rotary)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(grad)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            for _ in range(PROFILED):
                step()
            torch.cuda.synchronize()
        kernels = [event for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]
        device = sum(event.time_range.elapsed_us() for event in kernels) / PROFILED / 1e3
        launches = len(kernels) / PROFILED

        # The host alone: two iterations launched behind a sleep kernel, so no launch waits on the device.
        torch.cuda._sleep(int(2e8))
        began = time.perf_counter()
        for _ in range(2):
            step()
        host = (time.perf_counter() - began) / 2 * 1e3
        torch.cuda.synchronize()

        began = time.perf_counter()
        for _ in range(iterations):
            step()
        torch.cuda.synchronize()
        alone = (time.perf_counter() - began) / iterations * 1e3
    print(f"  {shape}, {'one GEMM a group' if fused else 'a GEMM each'}: {compiler.fused_gemms} group(s) fused",
          file=sys.stderr)  # fmt: skip
    return {"device": device, "host": host, "alone": alone, "launches": launches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--float8-linear", action="store_true", help="frozen linear layers in float8")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args()
    lines = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, 2 x 4,096 tokens, LoRA r=16, "
        f"{'float8' if args.float8_linear else 'bf16'} frozen linears; ms per forward + backward "
        f"(mean of {args.iterations}), kernels launched",
        "",
        "| layer | GEMMs | device | host | alone | kernels |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for shape in SHAPES:
        for fused in (False, True):
            result = measure(shape, fused, args.float8_linear, args.iterations)
            lines.append(
                f"| {shape} | {'one a group' if fused else 'one each'} | {result['device']:.3f} | "
                f"{result['host']:.3f} | {result['alone']:.3f} | {result['launches']:.0f} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
