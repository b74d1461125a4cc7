"""``shardtune slurm``: an sbatch script for a run on N nodes, written into the run directory.

The script is meant to be read: every line that is not obvious says why it is there. It runs one
``shardtune launch`` per node through ``srun``; the nodes meet at the first node of the allocation.
Preemption is a round trip: SIGUSR1 (Slurm's warning before the time limit, or ``scancel
--signal=USR1``) makes every rank stop at the same step with a full checkpoint, ``shardtune launch``
exits with ``PREEMPTED_EXIT_CODE``, the script requeues the job, and the requeued job resumes from
that checkpoint.

SIGUSR1, not SIGTERM, is the signal to stop with a checkpoint: a SIGTERM sent to the whole job (a
plain ``scancel``, the end of the time limit) also reaches ``srun``, which kills its tasks at once.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from shardtune.atomic import write_atomic
from shardtune.config import Config, add_config_arguments, dump_config, load_config
from shardtune.errors import InputError
from shardtune.launch.elastic import port_problem
from shardtune.launch.network import network_environment
from shardtune.run_dir import output_dir_problem
from shardtune.train.preemption import PREEMPTED_EXIT_CODE

DEFAULT_PORT = 29500
DEFAULT_SIGNAL_SECONDS = 300

# Slurm's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; or no limit.
_TIME = re.compile(r"(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2}|infinite|unlimited)", re.IGNORECASE)
# What a path in the script may hold: it is written into shell code and #SBATCH lines unquoted.
_SAFE_PATH = re.compile(r"[\w./+@,:=-]+")


@dataclass(frozen=True)
class SlurmJob:
    """What the job asks Slurm for, and how each node's ``shardtune launch`` is told to start."""

    nodes: int
    gpus_per_node: int = 0  # 0: a CPU-only job
    workers_per_node: int = 1  # one per GPU on GPU nodes
    cpus_per_task: int | None = None  # the CPUs of the one task per node, shared by its workers
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    job_name: str = "shardtune"
    extra_sbatch: tuple[str, ...] = ()
    port: int = DEFAULT_PORT
    signal_seconds: int = DEFAULT_SIGNAL_SECONDS
    max_restarts: int = 0


@dataclass(frozen=True)
class JobFiles:
    """Where the job's files live; all absolute, because the job runs on other machines."""

    run_dir: Path  # training.output_dir
    workdir: Path  # the directory relative paths in the config are relative to
    python: str  # the interpreter every node runs shardtune with

    @property
    def slurm_dir(self) -> Path:
        return self.run_dir / "slurm"

    @property
    def script(self) -> Path:
        return self.slurm_dir / "job.sbatch"

    @property
    def config(self) -> Path:
        return self.slurm_dir / "config.yaml"


# The script after its #SBATCH lines; {{name}} marks a value filled in by render_sbatch.
_BODY = r"""
# No `set -e`: the training step's exit status is looked at below.
set -uo pipefail
start=$((${SLURM_RESTART_COUNT:-0} + 1))
echo "shardtune: $(date --iso-8601=seconds) job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, start $start"

# The nodes meet at the first node of the allocation, at the address Slurm reaches it by
# (a node's name need not resolve on the other nodes; its NodeAddr does).
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
head_addr=$(scontrol show node "$head_node" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
head_addr=${head_addr:-$head_node}
{{network}}
# A requeued job (SLURM_RESTART_COUNT > 0) carries on from the newest complete checkpoint of its
# output directory, such as the one its preemption committed; with none yet, it starts as configured.
export SHARDTUNE_REQUEUE_COUNT=${SLURM_RESTART_COUNT:-0}

# One `shardtune launch` per node. `bash -c` adds --node-rank inside each task, where SLURM_NODEID
# is that node's index in the allocation (0 is the node the others meet at).
# --kill-on-bad-exit: when one node fails, the others stop instead of waiting in a collective.{{srun_cpus_why}}
# It runs in the background so that this shell can pass on signals while it waits.
srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1{{srun_cpus}} --kill-on-bad-exit=1 \
    bash -c 'exec "$@" --node-rank "$SLURM_NODEID"' shardtune-node \
    {{python}} -m shardtune launch \
        --nnodes "$SLURM_JOB_NUM_NODES" \
        --nproc-per-node {{workers}} \
        --rdzv-endpoint "$head_addr:{{port}}" \
        --rdzv-id "$SLURM_JOB_ID" \
        --max-restarts {{max_restarts}} \
        {{config}} &
step=$!

# Slurm signals the tasks itself (--signal above, `scancel --signal=USR1`). A SIGUSR1 sent to this
# shell only (`scancel --batch`, `--full`) goes on to the tasks through srun: without this trap it
# would end the shell, and with it the job, before the checkpoint.
trap 'echo "shardtune: SIGUSR1 to the batch shell, passed on to the tasks"; kill -USR1 "$step"' USR1
# `wait` also returns when a trap has run: wait until srun has ended, then take its status.
while kill -0 "$step" 2>/dev/null; do wait "$step"; done
wait "$step"
status=$?

if [ "$status" -eq {{preempted}} ]; then
    # {{preempted}}: every rank stopped at the same step and a full checkpoint was committed.
    echo "shardtune: stopped with a checkpoint; requeueing job $SLURM_JOB_ID to resume from it"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
    echo "shardtune: scontrol requeue failed; to resume, submit again with training.resume_from_checkpoint=auto" >&2
fi
exit "$status"
"""


def render_sbatch(job: SlurmJob, files: JobFiles, network_env: dict[str, str]) -> str:
    """The sbatch script's text."""
    if job.gpus_per_node:
        shape = f"{job.nodes} node(s) x {job.gpus_per_node} GPU(s)"
    else:
        shape = f"{job.nodes} node(s) x {job.workers_per_node} CPU worker(s)"
    header = [
        "#!/bin/bash",
        f"# shardtune: {job.job_name} on {shape}, written by `shardtune slurm`.",
        f"#   submit:  sbatch {files.script}",
        f"#   log:     {files.slurm_dir}/<job id>.out",
        "#   stop with a checkpoint, then requeue and resume:  scancel --signal=USR1 <job id>",
        "#",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        "# One task per node: `shardtune launch`, which starts that node's workers.",
        "#SBATCH --ntasks-per-node=1",
    ]
    if job.gpus_per_node:
        header.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_task:
        header.append(f"#SBATCH --cpus-per-task={job.cpus_per_task}")
    for option, value in (("partition", job.partition), ("time", job.time), ("account", job.account)):
        if value:
            header.append(f"#SBATCH --{option}={value}")
    header += [
        "# Relative paths in the config are relative to the directory `shardtune slurm` ran in.",
        f"#SBATCH --chdir={files.workdir}",
        f"#SBATCH --output={files.slurm_dir}/%j.out",
        "# A requeued job keeps its id and its log: append to the log instead of truncating it.",
        "#SBATCH --open-mode=append",
        f"# SIGUSR1 to every task {job.signal_seconds} s before the time limit: checkpoint at the next step, stop.",
        f"#SBATCH --signal=USR1@{job.signal_seconds}",
        "# Allow the requeue after a preemption checkpoint (some clusters default to --no-requeue).",
        "#SBATCH --requeue",
    ]
    if job.extra_sbatch:
        header.append("# Given with --sbatch:")
        header += [f"#SBATCH {line}" for line in job.extra_sbatch]

    network = ""
    if network_env:
        network = "\n".join(
            [
                "",
                "# The config's network settings. shardtune launch gives every worker the same ones; they are",
                "# here to be seen (and edited). As there, a variable already in the environment wins.",
                'export_default() { [ -n "${!1+set}" ] || export "$1=$2"; }',
                *(f"export_default {shlex.quote(name)} {shlex.quote(value)}" for name, value in network_env.items()),
                "",
            ]
        )
    values = {
        "network": network,
        "srun_cpus": f" --cpus-per-task={job.cpus_per_task}" if job.cpus_per_task else "",
        "srun_cpus_why": "\n# srun does not take --cpus-per-task over from the job (Slurm 22.05+): it is repeated."
        if job.cpus_per_task
        else "",
        "python": files.python,
        "workers": str(job.workers_per_node),
        "port": str(job.port),
        "max_restarts": str(job.max_restarts),
        "config": str(files.config),
        "preempted": str(PREEMPTED_EXIT_CODE),
    }
    body = re.sub(r"\{\{(\w+)\}\}", lambda match: values[match.group(1)], _BODY)
    return "\n".join(header) + "\n" + body


# The script's third line: the sha256 of the script (without that line) and of config.yaml as ``write_job`` wrote
# them. Written again, they replace the job's files only while both still read so: an edit (the script invites
# one) or a file of their name that shardtune did not write is replaced only with --overwrite.
_AS_WRITTEN = re.compile(r"^# as written: job\.sbatch ([0-9a-f]{16}), config\.yaml ([0-9a-f]{16}) .*\n", re.MULTILINE)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read(path: Path) -> str | None:
    """The text of ``path``; None when nothing is there; "" when what is there does not read as text."""
    if not os.path.lexists(path):
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""


def changed_job_files(files: JobFiles) -> list[Path]:
    """The job's files there that are not as ``write_job`` wrote them: edited since, or never written by it."""
    script, config = _read(files.script), _read(files.config)
    record = _AS_WRITTEN.search(script or "")
    if record is None:
        return [path for path, text in ((files.script, script), (files.config, config)) if text is not None]
    body = _AS_WRITTEN.sub("", script, count=1)
    changed = [files.script] if _digest(body) != record[1] else []
    return changed + ([files.config] if config is not None and _digest(config) != record[2] else [])


def write_job(config: Config, job: SlurmJob, overwrite: bool = False) -> JobFiles:
    """Write ``<output_dir>/slurm/config.yaml`` (the resolved config) and ``job.sbatch`` next to it. The job
    runs in the current directory, with this Python interpreter. Files there that are not as this wrote them
    (``changed_job_files``) are replaced only with ``overwrite``."""
    workdir = Path.cwd().resolve()
    files = JobFiles(run_dir=workdir / config.training.output_dir, workdir=workdir, python=sys.executable)
    problems = [
        f"{name}: {path} holds a character an sbatch script cannot carry unquoted (space, quote, ...); "
        "choose a path without one"
        for name, path in (
            ("training.output_dir", files.run_dir),
            ("working directory", files.workdir),
            ("python interpreter", files.python),
        )
        if not _SAFE_PATH.fullmatch(str(path))
    ]
    if problems:
        raise InputError(problems)
    from shardtune.train.preflight import check_writable  # imports torch: not for every command's parser

    check_writable("training.output_dir", files.slurm_dir)
    if not overwrite and (changed := changed_job_files(files)):
        raise InputError(
            [
                f"{path}: not as shardtune slurm wrote it (edited since, or not its own); pass --overwrite to "
                "replace it, or choose another training.output_dir"
                for path in changed
            ]
        )
    config_text = dump_config(config)
    script = render_sbatch(job, files, network_environment(config.network))
    shebang, title, rest = script.split("\n", 2)
    as_written = (
        f"# as written: job.sbatch {_digest(script)}, config.yaml {_digest(config_text)} (sha256; shardtune "
        "slurm replaces an edited one only with --overwrite)"
    )
    files.slurm_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(files.config, config_text)
    write_atomic(files.script, "\n".join([shebang, title, as_written, rest]))
    files.script.chmod(0o755)
    return files


class SubmitError(RuntimeError):
    """sbatch refused the job; its message says why."""


def submit(script: Path) -> str:
    """``sbatch`` the script; returns the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise InputError(
            f"--submit: sbatch is not on PATH (is this a Slurm login node?); the script is written: sbatch {script}"
        )
    result = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True)
    if result.returncode != 0:
        raise SubmitError(f"sbatch {script} failed (exit {result.returncode}): {result.stderr.strip()}")
    # --parsable prints "<job id>" or "<job id>;<cluster>".
    return result.stdout.strip().split(";")[0]


def job_from_args(args: argparse.Namespace, config: Config) -> SlurmJob:
    """A SlurmJob from the command line; every bad option is named, all at once."""
    problems = []
    if args.nodes < 1:
        problems.append(f"--nodes: must be at least 1, got {args.nodes}")
    if args.gpus_per_node < 0:
        problems.append(f"--gpus-per-node: must be 0 (CPU-only nodes) or more, got {args.gpus_per_node}")
    if args.workers_per_node is not None:
        if args.gpus_per_node > 0:
            problems.append("--workers-per-node: only for CPU-only jobs; with --gpus-per-node each GPU gets a worker")
        elif args.workers_per_node < 1:
            problems.append(f"--workers-per-node: must be at least 1, got {args.workers_per_node}")
    if args.cpus_per_task is not None and args.cpus_per_task < 1:
        problems.append(f"--cpus-per-task: must be at least 1, got {args.cpus_per_task}")
    if args.time is not None and not _TIME.fullmatch(args.time):
        problems.append(
            f"--time: {args.time!r} is not a Slurm time (minutes, HH:MM:SS, D-HH:MM:SS, ...; e.g. 04:00:00)"
        )
    for option in ("partition", "account", "job_name"):
        value = getattr(args, option)
        if value is not None and not re.fullmatch(r"[\w.,:+@-]+", value):
            problems.append(f"--{option.replace('_', '-')}: {value!r} is not a Slurm name")
    if problem := port_problem("--port", args.port):
        problems.append(problem)
    if not 0 < args.signal_seconds < 65536:
        problems.append(f"--signal-seconds: must be in 1..65535, got {args.signal_seconds}")
    if args.max_restarts < 0:
        problems.append(f"--max-restarts: must be 0 or more, got {args.max_restarts}")
    extra = []
    for line in args.sbatch:
        option = line.strip().removeprefix("#SBATCH").strip()
        if not option.startswith("-") or "\n" in option:
            problems.append(f"--sbatch: {line!r} is not an sbatch option (e.g. --mem=200G)")
        extra.append(option)
    if problems:
        raise InputError(problems)

    gpu_job = args.gpus_per_node > 0
    workers = args.gpus_per_node if gpu_job else (args.workers_per_node or 1)
    # CPU-only: at least one core per worker; GPU nodes: the cluster's default unless told.
    cpus_per_task = args.cpus_per_task if (args.cpus_per_task or gpu_job) else workers
    return SlurmJob(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        workers_per_node=workers,
        cpus_per_task=cpus_per_task,
        partition=args.partition,
        time=args.time,
        account=args.account,
        job_name=args.job_name or f"shardtune-{Path(config.training.output_dir).name}",
        extra_sbatch=tuple(extra),
        port=args.port,
        signal_seconds=args.signal_seconds,
        max_restarts=args.max_restarts,
    )


def check_run_dir_is_free(config: Config) -> None:
    """Refuse now, not after the job waited in the queue, what ``shardtune train`` would refuse at its start: a
    run still training there (its lock; the job's script would also replace that run's), or a finished one the
    config neither continues nor replaces."""
    problem = output_dir_problem(config.training)
    if problem:
        raise InputError(problem)


def cmd_slurm(args: argparse.Namespace) -> int:
    """Write the job's script (and the resolved config) into the run directory; print it or submit it."""
    config = load_config(args.config, args.overrides)
    job = job_from_args(args, config)
    check_run_dir_is_free(config)
    files = write_job(config, job, args.overwrite)
    if not args.submit:
        print(files.script.read_text(), end="")
        print(f"shardtune: wrote {files.script}; submit it with: sbatch {files.script}", file=sys.stderr)
        return 0
    try:
        job_id = submit(files.script)
    except SubmitError as error:
        print(f"shardtune: error: {error}", file=sys.stderr)
        return 1
    print(job_id)
    print(f"shardtune: submitted {files.script} as job {job_id}; log: {files.slurm_dir / job_id}.out", file=sys.stderr)
    return 0


def add_slurm_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``slurm`` on the ``shardtune`` sub-command parsers; returns its parser."""
    slurm = commands.add_parser(
        "slurm",
        help="write (and submit) an sbatch script that runs a config on a Slurm cluster",
        description="Write <training.output_dir>/slurm/job.sbatch and print it, or submit it with --submit. "
        "The job runs one `shardtune launch` per node, and requeues itself after a preemption checkpoint "
        "(SIGUSR1 before the time limit, or scancel --signal=USR1).",
    )
    add_config_arguments(slurm)
    slurm.add_argument("--nodes", type=int, required=True, help="nodes to run on")
    slurm.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node, one worker each (0: CPU-only)")
    slurm.add_argument(
        "--workers-per-node", type=int, default=None, help="CPU-only jobs: worker processes per node (default 1)"
    )
    slurm.add_argument(
        "--cpus-per-task",
        type=int,
        default=None,
        help="CPUs of each node's task, shared by its workers (default: one per worker on CPU-only jobs, "
        "the cluster's default with GPUs)",
    )
    slurm.add_argument("--partition", default=None, help="Slurm partition")
    slurm.add_argument("--time", default=None, help="time limit, e.g. 04:00:00 or 2-00:00:00")
    slurm.add_argument("--account", default=None, help="Slurm account to charge")
    slurm.add_argument("--job-name", default=None, help="default: shardtune-<output_dir's name>")
    slurm.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="OPTION",
        help="one more #SBATCH line, e.g. --sbatch=--mem=200G (repeatable)",
    )
    slurm.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"rendezvous port on the first node (default {DEFAULT_PORT})"
    )
    slurm.add_argument(
        "--signal-seconds",
        type=int,
        default=DEFAULT_SIGNAL_SECONDS,
        help=f"send SIGUSR1 this long before the time limit, to checkpoint and stop (default {DEFAULT_SIGNAL_SECONDS})",
    )
    slurm.add_argument(
        "--max-restarts", type=int, default=0, help="restart a node's workers this many times after a failure"
    )
    slurm.add_argument("--submit", action="store_true", help="submit with sbatch and print the job id")
    slurm.add_argument(
        "--overwrite",
        action="store_true",
        help="replace slurm/job.sbatch and slurm/config.yaml even where they were edited since written, or are not "
        "shardtune's",
    )
    slurm.set_defaults(handler=cmd_slurm)
    return slurm
