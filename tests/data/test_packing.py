"""Packing: every example exactly once, fitting sequences, and no attention across examples."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import TINY_DATA

from shardtune.config import DataConfig, ModelConfig
from shardtune.data.collate import collate
from shardtune.data.formats import render_row
from shardtune.data.packing import pack_examples, unpacked
from shardtune.data.tokenize import IGNORE_INDEX, ExampleTokenizer
from shardtune.model.load import load_model
from shardtune.train.loss import summed_token_loss


@pytest.fixture(scope="module")
def examples(tokenizer):
    rows = [json.loads(line) for line in TINY_DATA.read_text().splitlines()[:40]]
    rendered = [render_row(row, "alpaca", {}, tokenizer, False) for row in rows]
    return [example for example, _ in ExampleTokenizer(tokenizer, 128).tokenize(rendered)]


def test_every_example_once_in_sequences_that_fit(examples):
    sequences = pack_examples(examples, max_length=128)
    assert all(len(ids) <= 128 for ids, _, _ in sequences)
    # Split every sequence back at its position-id restarts: the examples come back, each once.
    recovered = []
    for ids, targets, positions in sequences:
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
        for a, b in zip(starts, starts[1:], strict=False):
            assert positions[a:b].tolist() == list(range(b - a))
            recovered.append((tuple(ids[a:b].tolist()), tuple(targets[a:b].tolist())))
    assert sorted(recovered) == sorted((tuple(e.input_ids.tolist()), tuple(e.targets.tolist())) for e in examples)
    # Best-fit decreasing fills sequences: within one sequence of the lower bound.
    total = sum(len(e) for e in examples)
    assert len(sequences) <= -(-total // 128) + 1
    again = pack_examples(examples, max_length=128)  # deterministic
    assert [s[0].tolist() for s in again] == [s[0].tolist() for s in sequences]


def test_collate_packed_has_positions_and_no_mask(examples):
    sequences = [tuple(np.array(part) for part in seq) for seq in pack_examples(examples[:6], max_length=64)]
    batch = collate(sequences, pad_token_id=3, packed=True)
    assert batch.attention_mask is None
    longest = max(len(s[0]) for s in sequences)
    short = min(range(len(sequences)), key=lambda i: len(sequences[i][0]))
    n = len(sequences[short][0])
    # The padding tail is its own pseudo-example: positions from 0, no targets.
    assert batch.position_ids[short, n:].tolist() == list(range(longest - n))
    assert (batch.targets[short, n:] == IGNORE_INDEX).all()
    assert batch.num_tokens == sum(len(s[0]) for s in sequences)


def test_training_batches_of_packed_sequences_all_have_max_length(examples):
    """Packed rows fill up to max_length but rarely exactly: padded the rest of the way, every batch has one shape
    (compiled layers meet one length; CUDA graphs replay). Unpacked examples keep data.pad_to's choice."""
    packed = [tuple(np.array(part) for part in s) for s in pack_examples(examples, max_length=128)]
    assert len({len(ids) for ids, _, _ in packed}) > 1
    length = DataConfig(dataset_path="rows.jsonl", packing=True, max_length=128).batch_length
    shapes = {tuple(collate(packed[i : i + 2], 3, True, length).input_ids.shape) for i in range(0, len(packed) - 1, 2)}
    assert shapes == {(2, 128)}
    assert DataConfig(dataset_path="rows.jsonl", max_length=128).batch_length is None
    assert DataConfig(dataset_path="rows.jsonl", max_length=128, pad_to="max_length").batch_length == 128


def test_packed_sequences_pad_to_max_length_with_isolated_positions(examples):
    packed = [tuple(np.array(part) for part in s) for s in pack_examples(examples[:8], max_length=128)]
    batch = collate(packed, pad_token_id=3, packed=True, pad_to_length=128)
    assert batch.input_ids.shape == (len(packed), 128) and batch.attention_mask is None
    for row, (ids, _, _) in enumerate(packed):
        n = len(ids)
        # The tail is one more pseudo-example from position 0 that carries no target.
        assert batch.position_ids[row, n:].tolist() == list(range(128 - n))
        assert (batch.targets[row, n:] == IGNORE_INDEX).all()
    assert batch.num_tokens == sum(len(ids) for ids, _, _ in packed)


def test_pad_to_max_length(examples):
    single = [tuple(np.array(p) for p in unpacked(examples[0]))]
    batch = collate(single, pad_token_id=3, packed=False, pad_to_length=128)
    assert batch.input_ids.shape == (1, 128) and batch.position_ids is None
    assert batch.attention_mask.sum().item() == len(examples[0])


# FlexAttention's case compiles its block mask (a minute of inductor on a CPU): with -m variants. The default run
# checks shardtune's flex mask in test_packed_rows_under_flex_attention_get_shardtunes_mask_only_where_it_is_the_models.
@pytest.mark.parametrize("attn", ["sdpa", "eager", pytest.param("flex_attention", marks=pytest.mark.variants)])
def test_packed_loss_equals_the_examples_run_one_by_one(examples, tiny_model_dir, attn):
    model = load_model(ModelConfig(name_or_path=str(tiny_model_dir), attn_implementation=attn), torch.float32, 0).eval()
    chosen = examples[:8]
    as_arrays = lambda seq: tuple(np.array(part) for part in seq)  # noqa: E731
    with torch.no_grad():
        one_by_one = sum(
            summed_token_loss(model, collate([as_arrays(unpacked(e))], 3, packed=False), None).item() for e in chosen
        )
        packed_sequences = [as_arrays(s) for s in pack_examples(chosen, max_length=128)]
        assert len(packed_sequences) < len(chosen), "the check needs several examples per sequence"
        packed = summed_token_loss(model, collate(packed_sequences, 3, packed=True), None).item()
        # The same packed tokens with ordinary causal attention: examples see each other.
        leaky = collate(packed_sequences, 3, packed=False)
        crossed = summed_token_loss(model, leaky, None).item()
    assert packed == pytest.approx(one_by_one, rel=1e-5)
    assert abs(crossed - one_by_one) > 1e-2 * one_by_one


def test_packed_rows_under_flex_attention_get_shardtunes_mask_only_where_it_is_the_models(examples, monkeypatch):
    """transformers takes a BlockMask handed to the model as every layer's mask: shardtune's mask of packed rows
    (causal, within each example) stands in for transformers' own only where the model attends causally over the
    whole row. A Mistral with a sliding window of 16 tokens, shorter than the 128-token rows, keeps its own mask (the
    window changes the loss); without a window, shardtune's mask gives transformers' loss."""
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    from shardtune.model import packed_attention

    made = []
    original = packed_attention.PackedBlockMasks.__call__
    monkeypatch.setattr(packed_attention.PackedBlockMasks, "__call__",
                        lambda self, positions: made.append(positions) or original(self, positions))  # fmt: skip
    packed = collate([tuple(np.array(p) for p in s) for s in pack_examples(examples[:8], 128)], 3, packed=True)
    losses = {}
    for window in (None, 16):
        torch.manual_seed(0)
        config = tiny_config("mistral")
        config.vocab_size, config.sliding_window = 32000, window
        model = AutoModelForCausalLM.from_config(config, attn_implementation="flex_attention").eval()
        made.clear()
        with torch.no_grad():
            loss = summed_token_loss(model, packed, None).item()
            logits = model(**packed.model_inputs(), use_cache=False).logits  # transformers' own mask
        own = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), packed.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        ).item()
        assert len(made) == (1 if window is None else 0), window
        assert loss == pytest.approx(own, rel=1e-6), window
        losses[window] = loss
    assert abs(losses[16] - losses[None]) > 1e-4 * losses[None]  # the window matters to these rows (4e-4)
