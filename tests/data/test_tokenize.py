"""Prompt masking: exactly the response tokens (and the closing EOS) are targets."""

from __future__ import annotations

from shardtune.data.alpaca import render_alpaca
from shardtune.data.collate import pad_to_longest
from shardtune.data.tokenize import IGNORE_INDEX, ExampleTokenizer


def test_prompt_layout_matches_the_seed():
    with_input = render_alpaca({"instruction": "Add.", "input": "1 and 2", "output": "3"})
    assert with_input.prompt == "### Instruction:\nAdd.\n\n### Input:\n1 and 2\n\n### Response:\n"
    without_input = render_alpaca({"instruction": "Say hi.", "input": "", "output": "hi"})
    assert without_input.prompt == "### Instruction:\nSay hi.\n\n### Response:\n"
    assert without_input.response == "hi"


def test_only_response_tokens_are_targets(tokenizer):
    text = render_alpaca({"instruction": "What color is a lemon?", "input": "", "output": "A lemon is yellow."})
    example, truncated = ExampleTokenizer(tokenizer, max_length=512)(text.prompt, text.response)
    prompt_ids = tokenizer.encode(text.prompt, add_special_tokens=False)
    response_ids = tokenizer.encode(text.response, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert not truncated
    assert example.input_ids == prompt_ids + response_ids
    # Position i predicts token i + 1: the last prompt position predicts the first response token.
    expected = [IGNORE_INDEX] * (len(prompt_ids) - 1) + response_ids + [IGNORE_INDEX]
    assert example.targets == expected
    assert example.num_targets == len(response_ids)


def test_truncation_keeps_the_prompt_and_cuts_the_response(tokenizer):
    text = render_alpaca({"instruction": "Repeat.", "input": "", "output": "word " * 50})
    prompt_len = len(tokenizer.encode(text.prompt, add_special_tokens=False))
    example, truncated = ExampleTokenizer(tokenizer, max_length=prompt_len + 5)(text.prompt, text.response)
    assert truncated
    assert len(example.input_ids) == prompt_len + 5
    assert example.num_targets == 5  # the last kept position has nothing left to predict


def test_example_without_room_for_a_response_is_dropped(tokenizer):
    text = render_alpaca({"instruction": "A long instruction " * 20, "input": "", "output": "ok"})
    example, truncated = ExampleTokenizer(tokenizer, max_length=16)(text.prompt, text.response)
    assert example is None and truncated


def test_padding_masks_attention_and_targets(tokenizer):
    encode = ExampleTokenizer(tokenizer, max_length=512)
    short, _ = encode("### Instruction:\nHi\n\n### Response:\n", "yo")
    long, _ = encode("### Instruction:\nSay something longer\n\n### Response:\n", "a much longer answer")
    batch = pad_to_longest([short, long], pad_token_id=tokenizer.pad_token_id)
    assert batch.input_ids.shape == (2, len(long.input_ids))
    assert batch.attention_mask[0].tolist() == [1] * len(short.input_ids) + [0] * (
        len(long.input_ids) - len(short.input_ids)
    )
    assert (batch.targets[0, len(short.input_ids) :] == IGNORE_INDEX).all()
    assert batch.num_targets == short.num_targets + long.num_targets
    assert batch.num_tokens == len(short.input_ids) + len(long.input_ids)


def test_bos_is_prepended_when_the_tokenizer_adds_it(tokenizer):
    """Llama-style tokenizers put BOS before text; the prompt must start with it as at inference."""
    from copy import deepcopy

    from tokenizers.processors import TemplateProcessing

    with_bos = deepcopy(tokenizer)
    with_bos.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    example, _ = ExampleTokenizer(with_bos, max_length=512)("### Instruction:\nHi\n\n### Response:\n", "yo")
    assert example.input_ids[0] == tokenizer.bos_token_id
    plain, _ = ExampleTokenizer(tokenizer, max_length=512)("### Instruction:\nHi\n\n### Response:\n", "yo")
    assert example.input_ids[1:] == plain.input_ids
    assert example.targets[1:] == plain.targets
