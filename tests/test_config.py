"""Config: the seed's config loads; every kind of mistake is one line naming the key, exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO

from shardtune.cli import main
from shardtune.config import ConfigError, dump_config, load_config, parse_override

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def seed_config(tmp_path: Path, tiny_model_dir: Path, alpaca_file: Path) -> Path:
    text = (FIXTURES / "seed_config.yaml").read_text()
    path = tmp_path / "config.yaml"
    path.write_text(text.replace("__MODEL__", str(tiny_model_dir)).replace("__DATA__", str(alpaca_file)))
    return path


def test_seed_config_loads_as_written(seed_config: Path):
    config = load_config(seed_config)
    assert config.data.max_length == 16384
    assert config.training.learning_rate == pytest.approx(2e-5)
    assert config.training.gradient_accumulation_steps == 2
    assert config.training.eval_dataset_type == "subset" and config.training.eval_subset_size == 200
    assert config.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert config.training.checkpoint_mode == "lite" and config.training.save_steps == 100
    assert config.training.save_total_limit == 10


def test_dump_round_trips(seed_config: Path, tmp_path: Path):
    config = load_config(seed_config)
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(config))
    assert load_config(again) == config


def test_overrides_are_typed(seed_config: Path):
    config = load_config(seed_config, ["training.learning_rate=1e-4", "lora.target_modules=all-linear", "lora.r=4"])
    assert config.training.learning_rate == pytest.approx(1e-4)
    assert config.lora.target_modules == "all-linear"
    assert config.lora.r == 4
    assert parse_override("lora.target_modules=[q_proj, v_proj]") == (["lora", "target_modules"], ["q_proj", "v_proj"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.learnig_rate=1e-4", "training.learnig_rate: unknown key (did you mean 'training.learning_rate'?)"),
        ("trainng.seed=1", "trainng: unknown key (did you mean 'training'?)"),
        ("lora.r=0", "lora.r: Input should be greater than 0 (got 0)"),
        ("lora.r=2.5", "lora.r: Input should be a valid integer"),
        ("training.learning_rate=0", "training.learning_rate: Input should be greater than 0"),
        ("training.learning_rate=-1e-3", "training.learning_rate: Input should be greater than 0"),
        ("training.learning_rate=fast", "training.learning_rate: Input should be a valid number"),
        ("training.warmup_ratio=1.5", "training.warmup_ratio: Input should be less than or equal to 1 (got 1.5)"),
        ("training.warmup_ratio=-0.1", "training.warmup_ratio: Input should be greater than or equal to 0"),
        ("data.dataset_path=/no/such/file.jsonl", "data.dataset_path: file not found: /no/such/file.jsonl"),
        ("model.name_or_path=./no/such/model", "model.name_or_path: directory not found: ./no/such/model"),
        ("model.dtype=fp8", "model.dtype: Input should be 'auto', 'bfloat16' or 'float32'"),
        ("data.truncation=cut", "data.truncation: Input should be 'truncate' or 'drop'"),
        ("data.columns={instruction: q, answer: a}", "data.columns: answer is not a field of format alpaca"),
        ("data.dataset_weights=[1, 2]", "data.dataset_weights: 2 weights for 1 dataset paths"),
        (
            "training.resume_from_checkpoint=ckpt",
            "training.resume_from_checkpoint: ckpt is not a complete checkpoint (no manifest.json)",
        ),
        ("training.eval_subset_size=null", "training.eval_subset_size: required when eval_dataset_type is subset"),
        (
            "training.loss_chunk_tokens=-5",
            "training.loss_chunk_tokens: should be auto, 0 (all logits at once) or a number of tokens (got -5)",
        ),
        ("training.loss_chunk_tokens=some", "training.loss_chunk_tokens: should be auto, 0 (all logits at once)"),
        ("training.memory_budget_gib=0", "training.memory_budget_gib: Input should be greater than 0"),
        # YAML reads .inf and .nan as numbers: plan's and the run's arithmetic then ended in a traceback.
        ("training.memory_budget_gib=.inf", "training.memory_budget_gib: Input should be a finite number (got inf)"),
        ("training.num_train_epochs=.inf", "training.num_train_epochs: Input should be a finite number (got inf)"),
        ("data.dataset_weights=[.nan]", "data.dataset_weights: Input should be a finite number (got nan)"),
    ],
)
def test_bad_values_name_the_key(seed_config: Path, override: str, message: str):
    with pytest.raises(ConfigError) as error:
        load_config(seed_config, [override])
    assert len(error.value.lines) == 1
    assert error.value.lines[0].startswith(message), error.value.lines[0]


def test_a_key_of_several_types_is_one_line_naming_them(seed_config: Path, capsys):
    """Pydantic reports a union key once per type, at names such as ``parallel.compile.literal['auto']``."""
    overrides = ["parallel.compile=maybe", "lora.target_modules=q_proj", "data.dataset_path="]
    assert main(["train", str(seed_config), *overrides]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "shardtune: error: data.dataset_path: Input should be a valid string or a valid list (got None)",
        "shardtune: error: lora.target_modules: Input should be a valid list or 'all-linear' (got 'q_proj')",
        "shardtune: error: parallel.compile: Input should be a valid boolean or 'auto' (got 'maybe')",
    ]
    # A value with one type's shape: that type's problem alone.
    with pytest.raises(ConfigError) as error:
        load_config(seed_config, ["data.dataset_path=[rows.jsonl, 3]"])
    assert error.value.lines == ["data.dataset_path.1: Input should be a valid string (got 3)"]


def test_warmup_steps_and_ratio_conflict(seed_config: Path):
    with pytest.raises(ConfigError, match="training.warmup_steps: set either warmup_steps or warmup_ratio"):
        load_config(seed_config, ["training.warmup_steps=10", "training.warmup_ratio=0.1"])


def test_hub_ids_are_not_checked_on_disk(seed_config: Path):
    assert load_config(seed_config, ["model.name_or_path=mistralai/Mistral-7B-v0.1"]).model.name_or_path


def test_paths_under_home_are_the_users_home_as_in_a_shell(seed_config: Path, tmp_path: Path, monkeypatch):
    """``~/...`` in a path key is the home directory, never a directory named ``~`` in the working directory (a run
    written there, and a later ``rm -rf ~`` to clean it up). Hub ids and ``auto`` stay as they are."""
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    (home / "data/rows.jsonl").write_text((FIXTURES.parent.parent / "examples/data/tiny_instruct.jsonl").read_text())
    (home / "model").symlink_to(load_config(seed_config).model.name_or_path)
    monkeypatch.setenv("HOME", str(home))
    config = load_config(
        seed_config,
        [
            "model.name_or_path=~/model", "data.dataset_path=[~/data/rows.jsonl, org/hub-dataset]",
            "data.cache_dir=~/cache", "data.eval_path=~/data/rows.jsonl", "data.eval_split_ratio=0",
            "training.output_dir=~/runs/one", "training.resume_from_checkpoint=auto",
        ],
    )  # fmt: skip
    assert config.model.name_or_path == str(home / "model")
    assert config.data.dataset_path == [str(home / "data/rows.jsonl"), "org/hub-dataset"]
    assert config.data.eval_path == str(home / "data/rows.jsonl") and config.data.cache_dir == str(home / "cache")
    assert config.training.output_dir == str(home / "runs/one") and config.training.resume_from_checkpoint == "auto"
    resumed = load_config(seed_config, ["training.resume_from_checkpoint=~/runs/one/checkpoint-2"], check_paths=False)
    assert resumed.training.resume_from_checkpoint == str(home / "runs/one/checkpoint-2")


def test_cli_exits_2_with_one_line_per_problem(seed_config: Path, capsys):
    status = main(["train", str(seed_config), "lora.r=0", "training.learnig_rate=1"])
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "shardtune: error: training.learnig_rate: unknown key (did you mean 'training.learning_rate'?)",
        "shardtune: error: lora.r: Input should be greater than 0 (got 0)",
    ]


def test_cli_rejects_malformed_yaml(tmp_path: Path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  name_or_path: [unclosed\n")
    assert main(["train", str(path)]) == 2
    assert f"{path}:" in capsys.readouterr().err


def test_a_key_written_twice_is_refused_not_read_as_its_last_value(seed_config: Path, tmp_path: Path, capsys):
    """PyYAML reads a second ``model:`` section as the only one: the first's keys were dropped without a word."""
    text = seed_config.read_text()
    twice = tmp_path / "twice.yaml"
    twice.write_text(text + "model:\n  dtype: float32\n")
    first, again = text.splitlines().index("model:") + 1, len(text.splitlines()) + 1
    assert main(["train", str(twice)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"shardtune: error: {twice}:{again}: not valid YAML (duplicate key 'model', first on line {first})"
    ]
    merged = tmp_path / "merged.yaml"  # the keys beside a merge override its keys: not a key written twice
    merged.write_text(text.replace("lora:\n", "lora:\n  <<: {r: 8, lora_dropout: 0.1}\n"))
    lora = load_config(merged).lora
    assert (lora.r, lora.lora_dropout) == (16, 0.1)
    with pytest.raises(ConfigError, match=r"override lora.target_modules: value .* \(duplicate key 'q', first on"):
        load_config(seed_config, ["lora.target_modules={q: 1, q: 2}"])


def test_a_config_that_is_a_directory_or_not_utf8_is_one_line(tmp_path: Path, capsys):
    run = tmp_path / "run"  # a run's directory, given where its config.yaml was meant
    run.mkdir()
    (run / "config.yaml").write_text((REPO / "examples/quickstart.yaml").read_text())
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"model:\n  name_or_path: examples/tiny-llama\n# caf\xe9\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, line in [
        (run, f"config file {run} is a directory: name a config file in it ({run / 'config.yaml'})"),
        (empty, f"config file {empty} is a directory"),
        (latin1, f"{latin1}:3: not valid UTF-8 (invalid continuation byte); save the config as UTF-8"),
    ]:
        assert main(["train", str(path)]) == 2
        assert capsys.readouterr().err.splitlines() == [f"shardtune: error: {line}"]
    with_mark = tmp_path / "bom.yaml"  # an editor's byte-order mark is not part of the first key
    with_mark.write_bytes(b"\xef\xbb\xbf" + (REPO / "examples/quickstart.yaml").read_bytes())
    assert load_config(with_mark, check_paths=False).model.name_or_path == "examples/tiny-llama"


def test_auto_attention_is_flex_for_packed_sequences_on_gpus_only(tmp_path, alpaca_file):
    import torch
    from conftest import make_config

    from shardtune.model.load import training_attention

    packed = make_config(tmp_path, alpaca_file, data={"packing": True})
    padded = make_config(tmp_path, alpaca_file)
    assert packed.model.attn_implementation == "auto"
    assert training_attention(packed, torch.device("cuda", 0)) == "flex_attention"
    assert training_attention(packed, torch.device("cpu")) == "sdpa"
    assert training_attention(padded, torch.device("cuda", 0)) == "sdpa"
    chosen = make_config(tmp_path, alpaca_file, data={"packing": True}, model={"attn_implementation": "eager"})
    assert training_attention(chosen, torch.device("cuda", 0)) == "eager"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("logging.profile_steps=[5,3]", "logging.profile_steps: [first, last] with 1 <= first <= last, got [5, 3]"),
        ("training.activation_offloading=true", "training.activation_offloading: needs gradient_checkpointing"),
        ("training.mlp_chunk_tokens=-1", "training.mlp_chunk_tokens"),
    ],
)
def test_speed_settings_are_validated(seed_config: Path, capsys, override, message):
    assert main(["prepare", str(seed_config), override]) == 2
    assert message in capsys.readouterr().err


def test_reliability_keys(seed_config: Path):
    config = load_config(seed_config)
    assert (config.training.on_nonfinite, config.training.max_nonfinite_steps) == ("stop", 3)
    assert config.hang_timeout_s == 900  # half of parallel.timeout_s: the watchdog speaks first
    assert load_config(seed_config, ["parallel.timeout_s=600"]).hang_timeout_s == 300
    assert load_config(seed_config, ["training.hang_timeout_s=0"]).hang_timeout_s == 0
    with pytest.raises(ConfigError) as raised:
        load_config(seed_config, ["training.hang_timeout_s=1800"])
    assert raised.value.lines == [
        "training.hang_timeout_s: 1800 must be below parallel.timeout_s (1800), or 0 to disable"
    ]
    with pytest.raises(ConfigError, match="training.on_nonfinite"):
        load_config(seed_config, ["training.on_nonfinite=ignore"])


def test_merge_final_needs_a_lora_run(seed_config: Path, capsys):
    assert load_config(seed_config, ["training.merge_final=true"]).training.merge_final
    assert main(["train", str(seed_config), "training.merge_final=true", "lora.enabled=false"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "shardtune: error: training.merge_final: needs lora.enabled: true; a full fine-tune's final/ is already "
        "the whole model"
    ]
