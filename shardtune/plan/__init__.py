"""``shardtune plan``: size a run offline (strategy, memory per GPU, steps) with the estimate the doctor uses."""

from shardtune.plan.command import add_plan_parser

__all__ = ["add_plan_parser"]
