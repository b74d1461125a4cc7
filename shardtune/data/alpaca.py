"""The alpaca instruction format: rows with ``instruction``, optional ``input``, and ``output``.

The prompt layout is the one the seed scripts used (Instruction, optional Input, Response); the
loss is taken on the response only.
"""

from __future__ import annotations

from dataclasses import dataclass

PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
PROMPT_WITHOUT_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


@dataclass(frozen=True)
class PromptResponse:
    """One training example as text: the prompt (masked from the loss) and the response (trained on)."""

    prompt: str
    response: str


def render_prompt(instruction: str, input_text: str = "") -> str:
    """The prompt text for an instruction, as the model sees it at training and generation time."""
    if input_text.strip():
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return PROMPT_WITHOUT_INPUT.format(instruction=instruction)


def render_alpaca(row: dict) -> PromptResponse:
    """Render one alpaca row; the caller has checked that the fields exist and are strings."""
    return PromptResponse(render_prompt(row["instruction"], row.get("input") or ""), row["output"])
