"""The alpaca prompt layout the seed scripts used: Instruction, optional Input, Response."""

from __future__ import annotations

PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
PROMPT_WITHOUT_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


def render_prompt(instruction: str, input_text: str = "") -> str:
    """The prompt text for an instruction, as the model sees it at training and generation time."""
    if input_text.strip():
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return PROMPT_WITHOUT_INPUT.format(instruction=instruction)
