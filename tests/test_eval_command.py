"""``shardtune eval``: a checkpoint's or a final/'s loss on eval data equals the run's own eval of that
step, in one process and in two (DDP and FSDP), and bad input is one line with exit status 2."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import jsonl, train
from conftest import REPO, TINY_DATA, make_config, write_jsonl

from shardtune.errors import EXIT_OUT_OF_MEMORY
from shardtune.out_of_memory import EVAL_ADVICE

# The eval rows are a file of their own, so that ``--data FILE`` can name exactly the run's eval data.
EVAL_ROWS = 6


def shardtune_eval(run: dict, *args: str, nproc: int = 1, fault: str | None = None) -> subprocess.CompletedProcess:
    """``shardtune eval`` with the run's config (the quickstart and the run's overrides), from the repo;
    ``fault``: SHARDTUNE_FAULT."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("SHARDTUNE_FAULT", None)
    if fault:
        env["SHARDTUNE_FAULT"] = fault
    return subprocess.run(
        [
            sys.executable, "-m", "shardtune", "eval", "examples/quickstart.yaml", "--nproc", str(nproc),
            *run["overrides"], *args,
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def run_with_checkpoints(tmp_path: Path, name: str, *overrides: str) -> dict:
    eval_file = write_jsonl(
        tmp_path / "eval.jsonl", [json.loads(line) for line in TINY_DATA.read_text().splitlines()[-EVAL_ROWS:]]
    )
    overrides = (
        f"data.cache_dir={tmp_path / 'cache'}", f"training.output_dir={tmp_path / name}",
        "data.eval_split_ratio=0", f"data.eval_path={eval_file}", "training.eval_subset_size=null",
        "training.per_device_eval_batch_size=1", "lora.lora_dropout=0", *overrides,
    )  # fmt: skip
    run = train(tmp_path, name, 1, *overrides, "training.eval_steps=2", "training.save_steps=2", steps=4)
    run["overrides"] = overrides
    run["eval_file"] = eval_file
    run["eval_loss"] = {row["step"]: row["eval_loss"] for row in jsonl(run["out"] / "logs/eval_log.jsonl")}
    assert sorted(run["eval_loss"]) == [2, 4]
    return run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> dict:
    return run_with_checkpoints(tmp_path_factory.mktemp("eval-lora"), "run")


def result_of(completed: subprocess.CompletedProcess, path: Path) -> dict:
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(path.read_text())
    assert f"loss {result['eval_loss']:.6f}, perplexity {result['eval_perplexity']:.4f}" in completed.stdout
    assert f"wrote {path}" in completed.stdout
    return result


@pytest.mark.variants
def test_eval_of_checkpoints_and_final_equals_the_runs_eval(lora_run: dict):
    out = lora_run["out"]
    for source, step in ((out / "checkpoint-2", 2), (out / "checkpoint-4", 4), (out / "final", 4)):
        result = result_of(shardtune_eval(lora_run, "--checkpoint", str(source)), source / "eval.json")
        assert result["step"] == step and result["world_size"] == 1, result
        assert result["examples"] == EVAL_ROWS
        assert result["eval_loss"] == pytest.approx(lora_run["eval_loss"][step], abs=1e-6), source
    # --data FILE, prepared like the config's data: the run's eval file gives the run's eval loss.
    data = shardtune_eval(
        lora_run, "--checkpoint", str(out / "checkpoint-2"), "--data", str(lora_run["eval_file"]),
        "--out", str(out.parent / "on-file.json"),
    )  # fmt: skip
    assert result_of(data, out.parent / "on-file.json")["eval_loss"] == pytest.approx(
        lora_run["eval_loss"][2], abs=1e-6
    )
    # Another file gives another loss: the data really is the file's.
    other = write_jsonl(
        out.parent / "other.jsonl", [json.loads(line) for line in TINY_DATA.read_text().splitlines()[:4]]
    )
    elsewhere = shardtune_eval(
        lora_run, "--checkpoint", str(out / "checkpoint-2"), "--data", str(other), "--out", str(out.parent / "o.json")
    )
    result = result_of(elsewhere, out.parent / "o.json")
    assert result["examples"] == 4 and abs(result["eval_loss"] - lora_run["eval_loss"][2]) > 1e-3


# DDP's case is in the data-parallel matrix (python -m pytest -m data_parallel); FSDP's, whose ranks evaluate from
# shards, runs by default.
@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param("ddp", marks=pytest.mark.data_parallel),
        pytest.param("fsdp", marks=[pytest.mark.data_parallel, pytest.mark.representative]),
    ],
)
def test_eval_on_two_processes_equals_the_single_process_runs_eval(lora_run: dict, strategy: str):
    out = lora_run["out"]
    for source, step in ((out / "checkpoint-2", 2), (out / "final", 4)):
        target = out.parent / f"{strategy}-{source.name}.json"
        completed = shardtune_eval(
            lora_run, "--checkpoint", str(source), "--out", str(target), f"parallel.strategy={strategy}", nproc=2
        )
        result = result_of(completed, target)
        assert (result["world_size"], result["strategy"]) == (2, strategy)
        assert result["eval_loss"] == pytest.approx(lora_run["eval_loss"][step], abs=1e-5), (strategy, source)
        assert completed.stdout.count("eval ") == 1, "the result line is printed once, by rank 0"


@pytest.mark.variants
def test_eval_out_of_memory_on_one_rank_is_one_line_with_exit_status_5(lora_run: dict, tmp_path: Path):
    target = tmp_path / "eval.json"
    # Rank 1 (3 batches of one example) runs out of memory in its second batch's forward.
    completed = shardtune_eval(
        lora_run, "--checkpoint", str(lora_run["out"] / "final"), "--out", str(target), nproc=2,
        fault="eval.batch:oom:rank=1",
    )  # fmt: skip
    assert completed.returncode == EXIT_OUT_OF_MEMORY, completed.stderr[-3000:]
    errors = [line for line in completed.stderr.splitlines() if line.startswith("shardtune: error:")]
    assert errors == [
        "shardtune: error: rank 1: out of memory in evaluation: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 "
        f"has a total capacity of 79.18 GiB of which 1.06 GiB is free. {EVAL_ADVICE}"
    ]
    assert "Traceback" not in completed.stderr and "[rank0]" not in completed.stderr, completed.stderr[-3000:]
    assert not target.exists()


@pytest.mark.variants
def test_eval_of_a_full_fine_tuning_checkpoint_and_final(tmp_path: Path):
    """Full fine-tuning, with full checkpoints (optimizer state beside the weights): the DCP checkpoint and
    the HF model in final/."""
    run = run_with_checkpoints(
        tmp_path, "full", "lora.enabled=false", "training.learning_rate=1e-4", "training.checkpoint_mode=full"
    )
    for source, step in ((run["out"] / "checkpoint-2", 2), (run["out"] / "final", 4)):
        result = result_of(shardtune_eval(run, "--checkpoint", str(source)), source / "eval.json")
        assert result["kind"] == ("checkpoint" if step == 2 else "model")
        assert result["eval_loss"] == pytest.approx(run["eval_loss"][step], abs=1e-5), source


def test_eval_bad_input_is_one_line_with_exit_status_2(lora_run: dict, tmp_path: Path, monkeypatch, capsys):
    from shardtune.cli import main

    out = lora_run["out"]
    checkpoint = str(out / "checkpoint-2")
    cases = [
        (["--checkpoint", str(tmp_path / "nothing")], "no such file or directory"),
        (["--checkpoint", str(out / "logs")], "neither a checkpoint (manifest.json) nor a final/ directory"),
        (["--checkpoint", str(out)], f"{out} is a run's directory: name {out / 'final'} or {out / 'checkpoint-4'}"),
        (["--checkpoint", checkpoint, "lora.r=4"], "lora.r is 4 here, 16 there"),
        (
            ["--checkpoint", str(out / "final"), "lora.enabled=false"],
            "it holds a LoRA adapter, but the config has lora.enabled: false; set lora.enabled=true, or",
        ),
        (["--checkpoint", checkpoint, "--data", str(tmp_path / "missing.jsonl")], "--data"),
        (["--checkpoint", checkpoint, "data.eval_path=null"], "no eval data"),
    ]
    (out / "checkpoint-4" / "eval.json").write_text("a user's notes\n")
    cases.append((["--checkpoint", str(out / "checkpoint-4")], "exists; pass --overwrite"))
    monkeypatch.chdir(REPO)
    for args, expected in cases:
        # Checked before any worker starts: with --nproc 2 the line is printed once, by the command.
        for nproc in ("1", "2"):
            status = main(["eval", "examples/quickstart.yaml", "--nproc", nproc, *lora_run["overrides"], *args])
            lines = capsys.readouterr().err.strip().splitlines()
            assert status == 2 and len(lines) == 1 and lines[0].startswith("shardtune: error: "), (args, lines)
            assert expected in lines[0], (args, lines)
    assert (out / "checkpoint-4" / "eval.json").read_text() == "a user's notes\n"
    # A shard that is gone is found when rank 0 reads the weights: every worker stops, one line names it.
    broken = tmp_path / "broken"
    shutil.copytree(out / "checkpoint-2", broken)
    (broken / "model" / "__0_0.distcp").unlink()
    completed = shardtune_eval(lora_run, "--checkpoint", str(broken), "--out", str(tmp_path / "broken.json"), nproc=2)
    errors = [line for line in completed.stderr.splitlines() if line.startswith("shardtune: error:")]
    assert completed.returncode == 2 and "Traceback" not in completed.stderr, completed.stderr[-3000:]
    assert errors == [
        f"shardtune: error: {broken}: cannot be evaluated: model/__0_0.distcp (written by rank 0 on "
        f"{socket.gethostname()}) is missing"
    ], completed.stderr[-3000:]
    # --overwrite replaces it.
    result = result_of(
        shardtune_eval(lora_run, "--checkpoint", str(out / "checkpoint-4"), "--overwrite"),
        out / "checkpoint-4" / "eval.json",
    )
    assert result["eval_loss"] == pytest.approx(lora_run["eval_loss"][4], abs=1e-6)


def test_eval_never_writes_over_a_runs_files_or_its_input(lora_run: dict, monkeypatch, capsys):
    """--out, even with --overwrite, is never a run's own file (the result written over logs/train_log.jsonl or
    config.yaml broke ``shardtune plot``), a checkpoint's manifest, the --data file just read, or a file of the base
    model (named as such): one line, exit 2, the file as it was. A new file in the run directory, and the default
    CHECKPOINT/eval.json named as --out, are written."""
    from shardtune.cli import main

    out, data = lora_run["out"], lora_run["eval_file"]
    checkpoint, other = out / "checkpoint-2", out / "checkpoint-4"
    cases = [
        (out / "logs" / "train_log.jsonl", f"is inside the run's logs in {out}, which only the run writes"),
        (out / "config.yaml", f"is the run's config.yaml in {out}, which only the run writes"),
        (out / "metrics.json", f"is the run's metrics.json in {out}, which only the run writes"),
        (checkpoint / "manifest.json", f"is inside the input {checkpoint}"),
        (other / "manifest.json", f"{other} is a checkpoint, which is never written to"),
        (data, f"is the input {data}"),
    ]
    before = {path: path.read_bytes() for path, _ in cases}
    monkeypatch.chdir(REPO)
    command = ["eval", "examples/quickstart.yaml", *lora_run["overrides"], "--checkpoint", str(checkpoint)]
    for path, why in cases:
        assert main([*command, "--data", str(data), "--out", str(path), "--overwrite"]) == 2
        assert capsys.readouterr().err.strip() == f"shardtune: error: --out {path}: {why}; choose another --out"
    assert {path: path.read_bytes() for path in before} == before
    # A file of the checkpoint's base model (without --overwrite: it exists).
    model_config = Path("examples/tiny-llama/config.json")
    assert main([*command, "--out", str(model_config)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"shardtune: error: --out {model_config}: is inside the checkpoint's base model "
        f"{REPO / 'examples/tiny-llama'}; choose another --out"
    )
    for path in (out / "eval-2.json", checkpoint / "eval.json"):
        path.unlink(missing_ok=True)
        result = result_of(shardtune_eval(lora_run, "--checkpoint", str(checkpoint), "--out", str(path)), path)
        assert result["eval_loss"] == pytest.approx(lora_run["eval_loss"][2], abs=1e-6)


def test_a_checkpoints_relative_model_path_matches_the_same_model_named_from_elsewhere(tmp_path: Path, monkeypatch):
    """A checkpoint's config.yaml keeps the run's relative model path; eval from another directory names it
    absolutely. Another model is still a mismatch."""
    from shardtune.evaluate import config_mismatches

    config = make_config(tmp_path, tmp_path / "data.jsonl")  # the tiny model by its absolute path
    relative = config.model.model_copy(update={"name_or_path": "examples/tiny-llama"})
    saved = config.model_copy(update={"model": relative})
    monkeypatch.chdir(tmp_path)
    assert config_mismatches(saved, config) == []
    other = config.model_copy(update={"model": config.model.model_copy(update={"name_or_path": str(tmp_path)})})
    assert config_mismatches(saved, other) == [
        f"model.name_or_path is {str(tmp_path)!r} here, 'examples/tiny-llama' there"
    ]


@pytest.mark.variants
def test_a_long_evaluation_says_how_far_it_has_got(lora_run: dict, tmp_path: Path):
    """Every EVAL_PROGRESS_EVERY_S seconds (0 here: after each batch but the last) rank 0 says how many of the
    evaluation's batches are done, in ``shardtune eval`` and in a run's own evaluation."""
    patched = (
        "import sys; import shardtune.metrics.progress as progress; progress.EVAL_PROGRESS_EVERY_S = 0.0; "
        "from shardtune.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    checkpoint = lora_run["out"] / "checkpoint-2"
    common = ["examples/quickstart.yaml", *lora_run["overrides"]]
    commands = {
        "eval": ["eval", *common, "--checkpoint", str(checkpoint), "--out", str(tmp_path / "eval.json")],
        "train": ["train", *common, f"training.output_dir={tmp_path / 'run'}", "training.max_steps=2",
                  "training.eval_steps=2", "training.eval_on_start=false"],
    }  # fmt: skip
    for name, command in commands.items():
        result = subprocess.run(
            [sys.executable, "-c", patched, *command], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-3000:]
        said = [
            line.split(" INFO ")[1].split("  elapsed")[0]
            for line in result.stderr.splitlines()
            if "INFO eval: " in line
        ]
        expected = [f"eval: {done} of {EVAL_ROWS} batches ({done / EVAL_ROWS:.0%})" for done in range(1, EVAL_ROWS)]
        assert said == expected, (name, result.stderr[-3000:])
