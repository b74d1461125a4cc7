"""Checkpoints on node-local storage: two "nodes", each a process in its own mount and UTS namespace,
so the same output path is a different disk on each, and each has its own host name."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from test_checkpoints import ENV, adapter, command, interrupt_after, losses, train

from shardtune.run_dir import existing_run_artifacts

HOSTS = ["node-a", "node-b"]


def _namespaces_available() -> bool:
    script = "hostname x && mount -t tmpfs none /mnt"
    probe = ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script]
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = pytest.mark.skipif(
    not _namespaces_available(), reason="needs unshare with mount and UTS namespaces (root) to give each rank a disk"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_on_two_nodes(tmp_path: Path, *overrides: str) -> list[subprocess.CompletedProcess]:
    """One rank per node; each node sees its own disk (tmp_path/node-a or node-b) at tmp_path/run."""
    mount_point = tmp_path / "run"
    mount_point.mkdir(exist_ok=True)
    port = _free_port()
    processes = []
    for rank, host in enumerate(HOSTS):
        disk = tmp_path / host
        disk.mkdir(exist_ok=True)
        train_command = command(tmp_path, mount_point, 1, f"data.cache_dir={mount_point / 'cache'}", *overrides)
        train_command.remove("--nproc")
        train_command.remove("1")
        script = f"hostname {host} && mount --bind {disk} {mount_point} && exec {shlex.join(train_command)}"
        env = {
            **ENV, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        }  # fmt: skip
        unshare = ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script]
        processes.append(
            subprocess.Popen(unshare, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return results


def succeeded(results: list[subprocess.CompletedProcess]) -> str:
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    return results[0].stderr


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.variants), "fsdp"])
def test_each_node_commits_its_own_shards_and_resumes(tmp_path, strategy):
    common = [f"parallel.strategy={strategy}", "lora.lora_dropout=0", "training.save_steps=2"]
    straight = tmp_path / "straight"
    train(tmp_path, straight, 2, *common, "training.max_steps=4")

    succeeded(train_on_two_nodes(tmp_path, *common, "training.max_steps=4"))
    for host in HOSTS:
        interrupt_after(tmp_path / host, 2)
    node_a, node_b = (tmp_path / host / "checkpoint-2" for host in HOSTS)
    for node, index in ((node_a, 0), (node_b, 1)):
        # Each node committed its own copy: manifest, trainer state, config, tokenizer and its shards.
        assert {"manifest.json", "trainer.json", "config.yaml", "tokenizer.json"} <= {p.name for p in node.iterdir()}
        assert [p.name for p in (node / "model").iterdir()] == [f"node-{index}"]
        assert (node / f"model/node-{index}/.metadata").is_file()
    manifest = json.loads((node_a / "manifest.json").read_text())
    assert manifest == json.loads((node_b / "manifest.json").read_text())
    assert manifest["storage"] == {
        "kind": "node-local",
        "nodes": [
            {"name": "node-0", "host": "node-a", "ranks": [0]},
            {"name": "node-1", "host": "node-b", "ranks": [1]},
        ],
    }
    for rank, node in ((0, node_a), (1, node_b)):
        for entry in manifest["files"][str(rank)]:
            assert entry["host"] == HOSTS[rank]
            assert (node / entry["path"]).stat().st_size == entry["bytes"]

    # The same two nodes resume from their own disks and continue exactly.
    log = succeeded(
        train_on_two_nodes(tmp_path, *common, "training.max_steps=4", "training.resume_from_checkpoint=auto")
    )
    assert "checkpoint-2 (step 2, saved by 2 rank(s)" in log
    resumed = losses(tmp_path / "node-a")
    assert resumed[2:] == pytest.approx(losses(straight)[2:], rel=1e-5)


@pytest.mark.variants
def test_a_resume_lacking_another_nodes_shards_names_them_and_where(tmp_path):
    common = ["parallel.strategy=fsdp", "lora.lora_dropout=0", "training.save_steps=2", "training.max_steps=2"]
    succeeded(train_on_two_nodes(tmp_path, *common))
    only_a = tmp_path / "node-a" / "checkpoint-2"
    result = train(
        tmp_path, tmp_path / "alone", 1, *common, "training.max_steps=3", f"training.resume_from_checkpoint={only_a}",
        expect=2,
    )  # fmt: skip
    assert "have shards that are not here" in result.stderr
    assert "model/node-1/__0_0.distcp (written by rank 1 on node-b)" in result.stderr
    assert "optimizer/node-1/" in result.stderr

    # Gathering node-b's copy next to node-a's makes the checkpoint whole: one process resumes from it.
    shutil.copytree(tmp_path / "node-b" / "checkpoint-2", only_a, dirs_exist_ok=True)
    log = train(
        tmp_path, tmp_path / "alone", 1, *common, "training.max_steps=3", f"training.resume_from_checkpoint={only_a}",
        "training.gradient_accumulation_steps=2",
    ).stderr  # fmt: skip
    assert "resumed from" in log
    assert adapter(tmp_path / "alone").keys()


@pytest.mark.variants
def test_replicated_lora_resumes_from_one_node_alone(tmp_path):
    """DDP keeps a whole copy of the adapter on every node, so one node's disk is enough for one process."""
    common = ["parallel.strategy=ddp", "lora.lora_dropout=0", "training.save_steps=2"]
    straight = tmp_path / "straight"
    train(tmp_path, straight, 2, *common, "training.max_steps=4")
    succeeded(train_on_two_nodes(tmp_path, *common, "training.max_steps=4"))
    only_a = tmp_path / "node-a" / "checkpoint-2"
    train(
        tmp_path, tmp_path / "alone", 1, *common, "training.max_steps=4", f"training.resume_from_checkpoint={only_a}",
        "training.gradient_accumulation_steps=2",
    )  # fmt: skip
    assert losses(tmp_path / "alone") == pytest.approx(losses(straight)[2:], rel=1e-5)


@pytest.mark.variants
def test_overwrite_output_dir_clears_the_previous_run_from_every_nodes_disk(tmp_path):
    """Rotation runs on each node's own disk: an old checkpoint left on node-b would outlive the new run's."""
    common = ["parallel.strategy=ddp", "lora.lora_dropout=0", "training.checkpoint_mode=lite"]
    succeeded(train_on_two_nodes(tmp_path, *common, "training.max_steps=4", "training.save_steps=2"))
    for host in HOSTS:
        (tmp_path / host / "notes.txt").write_text(f"{host}'s notes\n")
    succeeded(
        train_on_two_nodes(
            tmp_path, *common, "training.overwrite_output_dir=true", "training.max_steps=3", "training.save_steps=1",
            "training.save_total_limit=2",
        )
    )  # fmt: skip
    for host in HOSTS:
        assert sorted(p.name for p in (tmp_path / host).glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"], host
        assert (tmp_path / host / "notes.txt").read_text() == f"{host}'s notes\n"
    log = succeeded(
        train_on_two_nodes(tmp_path, *common, "training.max_steps=4", "training.resume_from_checkpoint=auto")
    )
    assert "checkpoint-3 (step 3, saved by 2 rank(s)" in log


@pytest.mark.variants
def test_a_run_holding_another_nodes_disk_stops_every_rank_with_one_line_before_anything_is_removed(tmp_path):
    """The output directory is node-local, and node-b's copy is in use by another run (a job sharing only that node):
    the run stops on every rank with one line naming that run and the disk, before rank 0 clears its own copy for
    ``overwrite_output_dir`` and before anything on node-b is touched."""
    common = [
        "parallel.strategy=ddp",
        "lora.lora_dropout=0",
        "training.max_steps=2",
        "training.overwrite_output_dir=true",
    ]
    for host in HOSTS:
        (tmp_path / host / "checkpoint-9").mkdir(parents=True)
        (tmp_path / host / "checkpoint-9" / "manifest.json").write_text("{}")  # a shardtune checkpoint's mark
        (tmp_path / host / "checkpoint-9" / "notes.txt").write_text(f"{host}'s run\n")
    hold = "import sys, time; from pathlib import Path; from shardtune.run_lock import RunLock; "
    hold += "lock = RunLock.take(Path(sys.argv[1])); print('held', flush=True); time.sleep(600)"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(tmp_path / "node-b")], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        results = train_on_two_nodes(tmp_path, *common)
    finally:
        holder.kill()
        holder.wait()
    assert [result.returncode for result in results] == [2, 2], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    errors = [line for result in results for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, errors
    assert re.fullmatch(
        rf"shardtune: error: training\.output_dir: {re.escape(str(tmp_path / 'run'))} is in use by another run "
        rf"\(host {re.escape(socket.gethostname())}, pid {holder.pid}, started [0-9T:+-]+\); wait for it to end, or "
        r"choose another output_dir \(on node-b's disk\)",
        errors[0],
    ), errors[0]
    for host in HOSTS:
        assert (tmp_path / host / "checkpoint-9" / "notes.txt").read_text() == f"{host}'s run\n"
        assert not list((tmp_path / host).glob("logs")), host

    # Once that run is gone, the same command takes both disks, and overwrite_output_dir clears both.
    succeeded(train_on_two_nodes(tmp_path, *common))
    for host in HOSTS:
        assert not (tmp_path / host / "checkpoint-9").exists(), host
        assert not (tmp_path / host / ".shardtune.lock").exists(), host


def test_a_previous_run_on_another_nodes_disk_stops_a_fresh_run_on_every_rank_with_one_line(tmp_path):
    """Rank 0's copy is empty but node-b's holds an earlier run: without ``overwrite_output_dir`` the fresh run
    stops on every rank with one line naming node-b's disk, leaving both disks as they were (its old checkpoints
    would otherwise be rotated with the new run's there, and ``auto`` resume would see them)."""
    common = [
        "parallel.strategy=ddp",
        "lora.lora_dropout=0",
        "training.max_steps=2",
        "training.overwrite_output_dir=false",
    ]
    (tmp_path / "node-a").mkdir()
    (tmp_path / "node-b" / "checkpoint-9").mkdir(parents=True)
    (tmp_path / "node-b" / "checkpoint-9" / "manifest.json").write_text("{}")  # a shardtune checkpoint's mark
    (tmp_path / "node-b" / "checkpoint-9" / "notes.txt").write_text("node-b's run\n")
    results = train_on_two_nodes(tmp_path, *common)
    assert [result.returncode for result in results] == [2, 2], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    errors = [line for result in results for line in result.stderr.splitlines() if "error" in line]
    assert errors == [
        f"shardtune: error: training.output_dir: {tmp_path / 'run'} already holds a run (checkpoint-9); choose "
        "another output_dir or set training.overwrite_output_dir=true (on node-b's disk)"
    ]
    assert (tmp_path / "node-b" / "checkpoint-9" / "notes.txt").read_text() == "node-b's run\n"
    assert existing_run_artifacts(tmp_path / "node-a") == []
    assert existing_run_artifacts(tmp_path / "node-b") == ["checkpoint-9"]


@pytest.mark.variants
def test_auto_resume_with_no_checkpoint_on_every_node_never_replaces_the_finished_run(tmp_path):
    """node-a holds the finished run and its checkpoint, node-b lost its copy of the checkpoint: ``auto`` has
    nothing every node can continue from, and starting over would replace final/ on node-a, so every rank stops with
    one line."""
    common = ["parallel.strategy=ddp", "lora.lora_dropout=0", "training.checkpoint_mode=lite"]
    succeeded(train_on_two_nodes(tmp_path, *common, "training.max_steps=2", "training.save_steps=2"))
    shutil.rmtree(tmp_path / "node-b" / "checkpoint-2")
    adapter_bytes = (tmp_path / "node-a" / "final" / "adapter_model.safetensors").read_bytes()
    results = train_on_two_nodes(
        tmp_path, *common, "training.max_steps=4", "training.resume_from_checkpoint=auto",
        "training.overwrite_output_dir=false",
    )  # fmt: skip
    assert [result.returncode for result in results] == [2, 2], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    errors = [line for result in results for line in result.stderr.splitlines() if "error" in line]
    assert errors == [
        f"shardtune: error: training.resume_from_checkpoint: auto found no checkpoint to continue from in "
        f"{tmp_path / 'run'}, which holds a finished run (final, metrics.json); to train again from the start and "
        "replace it, set training.overwrite_output_dir=true, or choose another output_dir"
    ]
    assert (tmp_path / "node-a" / "final" / "adapter_model.safetensors").read_bytes() == adapter_bytes
