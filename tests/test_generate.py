"""``shardtune generate``: the prompt is what training tokenized, in the run's data format; final/ and
exports load from any directory; bad paths and bases are one line with exit status 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from copy import deepcopy
from pathlib import Path

import pytest
import torch
from cli_runs import train
from conftest import REPO, TINY_MODEL, make_config

from shardtune.data.formats import render_row
from shardtune.data.tokenize import IGNORE_INDEX, ExampleTokenizer
from shardtune.generate import generate_response, prompt_ids

SYSTEM = "You answer in one word."
QUESTION = "What is the capital of Italy?"
ANSWER = "Rome."


def shardtune(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "shardtune", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def without_template(tokenizer):
    plain = deepcopy(tokenizer)
    plain.chat_template = None
    return plain


# (format, training row, generate's text, --input, --system, whether the tokenizer keeps its chat template)
CASES = {
    "alpaca": ("alpaca", {"instruction": QUESTION, "output": ANSWER}, QUESTION, "", None, True),
    "alpaca-input": (
        "alpaca", {"instruction": "Name the capital.", "input": "Italy", "output": ANSWER}, "Name the capital.",
        "Italy", None, True,
    ),
    "messages-template": (
        "messages", {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]},
        QUESTION, "", None, True,
    ),
    "messages-template-system": (
        "messages",
        {"messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": ANSWER},
        ]},
        QUESTION, "", SYSTEM, True,
    ),
    "messages-layout-system": (
        "messages",
        {"messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": ANSWER},
        ]},
        QUESTION, "", SYSTEM, False,
    ),
    "text": ("text", {"text": "Once upon a time"}, "Once upon a time", "", None, True),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_generation_prompt_is_what_training_tokenized_before_the_answer(tokenizer, case: str):
    format, row, text, input_text, system, templated = CASES[case]
    tokenizer = tokenizer if templated else without_template(tokenizer)
    assert bool(tokenizer.chat_template) == templated
    rendered = render_row(row, format, {}, tokenizer, train_on_prompt=False)
    example, _ = ExampleTokenizer(tokenizer, 512).tokenize([rendered])[0]
    trained_ids, targets = example.input_ids.tolist(), example.targets.tolist()
    prompt = prompt_ids(tokenizer, format, text, input_text, system)
    if format == "text":
        # Every token of a text document is trained on: the prompt is the document, then EOS follows.
        assert trained_ids == [*prompt, tokenizer.eos_token_id]
        return
    assert trained_ids[: len(prompt)] == prompt
    # The answer starts right after the prompt: the last prompt position predicts its first token.
    assert all(target == IGNORE_INDEX for target in targets[: len(prompt) - 1])
    assert targets[len(prompt) - 1] == trained_ids[len(prompt)]
    if format == "messages" and templated:
        conversation = [m for m in row["messages"] if m["role"] != "assistant"]
        rendered_text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(prompt) == rendered_text


def test_a_chat_template_that_refuses_the_system_turn_is_one_input_line(tokenizer):
    """Gemma's template raises on a system turn: generate's prompt is then the one line training gives such a row,
    not jinja's traceback."""
    from shardtune.errors import InputError

    strict = deepcopy(tokenizer)
    strict.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(InputError) as error:
        prompt_ids(strict, "messages", QUESTION, system=SYSTEM)
    assert error.value.lines == [
        "--system/--instruction: the tokenizer's chat template refuses this conversation (System role not supported)"
    ]
    assert strict.decode(prompt_ids(strict, "messages", QUESTION)) == QUESTION


def final_dir(tmp_path: Path, format: str) -> Path:
    """A LoRA final/ as training writes it, saved for a run of ``format`` (its adapter starts at zero)."""
    from shardtune.checkpoint.export import save_final
    from shardtune.model.load import load_model, load_tokenizer
    from shardtune.model.lora import apply_lora

    config = make_config(tmp_path, tmp_path / "unused.jsonl", data={"format": format})
    model = apply_lora(load_model(config.model, torch.float32, 0), config.lora)
    save_final(model, load_tokenizer(config.model), tmp_path / "final", torch.float32, config=config)
    return tmp_path / "final"


@torch.no_grad()
def test_generate_on_a_messages_run_answers_through_the_chat_template(tmp_path: Path, tokenizer):
    final = final_dir(tmp_path, "messages")
    answer = generate_response(final, QUESTION, max_new_tokens=6, system=SYSTEM)
    # The same greedy generation by hand, from the chat template's rendering of the conversation.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL).eval()
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    ids = torch.tensor([tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)])
    output = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    assert answer == tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True).strip()


@pytest.mark.variants
def test_final_and_exports_load_from_any_directory(tmp_path: Path):
    """The quickstart names its model relatively (examples/tiny-llama); its outputs still load elsewhere."""
    run = train(tmp_path, "run", 1, "training.save_steps=2", steps=2)
    final = run["out"] / "final"
    export = tmp_path / "export"
    exported = shardtune("export", str(run["out"] / "checkpoint-2"), "--out", str(export))
    assert exported.returncode == 0, exported.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for directory in (final, export):
        settings = json.loads((directory / "adapter_config.json").read_text())
        assert settings["base_model_name_or_path"] == str(TINY_MODEL.resolve())
        assert (directory / "config.yaml").is_file()
    loads = subprocess.run(
        [
            sys.executable, "-c",
            "import sys; from peft import PeftModel; from transformers import AutoModelForCausalLM as M; "
            "import json; base = json.load(open(sys.argv[1] + '/adapter_config.json'))['base_model_name_or_path']; "
            "PeftModel.from_pretrained(M.from_pretrained(base), sys.argv[1]); print('loaded')",
            str(final),
        ],
        cwd=elsewhere, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert loads.stdout.strip() == "loaded", loads.stderr[-3000:]
    answers = [
        shardtune("generate", str(directory), "--instruction", QUESTION, "--max-new-tokens", "4", cwd=elsewhere)
        for directory in (final, export)
    ]
    assert [answer.returncode for answer in answers] == [0, 0], [answer.stderr[-2000:] for answer in answers]
    # The export of the last checkpoint holds final/'s weights: the same answer.
    assert answers[0].stdout == answers[1].stdout


def test_generate_bad_input_is_one_line_with_exit_status_2(tmp_path: Path, capsys):
    from shardtune.cli import main

    final = final_dir(tmp_path, "alpaca")
    bare = tmp_path / "bare"  # an adapter without the run's config
    bare.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(final / name, bare / name)
    moved = tmp_path / "moved"  # an adapter whose recorded base is a relative path that is not here
    shutil.copytree(final, moved)
    settings = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**settings, "base_model_name_or_path": "models/gone"}))
    checkpoint = tmp_path / "run" / "checkpoint-3"  # what a run saves at step 3, lite
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "trainer.json").write_text("{}")
    (checkpoint / "config.yaml").write_text("")
    (checkpoint / "manifest.json").write_text(json.dumps({"step": 3, "mode": "lite", "world_size": 1, "files": {}}))
    cases = [
        ([str(tmp_path / "nothing")], "no such directory"),
        (
            [str(checkpoint)],
            f"{checkpoint}: a training checkpoint, not a model: export it first (shardtune export {checkpoint} "
            "--out DIR) and name DIR, or name the run's final/",
        ),
        ([str(tmp_path)], "neither a PEFT adapter (adapter_config.json) nor a model (config.json)"),
        (
            [str(final.parent)],
            f"{final.parent}: neither a PEFT adapter (adapter_config.json) nor a model (config.json); {final.parent} "
            f"is a run's directory: name {final}",
        ),
        ([str(final), "--base", str(tmp_path / "no-base")], "--base: "),
        ([str(moved)], "base_model_name_or_path of"),
        ([str(final), "--system", SYSTEM], "--system: a system prompt is for messages-format models"),
        ([str(final), "--format", "text", "--input", "x"], "--input: only alpaca-format models take an input"),
        ([str(bare)], "pass --format alpaca|messages|text"),
    ]
    capsys.readouterr()  # what building final/ printed
    for args, expected in cases:
        status = main(["generate", *args, "--instruction", QUESTION, "--max-new-tokens", "2"])
        lines = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and len(lines) == 1 and lines[0].startswith("shardtune: error: "), (args, lines)
        assert expected in lines[0], (args, lines)


def test_an_empty_answer_says_so_and_max_new_tokens_below_1_is_one_line(tmp_path: Path, capsys):
    from safetensors.torch import load_file, save_file

    from shardtune.cli import main

    # Zero embeddings (tied to the output layer): every logit is 0, greedy decoding picks token 0, <unk>, a special
    # token that decoding drops: the answer is empty.
    silent = tmp_path / "silent"
    shutil.copytree(TINY_MODEL, silent)
    weights = load_file(silent / "model.safetensors")
    save_file({name: torch.zeros_like(value) for name, value in weights.items()}, silent / "model.safetensors")
    capsys.readouterr()
    answered = main(["generate", str(silent), "--instruction", QUESTION, "--format", "alpaca", "--max-new-tokens", "3"])
    assert answered == 0
    printed = capsys.readouterr()
    assert printed.out == "\n"
    assert printed.err.strip().splitlines() == [
        "shardtune: the answer is empty: the model ended it before any text (its end-of-sequence token, or special "
        "tokens only); a model trained longer, or another prompt, may answer"
    ]
    for count in ("0", "-5"):
        status = main(["generate", str(silent), "--instruction", QUESTION, "--max-new-tokens", count])
        assert status == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"shardtune: error: --max-new-tokens: must be at least 1, got {count}"
        ]


def test_an_empty_prompt_and_one_beyond_the_models_positions_are_one_line(tmp_path: Path, tokenizer, capsys):
    """GPT-2 learns its 256 position embeddings: a prompt and answer beyond them failed to index one (a traceback;
    rotary models answer nonsense there); an empty text prompt made an empty tensor of floats (a traceback)."""
    from tiny_models import tiny_config, write_tiny_model
    from transformers import AutoModelForCausalLM

    from shardtune.cli import main

    model_dir = write_tiny_model(tmp_path / "gpt2", "gpt2")
    AutoModelForCausalLM.from_config(tiny_config("gpt2")).save_pretrained(model_dir)

    def generate(instruction: str, new_tokens: int) -> int:
        args = ["--format", "text", "--instruction", instruction, "--max-new-tokens", str(new_tokens)]
        return main(["generate", str(model_dir), *args])

    text = "word " * 250
    prompt, longer = len(prompt_ids(tokenizer, "text", text)), len(prompt_ids(tokenizer, "text", text * 2))
    cases = [
        ("", 4, "--instruction: the prompt is empty (not one token); give the text to continue"),
        (text, 10, f"--max-new-tokens: 10 after the prompt's {prompt} tokens go beyond the 256 positions the model "
                   f"was built for (max_position_embeddings); set at most {256 - prompt}"),
        (text * 2, 1, f"--instruction: the prompt is {longer} tokens, and the model was built for 256 positions "
                      "(max_position_embeddings): none is left for the answer; shorten it"),
    ]  # fmt: skip
    capsys.readouterr()
    for instruction, new_tokens, line in cases:
        assert generate(instruction, new_tokens) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"shardtune: error: {line}"]
    assert generate(text, 256 - prompt) == 0  # up to the last position


def test_an_adapter_trained_on_random_weights_is_refused_without_them(tmp_path: Path, capsys):
    """Its adapter_config names the base's architecture only: on any weights but the run's random ones it would
    answer as if untrained. generate says where the run's weights are (final-merged/), or how to get them."""
    from shardtune.cli import main

    run = train(tmp_path, "random", 1, "model.init=random", "training.merge_final=true", steps=2)["out"]
    alone = tmp_path / "alone" / "final"  # the adapter without the merged model beside it
    shutil.copytree(run / "final", alone)
    capsys.readouterr()
    expected = {
        run / "final": f"generate from {run / 'final-merged'}",
        alone: "train with training.merge_final: true",
    }
    for final, instead in expected.items():
        assert main(["generate", str(final), "--instruction", QUESTION, "--max-new-tokens", "2"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"shardtune: error: {final}: an adapter trained on random weights (model.init: random), which no file "
            f"holds: {instead} (the run's weights with the adapter merged), or pass --base with the weights it "
            "trained on"
        ]
    assert main(["generate", str(run / "final-merged"), "--instruction", QUESTION, "--max-new-tokens", "2"]) == 0
    assert main(["generate", str(alone), "--base", str(TINY_MODEL), "--instruction", QUESTION,
                 "--max-new-tokens", "2"]) == 0  # fmt: skip
