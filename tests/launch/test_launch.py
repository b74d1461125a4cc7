"""``shardtune launch``: two nodes on one host (node ranks 0 and 1, gloo, one worker each), for real."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runs import children_of
from conftest import REPO

ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
BASE = [
    "training.logging_steps=1", "training.per_device_train_batch_size=2", "training.eval_on_start=false",
    "training.eval_steps=null", "lora.lora_dropout=0", "training.checkpoint_mode=full",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def overrides(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    return [f"training.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", *BASE, *extra]


def start_node(tmp_path: Path, out: Path, node_rank: int, port: int, *extra: str, options=()) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "shardtune", "launch", "examples/quickstart.yaml", "--nnodes", "2",
        "--node-rank", str(node_rank), "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node", "1",
        "--join-timeout", "90", *options, *overrides(tmp_path, out, *extra),
    ]  # fmt: skip
    with open(tmp_path / f"node{node_rank}-{out.name}.log", "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(command, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT, text=True)


def finish(tmp_path: Path, process: subprocess.Popen, node_rank: int, out: Path, timeout: float = 600) -> str:
    process.wait(timeout=timeout)
    return (tmp_path / f"node{node_rank}-{out.name}.log").read_text()


def single_process(tmp_path: Path, out: Path, *extra: str) -> list[float]:
    """The same global batch in one process: two micro-batches accumulated instead of two ranks."""
    command = [
        sys.executable, "-m", "shardtune", "train", "examples/quickstart.yaml", "--nproc", "1",
        *overrides(tmp_path, out, "training.gradient_accumulation_steps=2", *extra),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(out)


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "logs/train_log.jsonl").read_text().splitlines()]


def test_two_nodes_train_like_one_process_even_when_one_starts_late(tmp_path):
    reference = single_process(tmp_path, tmp_path / "single", "training.max_steps=4")
    out, port = tmp_path / "two-nodes", free_port()
    # gloo over the loopback interface, as the network section asks
    settings = ["training.max_steps=4", "network.socket_ifname=lo"]
    node1 = start_node(tmp_path, out, 1, port, *settings)  # node 1 first: any order works
    waiting = "node 1 of 2 on"
    deadline = time.monotonic() + 120
    while waiting not in (tmp_path / f"node1-{out.name}.log").read_text():
        assert node1.poll() is None and time.monotonic() < deadline, "node 1 never reached the rendezvous"
        time.sleep(0.5)
    time.sleep(3)  # node 1 waits at the rendezvous a while before node 0 starts
    node0 = start_node(tmp_path, out, 0, port, *settings)
    logs = [finish(tmp_path, node0, 0, out), finish(tmp_path, node1, 1, out)]
    assert node0.returncode == 0 and node1.returncode == 0, logs[0][-3000:] + logs[1][-3000:]
    assert losses(out) == pytest.approx(reference, rel=1e-5)
    for node_rank, log in enumerate(logs):
        banner = next(line for line in log.splitlines() if line.startswith("shardtune: ") and " node " in line)
        assert f"node {node_rank} of 2" in banner and "world size 2" in banner and f"127.0.0.1:{port}" in banner
        # Global ranks follow node ranks, whichever node reached the rendezvous first (node 1 here).
        assert f"global ranks {node_rank}-{node_rank} of world size 2" in banner
    assert (out / "final" / "adapter_model.safetensors").is_file()


def test_a_node_that_never_comes_is_named_within_the_timeout(tmp_path):
    out, port = tmp_path / "alone", free_port()
    started = time.monotonic()
    node0 = start_node(tmp_path, out, 0, port, "training.max_steps=2", options=["--join-timeout", "8"])
    log = finish(tmp_path, node0, 0, out, timeout=120)
    assert node0.returncode == 2, log[-3000:]
    assert time.monotonic() - started < 60
    assert "for node rank(s) 1 of 2, which never arrived (arrived: node 0 on" in log
    assert "--join-timeout" in log


# TEST-NET-1 (RFC 5737): an address of no machine here, which takes no connection.
UNREACHABLE = "192.0.2.1"
# What a launcher prints while it waits for an unreachable store: the time, then this.
WAITING_FOR_THE_STORE = (
    r"\d\d:\d\d:\d\d INFO node 1 of 2 on .+: waiting up to {timeout} s for the rendezvous store at {endpoint}"
)


def start_alone(tmp_path: Path, endpoint: str, join_timeout: str) -> subprocess.Popen:
    """Node 1 of 2, whose rendezvous store would be at ``endpoint``, on another machine; in a process group of its
    own, as a terminal starts a command. Its stdout and stderr go to ``node1.out`` and ``node1.err``."""
    command = [
        sys.executable, "-m", "shardtune", "launch", "examples/quickstart.yaml", "--nnodes", "2", "--node-rank", "1",
        "--rdzv-endpoint", endpoint, "--nproc-per-node", "1", "--join-timeout", join_timeout,
        *overrides(tmp_path, tmp_path / "run"),
    ]  # fmt: skip
    with open(tmp_path / "node1.out", "w") as out, open(tmp_path / "node1.err", "w") as err:
        return subprocess.Popen(command, cwd=REPO, env=ENV, stdout=out, stderr=err, start_new_session=True)


def test_an_unreachable_rendezvous_store_is_one_line_within_the_join_timeout(tmp_path):
    """TCPStore's own connect lasted twice the join timeout and printed a C++ stack for every try."""
    endpoint = f"{UNREACHABLE}:{free_port()}"
    node1 = start_alone(tmp_path, endpoint, "2")
    assert node1.wait(timeout=120) == 2, (tmp_path / "node1.err").read_text()
    assert (tmp_path / "node1.out").read_text() == ""
    waiting, error = (tmp_path / "node1.err").read_text().splitlines()
    assert re.fullmatch(WAITING_FOR_THE_STORE.format(timeout=2, endpoint=re.escape(endpoint)), waiting)
    assert error.startswith(
        f"shardtune: error: node 1: could not reach the rendezvous store at {endpoint} within 2 s (--join-timeout): "
        f"is the node at {UNREACHABLE} started, and port {endpoint.split(':')[1]} open between the nodes? (last try: "
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("signum", "status", "line"),
    [
        (signal.SIGINT, 130, "shardtune: SIGINT: stopped (launch)"),
        (signal.SIGTERM, 75, "shardtune: SIGTERM before the workers ran: stopping"),
    ],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_while_waiting_for_the_rendezvous_store_stops_at_once(tmp_path, signum, status, line):
    """TCPStore's connect held a signal off until it gave up (twice the join timeout), and SIGTERM then ended in a
    traceback."""
    endpoint = f"{UNREACHABLE}:{free_port()}"
    node1 = start_alone(tmp_path, endpoint, "600")
    log = tmp_path / "node1.err"
    try:
        deadline = time.monotonic() + 60
        while not log.read_text().endswith("\n"):  # the launcher says it waits for the store, then waits
            assert node1.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        (waiting,) = log.read_text().splitlines()
        assert re.fullmatch(WAITING_FOR_THE_STORE.format(timeout=600, endpoint=re.escape(endpoint)), waiting)
        os.killpg(node1.pid, signum)
        assert node1.wait(timeout=20) == status
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
    assert (tmp_path / "node1.out").read_text() == ""
    assert log.read_text().splitlines()[1:] == [line]


def test_two_nodes_claiming_one_rank_are_told(tmp_path):
    out, port = tmp_path / "same-rank", free_port()
    first = start_node(tmp_path, out, 0, port, "training.max_steps=2", options=["--join-timeout", "8"])
    time.sleep(3)
    second = start_node(tmp_path, out / "b", 0, port, "training.max_steps=2", options=["--join-timeout", "8"])
    logs = [finish(tmp_path, first, 0, out, 120), finish(tmp_path, second, 0, out / "b", 120)]
    assert first.returncode != 0 and second.returncode == 2
    assert "another node already joined" in logs[1] and "as node rank 0" in logs[1]


def _wait_for(path_glob: Path, count: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(list(path_glob.parent.glob(path_glob.name))) < count:
        assert time.monotonic() < deadline, f"no {count} x {path_glob} within {timeout} s"
        time.sleep(0.1)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the workers through /proc")
# The soak (tests/launch/test_soak.py) kills workers at random steps and checks the restarts too.
@pytest.mark.variants
def test_a_killed_worker_is_restarted_and_training_resumes(tmp_path):
    steps = ["training.max_steps=8", "training.save_steps=2"]
    reference = single_process(tmp_path, tmp_path / "single", *steps)
    out, port = tmp_path / "restarted", free_port()
    options = ["--max-restarts", "1"]
    nodes = [start_node(tmp_path, out, rank, port, *steps, options=options) for rank in (0, 1)]
    _wait_for(out / "checkpoint-4", 1)
    victims = children_of(nodes[1].pid)
    assert victims, "node 1 has a worker"
    os.kill(victims[0], signal.SIGKILL)
    logs = [finish(tmp_path, node, rank, out) for rank, node in enumerate(nodes)]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "restart 1" in logs[0] and "resumed from" in logs[0]
    assert losses(out) == pytest.approx(reference, rel=1e-5)


@pytest.mark.variants
def test_sigusr1_commits_a_checkpoint_and_the_next_run_resumes(tmp_path):
    steps = ["training.max_steps=60"]
    out, port = tmp_path / "preempted", free_port()
    nodes = [start_node(tmp_path, out, rank, port, *steps) for rank in (0, 1)]
    deadline = time.monotonic() + 300
    while not (out / "logs/train_log.jsonl").is_file() or len(losses(out)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    nodes[1].send_signal(signal.SIGUSR1)  # one node told; the other learns at the step boundary
    logs = [finish(tmp_path, node, rank, out) for rank, node in enumerate(nodes)]
    assert [node.returncode for node in nodes] == [75, 75], logs[0][-3000:] + logs[1][-3000:]
    committed = sorted(out.glob("checkpoint-*"))
    assert len(committed) == 1
    manifest = json.loads((committed[0] / "manifest.json").read_text())
    assert manifest["mode"] == "full" and 2 <= manifest["step"] < 60
    assert "SIGUSR1: stopping after step" in logs[0] + logs[1]

    port = free_port()
    again = [start_node(tmp_path, out, rank, port, *steps, "training.resume_from_checkpoint=auto") for rank in (0, 1)]
    logs = [finish(tmp_path, node, rank, out) for rank, node in enumerate(again)]
    assert [node.returncode for node in again] == [0, 0], logs[0][-3000:]
    assert f"checkpoint-{manifest['step']} (step {manifest['step']}" in logs[0]
    reference = single_process(tmp_path, tmp_path / "single", *steps)
    assert losses(out) == pytest.approx(reference, rel=1e-5)
