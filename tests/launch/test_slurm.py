"""``shardtune slurm``: the sbatch script it writes, and that script run for real on a two-node Slurm
cluster (two slurmd on this host, gloo, one CPU worker per node), through a preemption and requeue."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from slurm_cluster import SlurmCluster, local_slurm_cluster, unavailable_reason

from shardtune.cli import main
from shardtune.config import load_config

QUICKSTART = str(REPO / "examples" / "quickstart.yaml")


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    """Paths in the quickstart config are relative to the repository root, as for every command."""
    monkeypatch.chdir(REPO)


def sbatch_options(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def slurm(tmp_path: Path, *options: str) -> int:
    return main(["slurm", QUICKSTART, f"training.output_dir={tmp_path / 'run'}", *options])


def test_gpu_job_script(tmp_path, capsys):
    assert slurm(tmp_path, "network.ib=false", "network.socket_ifname=ib0", "--nodes", "4", "--gpus-per-node", "8",
                 "--cpus-per-task", "96", "--partition", "gpu", "--time", "2-00:00:00", "--account", "proj",
                 "--sbatch=--mem=0", "--sbatch", "#SBATCH --exclusive", "--port", "29600",
                 "--signal-seconds", "600", "--max-restarts", "2") == 0  # fmt: skip
    out = capsys.readouterr()
    slurm_dir = tmp_path / "run" / "slurm"
    script = (slurm_dir / "job.sbatch").read_text()
    assert out.out == script and f"sbatch {slurm_dir / 'job.sbatch'}" in out.err
    assert sbatch_options(script) == [
        "--job-name=shardtune-run", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=96",
        "--partition=gpu", "--time=2-00:00:00", "--account=proj", f"--chdir={REPO}",
        f"--output={slurm_dir}/%j.out", "--open-mode=append", "--signal=USR1@600", "--requeue", "--mem=0",
        "--exclusive",
    ]  # fmt: skip
    srun = re.search(r"^srun .*?&$", script, re.MULTILINE | re.DOTALL).group(0)
    assert srun.startswith('srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task=96 ')
    assert "--kill-on-bad-exit=1" in srun and '--node-rank "$SLURM_NODEID"' in srun
    launch = " ".join(srun.replace("\\\n", " ").split())  # one line, without the continuations
    assert f'{sys.executable} -m shardtune launch --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node 8 ' in launch
    assert '--rdzv-endpoint "$head_addr:29600" --rdzv-id "$SLURM_JOB_ID" --max-restarts 2 ' in launch
    assert launch.endswith(f"{slurm_dir / 'config.yaml'} &")
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in script
    # The network section, shown as the variables shardtune launch sets on every worker.
    for name, value in [("NCCL_SOCKET_IFNAME", "ib0"), ("GLOO_SOCKET_IFNAME", "ib0"), ("NCCL_IB_DISABLE", "1")]:
        assert f"export_default {name} {value}\n" in script
    # Exit status 75 (preempted, checkpoint committed) requeues; the requeued job resumes.
    assert 'if [ "$status" -eq 75 ]; then' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    # The requeued job tells its workers it is one (they carry on from the run's newest checkpoint), leaving the
    # config as it is: a run resumed from another directory's checkpoint starts from it again if it saved none.
    assert "\nexport SHARDTUNE_REQUEUE_COUNT=${SLURM_RESTART_COUNT:-0}\n" in script and "$resume" not in script
    assert subprocess.run(["bash", "-n", str(slurm_dir / "job.sbatch")]).returncode == 0


def test_cpu_job_script_and_the_config_it_runs(tmp_path, capsys):
    overrides = [f"training.output_dir={tmp_path / 'run'}", "training.max_steps=7", "lora.r=4"]
    assert main(["slurm", QUICKSTART, *overrides, "--nodes", "2", "--workers-per-node", "3"]) == 0
    script = capsys.readouterr().out
    options = sbatch_options(script)
    # CPU-only: no GPUs asked for, one core per worker, and srun is told the same.
    assert "--nodes=2" in options and "--cpus-per-task=3" in options
    assert not any(option.startswith(("--gpus", "--partition", "--time", "--account")) for option in options)
    assert "--ntasks-per-node=1 --cpus-per-task=3 --kill-on-bad-exit=1" in script
    assert "--nproc-per-node 3 " in script and '--rdzv-endpoint "$head_addr:29500"' in script
    # The job runs the resolved config (overrides included), which loads back as the same config.
    copied = load_config(tmp_path / "run" / "slurm" / "config.yaml")
    assert copied == load_config(QUICKSTART, overrides)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--nodes", "0"], "--nodes: must be at least 1, got 0"),
        (["--nodes", "2", "--gpus-per-node", "4", "--workers-per-node", "2"], "--workers-per-node: only for CPU-only"),
        (["--nodes", "2", "--workers-per-node", "0"], "--workers-per-node: must be at least 1"),
        (["--nodes", "2", "--time", "4h"], "--time: '4h' is not a Slurm time"),
        (["--nodes", "2", "--sbatch", "mem=4G"], "--sbatch: 'mem=4G' is not an sbatch option"),
        (["--nodes", "2", "--port", "70000"], "--port: must be in 1..65535"),
        (["--nodes", "2", "--signal-seconds", "0"], "--signal-seconds: must be in 1..65535"),
        (["--nodes", "2", "training.output_dir=a b"], "b holds a character an sbatch script cannot carry"),
        (
            ["--nodes", "2", "training.max_step=3"],
            "training.max_step: unknown key (did you mean 'training.max_steps'?)",
        ),
    ],
)
def test_bad_input_exits_2_naming_the_option(tmp_path, capsys, options, message):
    assert slurm(tmp_path, *options) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_directory_holding_a_run_is_refused_before_the_queue(tmp_path, capsys):
    (tmp_path / "run" / "logs").mkdir(parents=True)
    (tmp_path / "run" / "run_args.json").write_text("{}")  # what marks it as a shardtune run's
    keep = ["--nodes", "2", "training.overwrite_output_dir=false"]
    assert slurm(tmp_path, *keep) == 2
    assert "already holds a run (logs, run_args.json)" in capsys.readouterr().err
    assert slurm(tmp_path, *keep, "training.resume_from_checkpoint=auto") == 0  # continuing it is fine


def test_a_directory_a_run_is_training_in_is_refused_before_the_queue(tmp_path, capsys):
    """A job continuing a run that is still training would find the directory locked only once it left the queue,
    and writing its script would replace the running job's."""
    from shardtune.run_lock import RunLock

    run = tmp_path / "run"
    script = run / "slurm" / "job.sbatch"
    assert slurm(tmp_path, "--nodes", "2", "training.resume_from_checkpoint=auto") == 0
    running = script.read_text()  # the running job's script
    capsys.readouterr()
    lock = RunLock.take(run)
    try:
        assert slurm(tmp_path, "--nodes", "3", "training.resume_from_checkpoint=auto") == 2
        error = capsys.readouterr().err
        assert re.fullmatch(
            rf"shardtune: error: training.output_dir: {re.escape(str(run))} is in use by another run \(host "
            rf"{re.escape(socket.gethostname())}, pid {os.getpid()}, started [\dT:+-]+\); wait for it to end, or "
            r"choose another output_dir\n",
            error,
        )
        assert script.read_text() == running
    finally:
        lock.release()
    assert slurm(tmp_path, "--nodes", "3", "training.resume_from_checkpoint=auto") == 0  # once it has ended
    assert "#SBATCH --nodes=3\n" in script.read_text()


def test_the_job_files_are_written_again_and_an_edited_or_foreign_one_only_with_overwrite(tmp_path, capsys):
    """The script invites edits (its network exports); writing the job again replaced them, and any file of the
    name, without a word."""
    slurm_dir = tmp_path / "run" / "slurm"
    script, config = slurm_dir / "job.sbatch", slurm_dir / "config.yaml"
    assert slurm(tmp_path, "--nodes", "2") == 0
    assert slurm(tmp_path, "--nodes", "3") == 0  # as it wrote them: replaced
    assert "#SBATCH --nodes=3\n" in script.read_text()
    capsys.readouterr()

    def refused(*paths: Path) -> list[str]:
        return [
            f"shardtune: error: {path}: not as shardtune slurm wrote it (edited since, or not its own); pass "
            "--overwrite to replace it, or choose another training.output_dir"
            for path in paths
        ]

    edited = script.read_text().replace("set -uo pipefail\n", "set -uo pipefail\nmodule load nccl\n")
    script.write_text(edited)
    assert slurm(tmp_path, "--nodes", "2") == 2
    assert capsys.readouterr().err.splitlines() == refused(script)
    config.write_text(config.read_text() + "# tuned by hand\n")
    assert slurm(tmp_path, "--nodes", "2") == 2
    assert capsys.readouterr().err.splitlines() == refused(script, config)
    assert script.read_text() == edited and config.read_text().endswith("# tuned by hand\n")
    assert slurm(tmp_path, "--nodes", "2", "--overwrite") == 0
    assert "module load" not in script.read_text() and "#SBATCH --nodes=2\n" in script.read_text()
    assert load_config(config) == load_config(QUICKSTART, [f"training.output_dir={tmp_path / 'run'}"])
    capsys.readouterr()

    # A project's own slurm/ that no `shardtune slurm` wrote.
    own = tmp_path / "project"
    (own / "slurm").mkdir(parents=True)
    (own / "slurm" / "config.yaml").write_text("partition: gpu\n")
    assert main(["slurm", QUICKSTART, f"training.output_dir={own}", "--nodes", "2"]) == 2
    assert capsys.readouterr().err.splitlines() == refused(own / "slurm" / "config.yaml")
    assert sorted(path.name for path in (own / "slurm").iterdir()) == ["config.yaml"]


def test_an_output_dir_the_job_cannot_be_written_into_is_one_line(tmp_path, capsys):
    (tmp_path / "run").write_text("a file, not a directory\n")
    assert slurm(tmp_path, "--nodes", "2") == 2
    assert capsys.readouterr().err == (
        f"shardtune: error: training.output_dir: cannot write {tmp_path / 'run' / 'slurm'} (Not a directory); set "
        "training.output_dir to a directory this user can create and write (on every node)\n"
    )


def test_submit_without_sbatch_says_so_and_leaves_the_script(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert slurm(tmp_path, "--nodes", "2", "--submit") == 2
    error = capsys.readouterr().err
    script = tmp_path / "run" / "slurm" / "job.sbatch"
    assert "--submit: sbatch is not on PATH" in error and f"sbatch {script}" in error and script.is_file()


# ---- A real cluster: two slurmd on this host ---------------------------------------------------------------

MAX_STEPS = 200
TRAINING = [
    f"training.max_steps={MAX_STEPS}", "training.logging_steps=1", "training.per_device_train_batch_size=2",
    "training.eval_on_start=false", "training.eval_steps=null", "lora.lora_dropout=0",
    "training.checkpoint_mode=full", "training.save_steps=1000",
]  # fmt: skip
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with local_slurm_cluster() as running:
        yield running


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One token store for every run of this module: built once, then reused."""
    return tmp_path_factory.mktemp("cache")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def submit(cluster: SlurmCluster, out: Path, cache_dir: Path) -> str:
    """``shardtune slurm --submit`` for a 2-node CPU job of the quickstart; returns the job id."""
    command = [
        sys.executable, "-m", "shardtune", "slurm", QUICKSTART, f"training.output_dir={out}",
        f"data.cache_dir={cache_dir}", *TRAINING, "--nodes", "2", "--port", str(free_port()), "--submit",
    ]  # fmt: skip
    # A node that never joins is named in the job's output within the join timeout, well before the
    # test's own (JOB_TIMEOUT_S), so that a failure shows why.
    env = {**cluster.env, "OMP_NUM_THREADS": "1", "SHARDTUNE_JOIN_TIMEOUT": "120"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip()
    cluster.submitted.append(job_id)
    return job_id


def job_log(out: Path, job_id: str) -> str:
    return (out / "slurm" / f"{job_id}.out").read_text()


def logged_steps(out: Path) -> list[dict]:
    path = out / "logs" / "train_log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory, cache_dir) -> list[float]:
    """The same global batch in one process: two micro-batches accumulated instead of two nodes."""
    out = tmp_path_factory.mktemp("single") / "run"
    command = [
        sys.executable, "-m", "shardtune", "train", QUICKSTART, "--nproc", "1", f"training.output_dir={out}",
        f"data.cache_dir={cache_dir}", *TRAINING, "training.gradient_accumulation_steps=2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [step["loss"] for step in logged_steps(out)]


def test_sbatch_refusal_is_reported(cluster, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    assert slurm(tmp_path, "--nodes", "2", "--partition", "nosuch", "--submit") == 1
    error = capsys.readouterr().err
    assert f"sbatch {tmp_path / 'run' / 'slurm' / 'job.sbatch'} failed (exit 1)" in error and "nosuch" in error


@pytest.mark.variants
def test_two_node_job_trains_like_one_process(cluster, tmp_path, cache_dir, single_process_losses):
    out = tmp_path / "run"
    job_id = submit(cluster, out, cache_dir)
    job = cluster.wait_finished(job_id, JOB_TIMEOUT_S)
    log = job_log(out, job_id)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", log[-5000:]
    assert [step["loss"] for step in logged_steps(out)] == pytest.approx(single_process_losses, rel=1e-5)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == MAX_STEPS
    assert "node 0 of 2" in log and "node 1 of 2" in log
    assert (out / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    "scancel_options",
    [
        # What Slurm sends before the time limit (--signal=USR1@...), here at once: SIGUSR1 to every task.
        pytest.param([], id="to-the-tasks"),
        # To the batch shell only: its trap passes the signal on to the tasks through srun.
        pytest.param(["--batch"], id="to-the-batch-shell", marks=pytest.mark.variants),
    ],
)
def test_signalled_job_checkpoints_requeues_and_resumes(
    cluster, tmp_path, cache_dir, single_process_losses, scancel_options
):
    out = tmp_path / "run"
    job_id = submit(cluster, out, cache_dir)
    cluster.wait(job_id, lambda job: len(logged_steps(out)) >= 3, JOB_TIMEOUT_S, "third training step")
    cluster.run("scancel", *scancel_options, "--signal=USR1", job_id)

    job = cluster.wait_finished(job_id, JOB_TIMEOUT_S)
    log = job_log(out, job_id)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", log[-5000:]
    assert job["Restarts"] == "1", log[-5000:]
    assert "start 1" in log and "requeueing job" in log and "start 2" in log
    # The preemption committed a full checkpoint before the end; the requeued job resumed from it.
    steps = sorted(int(path.name.split("-")[1]) for path in out.glob("checkpoint-*"))
    assert len(steps) == 2 and 3 <= steps[0] < MAX_STEPS and steps[1] == MAX_STEPS, steps
    manifest = json.loads((out / f"checkpoint-{steps[0]}" / "manifest.json").read_text())
    assert manifest["mode"] == "full" and manifest["world_size"] == 2
    assert f"resumed from {out / f'checkpoint-{steps[0]}'}" in log
    # An exact resume: every step logged once, with the losses of an uninterrupted run.
    logged = logged_steps(out)
    assert [step["step"] for step in logged] == list(range(1, MAX_STEPS + 1))
    assert [step["loss"] for step in logged] == pytest.approx(single_process_losses, rel=1e-5)
    assert (out / "final" / "adapter_model.safetensors").is_file()
