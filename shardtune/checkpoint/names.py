"""How state dicts name parameters, apart from the wrappers a run puts around modules."""

from __future__ import annotations

WRAPPER_PARTS = ("module", "_orig_mod", "_checkpoint_wrapped_module")


def without_wrappers(name: str) -> str:
    """A parameter's or module's name as state dicts spell it: DDP's ``module.``, torch.compile's ``_orig_mod.``
    and activation checkpointing's ``_checkpoint_wrapped_module.`` are not part of it."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)
