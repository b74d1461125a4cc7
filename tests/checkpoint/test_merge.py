"""The merge behind ``final-merged/`` (``training.merge_final``) and ``shardtune export --merge``: the base's
own safetensors files, shard by shard, with the adapter added as PEFT's ``merge_and_unload`` adds it.

The two-worker FSDP run, its one-worker twin and the export of the same checkpoint are in test_export.py;
every architecture's merge after a random init is in tests/test_architectures.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_runs import train
from conftest import REPO, TINY_MODEL
from peft import PeftModel
from safetensors import safe_open
from tiny_models import tiny_config, write_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.checkpoint.merge import lora_deltas, save_merged
from shardtune.config import Config, LoraConfig
from shardtune.distributed.activations import apply_activation_checkpointing
from shardtune.distributed.parallelize import decoder_layers
from shardtune.doctor.report import size
from shardtune.errors import InputError
from shardtune.model.fused_moe import use_fused_experts
from shardtune.model.lora import apply_lora, share_expert_adapters, targets_as_given

INPUT = torch.randint(3, 1000, (2, 20), generator=torch.Generator().manual_seed(0))


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=INPUT).logits


def write_base(directory: Path, architecture: str, shard_size: str, dtype: torch.dtype = torch.float32) -> Path:
    """A tiny model with seeded random weights, all drawn wide enough that every delta shows in them, saved by
    transformers in several safetensors shards (MoE experts as per-expert tensors, as on the hub)."""
    write_tiny_model(directory, architecture)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(architecture), dtype=dtype)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.2)
    model.save_pretrained(directory, max_shard_size=shard_size)
    return directory


def run_config(base: Path, lora: LoraConfig) -> Config:
    return Config.model_validate({"model": {"name_or_path": str(base)}, "data": {"dataset_path": "-"}, "lora": lora})


def stored_layout(directory: Path) -> dict[str, dict[str, tuple]]:
    """Per safetensors file: each tensor's dtype and shape."""
    layout = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            layout[path.name] = {
                key: (handle.get_slice(key).get_dtype(), tuple(handle.get_slice(key).get_shape()))
                for key in handle.keys()  # noqa: SIM118
            }
    return layout


def peft_merged(base: Path, adapter: Path) -> torch.nn.Module:
    """The reference: PEFT's own merge of the saved adapter into the base as transformers loads it."""
    with targets_as_given():  # PEFT would rewrite the MoE targets as it loads (see shardtune.model.lora)
        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).merge_and_unload()


MOE_GROUPS = ["attention", "dense_mlp", "shared_experts", "routed_experts", "router"]
CASES = {
    # Every LoRA group of GLM-4.5's layout: linear layers, a router's 2-D weight and fused 3-D experts,
    # stored in the files as per-expert tensors.
    "glm4_moe": ("glm4_moe", torch.float32, {"moe_targets": MOE_GROUPS}),
    # One adapter shared by a layer's experts, in bf16: PEFT rounds a LoRA layer's sum once and casts an
    # expert delta to bf16 before adding it.
    "glm4_moe-shared-bf16": (
        "glm4_moe",
        torch.bfloat16,
        {"moe_targets": ["attention", "routed_experts", "router"], "shared_expert_adapter": True},
    ),
    # Files with other module names (block_sparse_moe, w1/w3/w2) than the model's (mlp, gate_up_proj).
    "mixtral": ("mixtral", torch.float32, {"moe_targets": ["attention", "routed_experts"]}),
    # Conv1D (fan_in_fan_out), in files written by the bare GPT2Model, without "transformer.", as on the hub.
    "gpt2-bare": ("gpt2", torch.float32, {"target_modules": "all-linear"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_merge_equals_peft_merge_and_unload_tensor_for_tensor(case, tmp_path):
    architecture, dtype, targets = CASES[case]
    base = write_base(tmp_path / "base", architecture, "100KB", dtype)
    if case == "gpt2-bare":
        AutoModelForCausalLM.from_pretrained(base).transformer.save_pretrained(base, max_shard_size="100KB")
        assert all(not key.startswith("transformer.") for file in stored_layout(base).values() for key in file)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0, **targets)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), lora)  # as training builds it
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_" in name:  # PEFT starts B at zero: a trained adapter has both factors
            torch.nn.init.normal_(param, std=0.3)
    if lora.shared_expert_adapter:
        share_expert_adapters(model)
    model.save_pretrained(tmp_path / "adapter")
    # Shaped as training leaves it: fused MoE blocks, decoder layers inside activation checkpointing's wrappers.
    use_fused_experts(model, decoder_layers(model), "auto")
    apply_activation_checkpointing(model, decoder_layers(model))

    written = save_merged(model, AutoTokenizer.from_pretrained(base), tmp_path / "merged", run_config(base, lora))

    merged_dir = tmp_path / "merged"
    assert written == sum(path.stat().st_size for path in merged_dir.iterdir())
    assert stored_layout(merged_dir) == stored_layout(base)  # the same files, names, dtypes and shapes
    assert json.loads((merged_dir / "model.safetensors.index.json").read_text()) == json.loads(
        (base / "model.safetensors.index.json").read_text()
    )
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    reference = peft_merged(base, tmp_path / "adapter")
    original = AutoModelForCausalLM.from_pretrained(base).state_dict()
    changed = set()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(merged.state_dict()[name], tensor), name
        if not torch.equal(tensor, original[name]):
            changed.add(name)
    assert changed == {delta.weight for delta in lora_deltas(model)}  # every adapted weight, and nothing else
    torch.testing.assert_close(logits(merged), logits(reference), rtol=0, atol=0)
    saved = json.loads((merged_dir / "config.json").read_text())
    assert saved["use_cache"] is True and saved["model_type"] == architecture
    assert "lora:\n  enabled: false" in (merged_dir / "config.yaml").read_text()


def test_a_lora_layer_the_merge_does_not_add_is_one_error(tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0, target_modules=["embed_tokens", "q_proj"])
    model = apply_lora(AutoModelForCausalLM.from_pretrained(TINY_MODEL), lora)
    with pytest.raises(InputError) as error:
        save_merged(model, AutoTokenizer.from_pretrained(TINY_MODEL), tmp_path / "merged", run_config(TINY_MODEL, lora))
    assert error.value.lines == [
        "lora.target_modules: model.embed_tokens is a Embedding LoRA layer; merging adds adapters of linear layers "
        "and of expert or router weights only"
    ]
    assert not any(tmp_path.iterdir())  # nothing written, no staging left


def report_merge_memory(base: str, out: str) -> None:
    """Prints (JSON) how much this process's anonymous memory (what tensors take; the files' pages are the
    kernel's cache) grows while it merges an adapter into ``base`` (the model on the meta device, only the
    adapter in memory), then while it reads every shard of ``base`` into memory, the measurement's control.
    Run in a fresh process, which has freed little before."""
    import ctypes
    import threading
    import time

    from safetensors.torch import load_file
    from transformers import AutoConfig

    def anonymous_bytes() -> int:
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("RssAnon:")).split()[1]) * 1024

    def growth(work) -> int:
        # Memory freed earlier and kept by the allocator would be reused unseen: give it back first (glibc).
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = peak = anonymous_bytes()
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, anonymous_bytes())
                time.sleep(0.0005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            kept = work()  # held until the last sample
            peak = max(peak, anonymous_bytes())
        finally:
            done.set()
            sampler.join()
        del kept
        return peak - before

    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0, target_modules="all-linear")
    with torch.device("meta"):
        model = apply_lora(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base)), lora)
    torch.manual_seed(0)
    adapter = {name: torch.randn(param.shape) for name, param in model.named_parameters() if "lora_" in name}
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    config = run_config(Path(base), lora)
    # A first merge sets up what is set up once (thread pools, the allocator's arenas); the next three are measured,
    # and the least growth counts: one merge's ranges from 2.0 to 4.2 shards with what the allocator keeps (the same
    # code, runs minutes apart), where holding the model would grow every one by the whole model.
    save_merged(model, tokenizer, Path(out), config, adapter)
    merge = min(growth(lambda: save_merged(model, tokenizer, Path(out), config, adapter)) for _ in range(3))
    files = sorted(Path(base).glob("*.safetensors"))
    whole = growth(lambda: [{key: t.clone() for key, t in load_file(path).items()} for path in files])
    print(json.dumps({"merge": merge, "whole": whole}))


def test_the_merge_holds_a_shard_at_a_time_not_the_model(tmp_path):
    """A 28 MiB base in nine shards of at most 3.3 MiB, all of whose linear weights the adapter changes: the
    merge grows memory by a few shards at most, while reading every shard (the control) grows it by the whole
    model."""
    base = write_tiny_model(tmp_path / "base", "llama")
    shape = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 8, "num_key_value_heads": 4}
    config = tiny_config("llama")
    config.update(shape)
    AutoModelForCausalLM.from_config(config).save_pretrained(base, max_shard_size="4MB")
    shards = [path.stat().st_size for path in base.glob("*.safetensors")]
    assert len(shards) == 9 and max(shards) <= 4e6 and sum(shards) > 8 * max(shards)

    tests = REPO / "tests"
    pythonpath = os.pathsep.join([str(tests), str(tests / "checkpoint"), os.environ.get("PYTHONPATH", "")])
    measure = f"import test_merge; test_merge.report_merge_memory({str(base)!r}, {str(tmp_path / 'merged')!r})"
    result = subprocess.run(
        [sys.executable, "-c", measure],
        env={**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    growth = json.loads(result.stdout.splitlines()[-1])
    assert growth["whole"] >= 0.9 * sum(shards)  # the measurement sees a whole model held
    # At most a shard's tensors, the copies save_file may make of them while it writes, one delta, and what the
    # allocator keeps of the shard before it: 4 shards, under half the model.
    assert growth["merge"] <= 4 * max(shards) < 0.5 * sum(shards), growth
    assert stored_layout(tmp_path / "merged") == stored_layout(base)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    original = AutoModelForCausalLM.from_pretrained(base).state_dict()
    assert not torch.equal(
        merged["model.layers.7.mlp.down_proj.weight"], original["model.layers.7.mlp.down_proj.weight"]
    )


def test_a_moe_run_with_lora_on_fused_routed_experts_writes_final_merged(tmp_path):
    """Qwen3-MoE trained on the fused expert path, with LoRA on attention and the routed experts (PEFT's
    per-expert blocks on the fused 3-D weights); its base in several shards that hold the experts as
    per-expert tensors."""
    base = write_base(tmp_path / "base", "qwen3_moe", "200KB")
    run = train(
        tmp_path, "run", 1, f"model.name_or_path={base}", "lora.target_modules=null",
        "lora.moe_targets=[attention,routed_experts]", "training.merge_final=true", steps=3,
    )  # fmt: skip
    assert "moe experts: fused (shardtune's grouped-GEMM block)" in run["log"]
    merged_dir = run["out"] / "final-merged"
    written = sum(path.stat().st_size for path in merged_dir.iterdir())
    assert f"saved the merged model to {merged_dir} ({size(written)})" in run["log"]
    assert stored_layout(merged_dir) == stored_layout(base) and len(stored_layout(base)) > 2
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    reference = peft_merged(base, run["out"] / "final")
    torch.testing.assert_close(logits(merged), logits(reference), rtol=1e-6, atol=1e-6)
    # Training moved the experts: the comparison above could not pass with an adapter left out.
    trained_experts = [name for name in reference.state_dict() if "experts" in name]
    original = AutoModelForCausalLM.from_pretrained(base).state_dict()
    assert trained_experts and all(
        not torch.equal(merged.state_dict()[name], original[name]) for name in trained_experts
    )
    assert (merged_dir / "tokenizer.json").is_file() and (merged_dir / "generation_config.json").is_file()
