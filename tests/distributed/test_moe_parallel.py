"""MoE models with two workers (gloo, CPU, fp32) train like one worker with twice the accumulation: same
losses, and the expert counts summed over the ranks equal the one worker's counts. Qwen3-MoE, Mixtral
and GLM-4.5 (Glm4Moe), with DDP and FSDP2 (experts sharded as units of their own), LoRA and full; Qwen3.5 under
FSDP2."""

from __future__ import annotations

import pytest
from cli_runs import RunsOnDemand, jsonl, train
from tiny_models import MOE_ARCHITECTURES, write_tiny_model

STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("moe-dp")
    recipes = {}

    def run(arch: str, name: str, nproc: int, *overrides: str) -> None:
        def train_it() -> dict:
            model = write_tiny_model(tmp_path / "models" / arch, arch)
            common = [f"model.name_or_path={model}", "model.init=random", "lora.target_modules=null"]
            return train(
                tmp_path,
                f"{arch}-{name}",
                nproc,
                *common,
                "training.moe_aux_loss_coef=0.01",
                *overrides,
                *(["training.gradient_accumulation_steps=2"] if nproc == 1 else []),
                steps=STEPS,
            )

        recipes[(arch, name)] = train_it

    for arch in MOE_ARCHITECTURES:
        run(arch, "single", 1)
        run(arch, "ddp", 2, "parallel.strategy=ddp")
        run(arch, "fsdp", 2, "parallel.strategy=fsdp")
    # LoRA on the fused routed experts and the router (PEFT parameter wrappers) inside FSDP units.
    experts = ["lora.moe_targets=[attention,routed_experts,router]", f"training.save_steps={STEPS}"]
    run("qwen3_moe", "experts-single", 1, *experts)
    run("qwen3_moe", "experts-fsdp", 2, "parallel.strategy=fsdp", *experts)
    # Qwen3.5's layout: linear-attention layers, and a shared expert scaled by its own gate, inside FSDP units.
    gated = ["lora.moe_targets=[attention,routed_experts,shared_experts]"]
    run("qwen3_5_moe_text", "gated-single", 1, *gated)
    run("qwen3_5_moe_text", "gated-fsdp", 2, "parallel.strategy=fsdp", *gated)
    # Full fine-tuning with the experts' own FSDP units, with activation checkpointing: around whole layers in
    # one process; around each layer's attention and MoE block (the experts' FSDP unit gathered again for
    # the recomputation) under FSDP; around the attention alone under DDP.
    full = ["lora.enabled=false", "training.gradient_checkpointing=true"]
    run("glm4_moe", "full-single", 1, *full)
    run(
        "glm4_moe",
        "full-fsdp",
        2,
        "parallel.strategy=fsdp",
        *full,
        "training.gradient_checkpointing_granularity=sublayers",
    )
    run(
        "glm4_moe",
        "full-ddp",
        2,
        "parallel.strategy=ddp",
        *full,
        "training.gradient_checkpointing_granularity=attention",
    )
    return RunsOnDemand(recipes)


CASES = [(arch, strategy) for arch in MOE_ARCHITECTURES for strategy in ("ddp", "fsdp")] + [
    ("qwen3_moe", "experts-fsdp"),
    ("qwen3_5_moe_text", "gated-fsdp"),
    ("glm4_moe", "full-fsdp"),
    ("glm4_moe", "full-ddp"),
]
# The cases CI runs (each architecture, DDP and FSDP each at least once, LoRA on the routed experts; full
# fine-tuning of an MoE model on two workers is in the matrix, and in one process in test_fused_moe.py); the
# whole matrix: python -m pytest -m data_parallel
IN_CI = {
    ("mixtral", "ddp"),
    ("glm4_moe", "fsdp"),
    ("qwen3_moe", "experts-fsdp"),
}


def single_of(strategy: str) -> str:
    return strategy.rsplit("-", 1)[0] + "-single" if "-" in strategy else "single"


@pytest.mark.parametrize(
    ("arch", "strategy"),
    [
        pytest.param(*case, marks=[pytest.mark.data_parallel, *([pytest.mark.representative] if case in IN_CI else [])])
        for case in CASES
    ],
)
def test_two_workers_train_and_route_like_one(runs, arch, strategy):
    reference, run = runs[(arch, single_of(strategy))], runs[(arch, strategy)]
    assert len(reference["losses"]) == STEPS
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert run["metrics"]["world_size"] == 2
    parts = {"full-single": "layer", "full-fsdp": "sublayers", "full-ddp": "attention"}
    for name, metrics in ((single_of(strategy), reference["metrics"]), (strategy, run["metrics"])):
        if name in parts:  # every one of the 3 layers recomputes that part
            assert metrics["checkpointed_parts"] == {"attention": 0, "mlp": 0, "sublayers": 0, "layer": 0} | {
                parts[name]: 3
            }

    train_log, reference_log = (
        jsonl(run["out"] / "logs/train_log.jsonl"),
        jsonl(reference["out"] / "logs/train_log.jsonl"),
    )
    # The load-balancing loss is logged apart from the LM loss, and agrees across world sizes.
    assert [row["moe_balance_loss"] for row in train_log] == pytest.approx(
        [row["moe_balance_loss"] for row in reference_log], rel=1e-5
    )
    usage, reference_usage = (jsonl(r["out"] / "logs/expert_usage.jsonl") for r in (run, reference))
    assert [row["step"] for row in usage] == list(range(1, STEPS + 1))
    for mine, theirs in zip(usage, reference_usage, strict=True):
        assert mine["tokens"] == theirs["tokens"] > 0
        assert [layer["counts"] for layer in mine["layers"]] == [layer["counts"] for layer in theirs["layers"]]
        for layer in mine["layers"]:
            assert sum(layer["counts"]) == mine["tokens"] * mine["top_k"]
            assert layer["entropy"] == pytest.approx(theirs["layers"][mine["layers"].index(layer)]["entropy"], rel=1e-5)


def test_moe_runs_say_what_they_route(runs):
    log = runs[("glm4_moe", "fsdp")]["log"]
    assert "moe: 2 MoE layers, 8 experts, top 2 (sigmoid router); load-balancing loss coefficient 0.01" in log
    assert "moe: 2 MoE layers, 4 experts, top 2 (softmax router)" in runs[("mixtral", "ddp")]["log"]
    # attention-only LoRA by default vs. experts and router added
    assert (
        runs[("qwen3_moe", "experts-fsdp")]["metrics"]["trainable_params"]
        > runs[("qwen3_moe", "fsdp")]["metrics"]["trainable_params"]
    )


def test_expert_usage_heatmap_of_a_run(runs, capsys):
    from PIL import Image

    from shardtune.cli import main

    out = runs[("glm4_moe", "fsdp")]["out"]
    assert main(["expert-usage", str(out), "--steps", "2:3"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == ["layer", "tokens", "busiest", "idlest", "max/mean", "entropy"]
    usage = jsonl(out / "logs/expert_usage.jsonl")
    tokens = usage[1]["tokens"] + usage[2]["tokens"]
    assert [line.split()[:2] for line in printed[1:3]] == [["1", f"{2 * tokens:,}"], ["2", f"{2 * tokens:,}"]]
    assert printed[-1] == f"wrote {out / 'expert_usage.png'}"
    with Image.open(out / "expert_usage.png") as image:
        assert image.format == "PNG" and image.width > 200 and image.height > 100


def test_expert_adapters_export_and_merge_consistently(runs, tmp_path):
    """LoRA on fused experts and the router (trained under FSDP): the PEFT adapter in final/ on the base
    model gives the logits of the merged model that ``export --merge`` writes from the checkpoint."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardtune.cli import main
    from shardtune.config import load_config
    from shardtune.model.load import load_model
    from shardtune.model.lora import targets_as_given

    out = runs[("qwen3_moe", "experts-fsdp")]["out"]
    assert main(["export", str(out / f"checkpoint-{STEPS}"), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    config = load_config(out / "config.yaml")
    base = load_model(config.model, torch.float32, config.training.seed)
    with targets_as_given():
        adapted = PeftModel.from_pretrained(base, out / "final").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-4, atol=1e-4)
        with adapted.disable_adapter():  # and training did change the model
            assert not torch.allclose(adapted(ids).logits, merged(ids).logits, rtol=1e-4, atol=1e-4)
