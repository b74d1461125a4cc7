"""Two workers (gloo, CPU, fp32) with DDP or FSDP2 train exactly like one worker with twice the
accumulation: same per-step losses, same exported weights, and FSDP holds half the parameters."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_runs import RunsOnDemand, train
from conftest import REPO
from safetensors.torch import load_file

STEPS = 5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("dp")
    one = "training.gradient_accumulation_steps=2"
    chunk = "training.loss_chunk_tokens=50"
    # The long-sequence settings: tiled MLPs, checkpointed layers with their inputs in host memory.
    long = [
        "training.mlp_chunk_tokens=24",
        "training.gradient_checkpointing=true",
        "training.activation_offloading=true",
    ]
    full = "lora.enabled=false"
    ac = "training.gradient_checkpointing=true"

    def run(name: str, nproc: int, *overrides: str):
        return lambda: train(tmp_path, name, nproc, *overrides)

    return RunsOnDemand({
        ("lora", "single"): run("lora-1", 1, one),
        ("lora", "ddp"): run("lora-ddp", 2, "parallel.strategy=ddp"),
        ("lora", "fsdp"): run("lora-fsdp", 2, "parallel.strategy=fsdp"),
        # The seed's crash: DDP + LoRA + gradient checkpointing.
        ("lora", "ddp+ac"): run("lora-ddp-ac", 2, "parallel.strategy=ddp", ac),
        ("lora", "fsdp+ac"): run("lora-fsdp-ac", 2, "parallel.strategy=fsdp", ac),
        # The chunked loss, inside the forward that DDP and FSDP wrap (and in evaluation).
        ("lora", "ddp+chunk"): run("lora-ddp-chunk", 2, "parallel.strategy=ddp", chunk),
        ("lora", "fsdp+chunk"): run("lora-fsdp-chunk", 2, "parallel.strategy=fsdp", chunk),
        ("full", "ddp+chunk"): run("full-ddp-chunk", 2, "parallel.strategy=ddp", full, chunk),
        ("full", "fsdp+chunk"): run("full-fsdp-chunk", 2, "parallel.strategy=fsdp", full, chunk),
        ("lora", "fsdp+long"): run("lora-fsdp-long", 2, "parallel.strategy=fsdp", *long, "logging.profile_steps=[2,3]"),
        ("full", "ddp+long"): run("full-ddp-long", 2, "parallel.strategy=ddp", full, *long),
        ("full", "single"): run("full-1", 1, one, full),
        ("full", "ddp+ac"): run("full-ddp-ac", 2, "parallel.strategy=ddp", full, ac),
        ("full", "ddp"): run("full-ddp", 2, "parallel.strategy=ddp", full),
        ("full", "fsdp"): run("full-fsdp", 2, "parallel.strategy=fsdp", full),
        ("full", "fsdp+ac"): run(
            "full-fsdp-ac", 2, "parallel.strategy=fsdp", full, ac, "training.gradient_checkpointing_every=2"
        ),
    })  # fmt: skip


STRATEGIES = ["ddp", "fsdp", "ddp+ac", "fsdp+ac", "ddp+chunk", "fsdp+chunk", "long"]
# The cases CI runs (each setting at least once, with LoRA or full fine-tuning: plain DDP and FSDP run inside every
# other setting); the whole matrix:
# python -m pytest -m data_parallel
IN_CI = {
    ("lora", "ddp+ac"), ("lora", "fsdp+chunk"), ("lora", "long"), ("full", "fsdp+ac"), ("full", "ddp+chunk"),
}  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "strategy"),
    [
        pytest.param(
            kind,
            strategy,
            marks=[pytest.mark.data_parallel, *([pytest.mark.representative] if (kind, strategy) in IN_CI else [])],
        )
        for kind in ("lora", "full")
        for strategy in STRATEGIES
    ],
)
def test_two_workers_match_one(runs, kind, strategy):
    if strategy == "long":
        strategy = "fsdp+long" if kind == "lora" else "ddp+long"
    reference, run = runs[(kind, "single")], runs[(kind, strategy)]
    assert len(reference["losses"]) == STEPS
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert run["metrics"]["world_size"] == 2 and run["metrics"]["strategy"] == strategy.split("+")[0]
    assert run["metrics"]["tokens"] == reference["metrics"]["tokens"]
    assert len(run["metrics"]["tokens_per_rank"]) == 2
    # Nothing but the run's own lines: no library's deprecation warning on every rank (DDP's broadcast_buffers).
    assert "Warning" not in run["log"], run["log"][-3000:]


def _launch(tmp_path: Path, launcher_env: list[dict], command: list[str]) -> list[float]:
    out = tmp_path / "run"
    args = [
        "examples/quickstart.yaml", f"training.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}",
        f"training.max_steps={STEPS}", "training.logging_steps=1", "training.per_device_train_batch_size=2",
        "training.eval_on_start=false", "training.eval_steps=null", "lora.lora_dropout=0", "parallel.strategy=ddp",
    ]  # fmt: skip
    base = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    processes = [
        subprocess.Popen([*command, *args], cwd=REPO, env={**base, **extra}, stderr=subprocess.PIPE, text=True)
        for extra in launcher_env
    ]
    errors = [process.communicate(timeout=600)[1] for process in processes]
    assert [process.returncode for process in processes] == [0] * len(processes), errors[0][-3000:]
    return [json.loads(line)["loss"] for line in (out / "logs/train_log.jsonl").read_text().splitlines()]


def test_runs_unchanged_under_torchrun(runs, tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    losses = _launch(tmp_path, [{}], [*torchrun, "-m", "shardtune", "train"])
    assert losses == pytest.approx(runs[("lora", "single")]["losses"], rel=1e-5)


def test_runs_as_the_tasks_of_srun(runs, tmp_path):
    """What srun gives each task: SLURM_* variables, no RANK; the job script sets MASTER_ADDR/PORT."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tasks = [
        {"SLURM_NTASKS": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS_PER_NODE": "2",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        for rank in range(2)
    ]  # fmt: skip
    losses = _launch(tmp_path, tasks, [sys.executable, "-m", "shardtune", "train"])
    assert losses == pytest.approx(runs[("lora", "single")]["losses"], rel=1e-5)


def test_checkpointing_is_applied(runs):
    assert "INFO gradient checkpointing on every layer\n" in runs[("lora", "ddp+ac")]["log"]
    assert "INFO gradient checkpointing on 2 of 4 layers\n" in runs[("full", "fsdp+ac")]["log"]
    assert "INFO gradient checkpointing off (auto)\n" in runs[("lora", "fsdp")]["log"]  # the default, on CPU
    long = runs[("lora", "fsdp+long")]
    assert "INFO gradient checkpointing on every layer\n" in long["log"]
    assert "activation offloading: checkpointed layers keep their inputs in host memory" in long["log"]
    assert "tiled MLPs: 4 decoder MLPs run 24 tokens at a time" in long["log"]


def test_profiled_steps_leave_a_report_and_a_trace_per_rank(runs):
    profile = runs[("lora", "fsdp+long")]["out"] / "profile"
    for rank in (0, 1):
        report = (profile / f"rank{rank}.txt").read_text()
        assert report.startswith("steps 2..3: ") and "ms per step" in report and "by host time:" in report
        # Python's garbage collections in the profiled steps: none, or how many of which generation and how long.
        assert re.fullmatch(r"python gc: (no collection|(generation \d: \d+ \([\d.]+ ms, longest [\d.]+ ms\)(, )?)+)",
                            report.splitlines()[1])  # fmt: skip
        assert "aten::mm" in report
        assert (profile / f"rank{rank}.trace.json.gz").stat().st_size > 1000


# A DDP and an FSDP run of each kind, one of them among the runs CI trains anyway (IN_CI): checkpointed layers
# change no weight (the chunked loss's other summation order moves a rare Adam update by 1e-4).
DDP_AND_FSDP = {"lora": ("ddp+ac", "fsdp"), "full": ("ddp", "fsdp+ac")}


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_exported_weights_match_one_worker(runs, kind):
    name = "adapter_model.safetensors" if kind == "lora" else "model.safetensors"
    reference = load_file(runs[(kind, "single")]["out"] / "final" / name)
    for strategy in DDP_AND_FSDP[kind]:
        weights = load_file(runs[(kind, strategy)]["out"] / "final" / name)
        assert weights.keys() == reference.keys()
        for key in reference:
            torch.testing.assert_close(weights[key], reference[key], rtol=1e-4, atol=1e-5)


def test_fsdp_holds_half_the_parameters(runs):
    ddp, fsdp = (runs[("full", strategy)]["metrics"]["parameter_bytes_per_rank"] for strategy in DDP_AND_FSDP["full"])
    assert ddp[0] == ddp[1]
    for rank_bytes in fsdp:
        assert rank_bytes == pytest.approx(ddp[0] / 2, rel=0.02)


def test_an_fsdp_adapter_save_gathers_the_trained_weights_alone(runs):
    """The final save of a LoRA run under FSDP gathers the adapter to rank 0, not the frozen base as well
    (the whole model through one host's memory, for a file of the adapter's size)."""
    trained = sum(
        t.numel() * 4
        for t in load_file(runs[("lora", "single")]["out"] / "final" / "adapter_model.safetensors").values()
    )
    # Runs CI trains anyway (``IN_CI``).
    lora = re.findall(
        r"final save: gathered (.+) to rank 0 \(([\d.]+) (KiB|MiB)\)", runs[("lora", "fsdp+chunk")]["log"]
    )
    assert [(which, unit) for which, _, unit in lora] == [("the trained weights", "KiB" if trained < 2**20 else "MiB")]
    scale = 2**10 if lora[0][2] == "KiB" else 2**20
    assert float(lora[0][1]) * scale == pytest.approx(trained, rel=0.01)
    full = re.findall(r"final save: gathered (.+) to rank 0", runs[("full", "fsdp+ac")]["log"])
    assert full == ["every weight"]
