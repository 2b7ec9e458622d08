"""A smoke run of scripts/bench_data.py at a tiny size: its table and well-formed JSON whose
figures are consistent (the figures themselves: docs/benchmarks.md)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_data_tiny(tmp_path):
    out = tmp_path / "data.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_data.py"),
                           "--tokenize-mb", "0.1", "--stream-gb", "0.001", "--batches", "3",
                           "--dir", str(tmp_path / "work"), "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ours / raw tokens/s" in proc.stdout and "RSS after GB" in proc.stdout
    r = json.loads(out.read_text())
    tok = r["tokenize"]
    assert tok["ours"]["tokens"] == tok["raw"]["tokens"] > 0  # the same documents, the same ids
    assert tok["ratio"] == tok["ours_tokens_per_s"] / tok["raw_tokens_per_s"] > 0
    assert [s["corpus_gb"] for s in r["stream"]] == [0.001]
    for s in r["stream"]:
        assert s["tokens"] == int(s["corpus_gb"] * 1e9) // 2
        assert 0 < s["rss_before_bytes"] <= s["peak_rss_bytes"] and s["batches_per_s"] > 0
    assert all(len(tok[side]["load_average"]) == 2 for side in ("ours", "raw"))
    assert os.listdir(tmp_path / "work") == []  # corpus files removed as it goes
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_data.py"),
                           "--tokenize-mb", "0.05", "--stream-gb", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ours / raw tokens/s" in proc.stdout and "streaming" not in proc.stdout
    assert json.loads(out.read_text())["stream"] == []  # tokenizing only
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_data.py"),
                           "--tokenize-mb", "0"], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert proc.returncode == 2 and "--tokenize-mb" in proc.stderr
