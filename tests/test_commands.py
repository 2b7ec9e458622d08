"""The one command line: `megatrain train|plan|export|generate|plot` and `python -m megatrain_jax
...`, over the same functions as scripts/*.py."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib

from megatrain_jax import commands

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def megatrain(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "megatrain_jax", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


def test_help_lists_the_commands():
    proc = megatrain("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m megatrain_jax {train,plan,export,generate,plot}")
    for name in ("train", "plan", "export", "generate", "plot"):
        assert f"\n  {name} " in proc.stdout
    for name, options in [("train", ["--config", "key=value"]),
                          ("plan", ["--config", "--device", "--sweep", "--json"]),
                          ("export", ["--run-dir", "--out", "--step", "--dtype", "--shard-size"]),
                          ("generate", ["--run", "--hf", "--step", "--prompt", "--max-new-tokens",
                                        "--temperature", "--top-p", "--seed"]),
                          ("plot", ["RUN_DIR", "--out"])]:
        sub = megatrain(name, "--help")
        assert sub.returncode == 0, sub.stderr
        assert sub.stdout.startswith(f"usage: python -m megatrain_jax {name} ")
        for option in options:
            assert option in sub.stdout, (name, option)


def test_unknown_or_missing_command_is_exit_2():
    proc = megatrain("trian", "--config", "configs/tiny.yaml")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("error: unknown command 'trian' (did you mean train?); expected "
                                   "one of train, plan, export, generate, plot (`python -m megatrain_jax --help`)")
    nothing = megatrain()
    assert nothing.returncode == 2 and nothing.stderr.startswith("usage: ")
    # A bad option of a command is one line too.
    bad = megatrain("export", "--run-dir", "x")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: the following arguments are required: --out"


def test_train_trains_and_writes_metrics(tmp_path):
    run_dir = tmp_path / "run"
    proc = megatrain("train", "--config", "configs/tiny.yaml", "train.steps=2", f"run_dir={run_dir}",
                     "data.seq_len=32", "data.batch_size=2", "optimizer.schedule=wsd")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(0 < r["loss"] < 10 and r["tokens_per_sec"] > 0 for r in records)
    assert (run_dir / "checkpoints" / "2").is_dir()
    assert "schedule: wsd" in (run_dir / "config.yaml").read_text()
    assert "step     2 | loss" in proc.stdout


def test_train_bad_input_is_one_line_exit_2(tmp_path):
    proc = megatrain("train", "--config", "configs/tiny.yaml", "train.stepz=2",
                     f"run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "error: unknown config key: train.stepz (did you mean train.steps?)"
    assert not (tmp_path / "run").exists()


def test_plan_prints_the_plan(tmp_path):
    out = tmp_path / "plan.json"
    proc = megatrain("plan", "--config", "configs/tiny.yaml", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for label in ("host RAM", "optimizer", "peak", "largest that fits"):
        assert label in proc.stdout, label
    # the advice a run prints after step 3, from the predicted step (megatrain_jax.advice)
    assert re.search(r"^advice: steps are bound by (transfers|the host update|device compute): ",
                     proc.stdout, re.M)
    plan = json.loads(out.read_text())
    assert plan["fits"] and plan["advice"][0].startswith("advice: steps are bound by ")
    bad = megatrain("plan", "--config", "configs/tiny.yaml", "--device", "tpu")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --device 'tpu'")


def test_scripts_are_the_same_functions():
    """scripts/*.py are thin shells: their main is the command's function."""
    from importlib import util
    for script, fn in [("train.py", commands.train), ("plan.py", commands.plan),
                       ("export_hf.py", commands.export), ("generate.py", commands.generate),
                       ("plot.py", commands.plot)]:
        spec = util.spec_from_file_location(script[:-3], os.path.join(ROOT, "scripts", script))
        module = util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.main is fn, script
    assert commands.run(["trian"]) == 2  # in-process, returns the code


def test_console_script_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts == {"megatrain": "megatrain_jax.commands:main"}
    # The installed metadata says the same (after `pip install -e .`). Every megatrain-jax
    # distribution on the path is read: an in-tree megatrain_jax.egg-info left by an older
    # install, found first from the repository root, may predate the entry point.
    entries = [e for d in importlib.metadata.distributions()
               if (d.metadata["Name"] or "").replace("_", "-") == "megatrain-jax"
               for e in d.entry_points if e.group == "console_scripts" and e.name == "megatrain"]
    assert entries, "no installed megatrain console script: pip install -e . again"
    assert all(e.value == "megatrain_jax.commands:main" for e in entries)
    assert entries[0].load() is commands.main
