"""``shardtune plot RUN_DIR [RUN_DIR ...]``: PNG charts of what runs logged, one line per run, so that runs
(DDP against FSDP against one device, say) can be compared on one chart.

Charts, each a PNG in the output directory: ``loss.png`` (train loss, and eval loss dashed), ``lr.png``,
``throughput.png`` (tokens/s per device, target tokens dashed), ``mfu.png`` (TFLOP/s per device and MFU),
``memory.png`` (peak memory), ``step_time.png`` (per-rank step time: the band from the fastest to the
slowest rank around the median, and data wait), and for MoE runs the expert-usage heatmap of
``shardtune expert-usage``. A chart or panel whose fields no run logged is left out (MFU on a CPU, whose peak
rate shardtune does not know).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardtune.errors import InputError
from shardtune.metrics.charts import write_charts
from shardtune.metrics.expert_heatmap import draw_heatmap
from shardtune.metrics.schema import LOG_FILES, read_rows
from shardtune.run_dir import check_output_place

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def add_plot_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("plot", help="PNG charts of one run, or of several runs overlaid")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (their logs/)")
    parser.add_argument(
        "--out", type=Path, default=None, help="directory for the PNGs (default with one run: RUN_DIR/plots)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace files in --out named as a chart that shardtune did not draw"
    )
    parser.set_defaults(handler=cmd_plot)


def read_log(path: Path) -> list[dict[str, Any]]:
    """The rows of a train or eval log ([] when the file does not exist)."""
    return read_rows(path, "a log row") if path.is_file() else []


def run_labels(runs: list[Path]) -> list[str]:
    """Short names that tell the runs apart: the directory names, with parents added while two clash."""
    resolved = [run.resolve() for run in runs]
    for depth in range(1, max(len(run.parts) for run in resolved) + 1):
        labels = ["/".join(run.parts[-depth:]) for run in resolved]
        if len(set(labels)) == len(labels):
            return labels
    return [str(run) for run in runs]  # the same directory given twice


def cmd_plot(args: argparse.Namespace) -> int:
    runs = [Path(run) for run in args.runs]
    if args.out is None and len(runs) > 1:
        raise InputError("plot: with several runs, name the directory for the charts with --out DIR")
    requested: Path = args.out or runs[0] / "plots"
    out = check_output_place(requested, {run / "logs": "the input" for run in runs})
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {requested}: is not a directory; name a directory for the charts")
    from shardtune.metrics.expert_usage import read_usage  # imports torch: not for every command's parser

    logs = {}
    for run, label in zip(runs, run_labels(runs), strict=True):
        train = read_log(run / "logs" / LOG_FILES["train"])
        if not train:
            raise InputError(f"{run}: no rows in logs/{LOG_FILES['train']} (not a run directory, or no step logged)")
        try:
            usage = read_usage(run)
        except FileNotFoundError:
            usage = None  # a dense model
        logs[label] = {"train": train, "eval": read_log(run / "logs" / LOG_FILES["eval"]), "usage": usage}
    figures = {out / name: figure for name, figure in draw_charts(logs).items()}
    out.mkdir(parents=True, exist_ok=True)
    # The default place is the command's own: what is there are its earlier charts, replaced as they always were.
    write_charts(figures, requested, overwrite=args.overwrite or args.out is None)
    for path in figures:
        print(f"wrote {path}")
    return 0


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a cluster node
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("plot needs matplotlib: pip install 'shardtune[plot]'") from None
    return plt


def _series(rows: list[dict[str, Any]], field: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    points = [(row["step"], row[field] * scale) for row in rows if isinstance(row.get(field), (int, float))]
    return [step for step, _ in points], [value for _, value in points]


def draw_charts(logs: dict[str, dict[str, Any]]) -> dict[str, Figure]:
    """Every chart the logs have data for, by file name: its matplotlib figure, for ``write_charts``."""
    plt = _pyplot()
    figures = {}

    def chart(name: str, panels: list[tuple[str, list[tuple[str, str, str]]]]) -> None:
        """One PNG with a panel per (y label, [(log, field, style)]) that some run logged, a line per run and field;
        none where no run logged any."""
        panels = [
            (ylabel, lines)
            for ylabel, lines in panels
            if any(_series(run_logs[kind], field)[0] for run_logs in logs.values() for kind, field, _ in lines)
        ]
        if not panels:
            return
        figure, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)), sharex=True, squeeze=False)
        for axis, (ylabel, lines) in zip(axes[:, 0], panels, strict=True):
            for index, (label, run_logs) in enumerate(logs.items()):
                color = f"C{index % 10}"
                for kind, field, style in lines:
                    scale = 100.0 if field == "mfu" else 1.0
                    steps, values = _series(run_logs[kind], field, scale)
                    if not steps:
                        continue
                    suffix = f" {field}" if len(lines) > 1 else ""
                    marker = "o" if len(steps) < 30 else None
                    axis.plot(steps, values, style, color=color, marker=marker, markersize=3, label=label + suffix)
            axis.set_ylabel(ylabel)
            axis.grid(alpha=0.3)
            if axis.lines:
                axis.legend(fontsize="small")
        axes[-1, 0].set_xlabel("step")
        figure.tight_layout()
        figures[f"{name}.png"] = figure

    chart("loss", [("loss", [("train", "loss", "-"), ("eval", "eval_loss", "--")])])
    chart("lr", [("learning rate", [("train", "lr", "-")])])
    chart(
        "throughput",
        [("tokens/s per device", [("train", "tokens_per_s_per_device", "-"),
                                  ("train", "target_tokens_per_s_per_device", "--")])],
    )  # fmt: skip
    chart("mfu", [("TFLOP/s per device", [("train", "tflops_per_device", "-")]), ("MFU (%)", [("train", "mfu", "-")])])
    chart("memory", [("peak memory (GiB)", [("train", "peak_memory_gib", "-")])])
    chart(
        "step_time",
        [("step time (s)", [("train", "step_time_s_median", "-"), ("train", "step_time_s_max", ":"),
                            ("train", "step_time_s_min", ":")]),
         ("data wait per step (s)", [("train", "data_wait_s", "-")])],
    )  # fmt: skip
    from shardtune.metrics.expert_usage import summarize  # imports torch: not for every command's parser

    for label, run_logs in logs.items():
        records = run_logs["usage"]
        if records is None:
            continue  # a dense model
        name = "expert_usage.png" if len(logs) == 1 else f"expert_usage-{label.replace('/', '_')}.png"
        layers, counts = summarize(records)
        steps = f"logging steps {records[0]['step']}-{records[-1]['step']}"
        figures[name] = draw_heatmap(layers, counts, f"{label}, {steps}")
    return figures
