"""Rendered segments -> token ids and next-token targets, with untrained segments masked out."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

import numpy as np
from transformers import PreTrainedTokenizerBase

from shardtune.data.formats import Rendered
from shardtune.errors import DataError

IGNORE_INDEX = -100


class Outcome(str, Enum):
    KEPT = "kept"
    TRUNCATED = "truncated"  # kept, cut to max_length
    TOO_LONG = "too_long"  # dropped: over max_length with data.truncation: drop
    NO_TARGET_TOKENS = "no_target_tokens"  # dropped: nothing left to train on


@dataclass(frozen=True, eq=False)
class TokenizedExample:
    """``targets[i]`` is the token the model must predict after reading ``input_ids[: i + 1]``.

    Targets are shifted here, once, per example, rather than inside the loss: a position never
    predicts a token of another example when examples are packed together, and the loss is a plain
    cross entropy over aligned tensors. Arrays (int32) rather than lists: the token store
    concatenates them without a per-token Python loop.
    """

    input_ids: np.ndarray
    targets: np.ndarray
    num_targets: int

    def __len__(self) -> int:
        return len(self.input_ids)


class ExampleTokenizer:
    """Tokenizes each segment separately, so the boundary between masked and trained text is exact.

    Tokenizing the joined text and guessing where the prompt ends can shift the boundary by a token
    when a merge spans it; separate encoding cannot. Segments are encoded in one batched call per
    chunk of rows, which lets the Rust tokenizer use every core.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int, truncation: str = "truncate"):
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no eos_token; set one in its tokenizer_config.json")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation = truncation
        self.prefix = _special_prefix(tokenizer)

    def encode_prompt(self, rendered: Rendered) -> list[int]:
        """The ids of a prompt rendered for generation: the ids training gives the same segments."""
        ids, _ = self._assemble(rendered, iter(self._encode_batch([segment.text for segment in rendered.segments])))
        return ids

    def tokenize(self, rendered: list[Rendered]) -> list[tuple[TokenizedExample | None, Outcome]]:
        texts = [segment.text for item in rendered for segment in item.segments]
        encoded = iter(self._encode_batch(texts) if texts else [])
        return [self._finish(*self._assemble(item, encoded)) for item in rendered]

    def _assemble(self, item: Rendered, encoded: Iterator[list[int]]) -> tuple[list[int], list[bool]]:
        """One example's ids (its segments' encodings from ``encoded``) and whether each is trained on."""
        ids = list(self.prefix) if item.add_special_prefix else []
        trained = [False] * len(ids)
        for segment in item.segments:
            piece = next(encoded) + ([self.tokenizer.eos_token_id] if segment.eos else [])
            ids += piece
            trained += [segment.trainable] * len(piece)
        return ids, trained

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            # The Rust tokenizer directly: it encodes the batch on all cores, and skipping the
            # transformers wrapper's per-call bookkeeping halves preparation time.
            return [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def _finish(self, ids: list[int], trained: list[bool]) -> tuple[TokenizedExample | None, Outcome]:
        outcome = Outcome.KEPT
        if len(ids) > self.max_length:
            if self.truncation == "drop":
                return None, Outcome.TOO_LONG
            ids, trained, outcome = ids[: self.max_length], trained[: self.max_length], Outcome.TRUNCATED
        input_ids = np.array(ids, dtype=np.int32)
        # Position i predicts token i + 1, which carries a target only if it is trained on.
        targets = np.full(len(input_ids), IGNORE_INDEX, dtype=np.int32)
        targets[:-1] = np.where(np.array(trained[1:], dtype=bool), input_ids[1:], IGNORE_INDEX)
        num_targets = int(np.count_nonzero(targets != IGNORE_INDEX))
        if num_targets == 0:
            return None, Outcome.NO_TARGET_TOKENS
        return TokenizedExample(input_ids, targets, num_targets), outcome


def _special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens the tokenizer puts before text by itself (BOS for most models)."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []
