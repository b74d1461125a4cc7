"""``parallel.compile``: each decoder layer compiled (after activation checkpointing) trains to the same
losses as the eager model."""

from __future__ import annotations

import pytest
from cli_runs import train


def test_compiled_layers_train_like_eager_ones(tmp_path):
    common = ["training.gradient_checkpointing=true", "data.pad_to=max_length", "data.max_length=64"]
    eager = train(tmp_path, "eager", 1, *common, steps=3)
    compiled = train(tmp_path, "compiled", 1, *common, "parallel.compile=true", steps=3)
    assert "torch.compile on 4 decoder layers" in compiled["log"]
    assert "torch.compile" not in eager["log"]
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4)
