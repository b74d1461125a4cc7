"""README's "Coming from hand-made scripts" names only config keys, commands and flags that exist."""

from __future__ import annotations

import argparse
import re
import typing
from pathlib import Path

from pydantic import BaseModel

from shardtune.cli import build_parser
from shardtune.config import Config

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Coming from hand-made scripts"

SECTIONS = "|".join(Config.model_fields)
# `training.save_steps`, `lora.r: 8`, `training.max_steps=10`, `logging.wandb.project`, `lora.*`
KEY = re.compile(rf"(?<![\w.-])((?:{SECTIONS})(?:\.\w+)+|(?:{SECTIONS})\.\*)")
COMMAND = re.compile(r"\bshardtune ([a-z][a-z-]*)")
FLAG = re.compile(r"(?:^|\s)(--[a-z][a-z0-9-]*)")


def section_text() -> str:
    text = README.read_text()
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    body = text.split(SECTION + "\n", 1)[1]
    return re.split(r"^## ", body, maxsplit=1, flags=re.M)[0]


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def submodel(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The section model of a field, if it is one (``Config.training`` -> ``TrainingConfig``)."""
    annotation = model.model_fields[name].annotation
    candidates = typing.get_args(annotation) or (annotation,)
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def key_exists(dotted: str) -> bool:
    model: type[BaseModel] | None = Config
    for part in dotted.split("."):
        if model is None:
            return False
        if part == "*":
            return True
        if part not in model.model_fields:
            return False
        model = submodel(model, part)
    return True


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_section_names_only_real_config_keys():
    keys = {match for span in code_spans(section_text()) for match in KEY.findall(span)}
    assert len(keys) > 30, f"the key pattern found too few keys to be reading the section: {sorted(keys)}"
    missing = sorted(key for key in keys if not key_exists(key))
    assert not missing, f"README names config keys that shardtune/config.py lacks: {missing}"


def test_section_names_only_real_commands_and_flags():
    commands = subcommands()
    named: set[str] = set()
    problems = []
    for span in code_spans(section_text()):
        for match in COMMAND.finditer(span):
            name = match.group(1)
            named.add(name)
            if name not in commands:
                problems.append(f"shardtune {name}: no such command")
                continue
            # Flags after the command, up to the next `shardtune` in the same span.
            rest = COMMAND.split(span[match.end() :], maxsplit=1)[0]
            options = commands[name]._option_string_actions
            unknown = [flag for flag in FLAG.findall(rest) if flag not in options]
            problems += [f"shardtune {name} {flag}: no such option" for flag in unknown]
    assert not problems, "\n".join(problems)
    assert {"launch", "slurm", "train", "convert", "prepare", "export", "doctor", "plot", "plan"} <= named
