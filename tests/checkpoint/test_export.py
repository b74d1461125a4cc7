"""``shardtune export``: checkpoints (from any world size) become what PEFT and transformers load."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from test_checkpoints import train
from transformers import AutoModelForCausalLM

from shardtune.cli import main

INPUT = torch.randint(0, 1000, (2, 20), generator=torch.Generator().manual_seed(0))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=INPUT).logits


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("export")
    out = tmp_path / "run"
    train(tmp_path, out, 2, "parallel.strategy=fsdp", "training.max_steps=4", "training.save_steps=4",
          "lora.lora_dropout=0", "training.checkpoint_mode=lite")  # fmt: skip
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
