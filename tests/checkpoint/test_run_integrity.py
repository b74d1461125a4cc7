"""Nothing destroyed or mixed: a fresh run replaces only what the previous run wrote, a resume continues
in place, a checkpoint is resumed only with the config that made it, a finished one is left alone, and
metrics.json counts the whole run across resumes. Every run is ``shardtune train`` as a user types it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runs import jsonl, snapshot
from conftest import REPO
from test_checkpoints import ENV, command, interrupt_after, train
from torch.distributed.checkpoint import FileSystemReader

from shardtune.checkpoint.layout import resume_conflicts
from shardtune.config import load_config
from shardtune.run_dir import output_dir_problem
from shardtune.run_lock import current_holder


def steps(path: Path) -> list[int]:
    return [row["step"] for row in jsonl(path)]


def checkpoints(out: Path) -> list[str]:
    return sorted((p.name for p in out.glob("checkpoint-*")), key=lambda name: int(name.split("-")[1]))


def test_overwrite_output_dir_removes_only_the_previous_runs_files_and_a_resume_removes_nothing(tmp_path):
    out = tmp_path / "run"
    lite = ("training.checkpoint_mode=lite", "lora.lora_dropout=0")
    train(tmp_path, out, 1, "training.max_steps=4", "training.save_steps=2", *lite)
    (out / "notes.txt").write_text("my notes\n")
    (out / ".checkpoint-6.tmp").mkdir()  # a save the previous run did not finish
    (out / "hang-20250101T000000").mkdir()  # an earlier hang report
    fresh = train(
        tmp_path, out, 1, "training.overwrite_output_dir=true", "training.max_steps=3", "training.save_steps=1",
        "training.save_total_limit=2", *lite,
    ).stderr  # fmt: skip
    removing = [line for line in fresh.splitlines() if "overwrite_output_dir: removing" in line]
    assert len(removing) == 1 and removing[0].endswith(
        "removing the previous run's .checkpoint-6.tmp, checkpoint-2, checkpoint-4, config.yaml, final, "
        f"hang-20250101T000000, heartbeat, logs, metrics.json, run_args.json from {out}"
    )
    # Rotation saw only this run's checkpoints; the user's file is untouched.
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-3"]
    assert (out / "notes.txt").read_text() == "my notes\n"
    assert not (out / ".checkpoint-6.tmp").exists() and not (out / "hang-20250101T000000").exists()
    assert steps(out / "logs/train_log.jsonl") == [1, 2, 3]

    # A lite checkpoint holds the trainable tensors only: tiny-llama ties lm_head to the frozen embeddings.
    saved = FileSystemReader(out / "checkpoint-3" / "model").read_metadata().state_dict_metadata
    assert saved and all("lora_" in name for name in saved), sorted(saved)

    # A resume continues this run in place whatever overwrite_output_dir says, from this run's checkpoint.
    resumed = train(
        tmp_path, out, 1, "training.overwrite_output_dir=true", "training.max_steps=4", "training.save_steps=1",
        "training.save_total_limit=2", "training.resume_from_checkpoint=auto", *lite,
    ).stderr  # fmt: skip
    assert "overwrite_output_dir: removing" not in resumed and "checkpoint-3 (step 3" in resumed
    assert (out / "notes.txt").read_text() == "my notes\n"
    assert steps(out / "logs/train_log.jsonl") == [1, 2, 3, 4]
    assert checkpoints(out) == ["checkpoint-3", "checkpoint-4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 6-step run, and one stopped after its step-3 checkpoint and resumed to step 6.
    Logging every 2 steps: the checkpoint falls inside a logging interval."""
    tmp_path = tmp_path_factory.mktemp("resume")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ("training.max_steps=6", "training.logging_steps=2", "training.eval_on_start=true", "lora.lora_dropout=0")
    train(tmp_path, straight, 1, *common)
    train(tmp_path, resumed, 1, *common, "training.save_steps=3")
    interrupt_after(resumed, 3)
    first_segment = json.loads((resumed / "metrics.json").read_text())
    (resumed / "metrics.json").unlink()
    train(tmp_path, resumed, 1, *common, "training.save_steps=3", "training.resume_from_checkpoint=auto")
    return {"tmp": tmp_path, "straight": straight, "resumed": resumed, "first_segment": first_segment}


def test_a_directory_no_run_made_keeps_its_own_files_even_with_overwrite_output_dir(tmp_path):
    """A project directory as output_dir, with its own config.yaml, logs/ and wandb/, and another trainer's
    checkpoint-500: names a run writes, but no shardtune run made them (no run_args.json, heartbeat or checkpoint
    with its manifest.json there). overwrite_output_dir (the quickstart's is true) used to remove them all. Refused
    in one line, nothing changed, as ``doctor`` and ``slurm`` say ahead of the run; a directory holding only other
    names takes the run."""
    project = tmp_path / "project"
    for name, text in [
        ("config.yaml", "my: config\n"), ("logs/experiment.log", "week 1\n"), ("wandb/run-1/files.txt", "x\n"),
        ("checkpoint-500/trainer_state.json", "{}\n"), ("notes.txt", "mine\n"),
    ]:  # fmt: skip
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    before = snapshot(project)
    refused = train(tmp_path, project, 1, "training.max_steps=2", "training.overwrite_output_dir=true", expect=2)
    line = (
        f"shardtune: error: training.output_dir: {project} holds checkpoint-500, config.yaml, logs, wandb, which a "
        "run writes but no shardtune run made there; choose a new or empty output_dir (overwrite_output_dir removes "
        "only a previous run's files)"
    )
    assert refused.stderr.strip().splitlines() == [line]
    assert snapshot(project) == before
    config = load_config(REPO / "examples/quickstart.yaml", [f"training.output_dir={project}"])
    assert "shardtune: error: " + output_dir_problem(config.training) == line
    for name in ("config.yaml", "logs", "wandb", "checkpoint-500"):
        shutil.move(project / name, tmp_path / name)
    train(tmp_path, project, 1, "training.max_steps=2", "training.overwrite_output_dir=true")
    assert (project / "notes.txt").read_text() == "mine\n" and (project / "final/adapter_model.safetensors").is_file()


def test_a_second_run_in_a_directory_in_use_stops_with_one_line_and_takes_over_once_the_first_is_gone(tmp_path):
    """Two runs in one directory at once: the second (resuming it, and with overwrite_output_dir, which would
    delete) stops with one line naming the first and changes nothing; once the first is killed (-9: nothing of it
    let go by hand), a resume takes the directory over, and leaves no lock behind when it ends."""
    out = tmp_path / "run"
    first = subprocess.Popen(
        command(tmp_path, out, 1, "training.max_steps=100000", "training.save_steps=2", "training.save_total_limit=2"),
        cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not checkpoints(out):
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()[-3000:]
            time.sleep(0.2)
        holder = json.loads((out / ".shardtune.lock").read_text())
        assert (holder["host"], holder["pid"]) == (os.uname().nodename, first.pid)
        second = train(
            tmp_path, out, 1, "training.resume_from_checkpoint=auto", "training.overwrite_output_dir=true", expect=2
        ).stderr
        assert [line for line in second.splitlines() if line.startswith("shardtune: error: ")] == [
            f"shardtune: error: training.output_dir: {out} is in use by another run (host {holder['host']}, pid "
            f"{holder['pid']}, started {holder['started']}); wait for it to end, or choose another output_dir"
        ]
        assert "Traceback" not in second and first.poll() is None  # the first trains on, its files in place
        assert (out / "config.yaml").is_file() and checkpoints(out)
        # What shardtune doctor's "previous run" row reports.
        assert current_holder(out) == f"host {holder['host']}, pid {holder['pid']}, started {holder['started']}"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    assert current_holder(out) is None
    last = int(checkpoints(out)[-1].split("-")[1])
    resumed = train(tmp_path, out, 1, "training.resume_from_checkpoint=auto", f"training.max_steps={last + 1}").stderr
    assert f"checkpoint-{last} (step {last}" in resumed
    assert steps(out / "logs/train_log.jsonl")[-1] == last + 1
    assert not (out / ".shardtune.lock").exists()


@pytest.mark.variants
def test_metrics_after_a_resume_count_the_whole_run(runs):
    straight = json.loads((runs["straight"] / "metrics.json").read_text())
    resumed = json.loads((runs["resumed"] / "metrics.json").read_text())
    assert resumed["steps"] == straight["steps"] == 6
    assert resumed["tokens"] == straight["tokens"] == runs["first_segment"]["tokens"] > 0
    assert resumed["tokens_per_rank"] == straight["tokens_per_rank"]
    assert resumed["first_eval_loss"] == pytest.approx(straight["first_eval_loss"], rel=1e-6)
    assert resumed["eval_loss"] == pytest.approx(straight["eval_loss"], rel=1e-5)
    # The train time of every logged interval of both segments, and more: step 3 was never logged.
    rows = jsonl(runs["resumed"] / "logs/train_log.jsonl")
    assert [row["step"] for row in rows] == [2, 4, 6]
    logged = sum(row["tokens"] / row["tokens_per_s"] for row in rows)
    assert resumed["train_time_s"] > logged
    assert resumed["wall_time_s"] > resumed["train_time_s"]
    assert resumed["tokens_per_s"] == pytest.approx(resumed["tokens"] / resumed["train_time_s"], rel=1e-9)
    # One config hash, the same in the run manifest and every checkpoint's manifest.
    config_hash = json.loads((runs["resumed"] / "run_args.json").read_text())["config_hash"]
    manifest = json.loads((runs["resumed"] / "checkpoint-6/manifest.json").read_text())
    assert (
        manifest["config_hash"]
        == hashlib.sha256((runs["resumed"] / "checkpoint-6/config.yaml").read_bytes()).hexdigest()
    )
    assert config_hash == hashlib.sha256((runs["resumed"] / "config.yaml").read_bytes()).hexdigest()


def test_resuming_a_finished_checkpoint_changes_nothing(runs):
    before = snapshot(runs["resumed"])
    result = train(
        runs["tmp"], runs["resumed"], 1, "training.max_steps=6", "training.resume_from_checkpoint=auto", expect=0
    )
    assert (
        f"{runs['resumed'] / 'checkpoint-6'} is at step 6 and this run ends at step 6: nothing to train, nothing "
        "changed" in result.stderr
    )
    assert "Traceback" not in result.stderr
    assert snapshot(runs["resumed"]) == before


def test_resuming_with_another_adapter_is_one_line_naming_the_keys(runs):
    before = snapshot(runs["resumed"])
    checkpoint = runs["resumed"] / "checkpoint-6"
    result = train(
        runs["tmp"], runs["resumed"], 1, "training.max_steps=8", f"training.resume_from_checkpoint={checkpoint}",
        "lora.r=4", "lora.target_modules=[q_proj]", "training.learning_rate=1e-3", expect=2,
    )  # fmt: skip
    assert result.stderr.strip().splitlines() == [
        f"shardtune: error: training.resume_from_checkpoint: {checkpoint} was saved with another model, adapter or "
        'data: lora.r 16 -> 4; lora.target_modules "all-linear" -> ["q_proj"]. Resume with the checkpoint\'s values '
        "(its config.yaml), or start a new run in another output_dir"
    ]
    assert snapshot(runs["resumed"]) == before


@pytest.mark.variants
def test_resuming_from_an_older_checkpoint_in_place_is_refused_and_branches_into_another_output_dir(runs):
    """checkpoint-3 of a run that went on to checkpoint-6: its steps redone in that directory would replace
    checkpoint-6 when saved again, and any later checkpoint they did not reach would stay for rotation and ``auto``
    to mix with them. Refused in one line, nothing changed; into another output_dir it resumes."""
    before = snapshot(runs["resumed"])
    checkpoint = runs["resumed"] / "checkpoint-3"
    result = train(
        runs["tmp"], runs["resumed"], 1, "training.max_steps=8", "training.save_steps=3",
        f"training.resume_from_checkpoint={checkpoint}", expect=2,
    )  # fmt: skip
    assert result.stderr.strip().splitlines() == [
        f"shardtune: error: training.resume_from_checkpoint: {checkpoint} is older than checkpoint-6 in "
        f"{runs['resumed']}, saved by the run that went on from it; resume from checkpoint-6, or from {checkpoint} "
        "into another output_dir"
    ]
    assert snapshot(runs["resumed"]) == before
    branch = runs["tmp"] / "branch"
    log = train(
        runs["tmp"], branch, 1, "training.max_steps=6", "training.logging_steps=2", "lora.lora_dropout=0",
        f"training.resume_from_checkpoint={checkpoint}",
    ).stderr  # fmt: skip
    assert f"resumed from {checkpoint} (step 3" in log
    assert json.loads((branch / "metrics.json").read_text())["steps"] == 6
    assert snapshot(runs["resumed"]) == before


@pytest.mark.variants
def test_branching_into_a_directory_that_holds_another_run_is_refused_unless_it_is_replaced(runs):
    """A resume from another directory's checkpoint starts a new run: into a directory holding a run it would mix
    its checkpoints with that run's (a later ``auto`` would take the newest of either), and its final/ and
    metrics.json would replace that run's. Refused in one line (``doctor`` and ``slurm`` say it too), nothing
    changed; with overwrite_output_dir the old run's files go, and the branch trains from the checkpoint."""
    checkpoint = runs["resumed"] / "checkpoint-3"
    other = runs["tmp"] / "other"
    shutil.copytree(runs["straight"], other)
    (other / "notes.txt").write_text("my notes\n")
    before = snapshot(other)
    branch = ("training.max_steps=6", "training.logging_steps=2", "lora.lora_dropout=0")
    branch += (f"training.resume_from_checkpoint={checkpoint}",)
    branch += ("training.overwrite_output_dir=false",)  # the quickstart's is true
    refused = train(runs["tmp"], other, 1, *branch, expect=2)
    line = (
        f"shardtune: error: training.output_dir: {other} already holds a run (config.yaml, final, heartbeat, logs, "
        f"metrics.json, run_args.json); to train from {checkpoint}, choose another output_dir or set "
        "training.overwrite_output_dir=true"
    )
    assert refused.stderr.strip().splitlines() == [line]
    assert snapshot(other) == before
    config = load_config(REPO / "examples/quickstart.yaml", [f"training.output_dir={other}", *branch])
    assert "shardtune: error: " + output_dir_problem(config.training) == line
    replaced = train(runs["tmp"], other, 1, *branch, "training.overwrite_output_dir=true").stderr
    assert "removing the previous run's config.yaml, final, heartbeat, logs, metrics.json, run_args.json" in replaced
    assert f"resumed from {checkpoint} (step 3" in replaced
    assert steps(other / "logs/train_log.jsonl") == [4, 6]
    assert (other / "notes.txt").read_text() == "my notes\n"


@pytest.mark.parametrize("inside", [False, True], ids=["the-checkpoint", "inside-it"])
def test_an_output_dir_in_a_checkpoint_is_refused_before_anything_is_written(runs, inside):
    """A checkpoint is never written to: a run there with overwrite_output_dir would remove its config.yaml, and
    one inside it would go with it when its own run's rotation removes it."""
    checkpoint = runs["resumed"] / "checkpoint-3"
    out = checkpoint / "branch" if inside else checkpoint
    before = snapshot(runs["resumed"])
    refused = train(runs["tmp"], out, 1, "training.overwrite_output_dir=true", expect=2)
    where = "lies inside the checkpoint" if inside else "is the checkpoint"
    assert refused.stderr.strip().splitlines() == [
        f"shardtune: error: training.output_dir: {out} {where} {checkpoint}, which is never written to; choose "
        "another output_dir"
    ]
    assert snapshot(runs["resumed"]) == before and not (checkpoint / "branch").exists()


def test_what_a_resume_may_change(monkeypatch):
    monkeypatch.chdir(REPO)
    config = load_config(REPO / "examples/quickstart.yaml").to_dict()

    def changed(section: str, key: str, value) -> list[str]:
        return resume_conflicts(config, {**config, section: {**config[section], key: value}})

    for section, key, value in [
        ("training", "max_steps", 99), ("training", "learning_rate", 1.0), ("training", "save_steps", 3),
        ("training", "output_dir", "elsewhere"), ("lora", "lora_dropout", 0.3), ("model", "dtype", "bfloat16"),
        ("data", "cache_dir", "/cache"), ("parallel", "strategy", "fsdp"), ("logging", "tensorboard", True),
    ]:  # fmt: skip
        assert changed(section, key, value) == [], key
    for section, key, value, line in [
        ("lora", "r", 8, "lora.r 16 -> 8"),
        ("lora", "lora_alpha", 8.0, "lora.lora_alpha 32.0 -> 8.0"),
        ("model", "name_or_path", "other", 'model.name_or_path "examples/tiny-llama" -> "other"'),
        ("data", "max_length", 64, "data.max_length 128 -> 64"),
        ("data", "packing", True, "data.packing false -> true"),
        ("data", "eval_split_ratio", 0.1, "data.eval_split_ratio 0.05 -> 0.1"),
        ("training", "seed", 1, "training.seed 42 -> 1"),
    ]:
        assert changed(section, key, value) == [line]
    # The same directory, named relatively or absolutely, is the same model.
    with_absolute = {**config, "model": {**config["model"], "name_or_path": str(REPO / "examples/tiny-llama")}}
    assert resume_conflicts(config, with_absolute) == []


def shardtune(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "shardtune", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_export_never_replaces_a_run_a_checkpoint_or_its_input(runs, tmp_path, capsys, monkeypatch):
    from shardtune.cli import main

    monkeypatch.chdir(REPO)  # where the checkpoint's relative base model path points

    run = runs["resumed"]
    (run / "notes.txt").write_text("my notes\n")
    before = snapshot(run)
    checkpoint, older = run / "checkpoint-6", run / "checkpoint-3"
    # As the issue found it: the checkpoint exported into its own run directory.
    result = shardtune("export", str(checkpoint), "--out", str(run), "--overwrite")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"shardtune: error: --out {run}: contains the input {checkpoint}; choose another --out"
    )
    for out, why in [
        (checkpoint, f"--out {checkpoint}: is the input {checkpoint}; choose another --out"),
        (checkpoint / "adapter", f"--out {checkpoint / 'adapter'}: is inside the input {checkpoint}"),
        (runs["straight"], f"--out {runs['straight']}: holds a training run (config.yaml, final, "),
        (older / "x", f"--out {older / 'x'}: {older} is a checkpoint, which is never written to"),
        (
            Path("examples/tiny-llama"),
            f"--out examples/tiny-llama: is the checkpoint's base model {REPO / 'examples/tiny-llama'}; choose another "
            "--out",
        ),
    ]:  # fmt: skip
        assert main(["export", str(checkpoint), "--out", str(out), "--overwrite"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"shardtune: error: {why}"), lines
    assert snapshot(run) == before
    # A file of the base model the checkpoint was trained from (without --overwrite: it exists).
    assert main(["export", str(checkpoint), "--out", "examples/tiny-llama/config.json"]) == 2
    assert capsys.readouterr().err.strip() == (
        "shardtune: error: --out examples/tiny-llama/config.json: is inside the checkpoint's base model "
        f"{REPO / 'examples/tiny-llama'}; choose another --out"
    )

    # An existing output is replaced only with --overwrite, and then whole.
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "old.txt").write_text("old\n")
    assert main(["export", str(checkpoint), "--out", str(adapter)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"shardtune: error: --out {adapter}: already exists; choose another path, or pass --overwrite to replace it"
    )
    assert (adapter / "old.txt").read_text() == "old\n"
    assert main(["export", str(checkpoint), "--out", str(adapter), "--overwrite"]) == 0
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()
    assert not (adapter / "old.txt").exists() and not list(tmp_path.glob(".adapter.*"))


def test_export_never_replaces_what_a_run_wrote_but_writes_a_new_directory_in_it(runs, tmp_path, monkeypatch, capsys):
    """--out, even with --overwrite, is never one of a run's own entries nor inside one: the run's logs/ was
    replaced by the adapter. One written later (a resumed run's final-merged/) counts too. A new directory in
    the run directory is where an export may go."""
    from shardtune.cli import main

    monkeypatch.chdir(REPO)  # where the checkpoint's relative base model path points
    run = tmp_path / "run"
    shutil.copytree(runs["resumed"], run)
    checkpoint = run / "checkpoint-6"
    before = snapshot(run)
    for name, where in [
        ("logs", "is"), ("final", "is"), ("config.yaml", "is"), ("final-merged", "is"), ("logs/adapter", "is inside"),
    ]:  # fmt: skip
        out, entry = run / name, name.split("/")[0]
        assert main(["export", str(checkpoint), "--out", str(out), "--overwrite"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"shardtune: error: --out {out}: {where} the run's {entry} in {run}, which only the run writes; "
            "choose another --out"
        )
    assert snapshot(run) == before and not (run / "final-merged").exists()
    assert main(["export", str(checkpoint), "--out", str(run / "exported-adapter")]) == 0, capsys.readouterr().err
    assert (run / "exported-adapter" / "adapter_model.safetensors").is_file()
    after = {name: stamp for name, stamp in snapshot(run).items() if not name.startswith("exported-adapter/")}
    assert after == before


def test_a_failed_export_over_an_old_one_leaves_the_old_one(runs, tmp_path, monkeypatch, capsys):
    from transformers import PreTrainedTokenizerBase

    from shardtune.cli import main

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "old.txt").write_text("old\n")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    # The tokenizer is written after the weights: the export fails with its new output half written.
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full_disk)
    with pytest.raises(OSError, match="No space left"):
        main(["export", str(runs["resumed"] / "checkpoint-6"), "--out", str(adapter), "--overwrite"])
    assert sorted(p.name for p in adapter.iterdir()) == ["old.txt"]
    # Nor is the half-written export left beside it (a Ctrl-C mid-save ends the same way).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_export_over_a_file_or_a_link_with_overwrite(runs, tmp_path, capsys):
    """--overwrite replaces a file at --out with the export's directory, and writes through a link (the checks
    look where it leads): the link stays and shows the export. Both were a traceback, the half-written export
    left beside them."""
    from shardtune.cli import main

    checkpoint = runs["resumed"] / "checkpoint-6"
    file, target, dangling_target = tmp_path / "adapter.txt", tmp_path / "v1", tmp_path / "v2"
    file.write_text("old\n")
    target.mkdir()
    (target / "old.txt").write_text("old\n")
    (tmp_path / "latest").symlink_to(target)
    (tmp_path / "next").symlink_to(dangling_target)
    final = sorted(p.name for p in (runs["resumed"] / "final").iterdir())  # what an adapter export holds
    for out, written in [(file, file), (tmp_path / "latest", target), (tmp_path / "next", dangling_target)]:
        assert main(["export", str(checkpoint), "--out", str(out), "--overwrite"]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.strip().endswith(f" in {written}")
        assert sorted(p.name for p in written.iterdir()) == final
    assert (tmp_path / "latest").is_symlink() and (tmp_path / "next").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter.txt", "latest", "next", "v1", "v2"]


@pytest.mark.variants
def test_resuming_after_the_training_data_changed_is_one_line(tmp_path):
    data = tmp_path / "data.jsonl"
    rows = (REPO / "examples/data/tiny_instruct.jsonl").read_text().splitlines(keepends=True)
    data.write_text("".join(rows))
    out = tmp_path / "run"
    common = (f"data.dataset_path={data}", "data.eval_split_ratio=0", "training.eval_subset_size=null")
    train(tmp_path, out, 1, *common, "training.max_steps=2", "training.save_steps=2")
    data.write_text("".join(rows[:-10]))  # the same path, ten rows fewer
    result = train(tmp_path, out, 1, *common, "training.max_steps=3", "training.resume_from_checkpoint=auto", expect=2)
    assert result.stderr.strip().splitlines()[-1] == (
        f"shardtune: error: training.resume_from_checkpoint: {out / 'checkpoint-2'}: sampler state is for "
        f"{len(rows)} examples with seed 42, this run has {len(rows) - 10} examples with seed 42; the training data "
        "changed since this checkpoint was saved: restore it, or start a new run in another output_dir"
    )
    assert "Traceback" not in result.stderr
