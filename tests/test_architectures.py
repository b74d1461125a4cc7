"""Every popular architecture trains: tiny random Llama, Mistral, Qwen2, Qwen3, Gemma-2, Gemma-3, Phi-3,
GPT-2, GPT-NeoX, OPT, Falcon, Qwen3-MoE, Mixtral and GLM-4.5 (``tests/tiny_models.py``), each from the
command line, LoRA on every linear layer and full fine-tuning: one process, then FSDP over 2 workers with
the same global batch (the same losses), then ``shardtune export`` of the 2-worker checkpoint (adapter, and
merged for LoRA) reloaded with plain transformers + PEFT, whose loss on the run's eval examples is the loss
the trained model measured in the run; a LoRA run's own ``final-merged/`` (``training.merge_final``) is the
merged export.

The whole matrix takes minutes: CI runs a representative subset (GPT-2, whose projections are Conv1D and
whose config has no num_key_value_heads, and GLM-4.5, an MoE with a dense layer and a shared expert, both
LoRA); ``python -m pytest -m architectures`` runs the rest.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cli_runs import train
from conftest import REPO, TINY_DATA, make_config
from tiny_models import ARCHITECTURES, MOE_ARCHITECTURES, tiny_config, write_tiny_model
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from shardtune.cli import main
from shardtune.config import LoraConfig, load_config
from shardtune.data.prepare import prepare_dataset
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.errors import ConfigError
from shardtune.metrics.flops import run_token_flops, token_flops
from shardtune.model.load import GPU_TRAINING_FALLBACKS, build_model, load_model, load_tokenizer, supported_attention
from shardtune.model.lora import apply_lora, count_parameters, targets_as_given

STEPS = 3
IN_CI = {("gpt2", "lora"), ("glm4_moe", "lora")}
CASES = [
    pytest.param(
        arch,
        mode,
        marks=[pytest.mark.architectures, *([pytest.mark.representative] if (arch, mode) in IN_CI else [])],
        id=f"{arch}-{mode}",
    )
    for arch in ARCHITECTURES
    for mode in ("lora", "full")
]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_flop_count_is_what_a_forward_pass_computes(arch):
    """The FLOP model, from the model's own modules, against torch's count of a forward pass (a third
    of the 6 x matmul weights + 12 x layers x attention width x sequence FLOPs per trained token)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    # eager attention and experts: plain matmuls, which FlopCounterMode counts on every torch version
    model = AutoModelForCausalLM.from_config(
        tiny_config(arch), attn_implementation="eager", experts_implementation="eager"
    ).eval()
    sequence = 32
    ids = torch.randint(4, 1000, (1, sequence))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids, use_cache=False)
    flops = token_flops(model, sequence, None)
    assert flops.per_token * sequence / 3 == pytest.approx(counter.get_total_flops(), rel=1e-9)
    # Under LoRA on every linear layer the adapter's FLOPs are the LoRA fraction, not matmul weights.
    adapted = apply_lora(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    assert token_flops(adapted, sequence, 1).matmul_params == flops.matmul_params


def test_auto_attention_is_one_the_architecture_runs():
    """``auto`` picks training's kernel where the architecture has it, else sdpa, else eager; a kernel the
    user named and the architecture lacks is one config line (train and doctor build through the same)."""
    gpt2, llama = (tiny_config(arch) for arch in ("gpt2", "llama"))
    assert supported_attention(llama, "auto", "flex_attention") == "flex_attention"
    assert supported_attention(gpt2, "auto", "flex_attention") == "sdpa"  # GPT-2 has no FlexAttention
    # In training on a GPU, FlexAttention before eager: GPT-OSS (no sdpa: its sinks) outside packed rows; Gemma 2
    # (no sdpa: its capped scores) in test_capped_attention_scores_never_take_sdpa
    gpt_oss = tiny_config("gpt_oss")
    assert supported_attention(gpt_oss, "auto", "sdpa") == "eager"
    assert supported_attention(gpt_oss, "auto", "sdpa", GPU_TRAINING_FALLBACKS) == "flex_attention"
    with pytest.raises(ConfigError) as error:
        supported_attention(gpt_oss, "sdpa", "sdpa")
    assert error.value.lines == ["model.attn_implementation: GptOssForCausalLM does not run sdpa; set it to auto"]


def test_capped_attention_scores_never_take_sdpa(tmp_path, alpaca_file, monkeypatch):
    """sdpa's kernels have no cap on the attention scores. transformers 5.17 marks Gemma 2 as running sdpa all the
    same (``_supports_sdpa``, set here as it has it) and drops the cap without a word; later versions mark it as not
    running sdpa and raise where the cap reaches sdpa. Gemma 2 takes FlexAttention in training on a GPU and eager
    attention on a CPU whatever its class says, and trains the capped model: its logits are eager attention's with
    the cap, not without."""
    from transformers import Gemma2ForCausalLM

    monkeypatch.setattr(Gemma2ForCausalLM, "_supports_sdpa", True)
    capped = tiny_config("gemma2")
    capped.attn_logit_softcapping = 0.01  # small enough to change the scores of tiny random weights
    assert supported_attention(capped, "auto", "sdpa") == "eager"
    assert supported_attention(capped, "auto", "sdpa", GPU_TRAINING_FALLBACKS) == "flex_attention"
    with pytest.raises(ConfigError) as error:
        supported_attention(capped, "sdpa", "sdpa")
    assert error.value.lines == [
        "model.attn_implementation: Gemma2ForCausalLM does not run sdpa with capped attention scores "
        "(attn_logit_softcapping: 0.01); set it to auto"
    ]
    model_dir = write_tiny_model(tmp_path / "gemma2", "gemma2")
    capped.save_pretrained(model_dir)
    config = make_config(tmp_path, alpaca_file, model={"name_or_path": str(model_dir), "init": "random"})
    built = build_model(config, torch.device("cpu"), training=True).get_base_model().eval()
    assert built.config._attn_implementation == "eager"
    # the base weights under LoRA's layers (its B factors start at zero: the same function)
    base = {key.replace(".base_layer", ""): value for key, value in built.state_dict().items() if "lora_" not in key}
    ids = torch.randint(4, 1000, (2, 24))
    logits = {}
    for name, cap in (("capped", 0.01), ("uncapped", None)):
        reference = AutoModelForCausalLM.from_config(capped, attn_implementation="eager").eval()
        reference.load_state_dict(base)
        for layer in reference.model.layers:
            layer.self_attn.attn_logit_softcapping = cap
        with torch.no_grad():
            logits[name] = reference(input_ids=ids).logits
    with torch.no_grad():
        trained = built(input_ids=ids).logits
    torch.testing.assert_close(trained, logits["capped"])
    assert (trained - logits["uncapped"]).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
def test_gpt_oss_padded_rows_train_on_flex_attention_as_on_eager(tmp_path, alpaca_file):
    """GPT-OSS has no sdpa; outside packed rows, training on a GPU builds it with FlexAttention (transformers' mask of
    the padded rows, the sliding windows and the sinks) where it took eager attention, which computes the same: a
    tiny GPT-OSS in fp32 (windows of 16 tokens), two rows of 64 tokens, the second padded after 40, its real tokens'
    logits and every weight's gradient against eager attention's on the same weights."""
    model_dir = write_tiny_model(tmp_path / "gpt_oss", "gpt_oss")
    config = make_config(tmp_path, alpaca_file, model={"name_or_path": str(model_dir), "init": "random"})
    assert not config.data.packing
    built = build_model(config, torch.device("cuda"), training=True)
    assert built.get_base_model().config._attn_implementation == "flex_attention"
    torch.manual_seed(0)
    models = {
        name: AutoModelForCausalLM.from_config(tiny_config("gpt_oss"), attn_implementation=name)
        for name in ("flex_attention", "eager")
    }
    models["flex_attention"].load_state_dict(models["eager"].state_dict())
    ids = torch.randint(4, 1000, (2, 64), device="cuda")
    mask = torch.ones(2, 64, dtype=torch.long, device="cuda")
    mask[1, 40:] = 0
    real = mask.bool()
    logits, grads = {}, {}
    for name, model in models.items():
        model.cuda().train()
        out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[real]
        out.square().mean().backward()
        logits[name] = out.detach()
        grads[name] = {key: param.grad for key, param in model.named_parameters() if param.grad is not None}
    scale = logits["eager"].abs().max()
    assert (logits["flex_attention"] - logits["eager"]).abs().max() <= 1e-4 * scale
    assert grads["flex_attention"].keys() == grads["eager"].keys()
    for key, grad in grads["eager"].items():
        assert (grads["flex_attention"][key] - grad).norm() <= 1e-3 * grad.norm(), key


def test_doctor_builds_and_counts_the_model_as_training_does(tmp_path):
    """GPT-2 (no num_key_value_heads, Conv1D projections) once crashed training in its FLOP count after
    loading while doctor said ok: doctor now builds the model through training's code and shows the count."""
    from test_doctor import doctor, free_port, table

    overrides = [f"model.name_or_path={write_tiny_model(tmp_path / 'gpt2', 'gpt2')}", "model.init=random"]
    result = doctor(tmp_path, *overrides, "--port", str(free_port()))
    assert result.returncode == 0, result.stdout + result.stderr
    config = load_config(REPO / "examples/quickstart.yaml", overrides, check_paths=False)
    model = build_model(config, torch.device("cpu"), training=True, materialize=False)
    trainable, total = count_parameters(model)
    per_token = run_token_flops(model, config.data.max_length, True, trainable).per_token
    status, detail = table(result.stdout)["0", "memory"]
    assert status == "ok" and detail.endswith(f"; {per_token / 1e9:.4g} GFLOP per trained token")


def export(checkpoint: Path, out: Path, *options: str) -> Path:
    """``shardtune export`` through its command line, in this process (a subprocess costs a startup)."""
    assert main(["export", str(checkpoint), "--out", str(out), *options]) == 0
    return out


@pytest.fixture(scope="session")
def architecture_data(tmp_path_factory) -> tuple[Path, Path]:
    """200 rows of the quickstart data, and one token cache for every architecture (one tokenizer)."""
    directory = tmp_path_factory.mktemp("architecture-data")
    rows = TINY_DATA.read_text().splitlines(keepends=True)[:200]
    (directory / "train.jsonl").write_text("".join(rows))
    return directory / "train.jsonl", directory / "cache"


def eval_loss(model: torch.nn.Module, run_dir: Path) -> float:
    """The token-weighted loss of ``model`` on the run's eval examples, one unpadded example at a time."""
    config = load_config(run_dir / "config.yaml")
    examples = prepare_dataset(config, load_tokenizer(config.model)).eval
    total, targets = 0.0, 0
    with torch.no_grad():
        for index in range(len(examples)):
            input_ids, target_ids, _ = examples.sequence(index)
            logits = model(input_ids=torch.as_tensor(input_ids)[None]).logits[0]
            target_ids = torch.as_tensor(target_ids, dtype=torch.long)
            total += F.cross_entropy(logits.float(), target_ids, ignore_index=IGNORE_INDEX, reduction="sum").item()
            targets += int((target_ids != IGNORE_INDEX).sum())
    return total / targets


@pytest.mark.parametrize(("arch", "mode"), CASES)
def test_architecture_trains_under_fsdp_and_exports(arch, mode, tmp_path, architecture_data):
    model_dir = write_tiny_model(tmp_path / "model", arch)
    data, cache = architecture_data
    common = [
        f"model.name_or_path={model_dir}", "model.init=random", f"data.dataset_path={data}", f"data.cache_dir={cache}",
        "lora.target_modules=all-linear", f"training.save_steps={STEPS}", "training.eval_subset_size=8",
        *(["lora.enabled=false"] if mode == "full" else []),
    ]  # fmt: skip
    single = train(tmp_path, "single", 1, *common, "training.gradient_accumulation_steps=2", steps=STEPS)
    merge_final = ["training.merge_final=true"] if mode == "lora" else []
    sharded = train(tmp_path, "fsdp", 2, *common, "parallel.strategy=fsdp", *merge_final, steps=STEPS)
    assert sharded["metrics"]["strategy"] == "fsdp" and sharded["metrics"]["world_size"] == 2
    assert len(single["losses"]) == STEPS
    assert sharded["losses"] == pytest.approx(single["losses"], rel=1e-5)
    trained_loss = sharded["metrics"]["eval_loss"]
    assert trained_loss == pytest.approx(single["metrics"]["eval_loss"], rel=1e-5)

    checkpoint = sharded["out"] / f"checkpoint-{STEPS}"
    config = load_config(sharded["out"] / "config.yaml")
    base = load_model(config.model, torch.float32, config.training.seed).eval()  # init: random, the run's seed
    # Training moved the model: the comparisons below could not pass with weights that did not change.
    assert abs(eval_loss(base, sharded["out"]) - trained_loss) > 1e-3
    if mode == "full":
        exported = AutoModelForCausalLM.from_pretrained(export(checkpoint, tmp_path / "export"), dtype=torch.float32)
        assert eval_loss(exported.eval(), sharded["out"]) == pytest.approx(trained_loss, rel=1e-5)
        return
    from peft import PeftModel

    linear = {name for name, module in base.named_modules() if isinstance(module, (torch.nn.Linear, Conv1D))}
    # PEFT <= 0.21 rewrites an MoE adapter's gate_proj/up_proj/down_proj targets (GLM's dense MLP and
    # shared experts) into routed experts when it loads one (huggingface/peft#3711, see README).
    with targets_as_given() if arch in MOE_ARCHITECTURES else contextlib.nullcontext():
        adapted = PeftModel.from_pretrained(base, export(checkpoint, tmp_path / "adapter")).eval()
    assert eval_loss(adapted, sharded["out"]) == pytest.approx(trained_loss, rel=1e-5)
    # Every linear layer but the LM head has its adapter (GPT-2's Conv1D included), nothing else has one.
    adapted_names = {
        name.removeprefix("base_model.model.") for name, module in adapted.named_modules() if hasattr(module, "lora_A")
    }
    assert adapted_names == linear - {"lm_head", "embed_out"}
    merged = AutoModelForCausalLM.from_pretrained(
        export(checkpoint, tmp_path / "merged", "--merge"), dtype=torch.float32
    )
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert eval_loss(merged.eval(), sharded["out"]) == pytest.approx(trained_loss, rel=1e-5)
    # The run's own final-merged/ (training.merge_final) is that export: the last checkpoint's adapter, one merge.
    merged_final = AutoModelForCausalLM.from_pretrained(sharded["out"] / "final-merged", dtype=torch.float32)
    # And the run's final/ adapter merges to it too (a run that kept no checkpoint has only final/).
    final_adapter = export(sharded["out"] / "final", tmp_path / "final-adapter-merged", "--merge")
    merged_adapter = AutoModelForCausalLM.from_pretrained(final_adapter, dtype=torch.float32)
    for name, tensor in merged.state_dict().items():
        assert torch.equal(merged_final.state_dict()[name], tensor), name
        assert torch.equal(merged_adapter.state_dict()[name], tensor), name
