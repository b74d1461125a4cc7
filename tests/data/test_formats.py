"""Formats and masking: exactly the trained-on tokens carry targets, for every format."""

from __future__ import annotations

import re
from copy import deepcopy

import pytest

from shardtune.data.formats import RowError, render_row
from shardtune.data.tokenize import IGNORE_INDEX, ExampleTokenizer, Outcome

X = IGNORE_INDEX


def tokenize(
    tokenizer, row, format="alpaca", columns=None, train_on_prompt=False, max_length=512, truncation="truncate"
):  # noqa: E501
    rendered = render_row(row, format, columns or {}, tokenizer, train_on_prompt)
    return ExampleTokenizer(tokenizer, max_length, truncation).tokenize([rendered])[0]


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def expected_targets(pieces):
    """pieces: [(token ids, trained?)] in order -> the next-token targets of their concatenation."""
    tokens = [t for piece, _ in pieces for t in piece]
    trained = [flag for piece, flag in pieces for _ in piece]
    return tokens, [tokens[i + 1] if trained[i + 1] else X for i in range(len(tokens) - 1)] + [X]


def test_alpaca_prompt_layout_and_masking(tokenizer):
    row = {"instruction": "Add.", "input": "1 and 2", "output": "3"}
    example, outcome = tokenize(tokenizer, row)
    prompt = "### Instruction:\nAdd.\n\n### Input:\n1 and 2\n\n### Response:\n"
    tokens, targets = expected_targets(
        [(ids(tokenizer, prompt), False), (ids(tokenizer, "3") + [tokenizer.eos_token_id], True)]
    )
    assert outcome == Outcome.KEPT
    assert example.input_ids.tolist() == tokens and example.targets.tolist() == targets
    assert example.num_targets == len(ids(tokenizer, "3")) + 1  # the response and EOS, nothing else


def test_alpaca_without_input_and_train_on_prompt(tokenizer):
    row = {"instruction": "Say hi.", "output": "hi"}
    example, _ = tokenize(tokenizer, row, train_on_prompt=True)
    prompt = "### Instruction:\nSay hi.\n\n### Response:\n"
    tokens, targets = expected_targets(
        [(ids(tokenizer, prompt), True), (ids(tokenizer, "hi") + [tokenizer.eos_token_id], True)]
    )
    assert example.input_ids.tolist() == tokens and example.targets.tolist() == targets
    assert example.num_targets == len(tokens) - 1  # everything but the first token, which nothing predicts


def test_text_format_trains_on_every_token(tokenizer):
    example, _ = tokenize(tokenizer, {"text": "The capital of France is Paris."}, format="text")
    tokens, targets = expected_targets(
        [(ids(tokenizer, "The capital of France is Paris.") + [tokenizer.eos_token_id], True)]
    )
    assert example.input_ids.tolist() == tokens and example.targets.tolist() == targets


def test_column_mapping(tokenizer):
    row = {"question": "What color is a lemon?", "answer": "A lemon is yellow."}
    mapped, _ = tokenize(tokenizer, row, columns={"instruction": "question", "output": "answer"})
    direct, _ = tokenize(tokenizer, {"instruction": "What color is a lemon?", "output": "A lemon is yellow."})
    assert mapped.input_ids.tolist() == direct.input_ids.tolist()
    assert mapped.targets.tolist() == direct.targets.tolist()
    with pytest.raises(RowError, match="missing column 'answer'"):
        tokenize(tokenizer, {"question": "q"}, columns={"instruction": "question", "output": "answer"})


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Add 1 and 2."},
    {"role": "assistant", "content": "1 plus 2 is 3."},
    {"role": "user", "content": "And 2 and 2?"},
    {"role": "assistant", "content": "2 plus 2 is 4."},
]


def test_multi_turn_chat_template_trains_on_assistant_turns_only(tokenizer):
    """The tiny tokenizer's template renders '<|role|>\\ncontent</s>\\n' per turn."""
    example, _ = tokenize(tokenizer, {"messages": CONVERSATION}, format="messages")
    eos = tokenizer.eos_token_id
    pieces = [
        (ids(tokenizer, "<|system|>\nBe brief.</s>\n<|user|>\nAdd 1 and 2.</s>\n<|assistant|>\n"), False),
        (ids(tokenizer, "1 plus 2 is 3.</s>\n"), True),
        (ids(tokenizer, "<|user|>\nAnd 2 and 2?</s>\n<|assistant|>\n"), False),
        (ids(tokenizer, "2 plus 2 is 4.</s>\n"), True),
    ]
    tokens, targets = expected_targets(pieces)
    assert example.input_ids.tolist() == tokens
    assert example.targets.tolist() == targets
    assert tokens.count(eos) == 5  # "</s>" in the template text is the EOS token, not characters
    trained_text = tokenizer.decode([t for t in example.targets.tolist() if t != X])
    assert trained_text == "1 plus 2 is 3.</s>\n2 plus 2 is 4.</s>\n"
    assert example.input_ids.tolist() == tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)


def test_messages_without_a_chat_template_use_the_default_layout(tokenizer):
    plain = deepcopy(tokenizer)
    plain.chat_template = None
    example, _ = tokenize(plain, {"messages": CONVERSATION[1:3]}, format="messages")
    eos = tokenizer.eos_token_id
    pieces = [
        (ids(plain, "<|user|>\nAdd 1 and 2.\n"), False),
        (ids(plain, "<|assistant|>\n"), False),
        (ids(plain, "1 plus 2 is 3.") + [eos], True),
        (ids(plain, "\n"), False),
    ]
    tokens, targets = expected_targets(pieces)
    assert example.input_ids.tolist() == tokens and example.targets.tolist() == targets


def test_sharegpt_turns_are_read(tokenizer):
    sharegpt = [{"from": "human", "value": "Add 1 and 2."}, {"from": "gpt", "value": "1 plus 2 is 3."}]
    a, _ = tokenize(tokenizer, {"conversations": sharegpt}, format="messages", columns={"messages": "conversations"})
    b, _ = tokenize(tokenizer, {"messages": CONVERSATION[1:3]}, format="messages")
    assert a.input_ids.tolist() == b.input_ids.tolist() and a.targets.tolist() == b.targets.tolist()


@pytest.mark.parametrize(
    ("row", "format", "reason"),
    [
        ({"instruction": "x"}, "alpaca", "missing field 'output'"),
        ({"instruction": "x", "output": "  "}, "alpaca", "empty response in 'output'"),
        ({"instruction": 3, "output": "y"}, "alpaca", "field 'instruction' must be a string, got int"),
        ({"instruction": None, "output": "y"}, "alpaca", "field 'instruction' is null"),
        ({"messages": None}, "messages", "field 'messages' is null"),
        ({"text": None}, "text", "field 'text' is null"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages", "message 0: unknown role 'robot'"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
            "messages",
            "message 1: empty assistant response",
        ),
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "no assistant message"),
        ({"messages": "hi"}, "messages", "'messages' must be a non-empty list"),
        (
            {"messages": [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Hello."}]},
            "messages",
            "message 0: an assistant turn opens the conversation; with the tokenizer's chat template a reply needs a "
            "system or user turn before it",
        ),
        ({"body": "x"}, "text", "missing field 'text' (fields: ['body'])"),
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            "alpaca",
            "missing field 'instruction' (fields: ['messages']); the row has the fields of data.format messages: set "
            "data.format=messages, or map columns with data.columns",
        ),
        (
            {"instruction": "x", "input": "", "output": "y"},
            "messages",
            "missing field 'messages' (fields: ['input', 'instruction', 'output']); the row has the fields of "
            "data.format alpaca: set data.format=alpaca, or map columns with data.columns",
        ),
        (
            {"text": "x", "output": "y"},
            "alpaca",
            "missing field 'instruction' (fields: ['output', 'text']); the row "
            "has the fields of data.format text: set data.format=text",
        ),
    ],
)
def test_bad_rows_say_why(tokenizer, row, format, reason):
    with pytest.raises(RowError, match=re.escape(reason)):
        tokenize(tokenizer, row, format=format)


def test_a_conversation_the_chat_template_refuses_is_a_bad_row(tokenizer):
    """Templates such as Mistral's raise on turns out of order; that row is bad, the dataset is not."""
    strict = deepcopy(tokenizer)
    strict.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != loop.index0 is even %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    with pytest.raises(RowError) as refused:
        tokenize(strict, {"messages": twice}, format="messages")
    assert str(refused.value) == (
        "the tokenizer's chat template refuses this conversation "
        "(Conversation roles must alternate user/assistant/user/assistant/...)"
    )
    example, _ = tokenize(strict, {"messages": CONVERSATION[1:3]}, format="messages")
    assert tokenizer.decode([t for t in example.targets.tolist() if t != X]) == "1 plus 2 is 3."


def test_truncate_or_drop_long_examples(tokenizer):
    row = {"instruction": "Repeat.", "output": "word " * 50}
    prompt_len = len(ids(tokenizer, "### Instruction:\nRepeat.\n\n### Response:\n"))
    example, outcome = tokenize(tokenizer, row, max_length=prompt_len + 5)
    assert outcome == Outcome.TRUNCATED and len(example) == prompt_len + 5
    assert example.num_targets == 5  # the last kept position has nothing left to predict
    assert tokenize(tokenizer, row, max_length=prompt_len + 5, truncation="drop") == (None, Outcome.TOO_LONG)
    assert tokenize(tokenizer, row, max_length=prompt_len) == (None, Outcome.NO_TARGET_TOKENS)


def test_bos_is_prepended_when_the_tokenizer_adds_it(tokenizer):
    """Llama-style tokenizers put BOS before text; prompts must start with it, as at inference."""
    from tokenizers.processors import TemplateProcessing

    with_bos = deepcopy(tokenizer)
    with_bos.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    row = {"instruction": "Hi", "output": "yo"}
    example, _ = tokenize(with_bos, row)
    plain, _ = tokenize(tokenizer, row)
    assert example.input_ids.tolist() == [tokenizer.bos_token_id] + plain.input_ids.tolist()
    assert example.targets.tolist() == [X] + plain.targets.tolist()
