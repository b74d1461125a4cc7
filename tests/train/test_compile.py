"""``parallel.compile``: each decoder layer compiled (after activation checkpointing) trains to the same
losses as the eager model, in torch.compile's mode that ``parallel.compile_mode`` names."""

from __future__ import annotations

import pytest
from cli_runs import train


def test_compiled_layers_train_like_eager_ones(tmp_path):
    common = ["training.gradient_checkpointing=true", "data.pad_to=max_length", "data.max_length=64"]
    eager = train(tmp_path, "eager", 1, *common, steps=3)
    # reduce-overhead: CUDA graphs where the device has them; on a CPU the same compiled graphs run.
    compiled = train(
        tmp_path, "compiled", 1, *common, "parallel.compile=true", "parallel.compile_mode=reduce-overhead", steps=3
    )
    assert "torch.compile (mode reduce-overhead) on 4 decoder layers" in compiled["log"]
    assert "torch.compile" not in eager["log"]
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4)


def test_an_unknown_compile_mode_is_refused_with_the_modes_there_are(tmp_path):
    from shardtune.config import ConfigError, load_config

    config = tmp_path / "config.yaml"
    config.write_text("model: {name_or_path: gpt2}\ndata: {path: data.jsonl}\n")
    with pytest.raises(ConfigError) as error:
        load_config(config, ["parallel.compile_mode=fast"], check_paths=False)
    assert "parallel.compile_mode" in str(error.value)
    assert "max-autotune-no-cudagraphs" in str(error.value)
