"""Reliability round 3 (issue 24, items 4-7): each bad input or fault below ends in one line
naming its culprit, and nothing of the user's is overwritten or deleted. In process, tiny runs."""

import errno
import importlib.util
import os
import re

import pytest

from megatrain_jax import checkpoint, distributed
from megatrain_jax import plan as plan_lib
from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.engine import tier as tier_lib
from megatrain_jax.runlock import LockedError, RunLock
from megatrain_jax.train import TrainingError, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
FAST = ["model.num_layers=2", "model.hidden_size=32", "model.intermediate_size=48",
        "model.num_heads=2", "model.num_kv_heads=1", "data.seq_len=32", "data.batch_size=2",
        "train.compute_dtype=float32", "train.attention=xla", "optimizer.warmup_steps=1",
        "checkpoint.async=false", "logging.tensorboard=false"]


def tiny(run_dir, *extra):
    return load_config(TINY, [*FAST, f"run_dir={run_dir}", *extra])


# ----------------------------------------------------------------------------- item 6


def test_ignore_plan_runs_a_config_the_plan_refuses_and_says_so(tmp_path, monkeypatch):
    """A plan that over-estimates blocks the run; train.ignore_plan=true runs it, printing the
    plan and that it was overridden."""
    small = plan_lib.Machine("a small machine", 1e-6, 1e-6, 0.0, 0.0, platform="cpu",
                             compute_on_host=True)
    monkeypatch.setattr(plan_lib, "machine_from_device", lambda *a, **k: small)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="does not fit.*train.ignore_plan=true runs it anyway"):
        train(tiny(run_dir, "train.steps=1"), log=lambda line: None)
    assert not run_dir.exists()
    lines = []
    history = train(tiny(run_dir, "train.steps=1", "train.ignore_plan=true"), log=lines.append)
    assert len(history) == 1
    summary = next(i for i, x in enumerate(lines) if x.startswith("plan (a small machine)"))
    assert "does not fit" in lines[summary] or "fits" not in lines[summary].split(";")[-1]
    assert lines[summary + 1].startswith("plan: overridden by train.ignore_plan=true")


# ----------------------------------------------------------------------------- item 4: launch.py

_spec = importlib.util.spec_from_file_location("launch", os.path.join(ROOT, "scripts", "launch.py"))
launch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch)

# Process 0 fails at once (an error line, or a SIGKILL); process 1 then dies as JAX's client
# makes the others die when process 0 is gone: a C++ fatal log and SIGABRT.
TWO_PROCESSES = """
import os, signal, sys, time
me = int(sys.argv[-1].split("=")[1])
if me == 0:
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    print("error: run_dir 'r' is in use by pid 1 on host h", file=sys.stderr)
    sys.exit(2)
time.sleep(1.0)
print("F1126 09:24:28.898570 6073 client.h:80] Terminating process because the JAX distributed "
      "service detected fatal errors.", file=sys.stderr, flush=True)
print("*** Check failure stack trace: ***", file=sys.stderr, flush=True)
os.abort()
"""


@pytest.mark.parametrize("how, code, line", [
    ("error", 2, "launch: process 0 exited with code 2; stopping the others"),
    ("kill", 128 + 9, "launch: process 0 exited with code -9 (killed by SIGKILL: lost); stopping "
                      "the others")])
def test_launch_reports_the_first_failure_not_the_others_abort(tmp_path, capsys, how, code, line):
    script = tmp_path / "two.py"
    script.write_text(TWO_PROCESSES)
    assert launch.launch(2, [str(script), how], grace=5) == code
    err = capsys.readouterr().err
    assert line in err, err
    if how == "error":
        assert "[0] error: run_dir 'r' is in use" in err
    assert "Terminating process" not in err and "stack trace" not in err, err


def test_a_busy_run_dir_is_refused_before_the_processes_join(tmp_path, monkeypatch):
    """Process 0 refusing after jax.distributed started would leave the others to abort."""
    def joined(d):
        raise AssertionError("jax.distributed.initialize ran before the lock was checked")

    monkeypatch.setattr(distributed, "initialize", joined)
    run_dir = tmp_path / "run"
    with RunLock(str(run_dir.mkdir() or run_dir)):
        with pytest.raises(LockedError, match=f"run_dir '{run_dir}' is in use by pid {os.getpid()}"):
            train(tiny(run_dir, "distributed.num_processes=2",
                       "distributed.coordinator=127.0.0.1:1234", "distributed.process_id=0"),
                  log=lambda line: None)
    assert os.listdir(run_dir) == []


# ----------------------------------------------------------------------------- item 7


def test_a_disk_tier_filled_mid_run_is_one_line_naming_path_step_and_checkpoints(tmp_path,
                                                                                  monkeypatch):
    """The tier's files are allocated at the start; a write that fails later (ENOSPC: another
    file took the space) stops the run naming offload.path, the step and the checkpoints."""
    full, save = [False], checkpoint.save

    def save_then_fill(manager, step, *args, **kwargs):
        save(manager, step, *args, **kwargs)
        full[0] = step == 2  # the disk fills after checkpoint 2

    def pwritev(fd, buffers, offset, write=os.pwritev):
        if full[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, buffers, offset)

    monkeypatch.setattr(checkpoint, "save", save_then_fill)
    monkeypatch.setattr(tier_lib.os, "pwritev", pwritev)
    run_dir, path = tmp_path / "run", tmp_path / "tier"
    with pytest.raises(TrainingError) as e:
        train(tiny(run_dir, "train.steps=4", "checkpoint.every=1", "offload.tier=disk",
                   f"offload.path={path}"), log=lambda line: None)
    line = str(e.value)
    assert "\n" not in line
    assert re.match(rf"stopped at step [34]: offload.path {path}: writing {path}/unit_\d+\.bin "
                    rf"failed \(No space left on device\); completed checkpoints: 1, 2 ", line), line
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2"]
