"""Bad inputs stop a run with one clear error, the same on every rank, before training: never a crash
deep inside it, and never one rank gone while the others wait for it in a collective."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, make_config, write_jsonl
from faulty_runs import run
from tiny_models import tiny_config
from transformers import AutoConfig

from shardtune.config import load_config
from shardtune.errors import ConfigError
from shardtune.train.preflight import check_model


def errors_of(log: str) -> list[str]:
    return [line.removeprefix("shardtune: error: ") for line in log.splitlines() if line.startswith("shardtune: error")]


def assert_every_rank_stopped_before_training(result, expected: str) -> str:
    assert result.returncode == 2, result.log[-4000:]
    errors = errors_of(result.log)
    assert len(errors) == 1, result.log[-4000:]  # both ranks stopped on it; the first to claim it printed it
    assert expected in errors[0]
    assert "Traceback" not in result.log and "exitcode" not in result.log
    assert "parameters:" not in result.log and "restart" not in result.log  # no model was loaded
    assert result.seconds < 120
    return errors[0]


def model_with_vocabulary(tmp_path: Path, vocab_size: int) -> Path:
    """The tiny model's tokenizer next to a config with a smaller vocabulary: a tokenizer/model mismatch."""
    directory = tmp_path / "small-vocab"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY_MODEL / name, directory / name)
    config = json.loads((TINY_MODEL / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}))
    return directory


def test_token_ids_beyond_the_vocabulary(tmp_path):
    model = model_with_vocabulary(tmp_path, 256)
    result = run(tmp_path, tmp_path / "run", 2, f"model.name_or_path={model}", "model.init=random",
                 "training.max_steps=2")  # fmt: skip
    error = assert_every_rank_stopped_before_training(result, "but " + str(model) + " has a vocabulary of 256 ids")
    assert "the tokenizer does not belong to this model" in error


def test_a_dataset_with_no_usable_row(tmp_path):
    data = write_jsonl(tmp_path / "bad.jsonl", [{"question": f"q{i}", "answer": "a"} for i in range(20)])
    result = run(tmp_path, tmp_path / "run", 2, f"data.dataset_path={data}", "data.on_bad_row=skip",
                 "training.max_steps=2")  # fmt: skip
    # The rank that built the token store and the one that waited for it report the same error.
    assert_every_rank_stopped_before_training(result, f"{data}: no training example left")


def test_a_model_that_is_not_a_causal_lm(tmp_path):
    encoder = tmp_path / "vit"
    encoder.mkdir()
    (encoder / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    result = run(tmp_path, tmp_path / "run", 2, f"model.name_or_path={encoder}", "training.max_steps=2")
    assert_every_rank_stopped_before_training(result, "is a 'vit' model (ViTModel), not a causal language model")


def test_expert_parallelism_on_a_model_without_moe_layers(tmp_path):
    """Refused by the built model, once the run had written config.yaml and run_args.json: the next run there found
    "a run" in the directory. Now by the preflight, on the model built on the meta device, before anything is
    written."""
    result = run(tmp_path, tmp_path / "run", 2, "parallel.expert_parallel_size=2", "training.max_steps=2")
    assert_every_rank_stopped_before_training(
        result,
        "parallel.expert_parallel_size: 2 needs an MoE model; examples/tiny-llama has no MoE layers; set it to 1",
    )
    assert not (tmp_path / "run").exists()


def test_model_checks(tmp_path):
    def config(**model):
        return make_config(tmp_path, tmp_path / "data.jsonl", model=model)

    assert check_model(config(name_or_path=str(TINY_MODEL))).vocab_size == 1024
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="is not a model this machine can read"):
        check_model(config(name_or_path=str(empty)))
    too_long = make_config(tmp_path, tmp_path / "data.jsonl", data={"max_length": 4096})
    with pytest.raises(ConfigError, match="data.max_length: 4096 tokens is beyond the 1024 positions"):
        check_model(too_long)


def _dbrx_config(directory, **ffn) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "model_type": "dbrx", "d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 1000,
        "attn_config": {"clip_qkv": 8.0, "kv_n_heads": 2, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2, **ffn},
    }))  # fmt: skip
    return directory


def test_a_whole_number_for_a_float_field_is_read_as_that_float(tmp_path, caplog):
    """DBRX's published config.json gives moe_normalize_expert_weights as 1, which transformers' typed config takes
    as a float only (huggingface_hub's StrictDataclassError: the model could not load as published). It is read as
    1.0, with one line naming the field, and the config equals the one of a config.json that says 1.0."""
    model = _dbrx_config(tmp_path / "dbrx", moe_normalize_expert_weights=1)
    config = make_config(tmp_path, tmp_path / "data.jsonl", model={"name_or_path": str(model)})
    with caplog.at_level("WARNING", logger="shardtune.model.load"):
        read = check_model(config)
        check_model(config)
    assert read.ffn_config.moe_normalize_expert_weights == 1.0
    written = AutoConfig.from_pretrained(_dbrx_config(tmp_path / "float", moe_normalize_expert_weights=1.0))
    assert read.to_diff_dict() == written.to_diff_dict()
    assert [record.getMessage() for record in caplog.records] == [
        f"{model}: config.json gives ffn_config.moe_normalize_expert_weights as whole numbers, which transformers "
        "takes as floats only: read as floats"
    ]


def test_a_config_field_transformers_refuses_is_one_line_naming_it(tmp_path):
    """A config.json value of the wrong kind (not a whole number for a float): one line naming the model, the field
    and what to do (before: huggingface_hub's traceback)."""
    model = _dbrx_config(tmp_path / "dbrx", moe_normalize_expert_weights="one")
    with pytest.raises(ConfigError) as error:
        check_model(make_config(tmp_path, tmp_path / "data.jsonl", model={"name_or_path": str(model)}))
    message = str(error.value)
    assert message.startswith(
        f"model.name_or_path: {model}: transformers refuses its config.json (Validation error for field "
        "'moe_normalize_expert_weights': ... TypeError: Field 'moe_normalize_expert_weights' with value 'one'"
    )
    assert message.endswith("; correct that value in the config.json") and "\n" not in message


def test_missing_model_and_resume_paths_that_are_not_checkpoints(tmp_path):
    """Checked when the config is read: in the launcher, before any worker starts."""
    data = write_jsonl(tmp_path / "data.jsonl", [{"instruction": "i", "output": "o"}])
    config = tmp_path / "config.yaml"
    config.write_text(f"model: {{name_or_path: {TINY_MODEL}}}\ndata: {{dataset_path: {data}}}\n")
    with pytest.raises(ConfigError, match="model.name_or_path: directory not found"):
        load_config(config, [f"model.name_or_path={tmp_path / 'nowhere'}"])
    garbage, partial = tmp_path / "garbage", tmp_path / "partial"
    garbage.mkdir(), partial.mkdir()
    (garbage / "manifest.json").write_text("{not json")
    (partial / "manifest.json").write_text('{"step": 3, "mode": "full", "world_size": 2, "files": {}}')
    for path, why in [
        (tmp_path, "is not a complete checkpoint (no manifest.json)"),
        (garbage, "is not a shardtune checkpoint: its manifest.json does not read as JSON"),
        (partial, "is not a complete checkpoint: trainer.json, model, config.yaml missing"),
    ]:
        with pytest.raises(ConfigError) as raised:
            load_config(config, [f"training.resume_from_checkpoint={path}"])
        assert len(raised.value.lines) == 1
        assert raised.value.lines[0].startswith(f"training.resume_from_checkpoint: {path} {why}")


def test_cuda_graphs_asked_for_under_a_strategy_that_shards_are_refused_before_the_model_loads(tmp_path):
    """``parallel.cuda_graphs: true`` cannot run where FSDP gathers each layer's weights into new memory. Where the
    config and the world size settle the strategy, the kernels check (run before any weight is read) says so; only
    ``auto`` on several ranks waits for the model, whose size decides."""
    from shardtune.train.preflight import check_kernels

    cuda = torch.device("cuda")  # the checks read the config and the device's type: no GPU is touched

    def kernels(world_size: int, **parallel) -> str:
        config = make_config(tmp_path, tmp_path / "data.jsonl", parallel={"cuda_graphs": True, **parallel})
        return check_kernels(config, cuda, tiny_config("llama"), world_size)

    expected = (
        "parallel.cuda_graphs: true needs one process or parallel.strategy: ddp (this run shards the weights with "
        "FSDP); set parallel.cuda_graphs: auto or false"
    )
    for world_size, parallel in [
        (2, {"strategy": "fsdp"}),
        (4, {"strategy": "auto", "expert_parallel_size": 2}),
        (1, {"strategy": "fsdp", "cpu_offload": True}),
    ]:
        with pytest.raises(ConfigError) as refused:
            kernels(world_size, **parallel)
        assert refused.value.lines == [expected], (world_size, parallel)
    for world_size, parallel in [(1, {"strategy": "fsdp"}), (2, {"strategy": "ddp"}), (2, {"strategy": "auto"})]:
        assert kernels(world_size, **parallel).endswith(", CUDA graphs"), (world_size, parallel)


def test_the_kernels_check_names_the_attention_the_model_is_built_with(tmp_path):
    """GPT-OSS has no sdpa: its padded rows train on FlexAttention on a GPU (eager on a CPU), which the kernels check
    names, and ``parallel.cuda_graphs: true`` there (FlexAttention's mask of padded rows is a new tensor every batch)
    is refused before any weight is read, not after the model is built."""
    from shardtune.train.preflight import check_kernels

    gpt_oss = tiny_config("gpt_oss")
    config = make_config(tmp_path, tmp_path / "data.jsonl")
    assert check_kernels(config, torch.device("cuda"), gpt_oss, 1) == "attention flex_attention"
    assert check_kernels(config, torch.device("cpu"), gpt_oss, 1) == "attention eager"
    assert check_kernels(config, torch.device("cuda"), tiny_config("llama"), 1) == "attention sdpa"
    graphs = make_config(tmp_path, tmp_path / "data.jsonl", parallel={"cuda_graphs": True})
    with pytest.raises(ConfigError) as refused:
        check_kernels(graphs, torch.device("cuda"), gpt_oss, 1)
    assert refused.value.lines == [
        "parallel.cuda_graphs: true needs data.packing where model.attn_implementation is flex_attention; set "
        "parallel.cuda_graphs: auto or false"
    ]
