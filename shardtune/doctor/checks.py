"""The checks one node runs on itself: the rendezvous endpoint and port, workers per GPU, network
interfaces, devices, backends, InfiniBand, the paths the config names; then the estimates (memory,
disk) of ``estimates.py``.

Every check returns rows rather than raising: a doctor reports everything wrong at once, and a check
that cannot run is itself a finding.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from shardtune.checkpoint.layout import not_a_checkpoint
from shardtune.config import (
    Config,
    DataConfig,
    ModelConfig,
    NetworkConfig,
    TrainingConfig,
    looks_local,
    model_path_problem,
)
from shardtune.data.sources import is_local
from shardtune.distributed.env import DistributedEnv
from shardtune.doctor.estimates import available_host_memory, disk_check, memory_checks
from shardtune.doctor.report import FAIL, GIB, OK, WARN, Check, plural, size
from shardtune.errors import InputError, first_line
from shardtune.launch.network import network_environment
from shardtune.plan.shape import model_shape_on
from shardtune.run_dir import output_dir_problem


def guarded(name: str, check: Callable[[], list[Check]]) -> list[Check]:
    """Run ``check``; an error inside it becomes a FAIL row under ``name`` instead of ending the doctor."""
    try:
        return check()
    except InputError as exc:
        return [Check(name, FAIL, "; ".join(exc.lines), fix="fix the setting named")]
    except Exception as exc:  # any error is a finding here; the other checks must still run
        return [Check(name, FAIL, f"{type(exc).__name__}: {first_line(exc)}", fix="see the error")]


# -- before any worker starts ----------------------------------------------------------------------
def port_in_use(port: int) -> str | None:
    """Why ``port`` cannot be bound on this host (by IPv4 or IPv6), or None when it is free."""
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        with sock:
            # As a server binds: a port left in TIME_WAIT by an earlier run is reusable, a live socket's is not.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((address, port))
            except OSError as exc:
                if family == socket.AF_INET or exc.errno == errno.EADDRINUSE:
                    return exc.strerror or str(exc)
    return None


def port_check(port: int, required: bool) -> Check:
    """The rendezvous port must be free on the node that will host the rendezvous store. ``required``:
    the run will use it (a multi-node launch, or a port the user named); otherwise a busy port only
    matters to a later multi-node run."""
    reason = port_in_use(port)
    if reason is None:
        return Check("rendezvous port", OK, f"{port} is free")
    return Check(
        "rendezvous port",
        FAIL if required else WARN,
        f"{port} cannot be bound here ({reason})",
        fix=f"pass --port, or a --rdzv-endpoint HOST:PORT, with a free port instead of {port}",
    )


def endpoint_check(host: str, port: int, addresses: list[str]) -> Check:
    if addresses:
        return Check("rendezvous endpoint", OK, f"{host}:{port} resolves to {', '.join(addresses)}")
    return Check(
        "rendezvous endpoint",
        FAIL,
        f"{host} does not resolve on this node",
        fix="use node 0's IP address, or a name every node resolves, in --rdzv-endpoint",
    )


# -- devices and backends --------------------------------------------------------------------------
def workers_check(nproc: int) -> Check:
    """Each worker of a node takes a GPU of its own: the GPU of its local rank, selected as it starts."""
    from shardtune.launch.local import check_worker_count

    try:
        warning = check_worker_count(nproc, "--nproc")
    except InputError as error:
        return Check("workers", FAIL, "; ".join(error.lines), fix="change --nproc")
    if warning:
        return Check("workers", WARN, warning, fix="start at most one worker per core (--nproc)")
    if not torch.cuda.is_available():
        return Check("workers", OK, f"{plural(nproc, 'worker')} on the CPU")
    return Check("workers", OK, f"{plural(nproc, 'worker')}, one per GPU, of {torch.cuda.device_count()}")


def devices_check() -> list[Check]:
    if not torch.cuda.is_available():
        cores = plural(os.cpu_count() or 1, "CPU core")
        return [Check("devices", OK, f"no GPU: {cores}, {size(available_host_memory())} RAM available")]
    count = torch.cuda.device_count()
    kinds = Counter(
        f"{props.name} ({props.total_memory / GIB:.0f} GiB)"
        for props in map(torch.cuda.get_device_properties, range(count))
    )
    listed = ", ".join(f"{n} x {kind}" for kind, n in kinds.items())
    return [Check("devices", OK, f"{plural(count, 'GPU')}: {listed}; CUDA {torch.version.cuda}")]


def backends_check(device: torch.device) -> list[Check]:
    import torch.distributed as dist

    gloo = dist.is_gloo_available()
    if device.type != "cuda":
        if gloo:
            return [Check("backends", OK, "gloo (CPU tensors)")]
        return [Check("backends", FAIL, "this torch build has no gloo", fix="install a standard torch build")]
    if not dist.is_nccl_available():
        return [Check("backends", FAIL, "this torch build has no NCCL", fix="install a CUDA build of torch")]
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    if not gloo:
        # Object collectives (file lists, hostnames) run on CPU tensors, through gloo.
        return [Check("backends", FAIL, f"nccl {nccl}, but no gloo", fix="install a standard CUDA build of torch")]
    return [Check("backends", OK, f"nccl {nccl} (GPU tensors), gloo (CPU tensors)")]


# -- network ---------------------------------------------------------------------------------------
def nccl_interfaces(spec: str, names: list[str]) -> list[str]:
    """The interfaces NCCL would consider for ``NCCL_SOCKET_IFNAME=spec``: a comma list of name prefixes,
    ``=`` for exact names, ``^`` to exclude instead of select."""
    exclude = spec.startswith("^")
    spec = spec.removeprefix("^")
    exact = spec.startswith("=")
    patterns = [pattern for pattern in spec.removeprefix("=").split(",") if pattern]

    def listed(name: str) -> bool:
        return any(name == pattern if exact else name.startswith(pattern) for pattern in patterns)

    return [name for name in names if listed(name) != exclude]


def network_checks(network: NetworkConfig, device: torch.device) -> list[Check]:
    names = sorted(name for _, name in socket.if_nameindex())
    here = ", ".join(names)
    configured = network_environment(network)
    rows = []
    for variable in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        # A variable the user exported wins over the config, in the workers as here.
        exported = os.environ.get(variable)
        spec = exported or configured.get(variable)
        if not spec:
            continue
        origin = f"{variable}={spec} ({'exported' if exported else 'network.socket_ifname'})"
        if variable.startswith("NCCL"):
            missing = [] if nccl_interfaces(spec, names) else [spec]
        else:
            missing = [name for name in spec.split(",") if name not in names]
        if not missing:
            rows.append(Check("network interface", OK, f"{origin} matches an interface here ({here})"))
            continue
        fix = f"unset {variable} or name" if exported else "set network.socket_ifname to"
        # NCCL only carries GPU tensors: on a CPU-only node a wrong NCCL setting is harmless here.
        status = WARN if variable.startswith("NCCL") and device.type != "cuda" else FAIL
        rows.append(
            Check(
                "network interface",
                status,
                f"{origin}: no interface {', '.join(missing)} here (interfaces: {here})",
                fix=f"{fix} an interface every node has",
            )
        )
    if not rows:
        rows.append(Check("network interface", OK, f"not set: NCCL and gloo choose among {here}"))
    return rows


def infiniband_check(network: NetworkConfig) -> list[Check]:
    """NCCL's InfiniBand transport (GPU nodes): without a device NCCL falls back to sockets, much slower."""
    root = Path("/sys/class/infiniband")
    devices = sorted(entry.name for entry in root.iterdir()) if root.is_dir() else []
    found = ", ".join(devices) if devices else "none"
    if network.ib is False:
        return [Check("infiniband", OK, f"off (network.ib=false): NCCL uses sockets; devices here: {found}")]
    if network.ib is True and not devices:
        return [
            Check(
                "infiniband",
                FAIL,
                "network.ib=true but this node has no InfiniBand device",
                fix="set network.ib=auto (or false) for sockets, or run on nodes with InfiniBand",
            )
        ]
    return [Check("infiniband", OK, f"devices: {found} (network.ib={network.ib})")]


# -- paths -----------------------------------------------------------------------------------------
def unreadable(path: Path) -> str | None:
    """Why ``path`` (a file or a directory) cannot be read, or None."""
    try:
        if path.is_dir():
            os.listdir(path)
        else:
            with open(path, "rb") as handle:
                handle.read(1)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def model_path_check(model: ModelConfig) -> list[Check]:
    name = model.name_or_path
    if not looks_local(name):
        return [Check("model", OK, f"{name}: hub id, fetched from the hub (or its cache) at start")]
    path = Path(name).expanduser()
    fix = "point model.name_or_path at a model directory that every node can read"
    if not path.is_dir():
        return [Check("model", FAIL, f"model.name_or_path: directory not found: {name}", fix=fix)]
    # What is missing (config.json, weight files, an index's shards) the "model config" and "weights" rows name,
    # once; this row: whether this node can read the files that are there.
    weights: list[Path] = []
    if model.init == "pretrained":
        from shardtune.train.preflight import weight_files

        with contextlib.suppress(InputError):  # an index without a weight_map: the weights row names it
            weights = [file for file in weight_files(path) if file.exists()]
    files = [file for file in [path / "config.json"] if file.exists()] + weights
    for file in files:
        reason = unreadable(file)
        if reason:
            return [Check("model", FAIL, f"{file}: {reason}", fix=fix)]
    total = sum(file.stat().st_size for file in weights)
    detail = f"{name}: {plural(len(files), 'file')} readable (config.json, {plural(len(weights), 'weight file')}, "
    return [Check("model", OK, f"{detail}{size(total)})")]


def data_check(data: DataConfig) -> list[Check]:
    sources = [("data.dataset_path", path) for path in data.paths]
    if data.eval_path:
        sources.append(("data.eval_path", data.eval_path))
    problems, local, hub = [], 0, 0
    for key, value in sources:
        path = Path(value).expanduser()
        if not is_local(value) and not path.exists():
            hub += 1
            continue
        local += 1
        reason = "not found" if not path.exists() else unreadable(path)
        if reason:
            problems.append(f"{key}: {value}: {reason}")
    if problems:
        return [Check("data", FAIL, "; ".join(problems), fix="correct the path, or copy the data to this node")]
    parts = [f"{plural(local, 'local source')} readable"] if local else []
    parts += [f"{plural(hub, 'hub dataset')}, fetched at preparation"] if hub else []
    return [Check("data", OK, ", ".join(parts))]


def resume_check(training: TrainingConfig) -> list[Check]:
    resume = training.resume_from_checkpoint
    if resume in (None, "auto"):
        return []
    problem = not_a_checkpoint(Path(resume))
    if problem is None:
        return [Check("resume checkpoint", OK, f"{resume} is a complete checkpoint")]
    return [
        Check(
            "resume checkpoint",
            FAIL,
            f"training.resume_from_checkpoint: {resume} {problem}",
            fix="name a checkpoint-<step> directory, or use auto",
        )
    ]


def previous_run_check(training: TrainingConfig) -> list[Check]:
    """A fresh run refuses an output directory that holds another run, and any run one that another run is
    writing now (a FAIL row; none when free)."""
    problem = output_dir_problem(training)
    return [] if problem is None else [Check("previous run", FAIL, problem)]  # the line says what to change


def run_preflight_checks(config: Config, device: torch.device, world_size: int) -> list[Check]:
    """The checks ``shardtune train`` on ``world_size`` ranks makes before it writes or loads anything, one row
    each. A local model directory that is not there is the ``model`` row's finding (training's config check names
    it before its preflight): its config is not read, where transformers would take the path for a hub id."""
    from shardtune.train.preflight import preflight_checks

    no_directory = model_path_problem(config.model) is not None
    return [
        row
        for name, check in preflight_checks(config, device, world_size)
        for row in (
            [Check(name, OK, "not checked (no model directory)")]
            if no_directory and name == "model config"
            else guarded(name, lambda check=check, name=name: [Check(name, OK, check())])
        )
    ]


def interface_checks(config: Config) -> list[Check]:
    """What must hold before a process group can form on this node: gloo will not even start on an
    interface that is not there."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return guarded("network interface", lambda: network_checks(config.network, device))


def node_checks(config: Config, env: DistributedEnv) -> list[Check]:
    """Everything else one node checks about itself (run by one process per node, in the process group)."""
    rows = [
        *guarded("devices", devices_check),
        *guarded("backends", lambda: backends_check(env.device)),
        *(guarded("infiniband", lambda: infiniband_check(config.network)) if env.device.type == "cuda" else []),
        *guarded("model", lambda: model_path_check(config.model)),
        *guarded("data", lambda: data_check(config.data)),
        *guarded("resume checkpoint", lambda: resume_check(config.training)),
        *previous_run_check(config.training),
        *run_preflight_checks(config, env.device, env.world_size),
    ]
    unknown_size = Check("disk", WARN, "not estimated: the model's size is unknown", fix="fix the memory check first")
    # No model config to build the model from: the row that says why says it once.
    unread = "model" if model_path_problem(config.model) else None
    if unread is None and any(row.name == "model config" and row.status == FAIL for row in rows):
        unread = "model config"
    if unread:
        fix = f"fix the {unread} check first"
        return [*rows, Check("memory", WARN, f"not estimated: see {unread}", fix=fix), unknown_size]
    try:
        shape = model_shape_on(config, env.device)
    except Exception as exc:  # a model that cannot even be shaped is the finding
        reason = "; ".join(exc.lines) if isinstance(exc, InputError) else f"{type(exc).__name__}: {first_line(exc)}"
        return [
            *rows,
            Check("memory", FAIL, f"cannot build the model from its config: {reason}", fix="check model.*"),
            unknown_size,
        ]
    return [
        *rows,
        *guarded("memory", lambda: memory_checks(config, env, shape)),
        *guarded("disk", lambda: disk_check(config, shape)),
    ]
