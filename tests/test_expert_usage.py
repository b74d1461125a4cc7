"""`shardtune expert-usage` on bad input: clear errors naming the file, line or range."""

from __future__ import annotations

import json

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
