"""scripts/train.py end to end: a few steps of the tiny config, and every bad input."""

import json
import os
import subprocess
import sys

import pytest

from megatrain_jax import commands, hostmem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
FAST = ["train.steps=3", "model.num_layers=2", "data.seq_len=32", "data.batch_size=2",
        "train.log_every=1"]


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train.py"), *args],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def test_tiny_config_trains_and_writes_metrics(tmp_path):
    # A relative run_dir, as in the README's command, from another working directory. (The one
    # training run through a command line: `megatrain train` is the same function,
    # tests/test_commands.py.)
    run_dir = tmp_path / "runs" / "tiny"
    proc = run("--config", os.path.join(ROOT, "configs", "tiny.yaml"), *FAST, "data.micro_batches=2",
               f"data.path={ROOT}/megatrain_jax/texts/devils_dictionary.txt", "run_dir=runs/tiny",
               "optimizer.schedule=wsd", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "checkpoints" / "3").is_dir()  # the final checkpoint, committed
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert {"step", "loss", "tokens_per_sec", "step_time_s"} <= set(r)
        assert 0 < r["loss"] < 10 and r["tokens_per_sec"] > 0 and r["step_time_s"] > 0
    saved = (run_dir / "config.yaml").read_text()
    assert "num_layers: 2" in saved and "micro_batches: 2" in saved and "schedule: wsd" in saved
    assert "num_layers: 2" in proc.stdout  # the resolved config is printed
    assert "step     3 | loss" in proc.stdout
    # the command ran itself again with glibc's allocations on huge pages (tests/test_hostmem.py)
    if hostmem.huge_pages_env(os.environ, hostmem.thp_setting()) is not None:
        assert "host memory: glibc's allocations on transparent huge pages" in proc.stdout


BAD_INPUTS = [
    (["model.hidden_sise=64"], "unknown config key: model.hidden_sise"),
    (["train.steps=ten"], "train.steps: expected int, got str"),
    (["model.hidden_size=100", "model.num_heads=3"], "model.num_heads (3) must divide model.hidden_size (100)"),
    (["model.num_kv_heads=3"], "model.num_kv_heads (3) must divide model.num_heads (4)"),
    (["data.path=/nonexistent/corpus.txt"], "data file not found: /nonexistent/corpus.txt"),
    (["run_dir={tmp}/a_file/run"], "run_dir '{tmp}/a_file/run' is not writable"),
]


# In-process: scripts/train.py's main is commands.train (tests/test_commands.py), and a bad input
# through the script itself (exit status, one line, no traceback) is tests/test_bad_inputs.py's.
@pytest.mark.parametrize("overrides,message", BAD_INPUTS, ids=[m.split(":")[0][:30] for _, m in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, overrides, message):
    run_dir = tmp_path / "run"
    (tmp_path / "a_file").write_text("a file where run_dir wants a directory")
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    assert commands.train(["--config", TINY, *FAST, f"run_dir={run_dir}", *overrides]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert message.format(tmp=tmp_path) in lines[0]
    assert "Traceback" not in err
    if "run_dir=" not in " ".join(overrides):
        assert not run_dir.exists()  # nothing written


def test_missing_config_file(tmp_path, capsys):
    assert commands.train(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err.strip() == f"error: config file not found: {tmp_path / 'nope.yaml'}"
