"""The command line end to end, as a user types it: train, then generate from final/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_runs import jsonl
from conftest import REPO

from shardtune.config import load_config
from shardtune.run_dir import output_dir_problem


def shardtune(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "shardtune", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_train_then_generate(tmp_path: Path):
    out = tmp_path / "run"
    result = shardtune(
        "train",
        "examples/quickstart.yaml",
        f"training.output_dir={out}",
        "training.max_steps=8",
        "training.logging_steps=4",
        "training.eval_steps=4",
    )
    assert result.returncode == 0, result.stderr
    # Not a terminal: plain progress lines with an ETA instead of a bar.
    assert "step 4/8  loss" in result.stderr and "eta" in result.stderr
    assert "parameters: 147,968 trainable of" in result.stderr
    # config.yaml is the resolved config, overrides included, and loads back as a config.
    saved = load_config(out / "config.yaml")
    assert saved.training.max_steps == 8 and saved.training.output_dir == str(out)
    run_args = json.loads((out / "run_args.json").read_text())
    assert run_args["argv"][-3:] == ["training.max_steps=8", "training.logging_steps=4", "training.eval_steps=4"]
    assert [json.loads(line)["step"] for line in (out / "logs/eval_log.jsonl").read_text().splitlines()] == [0, 4, 8]

    generated = shardtune("generate", str(out / "final"), "--instruction", "What is the capital of France?")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.strip(), "generation printed nothing"


def test_second_run_into_the_same_directory_is_refused(tmp_path: Path):
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "run_args.json").write_text("{}")  # what marks it as a shardtune run's
    result = shardtune(
        "train", "examples/quickstart.yaml", f"training.output_dir={out}", "training.overwrite_output_dir=false"
    )
    assert result.returncode == 2
    # No checkpoint there: resume_from_checkpoint=auto is not offered (it would start over and replace the run).
    assert result.stderr.strip().splitlines()[-1] == (
        f"shardtune: error: training.output_dir: {out} already holds a run (logs, run_args.json); choose another "
        "output_dir or set training.overwrite_output_dir=true"
    )


@pytest.mark.variants
def test_auto_resume_without_a_checkpoint_never_replaces_a_finished_run(tmp_path: Path):
    """``save_steps`` is off by default: a finished run may hold no checkpoint. ``auto`` then has nothing to continue
    from, and starting over would replace the run's final/ and metrics.json: only overwrite_output_dir may."""
    out = tmp_path / "run"
    first = shardtune("train", "examples/quickstart.yaml", f"training.output_dir={out}", "training.max_steps=2")
    assert first.returncode == 0, first.stderr
    adapter = (out / "final/adapter_model.safetensors").read_bytes()
    metrics = (out / "metrics.json").read_text()
    again = ["train", "examples/quickstart.yaml", f"training.output_dir={out}", "training.max_steps=3"]
    again += ["training.resume_from_checkpoint=auto"]
    refused = shardtune(*again, "training.overwrite_output_dir=false")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"shardtune: error: training.resume_from_checkpoint: auto found no checkpoint to continue from in {out}, "
        "which holds a finished run (final, metrics.json); to train again from the start and replace it, set "
        "training.overwrite_output_dir=true, or choose another output_dir"
    )
    assert (out / "final/adapter_model.safetensors").read_bytes() == adapter
    assert (out / "metrics.json").read_text() == metrics
    # shardtune doctor's "previous run" row and shardtune slurm say the same ahead of the run.
    config = load_config(REPO / "examples/quickstart.yaml", again[2:] + ["training.overwrite_output_dir=false"])
    assert "shardtune: error: " + output_dir_problem(config.training) == refused.stderr.strip().splitlines()[-1]
    replaced = shardtune(*again, "training.overwrite_output_dir=true")
    assert replaced.returncode == 0, replaced.stderr
    assert "auto found no checkpoint complete on every node" in replaced.stderr
    assert json.loads((out / "metrics.json").read_text())["steps"] == 3


def test_malformed_data_row_names_file_and_line(tmp_path: Path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": \n')
    result = shardtune(
        "train", "examples/quickstart.yaml", f"data.dataset_path={data}", f"training.output_dir={tmp_path}/r"
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"shardtune: error: {data}:2: not valid JSON")


@pytest.mark.variants
def test_wandb_offline_logs_without_network(tmp_path: Path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    result = shardtune(
        "train",
        "examples/quickstart.yaml",
        f"training.output_dir={out}",
        "training.max_steps=4",
        "training.logging_steps=2",
        "logging.wandb.enabled=true",
        "logging.wandb.mode=offline",
        "logging.peak_tflops=1",
    )
    assert result.returncode == 0, result.stderr
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    content = runs[0].read_bytes()
    # every number of the JSONL rows (the host name is text)
    rows = {"train": jsonl(out / "logs/train_log.jsonl")[-1], "eval": jsonl(out / "logs/eval_log.jsonl")[-1]}
    for kind, row in rows.items():
        for name in set(row) - {"step", "schema_version", "slowest_host"}:
            assert f"{kind}/{name}".encode() in content, name


@pytest.mark.slow
def test_quickstart_halves_the_eval_loss(tmp_path: Path):
    """The README's promise: the quickstart, as shipped, ends with at most half its first eval loss."""
    config = yaml.safe_load((REPO / "examples/quickstart.yaml").read_text())
    result = shardtune("train", "examples/quickstart.yaml", f"training.output_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr
    metrics = json.loads((tmp_path / "run/metrics.json").read_text())
    assert config["training"]["eval_on_start"] is True
    assert metrics["eval_loss"] <= 0.5 * metrics["first_eval_loss"], metrics


def test_convert_then_train_on_messages_with_packing(tmp_path: Path):
    """convert's output is training data: messages format, chat template, packed sequences."""
    source = tmp_path / "qa.jsonl"
    rows = [{"question": f"Add {i} and 2.", "answer": f"{i} plus 2 is {i + 2}."} for i in range(60)]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"question": "no answer"}\n')
    converted = tmp_path / "messages.jsonl"
    result = shardtune(
        "convert",
        str(source),
        "--out",
        str(converted),
        "--input-col",
        "question",
        "--output-col",
        "answer",
        "--system-prompt",
        "Be brief.",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(f"wrote 60 rows to {converted}; skipped 1 (missing column 'answer'")
    first = json.loads(converted.read_text().splitlines()[0])
    assert first == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Add 0 and 2."},
            {"role": "assistant", "content": "0 plus 2 is 2."},
        ]
    }
    out = tmp_path / "run"
    result = shardtune(
        "train",
        "examples/quickstart.yaml",
        f"data.dataset_path={converted}",
        "data.format=messages",
        "data.packing=true",
        "data.max_length=256",
        "data.eval_split_ratio=0.1",
        "training.eval_subset_size=null",
        "training.per_device_train_batch_size=1",
        "training.max_steps=4",
        "training.logging_steps=2",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"training.output_dir={out}",
    )
    assert result.returncode == 0, result.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    summary = metrics["data"]
    assert metrics["packing"] is True and summary["packing"] is True
    assert summary["train"]["kept"] == 54 and summary["train"]["sequences"] < 54 / 4
    assert "building token store" in result.stderr and "(packed)" in result.stderr


def test_help_and_a_config_error_are_answered_without_importing_torch():
    """The command line's parsers import neither torch nor transformers (seconds each): ``shardtune --help``
    and a mistyped key answer at once; a command imports them when it runs."""
    code = (
        "import sys; from shardtune.cli import main; status = main(['train', 'examples/quickstart.yaml', "
        "'training.nope=1']); print(status, sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.stdout.splitlines() == ["2 []"], result.stderr
    assert result.stderr.splitlines() == ["shardtune: error: training.nope: unknown key"]


@pytest.mark.parametrize(
    ("command", "required"),
    [("train", "config"), ("prepare", "config"), ("plan", "config"), ("eval", "config, --checkpoint"),
     ("bench", "--shape")],
)  # fmt: skip
def test_a_command_given_nothing_names_what_it_needs_and_not_the_overrides(
    command: str, required: str, capsys: pytest.CaptureFixture[str]
):
    """``section.key=value`` overrides are optional: a command given nothing names only what it needs."""
    from shardtune.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([command])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"shardtune {command}: error: the following arguments are required: {required}"
    )


def test_a_command_ends_after_its_threads_and_exit_handlers_without_the_interpreters_finalization(tmp_path: Path):
    """The command's own process skips the seconds of tearing torch and transformers down, but what
    finalization runs first still runs: a non-daemon thread is waited for, a thread pool's idle workers are
    stopped (not waited for forever), atexit handlers (wandb's) run.
    Called from Python (``main(argv)``), the command returns its status instead."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        f"""
import atexit, pathlib, sys, threading, time
marks = pathlib.Path({str(tmp_path)!r})
atexit.register(lambda: (marks / "atexit").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(2), (marks / "thread").write_text("ran"))).start()
from concurrent.futures import ThreadPoolExecutor
ThreadPoolExecutor(1).submit(lambda: (marks / "pool").write_text("ran"))  # its idle worker thread stays

class Finalized:
    def __del__(self):
        (marks / "finalized").write_text("ran")

finalized = Finalized()  # a module global: only the interpreter's finalization deletes it
from shardtune.entry import main
assert main(["plan", "examples/quickstart.yaml"]) == 0  # a caller's command line: it returns
sys.argv = ["shardtune", "plan", "examples/quickstart.yaml"]
main()
(marks / "returned").write_text("ran")
"""
    )
    result = subprocess.run(
        [sys.executable, str(probe)], cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1].startswith("fits: "), result.stdout[-2000:]
    assert sorted(path.name for path in tmp_path.iterdir() if path != probe) == ["atexit", "pool", "thread"]
