"""``shardtune doctor CONFIG``: can every node run this config? Checked before any model is loaded.

The command a user types (alone, with ``--nproc``, or on every node with the ``launch`` options, e.g.
once per node in an sbatch script) first checks what its workers need to start at all: the rendezvous
endpoint and port, a GPU per worker, the network interfaces; if any of these fails, it stops there.
Otherwise it starts this node's workers exactly as a run would (one process does the work itself).
The workers join one process group; one process per node checks the node; every rank takes part in
the cross-node checks (shared directories, all-reduce bandwidth); global rank 0 prints one table.
Started by torchrun or as the tasks of srun, the workers check the network interfaces themselves
first. The exit status is 1 when any check failed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.config import Config, add_config_arguments, load_config
from shardtune.doctor.report import FAIL, OK, WARN, Check, failed, format_report, plural
from shardtune.errors import InputError, positive_number_problem
from shardtune.launch.elastic import NodeSpec, add_node_arguments

if TYPE_CHECKING:
    from shardtune.distributed.env import DistributedEnv

DEFAULT_PORT = 29500  # torchrun's, and the usual rendezvous port
FRONT_CHECKS = "front.json"  # in the state directory: the launching command's checks of this node
VERDICT = "verdict"  # in the state directory: the exit status, written by a worker of this node
STOPPED = "shardtune doctor: stopped before starting the workers; fix the above, then run it again for the other checks"


def node_label() -> str:
    """This node's rank in the run, as our launcher, torchrun or Slurm number nodes ("0" for one process)."""
    for variable in ("SHARDTUNE_NODE_RANK", "GROUP_RANK", "SLURM_NODEID"):
        if variable in os.environ:
            return os.environ[variable]
    return "0"


def shared_dir_checks(config: Config, env: DistributedEnv, rows: list[Check], timeout_s: float) -> list[Check]:
    """Whether the output and cache directories are one filesystem for all nodes (a collective).

    Global rank 0 leaves a marker file that the other ranks look for. A directory that some node could
    not write is not tested: the marker could not be written or would not be found, for another reason.
    """

    from shardtune.distributed.storage import is_shared_with_rank0

    directories = [
        ("output dir", Path(config.training.output_dir), "each node saves its own checkpoint shards"),
        ("cache dir", config.data.resolved_cache_dir, "each node builds its own token store"),
    ]
    checks = []
    for name, directory, node_local in directories:
        if any(row.name == name and row.status == FAIL for row in rows):
            checks.append(Check(f"{name} shared", WARN, "not tested: the directory is not writable on every node"))
            continue
        shared = is_shared_with_rank0(env, directory, timeout_s, purpose=f"doctor-{name.replace(' ', '-')}")
        seen = env.all_gather_objects((node_label(), shared))
        nodes = sorted({node for node, _ in seen}, key=int)
        apart = sorted({node for node, same in seen if not same}, key=int)
        if not apart:
            detail = "shared (one process)"
            if env.world_size > 1:
                detail = f"shared: all {env.world_size} ranks, on {plural(len(nodes), 'node')}, see rank 0's marker"
            checks.append(Check(f"{name} shared", OK, detail))
            continue
        detail = f"node-local on node {', '.join(apart)} (no sight of node 0's marker): {node_local}"
        if name == "cache dir":
            checks.append(Check(f"{name} shared", OK, detail))
        else:
            fix = "to export, or to resume on other nodes, copy every node's checkpoint-<step>/ into one directory"
            checks.append(Check(f"{name} shared", WARN, detail, fix=fix))
    return checks


def run_checks(config: Config, timeout_s: float, front: list[Check]) -> int:
    """This process's part of the checks, as one rank of the run; 1 when any check failed, else 0.
    ``front``: this node's checks made before the process group, reported with the node's others."""

    from shardtune.cli import setup_logging
    from shardtune.distributed.env import DistributedEnv
    from shardtune.doctor.bandwidth import bandwidth_checks
    from shardtune.doctor.checks import node_checks
    from shardtune.launch.local import close_unless_worker

    setup_logging(is_main=False)
    env = DistributedEnv.from_environment(timeout_s, config.parallel.expert_parallel_size)
    try:
        host = socket.gethostname()
        mine = [check.on(node_label(), host) for check in [*front, *node_checks(config, env)]]
        # One process per node checks the node; the others only join the collectives.
        gathered = env.all_gather_objects(mine if env.local_rank == 0 else [])
        rows = [row for part in gathered for row in part or []]
        rows += shared_dir_checks(config, env, rows, timeout_s)
        rows += bandwidth_checks(env)
        if env.is_main:
            print(format_report(rows), flush=True)
        return 1 if failed(rows) else 0
    finally:
        close_unless_worker(env)


def rendezvous_checks(spec: NodeSpec, port: int, named: bool) -> list[Check]:
    """Checks of this node that must pass before its workers can meet the others."""
    from shardtune.doctor.checks import endpoint_check, port_check
    from shardtune.launch.elastic import endpoint_addresses, is_this_host

    rows = []
    hosts_store = spec.node_rank == 0
    if spec.rdzv_endpoint:
        host = spec.host_port()[0]
        addresses = endpoint_addresses(host)
        rows.append(endpoint_check(host, port, addresses))
        # The first launcher on the endpoint's machine hosts the rendezvous store there.
        hosts_store = hosts_store and is_this_host(addresses)
    if hosts_store:
        rows.append(port_check(port, required=spec.multi_node or named))
    return rows


def _is_worker(args: argparse.Namespace) -> bool:
    """A worker of a launcher (ours or torchrun), or an srun task with no node options: then each task is
    one rank. An srun task given node options is its node's launching command, as with ``launch``."""
    from shardtune.launch.local import running_as_worker

    if "RANK" in os.environ:
        return True
    return running_as_worker() and args.nnodes == 1 and not args.rdzv_endpoint


def cmd_doctor(args: argparse.Namespace) -> int:
    # Paths are checked by the nodes, each for itself, and reported in the table; bad keys stop here.
    config = load_config(args.config, args.overrides, check_paths=False)
    from shardtune.doctor.checks import interface_checks, workers_check
    from shardtune.launch.elastic import SELF_REPORTED, default_nproc, launch_node, node_spec_from_args, port_problem

    if _is_worker(args):
        state = Path(args.worker_state) if args.worker_state else None
        if state:
            front = [Check(**row) for row in json.loads((state / FRONT_CHECKS).read_text())]
        else:
            # No command above these workers (torchrun, srun tasks): they check the node first themselves.
            front = [check.on(node_label(), socket.gethostname()) for check in interface_checks(config)]
            local_rank = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
            if failed(front):
                if local_rank == "0":
                    print(f"{format_report(front)}\n{STOPPED}", flush=True)
                return 1
        status = run_checks(config, args.timeout, front)
        if state is None:
            return status
        if os.environ.get("LOCAL_RANK") == "0":
            (state / VERDICT).write_text(str(status))
        # The verdict travels by file: a worker exiting non-zero would read as a crash to the launcher.
        return 0

    if problem := positive_number_problem("--timeout", args.timeout):
        raise InputError(problem)
    if args.port is not None and (problem := port_problem("--port", args.port)):
        raise InputError(problem)
    # A failed check is a finding, not a crash for the launcher to retry.
    spec = replace(node_spec_from_args(args), max_restarts=0)
    endpoint_port = spec.host_port()[1] if spec.rdzv_endpoint else None
    if args.port is not None and endpoint_port is not None and args.port != endpoint_port:
        raise InputError(f"--port {args.port} differs from the --rdzv-endpoint's port {endpoint_port}; drop one")
    port = args.port or endpoint_port or DEFAULT_PORT
    nproc = spec.nproc_per_node or default_nproc()
    front = [*rendezvous_checks(spec, port, args.port is not None), workers_check(nproc), *interface_checks(config)]
    front = [check.on(str(spec.node_rank), socket.gethostname()) for check in front]
    if failed(front):
        # Workers that cannot meet, cannot each have a GPU or cannot open a socket would fail less clearly.
        print(f"{format_report(front)}\n{STOPPED}", flush=True)
        return 1
    if not spec.multi_node and nproc == 1:
        return run_checks(config, args.timeout, front)
    from shardtune.cli import setup_logging

    setup_logging(is_main=True)  # the launcher says who it waits for (the other nodes, the rendezvous store)
    with tempfile.TemporaryDirectory(prefix="shardtune-doctor-") as state:
        Path(state, FRONT_CHECKS).write_text(json.dumps([asdict(check) for check in front]))
        worker = ["doctor", args.config, *args.overrides, "--timeout", str(args.timeout), "--worker-state", state]
        status = launch_node(replace(spec, nproc_per_node=nproc), worker, config.network)
        verdict = Path(state, VERDICT)
        if verdict.is_file():
            return int(verdict.read_text())
    if status in SELF_REPORTED:
        return status  # the workers said why, in one line (bad input, Ctrl-C, ...)
    print(
        f"shardtune doctor: the workers stopped before reporting (exit {status}); see their errors above",
        file=sys.stderr,
    )
    return status or 1


def add_doctor_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``doctor`` on the ``shardtune`` sub-command parsers; returns its parser."""
    doctor = commands.add_parser(
        "doctor",
        help="preflight: check that every node can run this config",
        description="Per node: devices, backends, network interface, rendezvous port, model and data paths, "
        "writable and shared output and cache directories, free disk, estimated memory per device; across "
        "ranks: all-reduce bandwidth. Prints a table; exits with 1 when any check failed. Run it as you would "
        "run the training: alone, with --nproc, or on every node with the launch options.",
    )
    add_config_arguments(doctor)
    doctor.add_argument(
        "--nproc", dest="nproc_per_node", type=int, default=argparse.SUPPRESS, metavar="N", help="as --nproc-per-node"
    )
    doctor.add_argument(
        "--port", type=int, default=None, help="rendezvous port to check (default: --rdzv-endpoint's, else 29500)"
    )
    doctor.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long ranks wait for each other (default 300)",
    )
    doctor.add_argument("--worker-state", default=None, help=argparse.SUPPRESS)
    add_node_arguments(doctor)
    doctor.set_defaults(handler=cmd_doctor)
    return doctor
