"""``shardtune expert-usage RUN_DIR``: the expert load of an MoE run as a heatmap (layers x experts) and
a per-layer table.

Each cell is an expert's share of its layer's routed tokens relative to an even share (count / mean
count), on a log color scale centered at 1: blue experts are starved, red ones overloaded, white ones
get what an even router would give them.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.errors import InputError
from shardtune.metrics.charts import write_charts
from shardtune.run_dir import check_output_place

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def add_expert_usage_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("expert-usage", help="MoE runs: expert load heatmap (PNG) and per-layer table")
    parser.add_argument("run", help="a run directory (its logs/expert_usage.jsonl) or an expert_usage.jsonl")
    parser.add_argument("--out", default=None, help="PNG to write (default: expert_usage.png next to logs/)")
    parser.add_argument("--steps", default=None, metavar="FROM:TO", help="only logging steps in [FROM, TO]")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a file at --out that is not a chart shardtune drew"
    )
    parser.set_defaults(handler=cmd_expert_usage)


def _step_range(text: str | None) -> tuple[int, float]:
    if text is None:
        return 0, math.inf
    start, sep, end = text.partition(":")
    try:
        return int(start or 0), (int(end) if end else math.inf) if sep else int(start)
    except ValueError:
        raise InputError(f"--steps: expected FROM:TO (e.g. 100:200, 100: or :200), got {text!r}") from None


def cmd_expert_usage(args: argparse.Namespace) -> int:
    # imports torch: not for every command's parser
    from shardtune.metrics.expert_usage import read_usage, summarize, usage_log

    source = Path(args.run)
    run = source if source.is_dir() else source.parent.parent
    requested = Path(args.out) if args.out else run / "expert_usage.png"
    out = check_output_place(requested, {usage_log(source): "the input"})
    if out.is_dir():
        raise InputError(f"--out {requested}: is a directory; name a .png file")
    if requested.suffix.lower() != ".png":
        raise InputError(f"--out {requested}: expert-usage writes a PNG; name a .png file")
    try:
        records = read_usage(source)
    except FileNotFoundError as exc:
        raise InputError(str(exc)) from None
    first, last = _step_range(args.steps)
    chosen = [record for record in records if first <= record["step"] <= last]
    if not chosen:
        steps = ", ".join(str(record["step"]) for record in records)
        raise InputError(f"--steps {args.steps}: no logging step in range (the log has steps {steps})")
    layers, counts = summarize(chosen)
    figure = draw_heatmap(layers, counts, f"logging steps {chosen[0]['step']}-{chosen[-1]['step']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    # The default place is the command's own: what is there is its earlier heatmap, replaced as it always was.
    write_charts({out: figure}, requested, overwrite=args.overwrite or args.out is None)
    print(format_table(chosen, layers, counts))
    print(f"wrote {out}")
    return 0


def format_table(records: list[dict], layers: list[int], counts) -> str:
    """Per layer over the chosen records (``layers`` and ``counts`` are their ``summarize``): tokens,
    busiest and idlest expert, max/mean ratio, entropy."""
    entropy: dict[int, list[float]] = {layer: [] for layer in layers}
    for record in records:
        for row in record["layers"]:
            entropy[row["layer"]].append(row["normalized_entropy"])
    lines = [f"{'layer':>5}  {'tokens':>10}  {'busiest':>13}  {'idlest':>13}  {'max/mean':>8}  {'entropy':>7}"]
    for layer, row in zip(layers, counts, strict=True):
        mean = float(row.mean())
        busiest, idlest = int(row.argmax()), int(row.argmin())
        lines.append(
            f"{layer:>5}  {int(row.sum()):>10,}  {f'e{busiest} {int(row[busiest]):,}':>13}  "
            f"{f'e{idlest} {int(row[idlest]):,}':>13}  {float(row.max()) / mean if mean else math.nan:>8.2f}  "
            f"{sum(entropy[layer]) / len(entropy[layer]):>7.3f}"
        )
    return "\n".join(lines)


def draw_heatmap(layers: list[int], counts, subtitle: str) -> Figure:
    """The heatmap's matplotlib figure, for ``write_charts``."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a cluster node
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
    except ImportError:
        raise InputError("expert-usage needs matplotlib: pip install 'shardtune[plot]'") from None
    relative = counts / counts.mean(dim=1, keepdim=True).clamp_min(1e-12)
    # Experts that got nothing would be -inf on a log scale: show them at the scale's floor.
    top = max(float(relative.max()), 2.0)
    floor = 1.0 / top
    values = relative.clamp_min(floor).numpy()
    num_layers, num_experts = values.shape
    figure, axes = plt.subplots(figsize=(min(4 + num_experts * 0.12, 24), min(2 + num_layers * 0.3, 16)))
    image = axes.imshow(
        values, aspect="auto", cmap="RdBu_r", norm=LogNorm(vmin=floor, vmax=top), interpolation="nearest"
    )
    axes.set_xlabel("expert")
    axes.set_ylabel("layer")
    axes.set_yticks(range(num_layers), [str(layer) for layer in layers])
    axes.set_title(f"tokens per expert / layer mean ({subtitle})")
    figure.colorbar(image, ax=axes, label="load relative to an even share")
    figure.tight_layout()
    return figure
