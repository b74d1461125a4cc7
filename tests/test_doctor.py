"""``shardtune doctor``: the table and exit status for a good config and for each kind of problem, run as a
user runs it (one process, two workers, two nodes on one host); and the pieces the table is built from."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO

from shardtune.config import NetworkConfig
from shardtune.doctor.bandwidth import AllReduceTiming
from shardtune.doctor.checks import nccl_interfaces, network_checks
from shardtune.doctor.estimates import disk_check
from shardtune.doctor.report import FAIL, OK, WARN, Check, format_report
from shardtune.metrics.flops import TokenFlops
from shardtune.plan.shape import ModelShape

# The launcher's node options also read SHARDTUNE_* variables: none may leak in from the caller.
ENV = {key: value for key, value in os.environ.items() if not key.startswith("SHARDTUNE_")}
ENV.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
# Checked by the command before it starts workers, then by one worker per node.
FRONT_CHECKS = ["rendezvous port", "workers", "network interface"]
NODE_CHECKS = [
    "devices", "backends", "model", "data", "model config", "weights", "precision", "kernels", "logging",
    "output dir", "cache dir", "memory", "disk",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_listening(port: int, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on port {port}: {process.communicate(timeout=10)}")


def doctor_command(tmp_path: Path, *args: str, output_dir: Path | None = None) -> list[str]:
    output = output_dir or tmp_path / "run"
    overrides = [f"training.output_dir={output}", f"data.cache_dir={tmp_path / 'cache'}"]
    return [sys.executable, "-m", "shardtune", "doctor", "examples/quickstart.yaml", *overrides, *args]


def doctor(tmp_path: Path, *args: str, output_dir: Path | None = None) -> subprocess.CompletedProcess:
    command = doctor_command(tmp_path, *args, output_dir=output_dir)
    return subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


def table(stdout: str) -> dict[tuple[str, str], tuple[str, str]]:
    """(node, check) -> (status, detail), from the printed table."""
    lines = stdout.split("\n\n")[0].splitlines()
    assert re.split(r"\s{2,}", lines[0]) == ["node", "host", "check", "status", "detail"], stdout
    rows = {}
    for line in lines[1:]:
        node, _, check, status, detail = re.split(r"\s{2,}", line, maxsplit=4)
        rows[node, check] = (status, detail)
    return rows


def gbps(detail: str, kind: str) -> float:
    return float(re.search(rf"{kind} ([\d.]+) GB/s", detail).group(1))


def test_good_config_on_one_cpu_process(tmp_path):
    port = free_port()
    result = doctor(tmp_path, "--port", str(port))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = table(result.stdout)
    assert {status for status, _ in rows.values()} == {OK}, result.stdout
    assert [check for node, check in rows if node == "0"] == [*FRONT_CHECKS, *NODE_CHECKS]
    assert rows["0", "rendezvous port"][1] == f"{port} is free"
    assert rows["0", "data"][1] == "1 local source readable"
    assert rows["all", "output dir shared"][1] == "shared (one process)"
    # The tiny model with LoRA r=16 on all linear layers: 147,968 trainable fp32 parameters.
    assert f"gradients {147_968 * 4 / 2**10:.0f} KiB" in rows["0", "memory"][1]
    bandwidth = [detail for (_, check), (_, detail) in rows.items() if check.startswith("all-reduce")]
    assert len(bandwidth) == 3 and all("(1 rank, gloo on cpu" in detail for detail in bandwidth)
    assert all(gbps(detail, "algbw") > 0 and gbps(detail, "busbw") == 0 for detail in bandwidth)
    assert result.stdout.rstrip().endswith(f"shardtune doctor: all {len(rows)} checks ok")


@pytest.mark.variants
def test_missing_data_path_fails(tmp_path):
    missing = tmp_path / "nowhere" / "train.jsonl"
    result = doctor(tmp_path, f"data.dataset_path={missing}", "--port", str(free_port()))
    assert result.returncode == 1, result.stdout + result.stderr
    rows = table(result.stdout)
    assert rows["0", "data"] == (FAIL, f"data.dataset_path: {missing}: not found")
    assert [check for (_, check), (status, _) in rows.items() if status != OK] == ["data"]
    assert "  FAIL data (node 0): correct the path, or copy the data to this node" in result.stdout
    assert result.stdout.rstrip().endswith(f"1 failed, 0 warnings in {len(rows)} checks")


@pytest.mark.variants
def test_unwritable_output_dir_fails(tmp_path):
    # Tests run as root, who may write anywhere: a directory below a regular file cannot exist for anyone.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    result = doctor(tmp_path, "--port", str(free_port()), output_dir=blocker / "run")
    assert result.returncode == 1, result.stdout + result.stderr
    rows = table(result.stdout)
    assert rows["0", "output dir"] == (
        FAIL,
        f"training.output_dir: cannot write {blocker / 'run'} (Not a directory); set training.output_dir to a "
        "directory this user can create and write (on every node)",
    )
    assert rows["all", "output dir shared"][0] == WARN  # untestable without a writable directory
    assert rows["0", "cache dir"][0] == OK


def test_busy_port_fails(tmp_path):
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", port))
        busy.listen()
        result = doctor(tmp_path, "--port", str(port))
    assert result.returncode == 1, result.stdout + result.stderr
    rows = table(result.stdout)
    status, detail = rows["0", "rendezvous port"]
    assert status == FAIL and detail.startswith(f"{port} cannot be bound here")
    assert f"with a free port instead of {port}" in result.stdout
    # Workers could not meet at a busy port: the doctor stops after the checks made before starting them.
    assert [check for _, check in rows] == FRONT_CHECKS
    assert result.stdout.rstrip().endswith("fix the above, then run it again for the other checks")


def test_two_workers_share_directories_and_measure_bandwidth(tmp_path):
    result = doctor(tmp_path, "--nproc", "2", "--port", str(free_port()))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = table(result.stdout)
    assert {status for status, _ in rows.values()} == {OK}, result.stdout
    # One process per node checks the node: one row per check, not one per worker.
    assert [check for node, check in rows if node == "0"] == [*FRONT_CHECKS, *NODE_CHECKS]
    assert rows["0", "workers"][1] == "2 workers on the CPU"
    for directory in ("output dir", "cache dir"):
        assert rows["all", f"{directory} shared"][1] == "shared: all 2 ranks, on 1 node, see rank 0's marker"
    for size in (1, 4, 16):
        detail = rows["all", f"all-reduce {size} MiB"][1]
        assert "(2 ranks, gloo on cpu)" in detail
        # Two ranks: busbw = algbw * 2 * (2 - 1) / 2.
        assert gbps(detail, "busbw") == gbps(detail, "algbw") > 0
    assert not list((tmp_path / "run").glob(".domain-*")), "the shared-directory marker is removed"


@pytest.mark.parametrize(
    ("model", "row", "detail"),
    [
        ("./no-such-model", "model", "model.name_or_path: directory not found: ./no-such-model"),
        # transformers' reason follows (the tests run with HF_HUB_OFFLINE=1)
        (
            "acme/unheard-of-7b",
            "model config",
            "model.name_or_path: acme/unheard-of-7b is not a model this machine can read (",
        ),
    ],
    ids=["missing-directory", "hub-id-not-cached"],
)
def test_a_model_that_is_not_there_is_one_failed_row(tmp_path, model, row, detail):
    """Said once, by the row that finds it. A missing directory also failed the model config row (transformers took
    the path for a hub id: "Repo id must be in the form ..."), and both failed the memory row, whose second line of
    transformers' message broke out of the table."""
    result = doctor(tmp_path, "--port", str(free_port()), f"model.name_or_path={model}")
    assert result.returncode == 1, result.stdout + result.stderr
    rows = table(result.stdout)
    assert [(check, status) for (_, check), (status, _) in rows.items() if status != OK] == [
        (row, FAIL), ("memory", WARN), ("disk", WARN),
    ]  # fmt: skip
    assert rows["0", row][1].startswith(detail)
    assert rows["0", "memory"][1] == f"not estimated: see {row}"
    assert rows["0", "weights"][1] == "not checked (no model config)"


def test_expert_parallelism_the_model_cannot_take_fails_as_training_does(tmp_path):
    """Training refuses expert parallelism for a model without MoE layers once it is built; the doctor said ok."""
    result = doctor(tmp_path, "--nproc", "2", "--port", str(free_port()), "parallel.expert_parallel_size=2")
    assert result.returncode == 1, result.stdout + result.stderr
    rows = table(result.stdout)
    assert rows["0", "expert parallel"] == (
        FAIL,
        "parallel.expert_parallel_size: 2 needs an MoE model; examples/tiny-llama has no MoE layers; set it to 1",
    )
    assert [check for (_, check), (status, _) in rows.items() if status != OK] == ["expert parallel"]


def test_workers_stopped_by_bad_input_say_so_once(tmp_path):
    """The workers' one line, and nothing from the doctor after it (it added "the workers stopped before
    reporting (exit 2); see their errors above"; after Ctrl-C too)."""
    result = doctor(tmp_path, "--nproc", "2", "--port", str(free_port()), "parallel.expert_parallel_size=3")
    assert (result.returncode, result.stdout, result.stderr) == (
        2,
        "",
        "shardtune: error: parallel.expert_parallel_size: 3 does not divide the world size 2; choose a divisor of 2 "
        "(the number of processes) or change --nproc/--nodes\n",
    )


@pytest.mark.parametrize(
    ("options", "line"),
    [
        (["--port", "0"], "--port: must be in 1..65535, got 0"),  # the doctor checked port 29500 instead
        (["--port", "70000"], "--port: must be in 1..65535, got 70000"),
        (["--timeout", "nan"], "--timeout: must be a finite number, got nan"),
        (["--join-timeout", "inf"], "--join-timeout: must be a finite number, got inf"),
    ],
)
def test_bad_options_are_one_line(tmp_path, options, line):
    result = doctor(tmp_path, *options)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"shardtune: error: {line}\n")


def test_a_node_that_never_comes_is_named_with_the_command_to_start(tmp_path):
    """The line said to start `shardtune launch` on the missing node, and nothing said that the doctor waited."""
    endpoint = f"127.0.0.1:{free_port()}"
    options = ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint, "--join-timeout", "2"]
    result = doctor(tmp_path, *options)
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    waiting, error = result.stderr.splitlines()
    host = socket.gethostname()
    assert re.fullmatch(
        rf"\d\d:\d\d:\d\d INFO node 0 of 2 on {re.escape(host)}: waiting up to 2 s at {endpoint} for the other nodes",
        waiting,
    )
    assert error == (
        f"shardtune: error: node 0: waited 2 s (--join-timeout) at {endpoint} for node rank(s) 1 of 2, which never "
        f"arrived (arrived: node 0 on {host}). Start `shardtune doctor` on those nodes with the same --rdzv-endpoint "
        "and --rdzv-id shardtune, or raise --join-timeout"
    )


@pytest.mark.variants
def test_two_nodes_with_node_local_output_dirs(tmp_path):
    """Node ranks 0 and 1 on one host, as two `launch`-style commands; each node names its own output dir."""
    port = free_port()
    nodes = []
    for rank in (0, 1):
        options = ["--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}"]
        options += ["--nproc-per-node", "1", "--join-timeout", "120"]
        command = doctor_command(tmp_path, *options, output_dir=tmp_path / f"node{rank}")
        nodes.append(subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        if rank == 0:
            # On one host either launcher may host the rendezvous store; node 0 must, having checked the port.
            wait_until_listening(port, nodes[0])
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert outputs[1][0] == b"", "only global rank 0 prints the table"
    rows = table(outputs[0][0].decode())
    assert rows["0", "rendezvous port"][0] == OK
    assert ("1", "rendezvous port") not in rows, "only the node hosting the rendezvous checks the port"
    assert all((node, check) in rows for node in "01" for check in NODE_CHECKS)
    status, detail = rows["all", "output dir shared"]
    assert status == WARN and detail.startswith("node-local on node 1")
    assert rows["all", "cache dir shared"][1] == "shared: all 2 ranks, on 2 nodes, see rank 0's marker"
    assert "(2 ranks, gloo on cpu)" in rows["all", "all-reduce 16 MiB"][1]


@pytest.mark.variants
def test_srun_tasks_check_without_a_launching_command(tmp_path):
    """As the tasks of srun: SLURM_* variables and MASTER_ADDR/PORT, no RANK; each task is a rank and exits
    with the verdict itself."""
    port = free_port()
    missing = tmp_path / "missing.jsonl"
    tasks = [
        {"SLURM_NTASKS": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS_PER_NODE": "2",
         "SLURM_NODEID": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        for rank in range(2)
    ]  # fmt: skip
    command = doctor_command(tmp_path, f"data.dataset_path={missing}")
    processes = [
        subprocess.Popen(command, cwd=REPO, env={**ENV, **task}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for task in tasks
    ]
    outputs = [process.communicate(timeout=300) for process in processes]
    assert [process.returncode for process in processes] == [1, 1], outputs
    rows = table(outputs[0][0].decode())
    # No launching command: no port check; the network is checked by the task itself.
    assert [check for node, check in rows if node == "0"] == ["network interface", *NODE_CHECKS]
    assert rows["0", "data"] == (FAIL, f"data.dataset_path: {missing}: not found")
    assert "(2 ranks, gloo on cpu)" in rows["all", "all-reduce 1 MiB"][1]
    assert outputs[1][0] == b""


def test_a_missing_model_shard_is_one_failed_row(tmp_path):
    """The weights row names the shard its index lists and the directory lacks; the model row (can this node read
    the files) passes on what is there instead of failing on the same shard a second time."""
    from conftest import TINY_MODEL

    from shardtune.config import load_config
    from shardtune.doctor.checks import model_path_check
    from shardtune.errors import ConfigError
    from shardtune.train.preflight import check_weights

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((TINY_MODEL / "config.json").read_text())
    (model / "model-00001-of-00002.safetensors").write_bytes(b"x")
    weight_map = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = load_config(REPO / "examples/quickstart.yaml", [f"model.name_or_path={model}"])
    (row,) = model_path_check(config.model)
    assert (row.status, row.detail) == (OK, f"{model}: 2 files readable (config.json, 1 weight file, 0 KiB)")
    with pytest.raises(ConfigError) as caught:
        check_weights(config)
    assert caught.value.lines == [
        f"model.name_or_path: {model} lacks 1 of its 2 weight files (first: model-00002-of-00002.safetensors, listed "
        "by its index); download or copy the model again"
    ]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("eth", ["eth0", "eth1"]),
        ("=eth0", ["eth0"]),
        ("=eth", []),
        ("^lo,docker", ["eth0", "eth1", "ib0"]),
        ("^=eth0", ["docker0", "eth1", "ib0", "lo"]),
        ("ib0,eth1", ["eth1", "ib0"]),
    ],
)
def test_nccl_interface_syntax(spec, expected):
    assert nccl_interfaces(spec, ["docker0", "eth0", "eth1", "ib0", "lo"]) == expected


def test_missing_interface_fails_where_its_backend_is_used():
    name = next(name for _, name in socket.if_nameindex())
    assert network_checks(NetworkConfig(socket_ifname=name), torch.device("cpu"))[0].status == OK
    rows = network_checks(NetworkConfig(socket_ifname="nosuch9"), torch.device("cpu"))
    # NCCL's variable does not matter to a CPU node; gloo's does.
    assert [(row.status, row.detail.split(":")[0]) for row in rows] == [
        (WARN, "NCCL_SOCKET_IFNAME=nosuch9 (network.socket_ifname)"),
        (FAIL, "GLOO_SOCKET_IFNAME=nosuch9 (network.socket_ifname)"),
    ]
    assert "set network.socket_ifname to an interface every node has" in rows[1].fix


def test_bus_bandwidth_follows_nccl_tests():
    timing = AllReduceTiming(size_bytes=10**9, seconds=0.5, world_size=8, correct=True)
    assert timing.algbw == 2.0
    assert timing.busbw == pytest.approx(2.0 * 2 * 7 / 8)


def _shape(trainable: int, total: int) -> ModelShape:
    return ModelShape(
        trainable, total, total * 2, 2, hidden=64, vocab=100, layers=(),
        flops=TokenFlops(matmul_params=total, layers=1, attention_width=64, sequence_length=128, adapter_params=None),
    )  # fmt: skip


def test_disk_counts_the_checkpoints_kept(tmp_path):
    from conftest import make_config

    shape = _shape(trainable=1000, total=10_000)
    limited = make_config(
        tmp_path, tmp_path / "d.jsonl", training={"save_steps": 10, "save_total_limit": 2, "max_steps": 100}
    )
    # Three at the peak: the new checkpoint is committed before the oldest goes.
    assert "needs ~16 KiB (3 checkpoints of 4 KiB, final/ 4 KiB)" in disk_check(limited, shape)[0].detail
    full = make_config(
        tmp_path, tmp_path / "d.jsonl", training={"save_steps": 2, "max_steps": 4, "checkpoint_mode": "full"}
    )
    assert "(2 checkpoints of 12 KiB, final/ 4 KiB)" in disk_check(full, shape)[0].detail
    unbounded = make_config(tmp_path, tmp_path / "d.jsonl", training={"save_steps": 2, "max_steps": -1})
    (row,) = disk_check(unbounded, shape)
    assert row.status == WARN and "save_total_limit" in row.fix


def test_report_lists_fixes_and_counts():
    checks = [
        Check("model", OK, "fine", node="0", host="a"),
        Check("data", FAIL, "data.dataset_path: x.jsonl: not found", fix="correct the path", node="1", host="bb"),
        Check("output dir shared", WARN, "node-local", fix="copy the shards", node="all"),
    ]
    text = format_report(checks)
    assert text.splitlines()[:4] == [
        "node  host  check              status  detail",
        "0     a     model              ok      fine",
        "1     bb    data               FAIL    data.dataset_path: x.jsonl: not found",
        "all   -     output dir shared  WARN    node-local",
    ]
    assert "  FAIL data (node 1): correct the path\n  WARN output dir shared: copy the shards" in text
    assert text.endswith("shardtune doctor: 1 failed, 1 warning in 3 checks")


def test_memory_counts_expert_parallelism():
    # The doctor's memory row is plan's estimate: with EP 8 on 16 ranks an MoE layer's experts unit holds
    # 1/8 of the layer's experts, so FSDP's gathered term shrinks; stored state is 1/16 of everything either way.
    from shardtune.config import load_config
    from shardtune.distributed.env import DistributedEnv
    from shardtune.distributed.mesh import ParallelDims
    from shardtune.doctor.estimates import memory_checks
    from shardtune.plan.shape import planned_model_shape

    recipe = REPO / "examples/recipes/glm-4.5-air-fsdp-16k.yaml"
    gathered = {}
    for ep in (1, 8):
        config = load_config(recipe, [f"parallel.expert_parallel_size={ep}"], check_paths=False)
        shape, _ = planned_model_shape(config)
        mesh = ParallelDims(world_size=16, rank=1, local_world_size=8, expert_parallel_size=ep)
        env = DistributedEnv(1, 1, 16, 8, torch.device("cpu"), 60.0, mesh)
        (row,) = memory_checks(config, env, shape)
        assert "fsdp on 16 ranks" in row.detail
        number, unit = re.search(r"FSDP gathered ([\d.]+) (GiB|MiB)", row.detail).groups()
        gathered[ep] = float(number)
    assert gathered[8] < gathered[1] / 2
