"""``shardtune doctor``: preflight checks of every node and of the links between them, before a run."""

from shardtune.doctor.command import add_doctor_parser

__all__ = ["add_doctor_parser"]
