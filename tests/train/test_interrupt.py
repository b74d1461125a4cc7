"""Ctrl-C (SIGINT) stops a run like a preemption: at a step boundary on every rank, with a checkpoint
where ``training.save_steps`` is set, one line saying where it is and the exact command that resumes
from it, exit status 130, and no traceback on any rank; outside the step loop, one line and 130 too."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runs import children_of, process_status
from conftest import REPO
from faulty_runs import command, train_log, worker_env

from shardtune.errors import EXIT_INTERRUPTED
from shardtune.train.preemption import PREEMPTED_EXIT_CODE, Preempted


def start(tmp_path: Path, out: Path, *overrides: str, fault: str | None = None) -> subprocess.Popen:
    """``shardtune train --nproc 2`` in a session of its own: its process group is the launcher and its
    workers, as a terminal's foreground job is."""
    return subprocess.Popen(
        command(tmp_path, out, 2, *overrides), cwd=REPO, env=worker_env(fault), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def wait_for(condition, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.communicate()[1][-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def logged_steps(out: Path) -> int:
    path = out / "logs/train_log.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def ctrl_c(process: subprocess.Popen) -> tuple[str, str]:
    """What a terminal's Ctrl-C does: SIGINT to every process of the foreground process group."""
    os.killpg(process.pid, signal.SIGINT)
    return process.communicate(timeout=240)


def test_ctrl_c_on_the_process_group_saves_says_how_to_resume_once_and_the_command_resumes(tmp_path):
    out = tmp_path / "run"
    # Each step sleeps a second on rank 1, so the run is still in its steps when Ctrl-C comes.
    settings = ["training.max_steps=8", "training.save_steps=100"]
    process = start(tmp_path, out, *settings, fault="optimizer:slow:rank=1")
    wait_for(lambda: logged_steps(out) >= 2, process)
    stdout, stderr = ctrl_c(process)
    assert process.returncode == EXIT_INTERRUPTED, stderr[-4000:]
    assert "Traceback" not in stderr + stdout
    lines = [line for line in stderr.splitlines() if "SIGINT" in line]
    assert len(lines) == 1, stderr[-4000:]  # the run's line, once: not per rank, no launcher or agent chatter
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert len(checkpoints) == 1, stderr[-4000:]
    manifest = json.loads((checkpoints[0] / "manifest.json").read_text())
    stopped = manifest["step"]
    assert manifest["mode"] == "full" and 2 <= stopped < 8
    assert [row["step"] for row in train_log(out)] == list(range(1, stopped + 1))
    expected = f"shardtune: SIGINT: stopping after step {stopped}; saved {checkpoints[0]}; resume with: "
    assert lines[0].startswith(expected)
    assert not (out / "final").exists()

    # The command the line gives, as typed: it resumes from that checkpoint and finishes the run.
    words = shlex.split(lines[0].split("resume with: ", 1)[1])
    assert words[:2] == ["shardtune", "train"] and "--nproc" in words
    assert words[-1] == f"training.resume_from_checkpoint={checkpoints[0]}"
    resumed = subprocess.run(
        [sys.executable, "-m", "shardtune", *words[1:]], cwd=REPO, env=worker_env(), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"checkpoint-{stopped} (step {stopped}" in resumed.stderr
    assert [row["step"] for row in train_log(out)] == list(range(1, 9))
    assert (out / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.variants
def test_ctrl_c_without_save_steps_stops_at_a_step_boundary_and_says_nothing_was_saved(tmp_path):
    out = tmp_path / "run"
    process = start(tmp_path, out, "training.max_steps=8", fault="optimizer:slow:rank=0")
    wait_for(lambda: logged_steps(out) >= 1, process)
    stdout, stderr = ctrl_c(process)
    assert process.returncode == EXIT_INTERRUPTED, stderr[-4000:]
    assert "Traceback" not in stderr + stdout
    lines = [line for line in stderr.splitlines() if "SIGINT" in line]
    assert len(lines) == 1 and "nothing saved (Ctrl-C saves a checkpoint only with training.save_steps set)" in lines[0]
    assert not list(out.glob("checkpoint-*")) and not (out / "final").exists()


@pytest.mark.variants
def test_ctrl_c_during_the_final_evaluation_is_one_line_and_exit_130(tmp_path):
    out = tmp_path / "run"
    # Eight evaluation batches of a second each, after the last step: outside the step loop.
    process = start(
        tmp_path, out, "training.max_steps=2", "training.eval_subset_size=8", "training.per_device_eval_batch_size=1",
        fault="eval.batch:slow",
    )  # fmt: skip
    wait_for(lambda: logged_steps(out) >= 2, process)
    time.sleep(1.5)
    stdout, stderr = ctrl_c(process)
    assert process.returncode == EXIT_INTERRUPTED, stderr[-4000:]
    assert "Traceback" not in stderr + stdout
    lines = [line for line in stderr.splitlines() if "SIGINT" in line]
    assert lines == [
        "shardtune: SIGINT: stopped outside the training steps (setup, evaluation, final save); nothing saved"
    ], stderr[-4000:]
    assert not (out / "final").exists() and not (out / "metrics.json").exists()


def test_ctrl_c_during_setup_is_one_line_and_exit_130(tmp_path):
    out = tmp_path / "run"
    process = start(tmp_path, out, "training.max_steps=2")
    # The workers exist and are still setting up: no heartbeat yet (it starts before the first step).
    wait_for(lambda: (out / "run_args.json").is_file(), process)
    stdout, stderr = ctrl_c(process)
    assert process.returncode == EXIT_INTERRUPTED, stderr[-4000:]
    assert "Traceback" not in stderr + stdout
    lines = [line for line in stderr.splitlines() if "SIGINT" in line]
    assert len(lines) == 1, stderr[-4000:]
    assert logged_steps(out) == 0


@pytest.mark.variants
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the workers through /proc")
def test_ctrl_c_on_one_worker_stops_every_rank_at_the_same_step_with_one_line(tmp_path):
    out = tmp_path / "run"
    process = start(tmp_path, out, "training.max_steps=8", "training.save_steps=100", fault="optimizer:slow:rank=0")
    wait_for(lambda: logged_steps(out) >= 1, process)
    workers = children_of(process.pid)
    assert len(workers) == 2
    os.kill(max(workers), signal.SIGINT)  # one worker only; the other learns at the step boundary
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == EXIT_INTERRUPTED, stderr[-4000:]
    assert "Traceback" not in stderr + stdout and "exitcode" not in stderr
    lines = [line for line in stderr.splitlines() if "SIGINT" in line]
    assert len(lines) == 1 and "resume with: shardtune train" in lines[0], stderr[-4000:]
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert len(checkpoints) == 1 and f"saved {checkpoints[0]};" in lines[0]


def ended(pid: int) -> bool:
    status = process_status(pid)
    return status is None or status[0] == "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal (prctl) is Linux's")
def test_workers_of_a_launcher_killed_outright_save_a_checkpoint_and_end(tmp_path):
    """SIGKILL on the launcher (or the out-of-memory killer): its workers, each in a session of its own, are
    told by the kernel and stop as on SIGTERM, instead of training on orphaned and holding their GPUs."""
    out = tmp_path / "run"
    process = start(tmp_path, out, "training.max_steps=8", "training.save_steps=100", fault="optimizer:slow:rank=1")
    wait_for(lambda: logged_steps(out) >= 2, process)
    workers = children_of(process.pid)
    assert len(workers) == 2
    process.kill()
    try:
        _, stderr = process.communicate(timeout=240)  # the workers hold its pipes until they end
    finally:
        for worker in workers:
            if not ended(worker):
                os.kill(worker, signal.SIGKILL)
    assert [ended(worker) for worker in workers] == [True, True]
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert len(checkpoints) == 1, stderr[-4000:]
    stopped = json.loads((checkpoints[0] / "manifest.json").read_text())["step"]
    assert 2 <= stopped < 8 and not (out / "final").exists()
    assert f"shardtune: SIGTERM: stopping after step {stopped}; saved {checkpoints[0]}; resume with: " in stderr
    assert "Traceback" not in stderr


# Installed through PYTHONPATH as the process's sitecustomize: the first import of torch waits, as it does for
# seconds on a cold disk, and says when it started waiting.
STALLED_TORCH_IMPORT = """
import os, sys, time


class StallTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            open(os.environ["SHARDTUNE_TEST_STALLED"], "w").close()
            time.sleep(120)
        return None


sys.meta_path.insert(0, StallTorch())
"""


@pytest.mark.parametrize("command", ["export", "plan", "train"])
def test_ctrl_c_while_a_command_imports_torch_is_one_line_and_exit_130(tmp_path, command):
    """The first seconds of every command import torch and transformers, before any command runs."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STALLED_TORCH_IMPORT)
    stalled = tmp_path / "stalled"
    arguments = {
        "export": [str(tmp_path / "checkpoint-1"), "--out", str(tmp_path / "export")],
        "plan": ["examples/quickstart.yaml"],
        "train": ["examples/quickstart.yaml", f"training.output_dir={tmp_path / 'run'}"],
    }[command]
    path = os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])
    process = subprocess.Popen(
        [sys.executable, "-m", "shardtune", command, *arguments], cwd=REPO,
        env={**os.environ, "PYTHONPATH": path, "SHARDTUNE_TEST_STALLED": str(stalled)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    wait_for(stalled.exists, process, timeout=60)
    stdout, stderr = ctrl_c(process)
    assert process.returncode == EXIT_INTERRUPTED, stderr[-4000:]
    assert (stdout, stderr) == ("", f"shardtune: SIGINT: stopped ({command})\n")
    assert not (tmp_path / "export").exists() and not (tmp_path / "run").exists()


def test_the_resume_command_is_the_starting_command_with_the_checkpoint(monkeypatch):
    monkeypatch.setenv(
        "SHARDTUNE_COMMAND", "shardtune train 'my config.yaml' --nproc 2 training.resume_from_checkpoint=auto lora.r=8"
    )
    stopped = Preempted("SIGINT", 3, "runs/a b/checkpoint-3")
    assert stopped.exit_code == EXIT_INTERRUPTED and Preempted("SIGTERM", 3, "x").exit_code == PREEMPTED_EXIT_CODE
    assert stopped.line() == (
        "shardtune: SIGINT: stopping after step 3; saved runs/a b/checkpoint-3; resume with: shardtune train "
        "'my config.yaml' --nproc 2 lora.r=8 'training.resume_from_checkpoint=runs/a b/checkpoint-3'"
    )
