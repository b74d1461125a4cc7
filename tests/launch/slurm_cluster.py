"""A real Slurm cluster for the tests: two slurmd "nodes" on this host, started by ``.ci/slurm-up``.

Tests talk to it only through Slurm's own commands (sbatch, scontrol, scancel), with ``SLURM_CONF``
pointing at its config; jobs inherit that environment, so ``scontrol`` inside a job script finds it too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SLURM_UP = REPO / ".ci" / "slurm-up"
# Where .ci/run starts the cluster too (slurm-up's default), so a running one is found and reused.
CLUSTER_DIR = Path("/tmp/shardtune-slurm")
_COMMANDS = ("sbatch", "scontrol", "scancel", "sinfo", "slurmctld", "slurmd", "munged")
_FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def unavailable_reason() -> str | None:
    """Why no local cluster can be started here, or None."""
    missing = [name for name in _COMMANDS if shutil.which(name) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing; .ci/run installs slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "starting a local Slurm cluster needs root (slurmd runs jobs as their user)"
    return None


class SlurmCluster:
    """Submit, watch and signal jobs on the local cluster."""

    def __init__(self, directory: Path):
        self.env = {**os.environ, "SLURM_CONF": str(directory / "slurm.conf")}
        self.submitted: list[str] = []

    def run(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60, check=True)

    def responds(self) -> bool:
        try:
            return bool(self.run("sinfo", "-h", "-o", "%t").stdout.strip())
        except (subprocess.SubprocessError, OSError):
            return False

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...); finished jobs stay listed."""
        fields = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout.split()
        return dict(field.split("=", 1) for field in fields if "=" in field)

    def wait(self, job_id: str, done: Callable[[dict[str, str]], bool], timeout_s: float, what: str) -> dict[str, str]:
        """Poll the job until ``done(job)``. After ``timeout_s`` the job is cancelled (so that it does not
        hold the nodes the next test needs) and the error names ``what``, the job's state, the nodes'
        states and the end of the job's output."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if done(job):
                return job
            if time.monotonic() > deadline:
                nodes = self.run("sinfo", "-N", "-h", "-o", "%N %t %E").stdout.strip()
                self.run("scancel", job_id)
                output = Path(job.get("StdOut", ""))
                tail = output.read_text()[-6000:] if output.is_file() else f"(no output file {output})"
                raise TimeoutError(
                    f"job {job_id}: no {what} within {timeout_s:.0f} s (cancelled): {job}\n"
                    f"nodes: {nodes}\njob output:\n{tail}"
                )
            time.sleep(0.5)

    def wait_finished(self, job_id: str, timeout_s: float) -> dict[str, str]:
        return self.wait(job_id, lambda job: job.get("JobState") in _FINISHED, timeout_s, "end")

    def cancel_unfinished(self) -> None:
        for job_id in self.submitted:
            if self.job(job_id).get("JobState") not in _FINISHED:
                self.run("scancel", job_id)


@contextmanager
def local_slurm_cluster(directory: Path = CLUSTER_DIR) -> Iterator[SlurmCluster]:
    """The cluster under ``directory``: reused if it is up, else started here and stopped afterwards."""
    cluster = SlurmCluster(directory)
    started_here = not cluster.responds()
    if started_here:
        subprocess.run([str(SLURM_UP), str(directory)], check=True, timeout=300)
    try:
        yield cluster
    finally:
        cluster.cancel_unfinished()
        if started_here:
            subprocess.run([str(SLURM_UP), "--stop", str(directory)], check=True, timeout=120)
