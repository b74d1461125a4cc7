"""Shared fixtures: the shipped tiny model, small alpaca files, and a world-size-1 process group."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Tests never touch the network, nor a GPU unless asked to: the GPU tests (marked gpu) run with
# SHARDTUNE_TEST_GPU=1 python -m pytest -m gpu, and skip elsewhere.
if os.environ.get("SHARDTUNE_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = REPO / "examples" / "tiny-llama"
TINY_DATA = REPO / "examples" / "data" / "tiny_instruct.jsonl"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return TINY_MODEL


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_MODEL)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def alpaca_file(tmp_path: Path) -> Path:
    """The first 200 rows of the quickstart dataset."""
    rows = [json.loads(line) for line in TINY_DATA.read_text().splitlines()[:200]]
    return write_jsonl(tmp_path / "train.jsonl", rows)


def make_config(tmp_path: Path, data_path: Path, **sections: dict):
    """A validated Config for the tiny model; ``sections`` override keys per section."""
    from shardtune.config import Config

    tree = {
        "model": {"name_or_path": str(TINY_MODEL)},
        "data": {"dataset_path": str(data_path), "max_length": 128, "cache_dir": str(tmp_path / "cache")},
        "training": {
            "output_dir": str(tmp_path / "run"),
            "max_steps": 4,
            "per_device_train_batch_size": 4,
            "learning_rate": 1e-3,
            "logging_steps": 1,
            "seed": 0,
        },
        "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0},
        "logging": {"progress_bar": False},
    }
    for section, values in sections.items():
        tree.setdefault(section, {}).update(values)
    return Config.model_validate(tree)


@pytest.fixture
def world():
    """A real world-size-1 process group, as every run has."""
    from shardtune.distributed.env import DistributedEnv

    env = DistributedEnv.from_environment(timeout_s=60)
    yield env
    env.close()
