"""`shardtune plot` on real runs: one run (an MoE model: its expert-usage heatmap too), two runs overlaid,
and bad input."""

from __future__ import annotations

import itertools
import shutil

import pytest
from cli_runs import schema_checked_logs, snapshot, train
from tiny_models import write_tiny_model

from shardtune.cli import main
from shardtune.metrics.charts import drawn_by_shardtune

LINE_CHARTS = ("loss", "lr", "throughput", "mfu", "memory", "step_time")
# matplotlib's first two line colors: the first run's and the second run's.
FIRST_RUN, SECOND_RUN = (0x1F / 255, 0x77 / 255, 0xB4 / 255), (0xFF / 255, 0x7F / 255, 0x0E / 255)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("matplotlib")
    tmp_path = tmp_path_factory.mktemp("plot")
    moe = write_tiny_model(tmp_path / "mixtral", "mixtral")
    dense = train(tmp_path, "dense", 1, "training.eval_steps=2", steps=4)
    sparse = train(
        tmp_path, "moe", 1, f"model.name_or_path={moe}", "model.init=random", "lora.target_modules=null",
        "training.save_steps=3", steps=3,
    )  # fmt: skip
    return {"dense": dense["out"], "moe": sparse["out"], "tmp": tmp_path}


def has_color(png, color, tolerance=0.02) -> bool:
    import matplotlib.image

    pixels = matplotlib.image.imread(png)[..., :3]
    return bool((abs(pixels - color).max(axis=-1) < tolerance).any())


def panel_count(png) -> int:
    """The panels of a chart: ``write_charts`` draws each 320 pixels high."""
    import matplotlib.image

    return matplotlib.image.imread(png).shape[0] // 320


def test_the_moe_run_logs_match_the_schema(runs):
    logs = schema_checked_logs(runs["moe"])
    assert [row["step"] for row in logs["expert_usage"]] == [1, 2, 3]
    assert all("moe_balance_loss" in row for row in logs["train"])


def test_one_run(runs, capsys):
    assert main(["plot", str(runs["moe"])]) == 0
    printed = capsys.readouterr().out
    out = runs["moe"] / "plots"
    for name in (*LINE_CHARTS, "expert_usage"):
        png = out / f"{name}.png"
        assert f"wrote {png}" in printed
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, name
    assert has_color(out / "loss.png", FIRST_RUN) and not has_color(out / "loss.png", SECOND_RUN)
    # A CPU has no peak rate, so no MFU: its panel is left out, not drawn empty, and TFLOP/s alone remains.
    assert all(row.get("mfu") is None for row in schema_checked_logs(runs["moe"])["train"])
    assert panel_count(out / "mfu.png") == 1 and panel_count(out / "step_time.png") == 2


def test_two_runs_overlaid(runs, capsys):
    out = runs["tmp"] / "compare"
    assert main(["plot", str(runs["dense"]), str(runs["moe"]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in LINE_CHARTS:
        png = out / f"{name}.png"
        assert f"wrote {png}" in printed and png.stat().st_size > 5000, name
        assert has_color(png, FIRST_RUN) and has_color(png, SECOND_RUN), f"{name}: both runs drawn"
    # the MoE run's heatmap, named after it; the dense run has none
    assert [png.name for png in out.glob("expert_usage*.png")] == ["expert_usage-moe.png"]


def test_bad_input(runs, tmp_path, capsys):
    assert main(["plot", str(runs["dense"]), str(runs["moe"])]) == 2
    assert "with several runs, name the directory for the charts with --out DIR" in capsys.readouterr().err
    assert main(["plot", str(tmp_path)]) == 2
    assert f"{tmp_path}: no rows in logs/train_log.jsonl" in capsys.readouterr().err
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs/train_log.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"loss": \n')
    assert main(["plot", str(tmp_path)]) == 2
    assert f"{tmp_path}/logs/train_log.jsonl:2: not a log row" in capsys.readouterr().err


def test_plot_and_expert_usage_never_write_over_a_runs_files_or_their_input(runs, tmp_path, capsys):
    """--out, even with --overwrite, is never one of a run's own entries (logs/, final/, a checkpoint, config.yaml,
    metrics.json) nor inside one, nor the log the command reads: `plot RUN --out RUN/logs` wrote its PNGs into the
    run's logs/, `expert-usage RUN --out RUN/logs/train_log.jsonl` replaced the log with a PNG. One line, exit 2,
    the run's files as they were. The defaults, and a new file in the run directory, are written."""
    run = shutil.copytree(runs["moe"], tmp_path / "run", ignore=shutil.ignore_patterns("plots", "expert_usage.png"))
    logs, checkpoint = run / "logs", run / "checkpoint-3"
    usage = logs / "expert_usage.jsonl"
    only_the_run = "which only the run writes"
    cases = {
        "plot": [
            (logs, f"is the input {logs}"),
            (logs / "charts", f"is inside the input {logs}"),
            (run, f"contains the input {logs}"),
            (run / "final", f"is the run's final in {run}, {only_the_run}"),
            (run / "final-merged", f"is the run's final-merged in {run}, {only_the_run}"),
            (checkpoint, f"{checkpoint} is a checkpoint, which is never written to"),
            (run / "config.yaml", f"is the run's config.yaml in {run}, {only_the_run}"),
        ],
        "expert-usage": [
            (usage, f"is the input {usage}"),
            (logs / "train_log.jsonl", f"is inside the run's logs in {run}, {only_the_run}"),
            (logs / "expert_usage.png", f"is inside the run's logs in {run}, {only_the_run}"),
            (run / "final" / "expert_usage.png", f"is inside the run's final in {run}, {only_the_run}"),
            (checkpoint / "expert_usage.png", f"{checkpoint} is a checkpoint, which is never written to"),
            (run / "config.yaml", f"is the run's config.yaml in {run}, {only_the_run}"),
            (run / "metrics.json", f"is the run's metrics.json in {run}, {only_the_run}"),
        ],
    }
    before = snapshot(run)
    for command, outs in cases.items():
        for (out, why), overwrite in itertools.product(outs, ([], ["--overwrite"])):
            assert main([command, str(run), "--out", str(out), *overwrite]) == 2, (command, out, overwrite)
            assert capsys.readouterr().err.strip() == f"shardtune: error: --out {out}: {why}; choose another --out"
    assert snapshot(run) == before
    assert main(["plot", str(run)]) == 0
    assert main(["expert-usage", str(run)]) == 0
    assert main(["expert-usage", str(run), "--out", str(run / "heatmap.png")]) == 0
    written = {name for name in snapshot(run) if name not in before}
    plots = {f"plots/{name}.png" for name in (*LINE_CHARTS, "expert_usage")}
    assert written == {*plots, "expert_usage.png", "heatmap.png"}
    assert {name: stamp for name, stamp in snapshot(run).items() if name not in written} == before


def test_charts_drawn_again_replace_shardtunes_own_and_another_file_only_with_overwrite(runs, tmp_path, capsys):
    """Charts derive from the logs: plot run again replaces its earlier charts, at the default RUN_DIR/plots
    (whatever is there) and at an --out (charts shardtune drew). A file of a chart's name in --out that shardtune
    did not draw is replaced only with --overwrite: without it, one line names it and nothing is written. A chart
    is written whole, under a temporary name: none is left beside it. An --out that is a file is one line."""
    run = shutil.copytree(runs["moe"], tmp_path / "run", ignore=shutil.ignore_patterns("plots", "expert_usage.png"))
    plots = run / "plots"
    plots.mkdir()
    (plots / "loss.png").write_text("a chart drawn before charts were marked as shardtune's\n")
    own_charts = {f"{name}.png" for name in (*LINE_CHARTS, "expert_usage")}
    for _ in range(2):
        assert main(["plot", str(run)]) == 0
        assert {path.name for path in plots.iterdir()} == own_charts
        assert all(drawn_by_shardtune(plots / name) for name in own_charts)
    out = tmp_path / "compare"
    compare = ["plot", str(runs["dense"]), str(run), "--out", str(out)]
    for _ in range(2):
        assert main(compare) == 0
    (out / "lr.png").write_text("mine\n")
    (out / "memory.png").write_text("mine too\n")
    (out / "notes.txt").write_text("mine as well\n")
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    capsys.readouterr()
    assert main(compare) == 2
    assert capsys.readouterr().err.strip() == (
        f"shardtune: error: --out {out}: already holds lr.png, memory.png, which shardtune did not draw; choose "
        "another path, or pass --overwrite to replace them"
    )
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert main([*compare, "--overwrite"]) == 0
    charts = {f"{name}.png" for name in LINE_CHARTS} | {"expert_usage-run.png"}
    assert {path.name for path in out.iterdir()} == {*charts, "notes.txt"}
    assert all(drawn_by_shardtune(out / name) for name in charts)
    assert (out / "notes.txt").read_text() == "mine as well\n"
    file = tmp_path / "charts.png"
    file.write_text("mine\n")
    assert main(["plot", str(run), "--out", str(file)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"shardtune: error: --out {file}: is not a directory; name a directory for the charts"
    )
    assert file.read_text() == "mine\n"


def test_a_crashed_runs_last_line_cut_short_is_left_out(runs, tmp_path, capsys):
    """A kill in mid-write leaves a log's last line without its newline: plot and expert-usage draw the rows
    before it, as a resume keeps them, instead of refusing the crashed run."""
    run = shutil.copytree(runs["moe"], tmp_path / "crashed")
    for name in ("train_log.jsonl", "expert_usage.jsonl"):
        log = run / "logs" / name
        log.write_text(log.read_text() + '{"schema_version": 1, "step": 4, "lo')
    assert main(["plot", str(run)]) == 0
    assert f"wrote {run / 'plots' / 'loss.png'}" in capsys.readouterr().out
    assert main(["expert-usage", str(run)]) == 0
    printed = capsys.readouterr()
    assert f"wrote {run / 'expert_usage.png'}" in printed.out and printed.err == ""
