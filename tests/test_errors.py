"""Every failure a user can cause or meet, from the command line: one line naming the file or key and what
to do, printed once however many workers met it, no traceback, exit status 2 (1 for the doctor's verdict)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_MODEL, write_jsonl
from faulty_runs import command, worker_env
from safetensors import safe_open
from test_doctor import free_port, table

from shardtune.doctor.report import FAIL

HOST = socket.gethostname()


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def errors(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("shardtune: error: ")]


def shardtune(*args: str, single_core: bool = False, env: dict[str, str | None] | None = None) -> Result:
    """``python -m shardtune ARGS``, as a user types it; ``single_core``: this process and its workers see one core;
    ``env``: variables set (or, given None, removed) for it."""
    one_core = (lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})) if single_core else None
    variables = worker_env()
    for name, value in (env or {}).items():
        variables.pop(name, None) if value is None else variables.__setitem__(name, value)
    result = subprocess.run(
        [sys.executable, "-m", "shardtune", *args], cwd=REPO, env=variables, capture_output=True, text=True,
        timeout=300, preexec_fn=one_core,
    )  # fmt: skip
    return Result(result.returncode, result.stdout, result.stderr)


def train(tmp_path: Path, nproc: int, *overrides: str, out: Path | None = None, **options) -> Result:
    """``shardtune train`` of the quickstart config (as ``faulty_runs`` runs it), into ``out``."""
    arguments = command(tmp_path, out or tmp_path / "run", nproc, *overrides)[3:]
    return shardtune(*arguments, **options)


def assert_one_line(result: Result, *lines: str, status: int = 2) -> None:
    """The run stopped with exactly ``lines`` as its errors, each once, and no traceback."""
    assert result.returncode == status, result.stderr[-4000:]
    assert result.errors == [f"shardtune: error: {line}" for line in lines], result.stderr[-4000:]
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-4000:]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A short one-process run with a full checkpoint at step 2 and its final/ adapter; copy before changing."""
    tmp_path = tmp_path_factory.mktemp("saved")
    result = train(tmp_path, 1, "training.max_steps=2", "training.save_steps=2")
    assert result.returncode == 0, result.stderr[-4000:]
    return tmp_path / "run"


def resume(tmp_path: Path, run: Path, nproc: int = 2) -> Result:
    return train(tmp_path, nproc, "training.max_steps=4", "training.resume_from_checkpoint=auto", out=run)


@pytest.mark.variants
def test_a_truncated_checkpoint_shard_is_named_with_the_host_that_wrote_it(tmp_path, saved_run):
    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    shard = run / "checkpoint-2" / "model" / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    result = resume(tmp_path, run)
    assert_one_line(
        result,
        f"training.resume_from_checkpoint: {run / 'checkpoint-2'} cannot be loaded here: {shard} is {size // 2:,} "
        f"bytes, but the manifest records {size:,} as written by rank 0 on {HOST}: it was truncated or changed after "
        f"the save; copy it again from {HOST}, or resume from an earlier checkpoint",
    )
    assert "resumed from" not in result.stderr


def test_a_checkpoint_shard_damaged_in_place_is_one_line(tmp_path, saved_run):
    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    shard = run / "checkpoint-2" / "model" / "__0_0.distcp"
    with open(shard, "r+b") as handle:  # the size stays; the content is gone
        handle.write(bytes(shard.stat().st_size // 2))
    assert_one_line(
        resume(tmp_path, run),
        f"training.resume_from_checkpoint: {run / 'checkpoint-2' / 'model'}: the shards do not read back "
        "(UnpicklingError on rank 0, 1): the checkpoint is damaged; resume from an earlier checkpoint",
    )


def test_a_damaged_checkpoint_is_one_line_for_export_and_eval(tmp_path, saved_run):
    """A shard cut short (its size differs from the manifest's) is named before any model is built; one damaged
    in place fails DCP's read. Both were a traceback from deep inside DCP's reader."""
    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    checkpoint = run / "checkpoint-2"
    shard = checkpoint / "model" / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    assert_one_line(
        shardtune("eval", str(run / "config.yaml"), "--checkpoint", str(checkpoint)),
        f"--checkpoint {checkpoint}: cannot be read: {shard} is {size // 2:,} bytes, but the manifest records "
        f"{size:,} as written by rank 0 on {HOST}: it was truncated or changed after the save; copy it again from "
        f"{HOST}, or use an earlier checkpoint of its run ({run} holds none that reads whole)",
    )
    shutil.copyfile(saved_run / "checkpoint-2" / "model" / "__0_0.distcp", shard)
    with open(shard, "r+b") as handle:  # the size stays; the content is gone
        handle.write(bytes(size // 2))
    assert_one_line(
        shardtune("export", str(checkpoint), "--out", str(tmp_path / "adapter")),
        f"{checkpoint}: cannot export: {checkpoint / 'model'}: the shards do not read back (UnpicklingError on "
        f"rank 0): the checkpoint is damaged; use an earlier checkpoint of its run ({run} holds none that reads whole)",
    )
    assert not (tmp_path / "adapter").exists()


@pytest.fixture(scope="module", params=["lite", pytest.param("full", marks=pytest.mark.variants)])
def three_checkpoints(request, tmp_path_factory) -> Path:
    """A one-process run with checkpoints at steps 2, 4 and 6, lite or full; copy before changing."""
    tmp_path = tmp_path_factory.mktemp(f"three-{request.param}")
    result = train(
        tmp_path, 1, "training.max_steps=6", "training.save_steps=2", f"training.checkpoint_mode={request.param}"
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return tmp_path / "run"


def garble(file: Path) -> None:
    """Its content gone, its size kept: the manifest's sizes do not tell."""
    file.write_bytes(b"x" * file.stat().st_size)


def test_a_damaged_checkpoint_names_the_earlier_ones_export_and_eval_can_use(tmp_path, three_checkpoints):
    """A checkpoint whose DCP metadata is damaged, cut, missing, or whose shard is cut: export and eval say so before
    any model is built, and name the earlier checkpoints of its run that read whole, newest first (a damaged one is
    left out). A damaged .metadata used to advise export and eval to "resume from an earlier checkpoint", a missing
    one gave no advice, and a cut one named no other checkpoint."""
    for case in ["garbled metadata", "empty metadata", "no metadata", "cut shard"]:
        run = Path(shutil.copytree(three_checkpoints, tmp_path / case / "run"))
        checkpoint, model = run / "checkpoint-6", run / "checkpoint-6" / "model"
        earlier = f"use an earlier checkpoint of its run: {run / 'checkpoint-4'}, {run / 'checkpoint-2'}"
        size = (model / ".metadata").stat().st_size
        if case == "garbled metadata":
            garble(model / ".metadata")
            problem = (
                f"{model}: its DCP metadata does not read (invalid load key, 'x'.): the checkpoint is damaged; "
                f"{earlier}"
            )
        elif case == "empty metadata":
            (model / ".metadata").write_bytes(b"")
            problem = (
                f"{model / '.metadata'} is 0 bytes, but the manifest records {size:,} as written by rank 0 on {HOST}: "
                f"it was truncated or changed after the save; copy it again from {HOST}, or {earlier}"
            )
        elif case == "no metadata":
            (model / ".metadata").unlink()
            garble(run / "checkpoint-4" / "model" / ".metadata")  # not named: it does not read either
            problem = (
                f"{model}: no .metadata, and no node-*/.metadata of a node-local save: the checkpoint is incomplete; "
                f"use an earlier checkpoint of its run: {run / 'checkpoint-2'}"
            )
        else:
            shard = model / "__0_0.distcp"
            size = shard.stat().st_size
            os.truncate(shard, size // 2)
            problem = (
                f"{shard} is {size // 2:,} bytes, but the manifest records {size:,} as written by rank 0 on {HOST}: "
                f"it was truncated or changed after the save; copy it again from {HOST}, or {earlier}"
            )
        out = tmp_path / case / "adapter"
        assert_one_line(
            shardtune("export", str(checkpoint), "--out", str(out)), f"{checkpoint}: cannot be read: {problem}"
        )
        assert not out.exists()
        assert_one_line(
            shardtune("eval", str(run / "config.yaml"), "--checkpoint", str(checkpoint)),
            f"--checkpoint {checkpoint}: cannot be read: {problem}",
        )
        assert not (checkpoint / "eval.json").exists()


def test_a_cut_optimizer_shard_stops_neither_export_nor_eval(tmp_path, saved_run):
    """export and eval read a checkpoint's weights alone: its optimizer state cut short (which a resume could not
    use) stopped both with the cut file's line."""
    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    checkpoint = run / "checkpoint-2"
    shard = checkpoint / "optimizer" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    exported = shardtune("export", str(checkpoint), "--out", str(tmp_path / "adapter"))
    assert exported.returncode == 0, exported.stderr[-2000:]
    # The checkpoint is the run's last step: its adapter is final/'s.
    files = [tmp_path / "adapter" / "adapter_model.safetensors", run / "final" / "adapter_model.safetensors"]
    with safe_open(files[0], "pt") as got, safe_open(files[1], "pt") as want:
        names = sorted(want.keys())
        assert sorted(got.keys()) == names
        for key in names:
            torch.testing.assert_close(got.get_tensor(key), want.get_tensor(key), rtol=0, atol=0)
    evaluated = shardtune("eval", str(run / "config.yaml"), "--checkpoint", str(checkpoint))
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert json.loads((checkpoint / "eval.json").read_text())["step"] == 2


def test_a_resume_from_a_checkpoint_without_its_metadata_is_one_line(tmp_path, saved_run):
    """Its .metadata gone: the line said only that it was missing."""
    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    model = run / "checkpoint-2" / "model"
    (model / ".metadata").unlink()
    assert_one_line(
        resume(tmp_path, run, nproc=1),
        f"training.resume_from_checkpoint: {run / 'checkpoint-2'} cannot be loaded here: {model}: no .metadata, and "
        "no node-*/.metadata of a node-local save: the checkpoint is incomplete; resume from an earlier checkpoint",
    )


@pytest.mark.parametrize("command", ["generate", "eval", "export"])
def test_an_adapter_without_its_weights_file_is_one_line(tmp_path, saved_run, command):
    """A final/ (or an export) copied without its adapter_model.safetensors: generate said the adapter "does not
    fit" the base, citing a hub id check; eval and export --merge stopped with that check's traceback."""
    final = Path(shutil.copytree(saved_run / "final", tmp_path / "final"))
    (final / "adapter_model.safetensors").unlink()
    arguments = {
        "generate": ["generate", str(final), "--instruction", "Say hi."],
        "eval": ["eval", str(saved_run / "config.yaml"), "--checkpoint", str(final)],
        "export": ["export", str(final), "--merge", "--out", str(tmp_path / "merged")],
    }[command]
    assert_one_line(
        shardtune(*arguments),
        f"{final / 'adapter_model.safetensors'} is missing (its adapter_config.json is there); export or copy it again",
    )


def test_a_checkpoint_of_other_shapes_names_the_tensor(tmp_path, world):
    """Whatever lets a checkpoint of another lora.r reach the load, the load itself says what differs."""
    import torch.distributed.checkpoint as dcp

    from shardtune.checkpoint.shards import ShardMismatch, ShardsReader, missing_shards

    dcp.save({"layer.lora_A.weight": torch.zeros(8, 64), "layer.bias": torch.zeros(64)}, checkpoint_id=tmp_path)
    wanted = {"layer.lora_A.weight": torch.zeros(16, 64), "layer.bias": torch.zeros(64)}
    with pytest.raises(ShardMismatch) as raised:
        missing_shards(wanted, ShardsReader(tmp_path))
    assert str(raised.value).startswith(
        "1 tensor(s) differ in shape: layer.lora_A.weight saved as [8, 64], here [16, 64]: the checkpoint was saved "
        "by a run with another model or adapter config (e.g. lora.r, lora.target_modules)"
    )
    with pytest.raises(ShardMismatch, match="Missing key in checkpoint state_dict: layer.lora_B.weight"):
        missing_shards({**wanted, "layer.lora_A.weight": torch.zeros(8, 64), "layer.lora_B.weight": torch.zeros(1)},
                       ShardsReader(tmp_path))  # fmt: skip


def truncated_copy(source: Path, target: Path, name: str) -> tuple[Path, int]:
    """A copy of ``source`` whose safetensors file ``name`` lost its second half; returns it and the full size."""
    shutil.copytree(source, target)
    weights = target / name
    size = weights.stat().st_size
    os.truncate(weights, size // 2)
    return weights, size


@pytest.mark.variants
def test_truncated_model_weights_are_named_before_anything_is_written(tmp_path):
    weights, size = truncated_copy(TINY_MODEL, tmp_path / "model", "model.safetensors")
    result = train(tmp_path, 1, f"model.name_or_path={tmp_path / 'model'}")
    assert_one_line(
        result,
        f"model.name_or_path: {weights} is truncated: {size // 2} bytes, expected {size}; download or copy the "
        "model again",
    )
    assert not (tmp_path / "run").exists()


def test_model_weights_missing_are_named_before_anything_is_written(tmp_path):
    """A model directory with its config but no weight file, and one whose index lists a shard not there."""
    bare = tmp_path / "bare"
    shutil.copytree(TINY_MODEL, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    assert_one_line(
        train(tmp_path, 2, f"model.name_or_path={bare}"),
        f"model.name_or_path: {bare} holds no weights (no *.safetensors or pytorch_model*.bin file); download or "
        "copy the model's weight files into it, or set model.init: random to train from random weights",
    )
    sharded = tmp_path / "sharded"
    shutil.copytree(TINY_MODEL, sharded)
    names = list(safe_open(sharded / "model.safetensors", "pt").keys())
    weight_map = {name: "model.safetensors" if index % 2 else "model-00002-of-00002.safetensors"
                  for index, name in enumerate(names)}  # fmt: skip
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_one_line(
        train(tmp_path, 1, f"model.name_or_path={sharded}"),
        f"model.name_or_path: {sharded} lacks 1 of its 2 weight files (first: model-00002-of-00002.safetensors, "
        "listed by its index); download or copy the model again",
    )
    assert not (tmp_path / "run").exists()


def test_a_truncated_adapter_is_named_by_generate(tmp_path, saved_run):
    adapter, size = truncated_copy(saved_run / "final", tmp_path / "final", "adapter_model.safetensors")
    result = shardtune("generate", str(tmp_path / "final"), "--instruction", "Say hi.")
    assert_one_line(result, f"{adapter} is truncated: {size // 2} bytes, expected {size}; export or copy it again")


def test_unwritable_output_and_cache_dirs_stop_every_worker_with_one_line_each(tmp_path):
    # Tests run as root, who may write anywhere: a directory below a regular file cannot exist for anyone.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    out, cache = blocker / "run", blocker / "cache"
    expected = [
        f"training.output_dir: cannot write {out} (Not a directory); set training.output_dir to a directory this "
        "user can create and write (on every node)",
        f"data.cache_dir: cannot write {cache} (Not a directory); set data.cache_dir to a directory this user can "
        "create and write (on every node)",
    ]
    assert_one_line(train(tmp_path, 2, f"data.cache_dir={cache}", out=out), *expected)

    # The doctor runs the same preflight: the same words, as failed rows of its table.
    doctor = shardtune(
        "doctor", "examples/quickstart.yaml", f"training.output_dir={out}", f"data.cache_dir={cache}",
        "--port", str(free_port()),
    )  # fmt: skip
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    rows = table(doctor.stdout)
    assert rows["0", "output dir"] == (FAIL, expected[0]) and rows["0", "cache dir"] == (FAIL, expected[1])


FLASH = (
    "model.attn_implementation: flash_attention_2 needs the flash-attn package, which is not installed: "
    "pip install flash-attn, or set model.attn_implementation: sdpa"
)


@pytest.mark.skipif(bool(__import__("importlib").util.find_spec("flash_attn")), reason="flash-attn is installed")
def test_flash_attention_without_the_package_and_the_doctor_agrees(tmp_path):
    assert_one_line(train(tmp_path, 1, "model.attn_implementation=flash_attention_2"), FLASH)
    assert not (tmp_path / "run").exists()
    doctor = shardtune(
        "doctor", "examples/quickstart.yaml", f"training.output_dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}", "model.attn_implementation=flash_attention_2",
        "--port", str(free_port()),
    )  # fmt: skip
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert table(doctor.stdout)["0", "kernels"] == (FAIL, FLASH)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "model.grouped_gemm=quack",
            "model.grouped_gemm: quack cannot run here: its kernels need a CUDA device; set it to auto or torch",
        ),
        pytest.param(  # test_layer_graphs.py checks the same line by default
            "parallel.cuda_graphs=true",
            "parallel.cuda_graphs: true needs a CUDA GPU; set parallel.cuda_graphs: auto or false",
            marks=pytest.mark.variants,
        ),
        (
            "model.attn_implementation=flex_attention",
            "model.attn_implementation: flex_attention trains on CUDA GPUs only (torch's FlexAttention has no backward "
            "on CPU); set model.attn_implementation: sdpa or auto on this machine",
        ),
    ],
    ids=["quack", "cuda-graphs", "flex-attention"],
)
def test_a_kernel_asked_for_where_it_cannot_run_is_one_line_before_anything_is_loaded(tmp_path, override, expected):
    assert_one_line(train(tmp_path, 1, override), expected)
    assert not (tmp_path / "run").exists()


def test_wandb_without_credentials_is_one_line_from_rank_0_and_no_worker_waits(tmp_path):
    pytest.importorskip("wandb")
    # No API key anywhere wandb looks (the variable, ~/.netrc, wandb's settings under HOME), and online mode.
    no_login = {"HOME": str(tmp_path), "WANDB_API_KEY": None, "WANDB_MODE": None, "WANDB_CONFIG_DIR": None,
                "NETRC": None}  # fmt: skip
    result = train(tmp_path, 2, "logging.wandb.enabled=true", env=no_login)
    assert_one_line(
        result,
        "logging.wandb: wandb.init failed (No API key configured. Use `wandb login` to log in.); log in on the node "
        "of global rank 0 (`wandb login`, or WANDB_API_KEY), or set logging.wandb.mode=offline and `wandb sync` the "
        "run later",
    )


def test_a_worker_killed_mid_run_is_one_line_from_its_peers_and_one_from_the_launcher(tmp_path):
    """A worker killed by a signal (the kernel's out-of-memory killer sends SIGKILL) leaves its peer waiting in a
    collective, which then fails in the transport: one line from the peer and one from the launcher naming the
    worker and the signal, with no traceback of the collective and no agent log line."""
    result = train(tmp_path, 2, "training.max_steps=5", env={"SHARDTUNE_FAULT": "forward_backward:kill:rank=1:step=3"})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-4000:]
    [lost] = result.errors
    assert re.fullmatch(
        r"shardtune: error: a worker left the run while the others waited for it in a collective \(Connection "
        r"(reset|closed) by peer\): it stopped without a word \(killed, out of host memory, or its node lost\); the "
        r"launcher's line names it",
        lost,
    ), lost
    killed = "shardtune: worker 1 was killed by SIGKILL: out of host memory (the kernel's OOM killer) or killed by hand"
    assert result.stderr.splitlines().count(killed) == 1, result.stderr[-4000:]
    assert "exitcode" not in result.stderr and "[rank0]" not in result.stderr, result.stderr[-4000:]


def test_a_metrics_package_not_installed_is_a_preflight_line(monkeypatch):
    from importlib import util

    from shardtune.config import Config
    from shardtune.errors import ConfigError
    from shardtune.metrics.sinks import check_logging_packages

    config = Config.model_validate({"model": {"name_or_path": "m"}, "data": {"dataset_path": "d.jsonl"},
                                    "logging": {"tensorboard": True, "wandb": {"enabled": True}}})  # fmt: skip
    assert check_logging_packages(config) == "JSONL, tensorboard, wandb"
    installed = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name: None if name in ("tensorboard", "wandb") else installed(name))
    with pytest.raises(ConfigError) as caught:
        check_logging_packages(config)
    assert caught.value.lines == [
        "logging.tensorboard: true needs the tensorboard package: pip install 'shardtune[tensorboard]'",
        "logging.wandb.enabled: true needs the wandb package: pip install 'shardtune[wandb]'",
    ]


def test_a_hub_warning_is_printed_once():
    """huggingface_hub's own warnings (the hub out of reach: a line for each of its retries) are printed once."""
    script = (
        "import logging; from shardtune.cli import setup_logging; setup_logging(True); "
        "logging.getLogger('huggingface_hub.utils._http').warning('Retrying in 1s [Retry 1/5].')"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.stderr.splitlines() == ["Retrying in 1s [Retry 1/5]."], result.stderr


def test_no_usable_row_counts_the_reasons_once_for_two_workers(tmp_path):
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, [
        {"instruction": "no output"},  # line 1: bad
        {"instruction": "word " * 300, "output": "cut off"},  # line 2: the response lies beyond max_length
        {"instruction": "no output either"},  # line 3: bad
    ])  # fmt: skip
    result = train(tmp_path, 2, f"data.dataset_path={data}", "data.on_bad_row=skip", "data.eval_split_ratio=0")
    assert_one_line(
        result,
        f"{data}: no training example left of 3 rows read: 2 bad (missing field 'output' (fields: ['instruction'])); "
        f"1 no target token left (e.g. the response cut off by data.max_length) (first: {data}:1, {data}:2); fix or "
        "replace the rows, or raise data.max_length (128)",
    )


@pytest.mark.variants
def test_an_eval_file_with_no_example_is_one_line_for_two_workers(tmp_path):
    """The run used to train on without evaluating, its log saying "eval: 0 examples"."""
    data = write_jsonl(tmp_path / "eval.jsonl", [{"instruction": "word " * 300, "output": "cut off"}])
    overrides = [f"data.eval_path={data}", "data.eval_split_ratio=0", "data.truncation=drop", "training.max_steps=2"]
    result = train(tmp_path, 2, *overrides)
    assert_one_line(
        result,
        f"{data}: no eval example left of 1 rows read: 1 longer than data.max_length with data.truncation: drop "
        f"(first: {data}:1); fix or replace the rows, or raise data.max_length (128), or leave data.eval_path out "
        "to train without evaluation",
    )
    assert not (tmp_path / "run" / "final").exists()


def test_no_usable_row_accounts_for_every_row_read(tmp_path, tokenizer):
    """The counts add up to the rows read: the eval rows held out are all counted, not the subset evaluated, and
    the rows data.subset_size left out are named."""
    from conftest import make_config

    from shardtune.data.prepare import prepare_dataset
    from shardtune.errors import DataError

    rows = [{"instruction": "word " * 300, "output": "cut off"}] * 1200  # every response beyond max_length
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    config = make_config(
        tmp_path, data, data={"eval_split_ratio": 0.1, "subset_size": 1000}, training={"eval_subset_size": 10}
    )
    with pytest.raises(DataError) as error:
        prepare_dataset(config, tokenizer)
    assert error.value.lines == [
        f"{data}: no training example left of 1,200 rows read: 1,000 no target token left (e.g. the response cut off "
        "by data.max_length); 120 held out for evaluation (data.eval_split_ratio); 80 left out by data.subset_size "
        f"(1,000) (first: {data}:1); fix or replace the rows, or raise data.max_length (128)"
    ]


def test_the_summary_lists_every_dropped_row(tmp_path, tokenizer):
    from conftest import make_config

    from shardtune.data.prepare import describe, prepare_dataset

    good = {"instruction": "Add 1 and 1.", "output": "2"}
    rows = [good, {"instruction": "x"}, {"instruction": "word " * 300, "output": "y"}, good, {"instruction": "z"}]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    config = make_config(tmp_path, data, data={"on_bad_row": "skip", "truncation": "drop"})
    summary = prepare_dataset(config, tokenizer).summary
    missing = "missing field 'output' (fields: ['instruction'])"
    assert summary["bad_row_locations"] == {missing: [f"{data}:2", f"{data}:5"]}
    assert summary["train"]["dropped_rows"] == {"too_long": [f"{data}:3"]}
    assert describe(summary).endswith(
        f"; rows dropped: bad row ({missing}): {data}:2, {data}:5; train too_long: {data}:3"
    )


@pytest.mark.variants
def test_worker_counts(tmp_path):
    assert_one_line(train(tmp_path, 0), "--nproc: must be at least 1, got 0")
    # Two workers on one core: a warning, once; then an output directory below a file stops both with one line.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    result = train(tmp_path, 2, out=blocker / "run", single_core=True)
    assert result.stderr.count("shardtune: warning:") == 1
    assert "shardtune: warning: --nproc: 2 workers on 1 CPU core(s): they will take turns" in result.stderr
    assert result.returncode == 2 and len(result.errors) == 1 and "Traceback" not in result.stderr


def tiny_model_with(tmp_path: Path, **settings) -> Path:
    directory = tmp_path / "model"
    shutil.copytree(TINY_MODEL, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **settings}))
    return directory


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ["model.dtype=bfloat16", "training.bf16=false"],
            "training.bf16: false contradicts model.dtype: bfloat16; set model.dtype: float32 (or auto) for full "
            "precision, or drop training.bf16",
        ),
        (
            ["parallel.cpu_offload=true", "parallel.strategy=ddp"],
            "parallel.cpu_offload: needs parallel.strategy: fsdp (got ddp)",
        ),
        (
            ["parallel.cpu_offload=true"],
            "parallel.cpu_offload: needs parallel.strategy: fsdp (got auto)",
        ),
        (
            ["training.loss_chunk_tokens=64", "model.name_or_path={scaled}"],
            "training.loss_chunk_tokens: not for {scaled}: it transforms its logits after the LM head "
            "(logit_scale), which a fused or chunked loss would skip; turn training.loss_chunk_tokens off",
        ),
        (
            ["lora.target_modules=null", "lora.moe_targets=[attention,routed_experts]", "lora.lora_dropout=0.1"],
            "lora.lora_dropout: must be 0 with lora.moe_targets routed_experts: PEFT adapts those weights directly, "
            "so there is no layer input to drop out (got 0.1; leave it unset or set 0)",
        ),
        (
            ["lora.target_modules=null", "lora.shared_expert_adapter=true"],
            "lora.shared_expert_adapter: needs routed_experts in lora.moe_targets, with target_modules null",
        ),
    ],
    ids=[
        "bf16-contradiction",
        "cpu-offload-ddp",
        "cpu-offload-auto",
        "logit-scale",
        "expert-dropout",
        "shared-adapter",
    ],
)
def test_config_only_contradictions_stop_before_anything_is_written(tmp_path, overrides, line):
    scaled = tiny_model_with(tmp_path, logit_scale=0.5)  # Cohere's: a transform the chunked loss does not apply
    overrides = [override.format(scaled=scaled) for override in overrides]
    assert_one_line(train(tmp_path, 2, *overrides), line.format(scaled=scaled))
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


# A machine the hub is out of reach of: no HF_HUB_OFFLINE, a hub whose name does not resolve (.invalid never
# does), a Hugging Face cache of the test's own.
NO_HUB = {"HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None, "HF_DATASETS_OFFLINE": None,
          "HF_ENDPOINT": "https://hub.invalid"}  # fmt: skip


def why_no_hub() -> str:
    """Why hub.invalid cannot be reached here, as the resolver says it (e.g. "Name or service not known")."""
    with pytest.raises(OSError) as error:
        socket.getaddrinfo("hub.invalid", 443)
    return error.value.strerror


def test_a_hub_model_not_in_the_cache_of_a_machine_without_the_hub_is_one_line_at_once(tmp_path):
    env = {**NO_HUB, "HF_HOME": str(tmp_path / "hf")}
    result = train(tmp_path, 1, "model.name_or_path=someone/some-model", env=env)
    assert result.returncode == 2, result.stderr[-4000:]
    # No retries (five over 23 s, two lines each) and no warning before the error: the line alone.
    assert result.stderr.strip().splitlines() == [
        "shardtune: error: model.name_or_path: someone/some-model is not in this machine's Hugging Face cache, and "
        f"hub.invalid cannot be reached from here ({why_no_hub()}): download it where the hub can be "
        "reached (hf download someone/some-model --local-dir DIR), copy DIR here and set model.name_or_path to it"
    ]


def test_a_hub_dataset_not_in_the_cache_names_the_download_of_a_dataset(tmp_path):
    """hf download fetches a model repository unless told otherwise: the line's command must say --repo-type dataset
    (without, it answers "repository not found" for a dataset's id)."""
    out = tmp_path / "out.jsonl"
    env = {**NO_HUB, "HF_HOME": str(tmp_path / "hf")}
    result = shardtune("convert", "someone/some-dataset", "--out", str(out), "--input-col", "q", "--output-col", "a",
                       env=env)  # fmt: skip
    assert_one_line(
        result,
        f"someone/some-dataset[train]: someone/some-dataset is not in this machine's Hugging Face cache, and "
        f"hub.invalid cannot be reached from here ({why_no_hub()}): download it where the hub can be reached (hf "
        "download someone/some-dataset --repo-type dataset --local-dir DIR), copy DIR here and name DIR in its place "
        "(a directory is read as the hub dataset is)",
    )
    assert not out.exists()


def test_a_hub_model_in_the_cache_trains_on_two_workers_without_the_hub(tmp_path):
    """The hub id resolves to its snapshot in the cache (as ``hf download`` left it) with no request tried."""
    snapshot = tmp_path / "hf" / "hub" / "models--someone--tiny-llama" / "snapshots" / ("0" * 40)
    shutil.copytree(TINY_MODEL, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    env = {**NO_HUB, "HF_HOME": str(tmp_path / "hf")}
    result = train(tmp_path, 2, "model.name_or_path=someone/tiny-llama", "training.max_steps=2", env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    said = [line for line in result.stderr.splitlines() if "cannot be reached" in line]
    assert len(said) == 1 and said[0].endswith(
        f"WARNING hub.invalid cannot be reached from here ({why_no_hub()}): hub ids are read from this "
        "machine's Hugging Face cache alone (HF_HUB_OFFLINE=1)"
    ), result.stderr[-4000:]
    assert "Retry" not in result.stderr and "Traceback" not in result.stderr
    adapter = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "someone/tiny-llama"
