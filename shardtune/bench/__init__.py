"""``shardtune bench``: throughput and memory of real-shaped models with random weights."""

from shardtune.bench.command import add_bench_parser

__all__ = ["add_bench_parser"]
