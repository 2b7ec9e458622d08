"""The one command line: `megatrain train|plan|export|generate|plot` and `python -m megatrain_jax
...`, over the same functions as scripts/*.py."""

import importlib.metadata
import os
import subprocess
import sys
import tomllib

import pytest

from megatrain_jax import commands

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def megatrain(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "megatrain_jax", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


def test_help_lists_the_commands(capsys):
    proc = megatrain("--help")  # `python -m megatrain_jax` names itself so
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m megatrain_jax {train,plan,export,generate,plot}")
    for name in ("train", "plan", "export", "generate", "plot"):
        assert f"\n  {name} " in proc.stdout
    # each command's --help in-process (what `python -m megatrain_jax` runs: commands.run with
    # that prog, as above)
    for name, options in [("train", ["--config", "key=value"]),
                          ("plan", ["--config", "--device", "--sweep", "--json"]),
                          ("export", ["--run-dir", "--out", "--step", "--dtype", "--shard-size"]),
                          ("generate", ["--run", "--hf", "--step", "--prompt", "--max-new-tokens",
                                        "--temperature", "--top-p", "--seed"]),
                          ("plot", ["RUN_DIR", "--out"])]:
        with pytest.raises(SystemExit) as exit_:
            commands.run([name, "--help"], prog="python -m megatrain_jax")
        assert exit_.value.code == 0
        sub = capsys.readouterr()
        assert sub.out.startswith(f"usage: python -m megatrain_jax {name} "), sub.err
        for option in options:
            assert option in sub.out, (name, option)


def test_unknown_or_missing_command_is_exit_2(capsys):
    proc = megatrain("trian", "--config", "configs/tiny.yaml")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("error: unknown command 'trian' (did you mean train?); expected "
                                   "one of train, plan, export, generate, plot (`python -m megatrain_jax --help`)")
    assert commands.run([], prog="python -m megatrain_jax") == 2  # in-process from here
    nothing = capsys.readouterr()
    assert nothing.out == "" and nothing.err.startswith("usage: python -m megatrain_jax ")
    # A bad option of a command is one line too.
    assert commands.run(["export", "--run-dir", "x"]) == 2
    assert capsys.readouterr().err.strip() == "error: the following arguments are required: --out"


# In-process: `python -m megatrain_jax` reaches commands.run (the tests above), whose exit code
# the process exits with. A training run through the command line (metrics, checkpoint, the saved
# config, here with optimizer.schedule=wsd): tests/test_cli.py::test_tiny_config_trains_and_writes_metrics;
# `megatrain plan`: tests/test_plan.py::test_script_prints_the_plan_and_writes_json.
def test_train_bad_input_is_one_line_exit_2(tmp_path, capsys):
    assert commands.run(["train", "--config", TINY, "train.stepz=2",
                         f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip() == "error: unknown config key: train.stepz (did you mean train.steps?)"
    assert not (tmp_path / "run").exists()


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
