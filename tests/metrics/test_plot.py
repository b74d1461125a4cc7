"""`shardtune plot` on real runs: one run (an MoE model: its expert-usage heatmap too), two runs overlaid,
and bad input."""

from __future__ import annotations

import pytest
from cli_runs import schema_checked_logs, train
from tiny_models import write_tiny_model

from shardtune.cli import main

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
        tmp_path, "moe", 1, f"model.name_or_path={moe}", "model.init=random", "lora.target_modules=null", steps=3
    )
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


def test_a_crashed_runs_last_line_cut_short_is_left_out(runs, tmp_path, capsys):
    """A kill in mid-write leaves a log's last line without its newline: plot and expert-usage draw the rows
    before it, as a resume keeps them, instead of refusing the crashed run."""
    import shutil

    run = shutil.copytree(runs["moe"], tmp_path / "crashed")
    for name in ("train_log.jsonl", "expert_usage.jsonl"):
        log = run / "logs" / name
        log.write_text(log.read_text() + '{"schema_version": 1, "step": 4, "lo')
    assert main(["plot", str(run)]) == 0
    assert f"wrote {run / 'plots' / 'loss.png'}" in capsys.readouterr().out
    assert main(["expert-usage", str(run)]) == 0
    printed = capsys.readouterr()
    assert f"wrote {run / 'expert_usage.png'}" in printed.out and printed.err == ""
