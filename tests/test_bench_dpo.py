"""scripts/bench_dpo.py on a tiny model: it runs, and the reference pass's peak host RAM is no
more than training's (the engine's own state, forward only, no second copy of the model)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_dpo_tiny(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_dpo.py"), "--hidden", "64",
         "--layers", "2", "--steps", "2", "--pairs", "8", "--batch-size", "8",
         "--compute-dtype", "float32", "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
        timeout=300)
    assert result.returncode == 0, result.stderr
    assert "reference pass:  peak RSS" in result.stdout
    r = json.loads(out.read_text())
    assert r["sequences"] == 16 and r["steps"] == 2
    assert r["baseline_rss_bytes"] < r["engine_rss_bytes"] <= r["reference_peak_rss_bytes"]
    assert r["reference_peak_rss_bytes"] <= r["train_peak_rss_bytes"]


def test_bench_dpo_rejects_bad_arguments():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_dpo.py"), "--batch-size", "7"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120)
    assert result.returncode == 2 and "--batch-size must be even" in result.stderr
