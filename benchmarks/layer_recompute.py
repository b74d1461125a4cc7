"""What one compiled decoder layer keeps for backward, and how long its backward takes, for each part
activation checkpointing can recompute (``training.gradient_checkpointing_granularity``), on one GPU:

    python benchmarks/layer_recompute.py [--parts none,attention,mlp,sublayers,layer] [--out FILE]

The layer is Qwen3-30B-A3B's (hidden 2048, 32 query and 4 key/value heads of 128, 128 experts of 768, 8 per
token) with LoRA r=16 on attention and the routed experts, fused experts, bf16 autocast, 2 x 4,096 tokens,
compiled as training compiles it (``parallelize``: the layer whole, with its sublayers' checkpoints inside its
graph; a whole checkpointed layer compiled inside its wrapper). "kept" counts the storage of the tensors
saved for backward (saved-tensor hooks), parameters and the rotary embedding (shared by every layer) aside;
"backward" is the wall time of the layer's backward after a synchronized forward, the third of three calls.
``plan.memory.AUTO_PARTS`` takes the parts in the order these numbers give.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from shardtune.config import LoraConfig
from shardtune.distributed.activations import apply_activation_checkpointing
from shardtune.distributed.parallelize import decoder_layers
from shardtune.model.fused_moe import use_fused_experts
from shardtune.model.lora import apply_lora
from shardtune.plan.memory import PARTS, Checkpointing

HIDDEN, TOKENS = 2048, 8192


def one_layer_model() -> torch.nn.Module:
    config = Qwen3MoeConfig(
        vocab_size=1024, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, experts_implementation="eager")
    # Adapters in fp32, as training keeps them: PEFT makes them so on a bf16 base (apply_lora).
    model = apply_lora(
        model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0, moe_targets=["attention", "routed_experts"])
    )
    use_fused_experts(model, decoder_layers(model), "fused", device=torch.device("cuda"))
    return model.train()


class SavedBytes:
    """A saved-tensor hook that tallies the storage it sees."""

    def __init__(self, skipped: set[int]) -> None:
        self.skipped, self.storages = skipped, {}

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.skipped:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def measure(base: torch.nn.Module, part: str) -> str:
    model = copy.deepcopy(base)
    layer = decoder_layers(model)[0]
    if part != "none":
        apply_activation_checkpointing(model, [layer], Checkpointing((part,)), compiled=True)
    layer.compile()
    run = model.get_base_model().model.layers[0]  # the checkpoint wrapper of a whole checkpointed layer
    parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}
    positions = torch.arange(TOKENS // 2, device="cuda").unsqueeze(0).expand(2, -1)
    for _ in range(3):
        x = torch.randn(2, TOKENS // 2, HIDDEN, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        rotary = model.get_base_model().model.rotary_emb(x, positions)
        kept = SavedBytes(parameters | {tensor.untyped_storage().data_ptr() for tensor in rotary})
        hooks = torch.autograd.graph.saved_tensors_hooks(kept.keep, lambda tensor: tensor)
        with hooks, torch.autocast("cuda", torch.bfloat16):
            out = run(x, position_embeddings=rotary, attention_mask=None, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        torch.cuda.synchronize()
        started = time.perf_counter()
        out.float().sum().backward()
        torch.cuda.synchronize()
        backward = time.perf_counter() - started
        model.zero_grad(set_to_none=True)
    return f"{part:10s} kept {kept.total / TOKENS / 1000:6.1f} kB a token, backward {backward * 1000:5.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(["none", *PARTS]))
    parser.add_argument("--out", help="also write the lines to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    base = one_layer_model()
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}"]
    for part in args.parts.split(","):
        lines.append(measure(base, part))
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as out:
            out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
