"""Checkpoints: exact resume, resume on another world size and strategy, commit, rotation, kills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file

BASE = [
    "training.logging_steps=1", "training.per_device_train_batch_size=2", "training.eval_on_start=false",
    "training.eval_steps=null", "lora.lora_dropout=0.1", "training.checkpoint_mode=full",
]  # fmt: skip


def command(tmp_path: Path, out: Path, nproc: int, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "shardtune", "train", "examples/quickstart.yaml", "--nproc", str(nproc),
        f"training.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", *BASE, *overrides,
    ]  # fmt: skip


ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def train(tmp_path: Path, out: Path, nproc: int, *overrides: str, expect: int = 0) -> subprocess.CompletedProcess:
    result = subprocess.run(
        command(tmp_path, out, nproc, *overrides), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == expect, result.stderr[-3000:]
    return result


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "logs/train_log.jsonl").read_text().splitlines()]


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "adapter_model.safetensors")


def interrupt_after(out: Path, step: int) -> None:
    """Make a finished run look like one stopped right after saving ``step``."""
    import shutil

    for checkpoint in out.glob("checkpoint-*"):
        if int(checkpoint.name.split("-")[1]) > step:
            shutil.rmtree(checkpoint)
    shutil.rmtree(out / "final", ignore_errors=True)


def test_resume_is_bitwise_exact(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(tmp_path, straight, 1, "training.max_steps=6")
    train(tmp_path, resumed, 1, "training.max_steps=6", "training.save_steps=3")
    interrupt_after(resumed, 3)
    log = train(tmp_path, resumed, 1, "training.max_steps=6", "training.resume_from_checkpoint=auto").stderr
    assert "resumed from" in log and "checkpoint-3 (step 3" in log
    assert [json.loads(line)["step"] for line in (resumed / "logs/train_log.jsonl").read_text().splitlines()] == [
        1, 2, 3, 4, 5, 6,
    ]  # fmt: skip
    assert losses(resumed) == losses(straight)  # bitwise, dropout included (RNG states restored)
    a, b = adapter(straight), adapter(resumed)
    assert all(torch.equal(a[key], b[key]) for key in a)


# The data-parallel matrix (python -m pytest -m data_parallel) has both; FSDP's shards gathered into one process
# run by default.
@pytest.mark.parametrize(
    ("first", "second"),
    [
        pytest.param(
            (2, "parallel.strategy=fsdp"), (1, "training.gradient_accumulation_steps=2"), id="fsdp2-to-1",
            marks=[pytest.mark.data_parallel, pytest.mark.representative],
        ),
        pytest.param(
            (1, "training.gradient_accumulation_steps=2"), (2, "parallel.strategy=ddp"), id="1-to-ddp2",
            marks=pytest.mark.data_parallel,
        ),
    ],
)  # fmt: skip
def test_resume_on_another_world_size_and_strategy(tmp_path, first, second):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(tmp_path, straight, first[0], first[1], "training.max_steps=6", "lora.lora_dropout=0")
    train(tmp_path, resumed, first[0], first[1], "training.max_steps=6", "training.save_steps=3", "lora.lora_dropout=0")
    interrupt_after(resumed, 3)
    train(
        tmp_path, resumed, second[0], second[1], "training.max_steps=6", "training.resume_from_checkpoint=auto",
        "lora.lora_dropout=0",
    )  # fmt: skip
    assert losses(resumed) == pytest.approx(losses(straight), rel=1e-5)
    a, b = adapter(straight), adapter(resumed)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


def test_rotation_manifest_and_lite_resume(tmp_path):
    out = tmp_path / "run"
    train(
        tmp_path, out, 1, "training.max_steps=4", "training.save_steps=1", "training.save_total_limit=2",
        "training.checkpoint_mode=lite",
    )  # fmt: skip
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    manifest = json.loads((out / "checkpoint-4/manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["mode"] == "lite" and manifest["world_size"] == 1
    for entry in manifest["files"]["0"]:
        assert (out / "checkpoint-4" / entry["path"]).stat().st_size == entry["bytes"]
    assert not (out / "checkpoint-4/optimizer").exists()
    # On two workers: a warning every rank meets alike is said once, by rank 0, not once per worker.
    log = train(tmp_path, out, 2, "training.max_steps=5", "training.resume_from_checkpoint=auto",
                "training.checkpoint_mode=lite").stderr  # fmt: skip
    warnings = [line for line in log.splitlines() if " WARNING " in line]
    assert warnings == [line for line in warnings if "weights only, the optimizer state starts fresh" in line]
    assert len(warnings) == 1, log


@pytest.mark.variants
def test_partial_checkpoints_are_ignored_and_missing_files_named(tmp_path):
    out = tmp_path / "run"
    train(tmp_path, out, 1, "training.max_steps=2", "training.save_steps=1")
    (out / ".checkpoint-9.tmp").mkdir()  # a save that was killed
    (out / "checkpoint-8").mkdir()  # no manifest: never committed
    log = train(
        tmp_path, out, 1, "training.max_steps=3", "training.save_steps=1", "training.resume_from_checkpoint=auto"
    ).stderr
    assert "checkpoint-2 (step 2" in log and not (out / ".checkpoint-9.tmp").exists()
    shard = next((out / "checkpoint-3/model").glob("__0_*.distcp"))
    shard.unlink()
    result = train(
        tmp_path, out, 1, "training.max_steps=4", f"training.resume_from_checkpoint={out / 'checkpoint-3'}", expect=2
    )
    assert f"model/{shard.name} (written by rank 0 on" in result.stderr


def test_rotation_that_cannot_move_a_checkpoint_aside_keeps_it_and_fails_nothing(tmp_path, caplog):
    """save_total_limit=1 after saving step 3: checkpoint-1 goes, checkpoint-2 cannot be renamed aside (a
    non-empty directory already holds its partial's name) and stays, with a warning; nothing raises."""
    from types import SimpleNamespace

    from shardtune.checkpoint.checkpointer import Checkpointer
    from shardtune.checkpoint.layout import MANIFEST_KEYS, complete_checkpoints

    for step in (1, 2, 3):
        checkpoint = tmp_path / f"checkpoint-{step}"
        (checkpoint / "model").mkdir(parents=True)
        (checkpoint / "manifest.json").write_text(json.dumps(dict.fromkeys(MANIFEST_KEYS, step)))
        (checkpoint / "trainer.json").write_text("{}")
        (checkpoint / "config.yaml").write_text("")
    blocker = tmp_path / ".checkpoint-2.removed.tmp"
    blocker.mkdir()
    (blocker / "file").write_text("x")
    limit = SimpleNamespace(training=SimpleNamespace(save_total_limit=1))
    rotating = SimpleNamespace(config=limit, output_dir=tmp_path)
    with caplog.at_level("INFO", logger="shardtune"):
        Checkpointer._rotate(rotating, 3)
    assert [path.name for path in complete_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]
    assert not (tmp_path / ".checkpoint-1.removed.tmp").exists()
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith(f"could not remove {tmp_path / 'checkpoint-2'}")
    assert warnings[0].endswith("; it stays")


@pytest.mark.variants
def test_kill_during_saves_leaves_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "run"
    process = subprocess.Popen(
        command(tmp_path, out, 1, "training.max_steps=400", "training.save_steps=1", "training.save_total_limit=3"),
        cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while len(list(out.glob("checkpoint-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.37)  # saves take most of each step: this lands inside one with high probability
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    committed = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert committed, "at least one checkpoint was committed before the kill"
    for checkpoint in committed:
        assert (checkpoint / "manifest.json").is_file()
    newest = int(committed[-1].name.split("-")[1])
    log = train(tmp_path, out, 1, f"training.max_steps={newest + 1}", "training.resume_from_checkpoint=auto").stderr
    assert f"checkpoint-{newest} (step {newest}" in log
    assert not list(out.glob(".checkpoint-*.tmp"))
