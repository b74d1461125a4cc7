"""Prompt/response text -> token ids and next-token targets with the prompt masked out."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from shardtune.errors import DataError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenizedExample:
    """``targets[i]`` is the token the model must predict after reading ``input_ids[: i + 1]``.

    Targets are shifted here, once, per example, rather than inside the loss: a position never
    predicts a token of another example, and the loss is a plain cross entropy over aligned tensors.
    """

    input_ids: list[int]
    targets: list[int]

    @property
    def num_targets(self) -> int:
        return sum(1 for t in self.targets if t != IGNORE_INDEX)


class ExampleTokenizer:
    """Tokenizes prompt and response separately so the mask boundary is exact.

    Tokenizing the joined text and guessing where the prompt ends can shift the boundary by a token
    when a merge spans it; separate encoding cannot. Special tokens follow the tokenizer's own habit
    (e.g. Llama prepends BOS, Qwen does not); EOS always ends the response so the model learns to stop.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int):
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no eos_token; set one in its tokenizer_config.json")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.prefix = _special_prefix(tokenizer)

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.prefix + self.tokenizer.encode(prompt, add_special_tokens=False)

    def __call__(self, prompt: str, response: str) -> tuple[TokenizedExample | None, bool]:
        """Return (example or None when no target token survives truncation, whether it was truncated)."""
        prompt_ids = self.encode_prompt(prompt)
        response_ids = self.tokenizer.encode(response, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        sequence = prompt_ids + response_ids
        truncated = len(sequence) > self.max_length
        sequence = sequence[: self.max_length]
        targets = [IGNORE_INDEX] * len(sequence)
        # Position i predicts sequence[i + 1]; only predictions of response tokens carry a target.
        for i in range(max(len(prompt_ids) - 1, 0), len(sequence) - 1):
            targets[i] = sequence[i + 1]
        example = TokenizedExample(sequence, targets)
        return (example if example.num_targets else None), truncated


def _special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens the tokenizer puts before text by itself (BOS for most models)."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []
