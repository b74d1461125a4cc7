"""Dataset rows -> text segments, each marked trained-on or not.

Three formats:
- ``alpaca``: ``instruction``, optional ``input``, ``output``; the seed scripts' prompt layout
  (see ``alpaca.py``); loss on the output and EOS.
- ``messages``: ``messages``: a list of ``{role, content}`` (roles system, user, assistant; ShareGPT's
  ``{from, value}`` with human/gpt also read). Rendered by the tokenizer's chat template when it has
  one, else by ``DEFAULT_CHAT_LAYOUT``; loss on assistant turns only unless ``train_on_prompt``.
- ``text``: ``text``, plain pretraining-style documents; loss on every token.

``data.columns`` maps these canonical field names to a dataset's own column names.
"""

from __future__ import annotations

from dataclasses import dataclass

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from shardtune.data.alpaca import render_prompt
from shardtune.errors import first_line

# Used for messages when the tokenizer has no chat template. Each turn is
# "<|role|>\n{content}\n"; an assistant turn's content is followed by EOS, so the model learns to stop.
DEFAULT_CHAT_LAYOUT = "<|{role}|>\n{content}"
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}


class RowError(ValueError):
    """This row cannot become an example; the caller adds where it is."""


@dataclass(frozen=True)
class Segment:
    text: str
    trainable: bool
    eos: bool = False  # an EOS token id follows the text (part of the segment)


@dataclass(frozen=True)
class Rendered:
    segments: list[Segment]
    # Whether the tokenizer's own leading special tokens (e.g. BOS) go first. Chat templates write
    # theirs into the text, so adding them again would double them.
    add_special_prefix: bool


def canonical_row(data: dict, columns: dict[str, str]) -> dict:
    """The row with the configured dataset columns renamed to the format's field names."""
    if not columns:
        return data
    row = dict(data)
    for field, column in columns.items():
        if column not in data:
            raise RowError(f"missing column '{column}' (mapped to '{field}'; columns: {sorted(data)})")
        row[field] = data[column]
    return row


# What a row of each format must have: the fields that tell a row's format by looking at it.
REQUIRED_FIELDS = {"alpaca": ("instruction", "output"), "messages": ("messages",), "text": ("text",)}


def _missing_field(name: str, row: dict) -> RowError:
    """A field the format needs is null or not in the row; where the row has every field another format needs (a file
    of messages read as alpaca, the usual slip), the line names that format."""
    if name in row:  # null: Parquet and hub datasets give every row every column, null where a row has no value
        return RowError(f"field '{name}' is null")
    line = f"missing field '{name}' (fields: {sorted(row)})"
    fits = [form for form, fields in REQUIRED_FIELDS.items() if name not in fields and set(fields) <= row.keys()]
    if fits:
        line += f"; the row has the fields of data.format {fits[0]}: set data.format={fits[0]}, or map columns with "
        line += "data.columns"
    return RowError(line)


def _string_field(row: dict, name: str, required: bool = True) -> str:
    value = row.get(name)
    if value is None and not required:
        return ""
    if value is None:
        raise _missing_field(name, row)
    if not isinstance(value, str):
        raise RowError(f"field '{name}' must be a string, got {type(value).__name__}")
    return value


def render_alpaca(row: dict, train_on_prompt: bool) -> Rendered:
    instruction = _string_field(row, "instruction")
    output = _string_field(row, "output")
    if not output.strip():
        raise RowError("empty response in 'output'")
    prompt = render_prompt(instruction, _string_field(row, "input", required=False))
    return Rendered([Segment(prompt, train_on_prompt), Segment(output, True, eos=True)], add_special_prefix=True)


def render_text(row: dict) -> Rendered:
    text = _string_field(row, "text")
    if not text.strip():
        raise RowError("empty 'text'")
    return Rendered([Segment(text, True, eos=True)], add_special_prefix=True)


def parse_messages(row: dict) -> list[dict[str, str]]:
    """Validated ``[{role, content}]``; ShareGPT turns are translated."""
    messages = row.get("messages")
    if messages is None:
        raise _missing_field("messages", row)
    if not isinstance(messages, list) or not messages:
        raise RowError("'messages' must be a non-empty list of {role, content} objects")
    parsed = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowError(f"message {number} is not an object")
        if "from" in message and "role" not in message:
            role = SHAREGPT_ROLES.get(message["from"])
            content = message.get("value")
            if role is None:
                raise RowError(f"message {number}: unknown role '{message['from']}' (expected human, gpt or system)")
        else:
            role, content = message.get("role"), message.get("content")
            if role not in ROLES:
                raise RowError(f"message {number}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise RowError(f"message {number}: 'content' must be a string")
        if role == "assistant" and not content.strip():
            raise RowError(f"message {number}: empty assistant response")
        parsed.append({"role": role, "content": content})
    if not any(message["role"] == "assistant" for message in parsed):
        raise RowError("no assistant message: nothing to train on")
    return parsed


def _layout_turn(message: dict[str, str]) -> str:
    """A prompt turn in ``DEFAULT_CHAT_LAYOUT``."""
    return DEFAULT_CHAT_LAYOUT.format(role=message["role"], content=message["content"]) + "\n"


REPLY_HEADER = DEFAULT_CHAT_LAYOUT.format(role="assistant", content="")


def render_messages(row: dict, tokenizer: PreTrainedTokenizerBase, train_on_prompt: bool) -> Rendered:
    messages = parse_messages(row)
    if tokenizer.chat_template:
        return _render_with_template(messages, tokenizer, train_on_prompt)
    segments = []
    for message in messages:
        if message["role"] == "assistant":
            segments.append(Segment(REPLY_HEADER, train_on_prompt))
            segments.append(Segment(message["content"], True, eos=True))
            segments.append(Segment("\n", train_on_prompt))
        else:
            segments.append(Segment(_layout_turn(message), train_on_prompt))
    return Rendered(segments, add_special_prefix=True)


def _template_text(
    messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, add_generation_prompt: bool = False
) -> str:
    """The template's text of a row's turns (and the opening of the assistant's reply). A template that refuses them
    (``raise_exception``: "roles must alternate", "system role not supported") refuses this row, not the dataset."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except TemplateError as error:
        raise RowError(f"the tokenizer's chat template refuses this conversation ({first_line(error)})") from None


def _render_with_template(
    messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, train_on_prompt: bool
) -> Rendered:
    """Find each assistant turn's text as the difference between two renderings of the template.

    Rendering ``messages[:i]`` with a generation prompt and then ``messages[: i + 1]`` gives exactly
    the text the template emits for reply ``i`` (including its end-of-turn token), whatever the
    template's layout; this works for any template that renders conversations incrementally.
    """
    if messages[0]["role"] == "assistant":
        # Its reply's opening would be the template's text of no turn at all, which transformers refuses to render.
        raise RowError(
            "message 0: an assistant turn opens the conversation; with the tokenizer's chat template a reply needs a "
            "system or user turn before it"
        )
    segments: list[Segment] = []
    done = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _template_text(messages[:index], tokenizer, add_generation_prompt=True)
        after = _template_text(messages[: index + 1], tokenizer)
        if not before.startswith(done) or not after.startswith(before):
            raise RowError("the tokenizer's chat template does not render this conversation incrementally")
        segments.append(Segment(before[len(done) :], train_on_prompt))
        segments.append(Segment(after[len(before) :], True))
        done = after
    full = _template_text(messages, tokenizer)
    if full[len(done) :]:
        segments.append(Segment(full[len(done) :], train_on_prompt))
    return Rendered([segment for segment in segments if segment.text], add_special_prefix=False)


def render_generation_prompt(
    format: str, tokenizer: PreTrainedTokenizerBase, text: str, input_text: str = "", system: str | None = None
) -> Rendered:
    """What a model trained on ``format`` reads before its answer to ``text``, as training renders it.

    ``alpaca``: the instruction prompt (``input_text`` as its input); ``messages``: a user turn (after
    a ``system`` turn when given) and the opening of the assistant's reply; ``text``: ``text`` itself.
    """
    if format == "alpaca":
        return Rendered([Segment(render_prompt(text, input_text), False)], add_special_prefix=True)
    if format == "text":
        return Rendered([Segment(text, False)], add_special_prefix=True)
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": text})
    if tokenizer.chat_template:
        text = _template_text(messages, tokenizer, add_generation_prompt=True)
        return Rendered([Segment(text, False)], add_special_prefix=False)
    segments = [Segment(_layout_turn(message), False) for message in messages]
    return Rendered([*segments, Segment(REPLY_HEADER, False)], add_special_prefix=True)


def render_row(
    data: dict, format: str, columns: dict[str, str], tokenizer: PreTrainedTokenizerBase, train_on_prompt: bool
) -> Rendered:
    """One dataset row as segments; raises ``RowError`` saying what is wrong with it."""
    row = canonical_row(data, columns)
    if format == "alpaca":
        return render_alpaca(row, train_on_prompt)
    if format == "messages":
        return render_messages(row, tokenizer, train_on_prompt)
    return render_text(row)
