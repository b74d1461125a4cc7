"""Faults during a checkpoint save on one of two ranks (gloo, CPU): a rank killed before or after writing
its shards, and a rank whose writes fail. Nothing half-written is ever committed or loaded."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from faulty_runs import assert_intact, checkpoint_weights, final_adapter, run, same_weights, train_log

from shardtune.errors import EXIT_SAVE_FAILED

SAVING = ["training.max_steps=6", "training.save_steps=2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same run without a fault: what every interrupted one must end with."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    result = run(tmp_path, tmp_path / "run", 2, *SAVING)
    assert result.returncode == 0, result.log[-3000:]
    return tmp_path / "run"


@pytest.mark.parametrize(
    "point",
    [
        pytest.param("save.shards", id="before-its-shards"),
        pytest.param("save.written", id="after-its-shards", marks=pytest.mark.variants),
    ],
)
def test_rank_killed_during_a_save_fails_the_job_and_the_restart_resumes_from_the_previous_checkpoint(
    tmp_path, point, uninterrupted
):
    out = tmp_path / "run"
    # Rank 1 dies by SIGKILL inside the save of step 4, in the first attempt only; the launcher restarts.
    result = run(tmp_path, out, 2, *SAVING, fault=f"{point}:kill:rank=1:step=4:attempt=0", max_restarts=1)
    assert result.returncode == 0, result.log[-4000:]
    assert f"fault injection: kill at {point}, step 4, rank 1" in result.log
    assert "workers failed (exit 1); restart 1 of 1" in result.log
    # The interrupted save left only its staging directory, which the restart removed instead of loading.
    assert "left by an interrupted save" in result.log and ".checkpoint-4.tmp" in result.log
    assert "resumed from" in result.log and "checkpoint-2 (step 2, saved by 2 rank(s)" in result.log
    # The log continues from step 2, and the run ends exactly where the uninterrupted one does.
    assert [row["step"] for row in train_log(out)] == [1, 2, 3, 4, 5, 6]
    assert [row["loss"] for row in train_log(out)] == [row["loss"] for row in train_log(uninterrupted)]
    assert same_weights(final_adapter(out), final_adapter(uninterrupted))
    for step in (4, 6):
        assert_intact(out / f"checkpoint-{step}")
    assert not list(out.glob(".checkpoint-*.tmp"))


@pytest.mark.variants
def test_a_kill_while_rotation_removes_a_checkpoint_leaves_no_checkpoint_without_its_manifest(tmp_path):
    out = tmp_path / "run"
    # save_total_limit=1: saving step 4 removes checkpoint-2, and the process dies in that removal.
    result = run(tmp_path, out, 1, *SAVING, "training.save_total_limit=1", fault="save.rotate:kill:step=4")
    assert result.returncode != 0 and "fault injection: kill at save.rotate, step 4, rank 0" in result.log
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-4"]
    assert_intact(out / "checkpoint-4")
    assert (out / ".checkpoint-2.removed.tmp").is_dir()  # checkpoint-2 went aside whole before its removal
    resumed = run(tmp_path, out, 1, *SAVING, "training.save_total_limit=1", "training.resume_from_checkpoint=auto")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert ".checkpoint-2.removed.tmp, left by an interrupted save or removal" in resumed.log
    assert "checkpoint-4 (step 4" in resumed.log
    assert sorted(path.name for path in out.iterdir() if "checkpoint" in path.name) == ["checkpoint-6"]


def test_write_error_on_one_rank_fails_every_rank_at_once_and_commits_nothing(tmp_path):
    out = tmp_path / "run"
    # Rank 1's file size limit drops to 0 bytes as it starts writing step 4's shards: the kernel fails
    # its next write (EFBIG), inside DCP's writer, as it would for ENOSPC.
    result = run(tmp_path, out, 2, *SAVING, "parallel.timeout_s=120", fault="save.shards:write_error:rank=1:step=4")
    assert result.returncode == EXIT_SAVE_FAILED, result.log[-4000:]
    errors = [line for line in result.log.splitlines() if line.startswith("shardtune: error: checkpoint-4")]
    assert len(errors) == 1 and "Traceback" not in result.log, result.log[-4000:]  # every rank raised it: one line
    assert "rank 1: OSError: [Errno 27] File too large" in errors[0]
    assert "Nothing was committed; the newest complete checkpoint is checkpoint-2" in errors[0]
    assert result.seconds < 100  # long before the 120 s collective timeout: nobody waited for rank 1
    assert "restart" not in result.log  # a launcher does not restart what a restart cannot fix
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-2"]
    assert_intact(out / "checkpoint-2")
    assert [row["step"] for row in train_log(out)] == [1, 2, 3, 4]
    # The previous checkpoint still reads back whole: A and B of 7 projections in 4 layers, all finite.
    weights = checkpoint_weights(out / "checkpoint-2")
    assert len([name for name in weights if ".lora_" in name]) == 2 * 7 * 4
    assert all(value.isfinite().all() for value in weights.values())


def disk_usage(path: Path) -> int:
    """Bytes ``path`` takes on a filesystem of 4 KiB pages, as tmpfs counts them."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in files)


@contextlib.contextmanager
def small_filesystem(mount_point: Path, size: int):
    """A real tmpfs of ``size`` bytes at ``mount_point``; skips the test where mounting is not allowed."""
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], capture_output=True, text=True
    ) if shutil.which("mount") else None  # fmt: skip
    if mounted is None or mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip() if mounted else 'no mount'}"
        )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], capture_output=True, timeout=60)


@pytest.mark.variants  # a write error on one rank (the test above) takes the same path by default
def test_a_full_filesystem_fails_the_save_on_every_rank_and_commits_nothing(tmp_path, uninterrupted):
    # Room for everything up to checkpoint-2, and half of another checkpoint: checkpoint-4 cannot fit.
    checkpoint = disk_usage(uninterrupted / "checkpoint-2")
    size = checkpoint + checkpoint // 2 + 256 * 1024
    with small_filesystem(tmp_path / "small", size) as small:
        out = small / "run"
        result = run(tmp_path, out, 2, *SAVING, "parallel.timeout_s=120")
        assert result.returncode == EXIT_SAVE_FAILED, result.log[-4000:]
        errors = [line for line in result.log.splitlines() if line.startswith("shardtune: error: checkpoint-4")]
        assert len(errors) == 1 and "Traceback" not in result.log, result.log[-4000:]
        # Which write meets the full disk first decides the wording (the OS's ENOSPC, or torch's zip writer
        # reporting a short write in words of its own): the error names the stage and the rank(s) whose write failed.
        assert re.search(r"could not be saved \(writing shards\): rank [01]: \w+Error: ", errors[0]), errors[0]
        assert "Nothing was committed; the newest complete checkpoint is checkpoint-2" in errors[0]
        assert result.seconds < 100 and "restart" not in result.log
        assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-2"]
        assert_intact(out / "checkpoint-2")
        assert same_weights(
            checkpoint_weights(out / "checkpoint-2"), checkpoint_weights(uninterrupted / "checkpoint-2")
        )


@pytest.mark.variants
@pytest.mark.parametrize("killed_at", [3, 5], ids=["before-its-first-save", "after-it"])
def test_a_restart_of_a_run_branched_from_another_directory_carries_on_from_its_own_newest_else_the_branch_point(
    tmp_path, killed_at
):
    """Resumed from another directory's checkpoint-2, the run loses a worker: before its first save (step 3), the
    restart starts from that checkpoint again (the first attempt's files in its directory are its own, not another
    run's); after checkpoint-4 (step 5), it continues from checkpoint-4 rather than redoing steps 3-4."""
    source, out = tmp_path / "source", tmp_path / "run"
    first = run(tmp_path, source, 2, "training.max_steps=2", "training.save_steps=2")
    assert first.returncode == 0, first.log[-3000:]
    resume = f"training.resume_from_checkpoint={source / 'checkpoint-2'}"
    kill = f"forward_backward:kill:rank=1:step={killed_at}:attempt=0"
    result = run(tmp_path, out, 2, *SAVING, resume, "training.overwrite_output_dir=false", fault=kill, max_restarts=1)
    assert result.returncode == 0, result.log[-4000:]
    assert "workers failed (exit 1); restart 1 of 1" in result.log
    resumed = [line.split("INFO ")[-1] for line in result.log.splitlines() if "INFO resumed from" in line]
    restart_from = out / "checkpoint-4" if killed_at == 5 else source / "checkpoint-2"
    assert [line.split(" (step")[0] for line in resumed] == [
        f"resumed from {source / 'checkpoint-2'}",
        f"resumed from {restart_from}",
    ]
    assert [row["step"] for row in train_log(out)] == [3, 4, 5, 6]
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    if killed_at == 5:
        # Started again by hand, the same command would be a second branch mixed into this one's checkpoints.
        again = run(tmp_path, out, 2, *SAVING, resume, "training.overwrite_output_dir=false")
        assert again.returncode == 2 and again.log.strip().splitlines()[-1] == (
            f"shardtune: error: training.output_dir: {out} already holds a run (checkpoint-4, checkpoint-6, "
            f"config.yaml, final, heartbeat, logs, metrics.json, run_args.json); to train from {source}/checkpoint-2, "
            "choose another output_dir or set training.overwrite_output_dir=true; or continue it with "
            "training.resume_from_checkpoint=auto"
        ), again.log[-3000:]


@pytest.mark.variants
def test_a_restart_of_a_run_resumed_from_a_checkpoint_in_place_carries_on_from_its_own_newest(tmp_path):
    """Resumed from checkpoint-2 of its own directory, the run saves checkpoint-4 and then loses a worker: the restart
    continues from checkpoint-4 (``auto``), neither redoing steps 3-4 nor refusing checkpoint-2 as older."""
    out = tmp_path / "run"
    first = run(tmp_path, out, 2, "training.max_steps=2", "training.save_steps=2")
    assert first.returncode == 0, first.log[-3000:]
    resume = f"training.resume_from_checkpoint={out / 'checkpoint-2'}"
    kill = "forward_backward:kill:rank=1:step=5:attempt=0"
    result = run(tmp_path, out, 2, *SAVING, resume, fault=kill, max_restarts=1)
    assert result.returncode == 0, result.log[-4000:]
    assert "workers failed (exit 1); restart 1 of 1" in result.log
    assert f"resumed from {out / 'checkpoint-4'} (step 4, saved by 2 rank(s)" in result.log
    assert [row["step"] for row in train_log(out)] == [1, 2, 3, 4, 5, 6]
