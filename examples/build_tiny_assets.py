"""Build the offline quickstart assets used by the shardtune examples.

Running ``python examples/build_tiny_assets.py`` from the repository root (re)creates:

* ``examples/data/tiny_instruct.jsonl``: ~2,400 alpaca-format rows (``instruction``, ``input``,
  ``output``) drawn from eight small, regular task families that a ~1M-parameter model can
  learn in a few minutes of CPU training.
* ``examples/data/tiny_instruct_messages.jsonl``: the first 300 of those rows as chat
  ``{"messages": [...]}`` records (some with a system prompt, some with a second exchange).
* ``examples/tiny-llama/``: a randomly initialised ~0.86M-parameter Llama model together with a
  byte-level BPE tokenizer (vocab 1024) trained on the generated text, loadable offline with
  ``AutoTokenizer.from_pretrained`` / ``AutoModelForCausalLM.from_pretrained``.

Everything is deterministic (fixed seeds, no network access) so re-running the script
overwrites the outputs with identical bytes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

# Never reach for the Hub: every asset here is built from scratch.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

Row = dict[str, str]
Message = dict[str, str]

EXAMPLES_DIR = Path(__file__).resolve().parent
DATA_DIR = EXAMPLES_DIR / "data"
MODEL_DIR = EXAMPLES_DIR / "tiny-llama"
ALPACA_PATH = DATA_DIR / "tiny_instruct.jsonl"
MESSAGES_PATH = DATA_DIR / "tiny_instruct_messages.jsonl"

ROWS_PER_FAMILY = 300  # 8 families -> 2,400 rows
NUM_MESSAGE_ROWS = 300
VOCAB_SIZE = 1024
MODEL_MAX_LENGTH = 1024
HIDDEN_SIZE = 128
# Weight init std. The Llama default (0.02) is tuned for hidden sizes in the thousands; at width 128
# it makes the tied embedding / lm_head so small that logits are capped at about 0.02 * 128 = 2.6.
# Full fine-tuning can grow the embeddings, but LoRA (which freezes embeddings, lm_head and norms)
# then cannot push the loss below ~4.4 nats (measured: stuck at 5.5-6.4 after 600 steps).
# Fan-in scaling (1/sqrt(hidden) ~= 0.088) lifts that cap to ~11 and lets both LoRA and full
# fine-tuning of this random base learn the toy tasks quickly.
INIT_STD = HIDDEN_SIZE**-0.5

# Special tokens, in id order. ``<unk>`` first mirrors the Llama convention (unk=0, bos=1, eos=2);
# a byte-level BPE never actually emits ``<unk>`` because every byte is in the base alphabet.
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]

# Jinja chat template: each turn is ``<|role|>\n{content}</s>\n``. No bos is emitted, matching the
# tokenizer, which never adds special tokens on its own. ``add_generation_prompt`` opens an
# assistant turn so generation continues right after ``<|assistant|>\n``.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# ---------------------------------------------------------------------------------------------
# Lookup tables. Kept small on purpose: a tiny model has to memorise them to answer correctly.
# ---------------------------------------------------------------------------------------------

# Tables are laid out several entries per line for readability; keep the formatter off them.
# fmt: off

CAPITALS: list[tuple[str, str]] = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"),
    ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Chile", "Santiago"),
    ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Brazil", "Brasilia"),
    ("Argentina", "Buenos Aires"), ("Russia", "Moscow"), ("Poland", "Warsaw"),
    ("Austria", "Vienna"), ("Greece", "Athens"), ("Sweden", "Stockholm"), ("Norway", "Oslo"),
    ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Ireland", "Dublin"),
    ("Australia", "Canberra"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("Turkey", "Ankara"), ("Cuba", "Havana"), ("Hungary", "Budapest"), ("Belgium", "Brussels"),
]

ANTONYMS: list[tuple[str, str]] = [
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("up", "down"),
    ("light", "dark"), ("open", "closed"), ("early", "late"), ("rich", "poor"), ("strong", "weak"),
    ("full", "empty"), ("young", "old"), ("hard", "soft"), ("wet", "dry"), ("tall", "short"),
    ("loud", "quiet"), ("near", "far"), ("clean", "dirty"), ("thick", "thin"), ("high", "low"),
    ("good", "bad"), ("true", "false"), ("first", "last"), ("inside", "outside"),
    ("win", "lose"), ("buy", "sell"), ("push", "pull"), ("day", "night"),
]

# (subject as it appears in the question, color). The answer capitalises the subject.
COLORS: list[tuple[str, str]] = [
    ("a banana", "yellow"), ("the sky", "blue"), ("grass", "green"), ("snow", "white"),
    ("coal", "black"), ("a lemon", "yellow"), ("a strawberry", "red"), ("a carrot", "orange"),
    ("milk", "white"), ("a tomato", "red"), ("the sea", "blue"), ("a crow", "black"),
    ("a lime", "green"), ("an orange", "orange"), ("a plum", "purple"), ("chocolate", "brown"),
    ("a flamingo", "pink"), ("an eggplant", "purple"), ("a pumpkin", "orange"),
    ("a cherry", "red"), ("a frog", "green"), ("the sun", "yellow"), ("an elephant", "gray"),
    ("a polar bear", "white"),
]

PLURALS: list[tuple[str, str]] = [
    ("cat", "cats"), ("dog", "dogs"), ("box", "boxes"), ("child", "children"), ("mouse", "mice"),
    ("man", "men"), ("woman", "women"), ("foot", "feet"), ("tooth", "teeth"), ("goose", "geese"),
    ("city", "cities"), ("baby", "babies"), ("leaf", "leaves"), ("knife", "knives"),
    ("bus", "buses"), ("church", "churches"), ("potato", "potatoes"), ("sheep", "sheep"),
    ("fish", "fish"), ("person", "people"), ("wolf", "wolves"), ("party", "parties"),
    ("book", "books"), ("tree", "trees"), ("glass", "glasses"), ("dish", "dishes"),
    ("hero", "heroes"), ("ox", "oxen"), ("life", "lives"), ("story", "stories"),
]

# Plain lowercase words reused by the "repeat", "first letter" and "uppercase" families.
WORDS: list[str] = [
    "apple", "river", "stone", "cloud", "tiger", "piano", "garden", "window", "yellow", "zebra",
    "orange", "bread", "candle", "dragon", "eagle", "forest", "guitar", "honey", "island",
    "jacket", "kettle", "lemon", "mountain", "needle", "ocean", "pencil", "queen", "rocket",
    "silver", "table", "umbrella", "violin", "water", "xylophone",
]

ADJECTIVES: list[str] = [
    "red", "blue", "green", "happy", "quiet", "little", "old", "bright", "cold", "warm",
    "fast", "sleepy", "brave", "tiny",
]

# fmt: on

COUNT_WORDS: dict[int, str] = {2: "two", 3: "three", 4: "four"}


# ---------------------------------------------------------------------------------------------
# Task families. Each takes the shared RNG and returns one row. About a third to a half of the
# rows put the argument in ``input`` so the model sees both prompt shapes.
# ---------------------------------------------------------------------------------------------


def _row(instruction: str, output: str, input_text: str = "") -> Row:
    """Build one alpaca row with a stable key order (so the JSONL bytes are stable)."""
    return {"instruction": instruction, "input": input_text, "output": output}


def make_capital(rng: random.Random) -> Row:
    """Capital of a country from a fixed table."""
    country, capital = rng.choice(CAPITALS)
    output = f"The capital of {country} is {capital}."
    style = rng.randrange(3)
    if style == 0:
        return _row(f"What is the capital of {country}?", output)
    if style == 1:
        return _row(f"Name the capital city of {country}.", output)
    return _row("What is the capital of the country below?", output, country)


def make_uppercase(rng: random.Random) -> Row:
    """Uppercase a short adjective + noun phrase given in ``input``."""
    phrase = f"{rng.choice(ADJECTIVES)} {rng.choice(WORDS)}"
    if rng.random() < 0.3:
        phrase = f"the {phrase}"
    instruction = rng.choice(["Convert the text to uppercase.", "Rewrite the input in capital letters."])
    return _row(instruction, phrase.upper(), phrase)


def make_antonym(rng: random.Random) -> Row:
    """Antonym of a word from a fixed table (either direction of the pair)."""
    word, opposite = rng.choice(ANTONYMS)
    if rng.random() < 0.5:
        word, opposite = opposite, word
    output = f"The opposite of {word} is {opposite}."
    if rng.random() < 0.6:
        return _row(f"What is the opposite of {word}?", output)
    return _row("Give the antonym of the word.", output, word)


def make_addition(rng: random.Random) -> Row:
    """Addition of two small integers."""
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    output = f"{a} plus {b} is {a + b}."
    style = rng.randrange(3)
    if style == 0:
        return _row(f"Add {a} and {b}.", output)
    if style == 1:
        return _row(f"What is {a} plus {b}?", output)
    return _row("Add the two numbers.", output, f"{a}, {b}")


def make_color(rng: random.Random) -> Row:
    """Typical color of a thing from a fixed table."""
    subject, color = rng.choice(COLORS)
    output = f"{subject[0].upper()}{subject[1:]} is {color}."
    if rng.random() < 0.6:
        return _row(f"What color is {subject}?", output)
    return _row("Name the color of the thing below.", output, subject)


def make_plural(rng: random.Random) -> Row:
    """Plural of a noun (regular and irregular) from a fixed table."""
    noun, plural = rng.choice(PLURALS)
    output = f"The plural of {noun} is {plural}."
    if rng.random() < 0.6:
        return _row(f"What is the plural of {noun}?", output)
    return _row("Write the plural form of the noun.", output, noun)


def make_repeat(rng: random.Random) -> Row:
    """Repeat a word two, three or four times (the count is spelled out in the instruction)."""
    word = rng.choice(WORDS)
    count = rng.choice(sorted(COUNT_WORDS))
    output = " ".join([word] * count)
    if rng.random() < 0.6:
        return _row(f"Repeat the word {word} {COUNT_WORDS[count]} times.", output)
    return _row(f"Repeat the word below {COUNT_WORDS[count]} times.", output, word)


def make_first_letter(rng: random.Random) -> Row:
    """First letter of a word."""
    word = rng.choice(WORDS + [noun for noun, _ in PLURALS] + [country for country, _ in CAPITALS])
    output = f"The first letter of {word} is {word[0]}."
    if rng.random() < 0.6:
        return _row(f"What is the first letter of the word {word}?", output)
    return _row("Give the first letter of the word.", output, word)


FAMILIES: list[Callable[[random.Random], Row]] = [
    make_capital,
    make_uppercase,
    make_antonym,
    make_addition,
    make_color,
    make_plural,
    make_repeat,
    make_first_letter,
]


def build_alpaca_rows(seed: int = 0) -> list[Row]:
    """Generate ``ROWS_PER_FAMILY`` rows per family, shuffled together with ``random.Random(seed)``."""
    rng = random.Random(seed)
    rows = [family(rng) for family in FAMILIES for _ in range(ROWS_PER_FAMILY)]
    rng.shuffle(rows)
    return rows


# ---------------------------------------------------------------------------------------------
# Chat-format view of the same data.
# ---------------------------------------------------------------------------------------------

SYSTEM_PROMPTS: list[str] = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in one short sentence.",
]


def user_content(row: Row) -> str:
    """Fold an alpaca row's instruction and optional input into a single user message."""
    return f"{row['instruction']}\n\n{row['input']}" if row["input"] else row["instruction"]


def build_message_rows(rows: list[Row], seed: int = 1) -> list[dict[str, list[Message]]]:
    """Convert the first ``NUM_MESSAGE_ROWS`` alpaca rows into chat records.

    About a quarter get a system prompt and about a quarter get a second user/assistant exchange.
    The second exchange is taken from the rows *after* the first 300 so no conversation repeats
    one of the first-300 rows. A separate RNG keeps the alpaca data independent of these choices.
    """
    rng = random.Random(seed)
    extra = rows[NUM_MESSAGE_ROWS:]
    records: list[dict[str, list[Message]]] = []
    for i, row in enumerate(rows[:NUM_MESSAGE_ROWS]):
        messages: list[Message] = []
        if rng.random() < 0.25:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        messages.append({"role": "user", "content": user_content(row)})
        messages.append({"role": "assistant", "content": row["output"]})
        if rng.random() < 0.25:
            follow_up = extra[i % len(extra)]
            messages.append({"role": "user", "content": user_content(follow_up)})
            messages.append({"role": "assistant", "content": follow_up["output"]})
        records.append({"messages": messages})
    return records


# ---------------------------------------------------------------------------------------------
# Rendering (used to build the tokenizer corpus; the quickstart uses the same alpaca layout).
# ---------------------------------------------------------------------------------------------


def render_alpaca(row: Row) -> str:
    """Render a row in the alpaca prompt layout, response included, without the trailing eos."""
    if row["input"]:
        prompt = f"### Instruction:\n{row['instruction']}\n\n### Input:\n{row['input']}\n\n### Response:\n"
    else:
        prompt = f"### Instruction:\n{row['instruction']}\n\n### Response:\n"
    return prompt + row["output"]


def render_chat(messages: list[Message]) -> str:
    """Python twin of ``CHAT_TEMPLATE`` (without eos), so the BPE learns the role markers."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)


def write_jsonl(path: Path, records: Iterable[dict]) -> None:
    """Write one compact JSON object per line with ``\\n`` endings regardless of platform."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------
# Tokenizer and model.
# ---------------------------------------------------------------------------------------------


def build_tokenizer(corpus: list[str]) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``corpus`` and wrap it for transformers.

    Byte-level (GPT-2 style) pre-tokenisation means any string can be encoded without ``<unk>``
    and ``decode(encode(x)) == x`` exactly, including spaces and newlines. ``add_prefix_space`` is
    off so a leading word is not silently given a space.

    The tokenizer does NOT add special tokens automatically (``add_bos_token=False``,
    ``add_eos_token=False``): callers (the trainer's formatter, the chat template) decide where
    ``<s>``/``</s>`` go, which avoids double-bos bugs when a template already contains them.
    transformers 5 does not write these flags to ``tokenizer_config.json``; the behaviour is
    persisted as the empty ``TemplateProcessing`` post-processor (``$A`` only) in ``tokenizer.json``.
    """
    backend = Tokenizer(models.BPE(unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so no <unk>
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
        # Byte-level decoding is already exact; the legacy clean-up would alter " ." etc.
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def check_roundtrip(tokenizer: PreTrainedTokenizerFast, samples: Iterable[str]) -> None:
    """Fail loudly if byte-level encode/decode is not lossless or specials are added implicitly."""
    for text in samples:
        ids = tokenizer.encode(text)
        decoded = tokenizer.decode(ids)
        if decoded != text:
            raise AssertionError(f"tokenizer roundtrip failed: {text!r} -> {decoded!r}")
        if ids and ids[0] == tokenizer.bos_token_id and not text.startswith(BOS):
            raise AssertionError("tokenizer unexpectedly prepends bos")


def build_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """Create the randomly initialised tiny Llama (fp32, tied embeddings) with a fixed seed."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MODEL_MAX_LENGTH,
        tie_word_embeddings=True,
        initializer_range=INIT_STD,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def verify_saved(model_dir: Path, samples: list[str]) -> int:
    """Reload both artefacts from disk (offline) and return the parameter count."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    check_roundtrip(tokenizer, samples)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    with torch.no_grad():
        ids = torch.tensor([tokenizer.encode(samples[0])])
        logits = model(input_ids=ids).logits
    if logits.shape[-1] != len(tokenizer):
        raise AssertionError("model vocab does not match tokenizer")
    return sum(p.numel() for p in model.parameters())


def _roundtrip_samples(rows: list[Row]) -> Iterator[str]:
    """Strings with spaces, newlines, unseen characters and special tokens."""
    yield "Hello, world!  Two  spaces,\ttab and\nnew\n\nlines.\n"
    yield "  leading and trailing spaces  "
    yield "Unicode: café, naïve, 東京, emoji 🙂"
    yield "<s>### Instruction:\nAdd 12 and 7.\n\n### Response:\n12 plus 7 is 19.</s>"
    for row in rows[:20]:
        yield render_alpaca(row)


def main() -> int:
    """Build every asset, verify it, and print a short summary."""
    rows = build_alpaca_rows(seed=0)
    message_rows = build_message_rows(rows, seed=1)
    write_jsonl(ALPACA_PATH, rows)
    write_jsonl(MESSAGES_PATH, message_rows)

    corpus = [render_alpaca(row) for row in rows]
    corpus += [render_chat(record["messages"]) for record in message_rows]
    tokenizer = build_tokenizer(corpus)
    samples = list(_roundtrip_samples(rows))
    check_roundtrip(tokenizer, samples)

    model = build_model(tokenizer)
    # The directory is fully generated: start from scratch so no stale file from an older layout
    # (e.g. a special_tokens_map.json) survives a rebuild.
    if MODEL_DIR.exists():
        shutil.rmtree(MODEL_DIR)
    MODEL_DIR.mkdir(parents=True)
    tokenizer.save_pretrained(MODEL_DIR)
    model.save_pretrained(MODEL_DIR, safe_serialization=True)
    # save_pretrained leaves the weights file with mode 0600; make it readable like the other assets.
    for path in MODEL_DIR.glob("*.safetensors"):
        path.chmod(0o644)

    n_params = verify_saved(MODEL_DIR, samples)
    lengths = [len(tokenizer.encode(text)) + 1 for text in corpus[: len(rows)]]  # +1 for eos
    print(f"wrote {len(rows)} rows -> {ALPACA_PATH.relative_to(EXAMPLES_DIR.parent)}")
    print(f"wrote {len(message_rows)} chat rows -> {MESSAGES_PATH.relative_to(EXAMPLES_DIR.parent)}")
    print(
        f"tokenizer: vocab={len(tokenizer)} unk={tokenizer.unk_token_id} bos={tokenizer.bos_token_id} "
        f"eos={tokenizer.eos_token_id} pad={tokenizer.pad_token_id}; "
        f"alpaca tokens/example max={max(lengths)} mean={sum(lengths) / len(lengths):.1f}"
    )
    print(f"model: {n_params:,} parameters -> {MODEL_DIR.relative_to(EXAMPLES_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
