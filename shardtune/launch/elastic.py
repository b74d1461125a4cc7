"""Start this node's workers through torch's elastic agent: one node alone, or one of many.

Every node runs the same command (``shardtune launch``, or ``shardtune train --nproc N`` on one
machine). Nodes meet at a c10d rendezvous on ``--rdzv-endpoint``. Before the agent's rendezvous, each
node registers its node rank in the rendezvous store and waits for the others, so a node that never
comes is named (by node rank) in an error on every node that did, within ``--join-timeout``,
instead of a hang. The store is hosted by the first launcher on the endpoint's machine; torch's
rendezvous then finds it there and uses it too.

Signals: SIGTERM and SIGUSR1 to the launcher are passed on to the workers (the agent's shutdown path),
which commit a full checkpoint at the next step boundary and exit; the launcher then exits with
``PREEMPTED_EXIT_CODE``. SIGINT (a terminal's Ctrl-C) likewise; the launcher then exits 130 and adds
no line to the one the workers print. ``--max-restarts`` restarts all workers after a failure (except
bad input and the other faults every rank meets alike, exit status 2, 3 and 4, which a restart cannot
fix); restarted workers resume from the newest complete checkpoint by themselves (see ``cmd_train``).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import shlex
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass

from shardtune.config import NetworkConfig
from shardtune.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_LOST_PEER,
    EXIT_NONFINITE,
    EXIT_OUT_OF_MEMORY,
    EXIT_SAVE_FAILED,
    InputError,
    first_line,
    positive_number_problem,
)
from shardtune.launch.local import LAUNCHER_PID_VARIABLE, REPORTED_ERRORS_VARIABLE
from shardtune.launch.network import apply_network_environment
from shardtune.train.preemption import COMMAND_VARIABLE, PREEMPTED_EXIT_CODE, PREEMPTION_SIGNALS

log = logging.getLogger("shardtune")

# Statuses with which a worker stops after saying why in one line, once per launch (every worker alike, or
# the workers out of memory), and which a restart would meet again.
SELF_REPORTED = (EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_SAVE_FAILED, EXIT_OUT_OF_MEMORY, EXIT_INTERRUPTED)

__all__ = [
    "PREEMPTED_EXIT_CODE", "NodeSpec", "add_node_arguments", "endpoint_addresses", "is_this_host", "launch_node",
    "node_spec_from_args", "port_problem",
]  # fmt: skip


class LaunchError(InputError):
    """The nodes could not meet: the message says who was waited for and what to check."""


@dataclass(frozen=True)
class NodeSpec:
    """One node's part of a run."""

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT; None on a single node (a private rendezvous)
    rdzv_id: str = "shardtune"
    nproc_per_node: int | None = None  # None: one per GPU, or 1 on a CPU-only machine
    join_timeout_s: float = 600.0
    max_restarts: int = 0
    # How long workers get to commit their preemption checkpoint before the agent kills them.
    shutdown_grace_s: float = 300.0
    command: str = "launch"  # what every node runs (``launch``, ``doctor``): named to a node left waiting

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1 or self.rdzv_endpoint is not None

    def host_port(self) -> tuple[str, int]:
        assert self.rdzv_endpoint is not None
        host, _, port = self.rdzv_endpoint.rpartition(":")
        return host.strip("[]"), int(port)


def _env_default(name: str, fallback: str | None) -> str | None:
    return os.environ.get(f"SHARDTUNE_{name}", fallback)


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that place this node in a run; each also reads a SHARDTUNE_* variable."""
    group = parser.add_argument_group("nodes (each option also reads SHARDTUNE_<NAME>, e.g. SHARDTUNE_NNODES)")
    group.add_argument("--nnodes", type=int, default=_env_default("NNODES", "1"), help="nodes in the run")
    group.add_argument(
        "--node-rank", type=int, default=_env_default("NODE_RANK", "0"), help="this node's rank, 0..nnodes-1"
    )
    group.add_argument(
        "--rdzv-endpoint",
        default=_env_default("RDZV_ENDPOINT", None),
        metavar="HOST:PORT",
        help="where the nodes meet (usually node 0's address and a free port)",
    )
    group.add_argument(
        "--rdzv-id", default=_env_default("RDZV_ID", "shardtune"), help="names this run at the endpoint (e.g. a job id)"
    )
    # String defaults go through ``type`` like typed values, so a bad variable is reported like a bad option.
    group.add_argument(
        "--nproc-per-node",
        type=int,
        default=_env_default("NPROC_PER_NODE", None),
        help="workers on this node (default: one per GPU, 1 on CPU)",
    )
    group.add_argument(
        "--join-timeout",
        type=float,
        default=_env_default("JOIN_TIMEOUT", "600"),
        metavar="SECONDS",
        help="how long nodes wait for each other to start (default 600)",
    )
    group.add_argument(
        "--max-restarts",
        type=int,
        default=_env_default("MAX_RESTARTS", "0"),
        help="restart the workers this many times after a failure; they resume from the newest checkpoint",
    )


def node_spec_from_args(args: argparse.Namespace) -> NodeSpec:
    """A checked NodeSpec; bad values raise an error naming the option."""
    if args.nnodes < 1:
        raise LaunchError(f"--nnodes: must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise LaunchError(
            f"--node-rank: must be in 0..{args.nnodes - 1} for --nnodes {args.nnodes}, got {args.node_rank}"
        )
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise LaunchError("--rdzv-endpoint: required with more than one node (HOST:PORT of node 0, e.g. node0:29500)")
    if args.rdzv_endpoint:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchError(f"--rdzv-endpoint: expected HOST:PORT, got {args.rdzv_endpoint!r}")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node: must be at least 1, got {args.nproc_per_node}")
    if problem := positive_number_problem("--join-timeout", args.join_timeout):
        raise LaunchError(problem)
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts: must be 0 or more, got {args.max_restarts}")
    return NodeSpec(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        nproc_per_node=args.nproc_per_node,
        join_timeout_s=args.join_timeout,
        max_restarts=args.max_restarts,
        command=args.command,
    )


def port_problem(option: str, port: int) -> str | None:
    """The line for a TCP port number that is none (outside 1..65535), or None when it is one."""
    return None if 0 < port < 65536 else f"{option}: must be in 1..65535, got {port}"


def default_nproc() -> int:
    """One worker per visible GPU; one process on a CPU-only machine."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def launch_node(spec: NodeSpec, worker_command: list[str], network: NetworkConfig) -> int:
    """Run ``python -m shardtune WORKER_COMMAND...`` as this node's workers; returns the exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    nproc = spec.nproc_per_node or default_nproc()
    apply_network_environment(network)  # inherited by the workers
    # The workers name the command that resumes a stopped run: this one, not their own.
    os.environ[COMMAND_VARIABLE] = shlex.join(["shardtune", *sys.argv[1:]])
    # torchrun pins every worker to one CPU thread unless told otherwise; CPU-side work (data
    # collation, and the optimizer step under FSDP CPU offload) then crawls. Share the cores instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # The agent passes these signals on to the workers and waits for them: SIGUSR1 is Slurm's usual
    # "time is nearly up" warning, so it joins the agent's default set.
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(
        sorted({"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *(s.name for s in PREEMPTION_SIGNALS)})
    )
    # The agent installs those handlers only once workers start; a signal before that (or between
    # restarts) must not kill the launcher with the default action, so they are installed now too.
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    for signum in PREEMPTION_SIGNALS:
        signal.signal(signum, _terminate_process_handler)
    os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(int(spec.shutdown_grace_s))
    _quiet_agent_shutdown_logs()

    # Workers that stop on the same input error print it once (see say_once).
    reported_errors = tempfile.TemporaryDirectory(prefix="shardtune-errors-")
    os.environ[REPORTED_ERRORS_VARIABLE] = reported_errors.name
    os.environ[LAUNCHER_PID_VARIABLE] = str(os.getpid())  # the workers end with it (end_with_the_launcher)
    store = None
    if spec.multi_node:
        os.environ.update(
            SHARDTUNE_NNODES=str(spec.nnodes),
            SHARDTUNE_NODE_RANK=str(spec.node_rank),
            SHARDTUNE_RDZV_ENDPOINT=str(spec.rdzv_endpoint),
        )
    try:
        if spec.multi_node:
            store = _host_or_join_store(spec)
        # Restarts are counted here rather than by the agent: torch's agent lets the node whose
        # worker failed count a restart while the others restart for "membership change" without
        # counting, and its workers then look for each other under different store prefixes and
        # hang. Every failure ends every node's attempt (the survivors' collectives fail), so each
        # node's own count stays in step, and each attempt meets under its own rendezvous id.
        for attempt in range(spec.max_restarts + 1):
            os.environ["SHARDTUNE_RESTART_COUNT"] = str(attempt)
            status = _run_attempt(spec, nproc, attempt, store, worker_command)
            if status == PREEMPTED_EXIT_CODE:
                _ignore_further_signals()
            # Bad input, a run stopped for non-finite losses, a checkpoint that cannot be written, a rank out
            # of memory fail again on restart, so every node stops here. Ctrl-C is final too.
            final = (0, PREEMPTED_EXIT_CODE, *SELF_REPORTED)
            if status in final or status >= 128 or attempt == spec.max_restarts:
                return status
            print(
                f"shardtune: node {spec.node_rank}: workers failed (exit {status}); restart {attempt + 1} of "
                f"{spec.max_restarts}, resuming from the newest complete checkpoint",
                file=sys.stderr,
                flush=True,
            )
    except SignalException as signalled:  # between attempts, or while waiting for the other nodes
        _ignore_further_signals()
        print(f"shardtune: {signalled.sigval.name} before the workers ran: stopping", file=sys.stderr)
        return PREEMPTED_EXIT_CODE if signalled.sigval in PREEMPTION_SIGNALS else 128 + int(signalled.sigval)
    finally:
        del store  # this node stops hosting (or using) the rendezvous store only now
        reported_errors.cleanup()
    return status


class _AgentShutdownFilter(logging.Filter):
    """The agent logs every signal it passes on ("Received 2 death signal, shutting down workers",
    "Sending process 123 closing signal SIGINT") and every worker's non-zero exit ("failed (exitcode: 3)
    local_rank: 0 ..."). Where the workers stopped alike and said why in one line (bad input, a run
    fault, Ctrl-C), or a worker was killed by a signal (the launcher names it), that is noise after it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(f"(exitcode: {code})" in message for code in (*SELF_REPORTED, EXIT_LOST_PEER)):
            return False  # the workers said why, once
        if "(exitcode: -" in message:
            return False  # killed by a signal: the launcher names the worker and the signal
        return "death signal" not in message and "closing signal" not in message


def _quiet_agent_shutdown_logs() -> None:
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _AgentShutdownFilter) for existing in logger.filters):
            logger.addFilter(_AgentShutdownFilter())


def _ignore_further_signals() -> None:
    """The checkpoint is committed and this launcher is leaving with its status. srun's
    --kill-on-bad-exit now sends SIGTERM to the other nodes' launchers, and Python's default action
    would kill them before they exit 75: Slurm would then see a killed job and not requeue it."""
    for signum in PREEMPTION_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _run_attempt(spec: NodeSpec, nproc: int, attempt: int, store, worker_command: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    arguments = [f"--nproc-per-node={nproc}", "--max-restarts=0", "--monitor-interval=0.5"]
    if spec.multi_node:
        rdzv_id = f"{spec.rdzv_id}-attempt{attempt}"
        _wait_for_the_other_nodes(spec, store, rdzv_id)
        timeout = int(spec.join_timeout_s)
        arguments += [
            f"--nnodes={spec.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={spec.rdzv_endpoint}",
            f"--rdzv-id={rdzv_id}",
            f"--rdzv-conf=join_timeout={timeout},read_timeout={timeout}",
        ]
    else:
        arguments.append("--standalone")
    parsed = get_args_parser().parse_args([*arguments, "--module", "shardtune", *worker_command])
    try:
        run(parsed)
    except ChildFailedError as failure:
        # The agent has already printed each failed worker's error; name the first for the user.
        rank, error = failure.get_first_failure()
        if error.exitcode == PREEMPTED_EXIT_CODE:
            print(f"shardtune: workers stopped for preemption (exit {PREEMPTED_EXIT_CODE})", file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        if error.exitcode in SELF_REPORTED:
            return error.exitcode  # every worker stopped alike and said why in one line, once (see say_once)
        return _status_of(failure.failures, rank, error.exitcode)
    except SignalException as signalled:
        name = signalled.sigval.name
        if signalled.sigval == signal.SIGINT:
            return EXIT_INTERRUPTED  # Ctrl-C: the workers stopped as told, and rank 0 said where
        if signalled.sigval in PREEMPTION_SIGNALS:
            print(f"shardtune: {name}: workers were told to checkpoint and stop", file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        print(f"shardtune: {name}: workers stopped", file=sys.stderr)
        return 128 + int(signalled.sigval)
    except RendezvousError as error:
        raise LaunchError(
            f"rendezvous at {spec.rdzv_endpoint} (id {spec.rdzv_id}) failed: {error}. "
            "Check that every node runs the same --nnodes, --rdzv-endpoint and --rdzv-id"
        ) from error
    return 0


def _status_of(failures: dict, first_rank: int, first_status: int) -> int:
    """The status of an attempt whose workers failed, with a line naming the worker behind it. A worker's own exit
    status comes first. Once one has failed, the agent stops the others with SIGTERM; a worker ended by another
    signal was ended from outside (SIGKILL: the kernel's out-of-memory killer, or by hand), and its peers, left
    waiting for it, exited with ``EXIT_LOST_PEER`` after saying so."""
    statuses = sorted((rank, failed.exitcode) for rank, failed in failures.items())
    exited = [(rank, status) for rank, status in statuses if status > 0 and status != EXIT_LOST_PEER]
    killed = [(rank, -status) for rank, status in statuses if status < 0 and -status != signal.SIGTERM]
    for rank, signum in killed:
        name = signal.Signals(signum).name
        what = (
            f"was killed by {name}: out of host memory (the kernel's OOM killer) or killed by hand"
            if signum == signal.SIGKILL
            else f"died of {name}"
        )
        print(f"shardtune: worker {rank} {what}", file=sys.stderr)
    if killed and not exited:
        return 1
    if not exited and first_status == EXIT_LOST_PEER:
        return EXIT_LOST_PEER  # a worker on another node went away; this node's workers said so
    rank, status = exited[0] if exited else (first_rank, first_status)
    print(f"shardtune: worker {rank} failed with exit code {status}", file=sys.stderr)
    return status if status > 0 else 1


def endpoint_addresses(host: str) -> list[str]:
    """The addresses ``host`` resolves to here (empty when it does not resolve)."""
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    except OSError:
        return []


def is_this_host(addresses: list[str]) -> bool:
    """Whether one of ``addresses`` belongs to this machine (it can be bound here). Used both to decide
    which launcher hosts the rendezvous store and by ``shardtune doctor`` to check that port."""
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address, 0))
                return True
            except OSError:
                continue
    return False


def _host_or_join_store(spec: NodeSpec):
    """The rendezvous store: hosted by the first launcher on the endpoint's machine, joined by the rest.
    It must stay alive for the whole run (torch's rendezvous uses it too)."""
    from torch.distributed import TCPStore

    host, port = spec.host_port()
    timeout = datetime.timedelta(seconds=spec.join_timeout_s)
    if is_this_host(endpoint_addresses(host)):
        try:
            return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
        except (RuntimeError, OSError):
            pass  # another launcher on this machine hosts it already (or the port is taken)
    _wait_until_the_store_listens(spec)
    try:
        return TCPStore(host, port, is_master=False, timeout=timeout)
    except (RuntimeError, OSError) as error:
        raise LaunchError(
            f"node {spec.node_rank}: joining the rendezvous store at {spec.rdzv_endpoint} failed "
            f"({first_line(error)}): is port {port} on {host} the first launcher's, and is that node still up?"
        ) from None


def _wait_until_the_store_listens(spec: NodeSpec) -> None:
    """Wait, up to ``--join-timeout``, until the rendezvous store's endpoint takes a connection: its node may start
    after this one, and its name may resolve only once it has. Tried here rather than by TCPStore's client, whose
    connect lasts about twice its timeout, holds off Ctrl-C and SIGTERM until it returns, and prints a C++ stack
    for every failed try."""
    host, port = spec.host_port()
    log.info("node %d of %d on %s: waiting up to %g s for the rendezvous store at %s", spec.node_rank, spec.nnodes,
             socket.gethostname(), spec.join_timeout_s, spec.rdzv_endpoint)  # fmt: skip
    deadline = time.monotonic() + spec.join_timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=min(max(left, 0.1), 5.0)).close()
            return
        except OSError as error:  # the name does not resolve (yet), nothing listens, no route, no answer
            reason = error.strerror or str(error)
        if time.monotonic() >= deadline:
            raise LaunchError(
                f"node {spec.node_rank}: could not reach the rendezvous store at {spec.rdzv_endpoint} within "
                f"{spec.join_timeout_s:g} s (--join-timeout): is the node at {host} started, and port {port} open "
                f"between the nodes? (last try: {reason})"
            )
        time.sleep(min(0.5, max(deadline - time.monotonic(), 0.0)))


def _wait_for_the_other_nodes(spec: NodeSpec, store, rdzv_id: str) -> None:
    """Register this node and wait until every node rank has, naming the missing ones on timeout."""
    deadline = time.monotonic() + spec.join_timeout_s
    prefix = f"shardtune/{rdzv_id}/nodes"
    if store.add(f"{prefix}/{spec.node_rank}/claims", 1) > 1:
        raise LaunchError(
            f"node {spec.node_rank}: another node already joined {spec.rdzv_endpoint} (id {spec.rdzv_id}) as node rank "
            f"{spec.node_rank}: give every node its own --node-rank, or a new --rdzv-id for a new run"
        )
    store.set(f"{prefix}/{spec.node_rank}", socket.gethostname())
    log.info("node %d of %d on %s: waiting up to %g s at %s for the other nodes", spec.node_rank, spec.nnodes,
             socket.gethostname(), spec.join_timeout_s, spec.rdzv_endpoint)  # fmt: skip
    keys = [f"{prefix}/{rank}" for rank in range(spec.nnodes)]
    while True:
        arrived = [rank for rank, key in enumerate(keys) if store.check([key])]
        if len(arrived) == spec.nnodes:
            return
        if time.monotonic() > deadline:
            missing = [rank for rank in range(spec.nnodes) if rank not in arrived]
            hosts = ", ".join(f"node {rank} on {store.get(keys[rank]).decode()}" for rank in arrived)
            raise LaunchError(
                f"node {spec.node_rank}: waited {spec.join_timeout_s:.0f} s (--join-timeout) at {spec.rdzv_endpoint} "
                f"for node rank(s) {', '.join(map(str, missing))} of {spec.nnodes}, which never arrived "
                f"(arrived: {hosts}). Start `shardtune {spec.command}` on those nodes with the same --rdzv-endpoint "
                f"and --rdzv-id {spec.rdzv_id}, or raise --join-timeout"
            )
        time.sleep(0.2)
