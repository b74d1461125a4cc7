"""``shardtune export``: checkpoints (from any world size) become what PEFT and transformers load."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from cli_runs import train as cli_train
from peft import PeftModel
from test_checkpoints import train
from transformers import AutoModelForCausalLM

from shardtune.cli import main
from shardtune.doctor.report import size

INPUT = torch.randint(0, 1000, (2, 20), generator=torch.Generator().manual_seed(0))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=INPUT).logits


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("export")
    out = tmp_path / "run"
    train(tmp_path, out, 2, "parallel.strategy=fsdp", "training.max_steps=4", "training.save_steps=4",
          "lora.lora_dropout=0", "training.checkpoint_mode=lite", "training.merge_final=true")  # fmt: skip
    return out


def test_adapter_and_merged_exports_of_a_two_rank_checkpoint(lora_run, tmp_path, tiny_model_dir, capsys):
    trained = logits(
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora_run / "final")
    )
    assert main(["export", str(lora_run / "checkpoint-4"), "--out", str(tmp_path / "adapter")]) == 0
    assert capsys.readouterr().out.startswith("wrote PEFT adapter for")
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "adapter")
    torch.testing.assert_close(logits(adapter), trained, rtol=1e-6, atol=1e-6)
    assert (tmp_path / "adapter" / "tokenizer.json").is_file()

    assert main(["export", str(lora_run / "checkpoint-4"), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged), trained, rtol=1e-5, atol=1e-5)
    # One merge: the export of the last checkpoint is the run's own final-merged/, byte for byte.
    weights = "model.safetensors"
    assert (tmp_path / "merged" / weights).read_bytes() == (lora_run / "final-merged" / weights).read_bytes()


def hub_cache(model_dir: Path, cache: Path, repo_id: str) -> Path:
    """A Hugging Face cache holding ``model_dir``'s files as the snapshot of ``repo_id``'s main branch, as
    ``from_pretrained`` leaves it after a download."""
    revision = "0" * 40
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return cache


def test_merge_final_on_two_fsdp_workers_equals_one_worker_and_peft(lora_run, tmp_path, tiny_model_dir):
    """``training.merge_final``: final-merged/ computes what PEFT's merge of final/ into the base computes,
    for the two-worker FSDP run and for the same run on one worker (the same global batch), and the two
    agree. The one-worker run names its base by a hub id, which training and the merge find offline in
    a Hugging Face cache."""
    cache = hub_cache(tiny_model_dir, tmp_path / "hub", "shardtune-tests/tiny-llama")
    single = cli_train(
        tmp_path, "single", 1, "model.name_or_path=shardtune-tests/tiny-llama",
        "training.gradient_accumulation_steps=2", "training.merge_final=true", steps=4,
        env={"HF_HUB_CACHE": str(cache)},
    )  # fmt: skip
    merged_dir = single["out"] / "final-merged"
    written = sum(path.stat().st_size for path in merged_dir.iterdir())
    assert f"saved the merged model to {merged_dir} ({size(written)})" in single["log"]
    merged = {}
    for name, run_dir in (("fsdp", lora_run), ("single", single["out"])):
        merged[name] = logits(AutoModelForCausalLM.from_pretrained(run_dir / "final-merged"))
        reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), run_dir / "final")
        torch.testing.assert_close(merged[name], logits(reference.merge_and_unload()), rtol=1e-6, atol=1e-6)
        # Its config.yaml (a full model: no adapter, nothing to merge) loads where generate reads it.
        assert main(["generate", str(run_dir / "final-merged"), "--instruction", "Hi", "--max-new-tokens", "2"]) == 0
    torch.testing.assert_close(merged["fsdp"], merged["single"], rtol=1e-5, atol=1e-5)
    # Training moved the model: the comparisons above could not pass with an adapter left out.
    assert (merged["single"] - logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir))).abs().max() > 1e-2
    assert sorted(path.name for path in merged_dir.iterdir()) == [
        "chat_template.jinja", "config.json", "config.yaml", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip


def test_full_finetuning_checkpoint_exports_an_hf_model(tmp_path):
    out = tmp_path / "run"
    train(tmp_path, out, 1, "lora.enabled=false", "training.max_steps=2", "training.save_steps=2")
    assert main(["export", str(out / "checkpoint-2"), "--out", str(tmp_path / "model")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    torch.testing.assert_close(logits(exported), logits(AutoModelForCausalLM.from_pretrained(out / "final")))


def test_export_refuses_an_incomplete_checkpoint(tmp_path, capsys):
    (tmp_path / "checkpoint-3").mkdir()
    assert main(["export", str(tmp_path / "checkpoint-3"), "--out", str(tmp_path / "x")]) == 2
    assert "not a complete checkpoint (no manifest.json)" in capsys.readouterr().err


def test_a_final_adapter_exports_merged_and_nothing_else(lora_run, tmp_path, capsys):
    """A run's final/ adapter merges as the run's own merge did, byte for byte; without --merge, and for a
    full model, there is nothing to export: one line each, nothing written."""
    final = lora_run / "final"
    assert main(["export", str(final), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    assert capsys.readouterr().out.startswith("wrote merged model (base ")
    weights = "model.safetensors"
    assert (tmp_path / "merged" / weights).read_bytes() == (lora_run / "final-merged" / weights).read_bytes()
    merged = tmp_path / "merged"
    for source, options, line in (
        (final, [], f"{final}: is a PEFT adapter already; add --merge for the base model with it merged"),
        (merged, ["--merge"], f"{merged}: holds a full model already; from_pretrained loads it as it is"),
    ):
        assert main(["export", str(source), "--out", str(tmp_path / "again"), *options]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"shardtune: error: {line}"]
        assert not (tmp_path / "again").exists()


def test_final_adapter_of_a_checkpointed_run_holds_every_trained_tensor(tmp_path):
    """Activation checkpointing's wrappers are in module names, not in state-dict names: PEFT matched the
    two and saved an empty adapter. final/ must hold what the same run without checkpointing holds."""
    from safetensors.torch import load_file

    plain = cli_train(tmp_path, "plain", 1, steps=2)
    checkpointed = cli_train(tmp_path, "checkpointed", 1, "training.gradient_checkpointing=true", steps=2)
    expected = load_file(plain["out"] / "final/adapter_model.safetensors")
    saved = load_file(checkpointed["out"] / "final/adapter_model.safetensors")
    assert len(expected) == 56 and sorted(saved) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-5, atol=1e-7)
