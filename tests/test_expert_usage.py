"""`shardtune expert-usage`: bad input is one clear line naming the file, line, range or --out; what it writes over."""

from __future__ import annotations

import json

import pytest

from shardtune.cli import main


def record(step: int) -> dict:
    layer = {"layer": 0, "counts": [5, 5, 6, 4], "max_mean_ratio": 1.2, "entropy": 1.3, "normalized_entropy": 0.94}
    return {"step": step, "tokens": 10, "top_k": 2, "num_experts": 4, "balance_loss": 2.1, "layers": [layer]}


def test_expert_usage_errors(tmp_path, capsys):
    assert main(["expert-usage", str(tmp_path)]) == 2
    assert f"{tmp_path}/logs/expert_usage.jsonl: no expert usage log" in capsys.readouterr().err
    log = tmp_path / "logs" / "expert_usage.jsonl"
    log.parent.mkdir()
    log.write_text(json.dumps(record(10)) + "\n" + '{"step": 20}\n')
    assert main(["expert-usage", str(tmp_path)]) == 2
    assert f"{log}:2: not an expert usage record" in capsys.readouterr().err
    log.write_text(json.dumps(record(10)) + "\n" + json.dumps(record(20)) + "\n")
    assert main(["expert-usage", str(log), "--steps", "30:"]) == 2
    assert "--steps 30:: no logging step in range (the log has steps 10, 20)" in capsys.readouterr().err
    assert main(["expert-usage", str(log), "--steps", "x"]) == 2
    assert "--steps: expected FROM:TO" in capsys.readouterr().err
    assert main(["expert-usage", str(log), "--steps", "20", "--out", str(tmp_path / "one.png")]) == 0
    assert "    0          20" in capsys.readouterr().out
    assert (tmp_path / "one.png").stat().st_size > 1000


def test_expert_usage_replaces_its_own_heatmap_and_another_file_only_with_overwrite(tmp_path, capsys, monkeypatch):
    """The heatmap derives from the log: drawn again, it replaces the earlier one, at the default RUN/expert_usage.png
    (whatever is there) and at an --out (a heatmap shardtune drew). Another file at --out is replaced only with
    --overwrite; --out must name a .png file. A heatmap is written whole: a save that fails leaves the old one and no
    temporary file."""
    import matplotlib.figure

    from shardtune.metrics.charts import drawn_by_shardtune

    log = tmp_path / "logs" / "expert_usage.jsonl"
    log.parent.mkdir()
    log.write_text(json.dumps(record(10)) + "\n" + json.dumps(record(20)) + "\n")
    default = tmp_path / "expert_usage.png"
    default.write_text("a heatmap drawn before heatmaps were marked as shardtune's\n")
    heatmap = tmp_path / "heatmap.png"
    for _ in range(2):
        assert main(["expert-usage", str(tmp_path)]) == 0 and drawn_by_shardtune(default)
        assert main(["expert-usage", str(log), "--out", str(heatmap)]) == 0 and drawn_by_shardtune(heatmap)
    mine, directory = tmp_path / "mine.png", tmp_path / "dir.png"
    mine.write_text("mine\n")
    directory.mkdir()
    capsys.readouterr()
    for out, why in [
        (mine, "already exists and shardtune did not draw it; choose another path, or pass --overwrite to replace it"),
        (directory, "is a directory; name a .png file"),
        (tmp_path / "heatmap.svg", "expert-usage writes a PNG; name a .png file"),
    ]:
        assert main(["expert-usage", str(tmp_path), "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip() == f"shardtune: error: --out {out}: {why}"
    assert mine.read_text() == "mine\n"
    assert main(["expert-usage", str(tmp_path), "--out", str(mine), "--overwrite"]) == 0 and drawn_by_shardtune(mine)

    drawn = heatmap.read_bytes()

    def full_disk(self, path, **kwargs):
        path.write_bytes(b"half a PNG")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    with pytest.raises(OSError, match="No space left"):
        main(["expert-usage", str(tmp_path), "--out", str(heatmap)])
    assert heatmap.read_bytes() == drawn
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "dir.png", "expert_usage.png", "heatmap.png", "logs", "mine.png"
    ]  # fmt: skip
