"""Start this node's workers through torch's elastic launcher, so nobody has to type torchrun."""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("shardtune")


def running_as_worker() -> bool:
    """Started by torchrun, by our own launcher, or as one task of a multi-task srun."""
    return "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1


def default_nproc() -> int:
    """One worker per visible GPU; one process on a CPU-only machine (``--nproc`` overrides)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def launch_local_workers(nproc: int, command: list[str]) -> int:
    """Run ``python -m shardtune COMMAND...`` as ``nproc`` workers of one standalone job; its exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # torchrun pins every worker to one CPU thread unless told otherwise; CPU-side work (data
    # collation, and the optimizer step under FSDP CPU offload) then crawls. Share the cores instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    arguments = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", "--module", "shardtune", *command]
    )
    try:
        run(arguments)
    except ChildFailedError as failure:
        # The launcher has already printed each failed worker's error; name the first for the user.
        rank, error = failure.get_first_failure()
        print(f"shardtune: worker {rank} failed with exit code {error.exitcode}", file=sys.stderr)
        return error.exitcode if error.exitcode > 0 else 1
    return 0
