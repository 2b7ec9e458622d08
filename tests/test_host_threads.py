"""optimizer.host_threads: the fused AdamW kernel's threads. Fewer than the CPUs run the update on
that many threads, pinned to the first CPUs (the update's own thread on the first), so the thread
that dispatches the device's work keeps the rest; the same bits as every CPU; out-of-range values
one line from the command line, exit 2."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_direct import engine_on, steps

from megatrain_jax import commands
from megatrain_jax.engine import fused_adamw

pytestmark = pytest.mark.skipif(fused_adamw.kernel() is None, reason="no C++ compiler")

CPU = jax.devices("cpu")
TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                    "tiny.yaml")
CPUS = sorted(os.sched_getaffinity(0))


def trained(host_threads):
    """(losses of 3 steps, every unit's master weights, the CPUs the update's thread ran on, the
    kernel's threads while the engine lived) of the accelerator path's direct update."""
    engine = engine_on((CPU[1], CPU[0]), host_threads=host_threads)
    where = set()
    # "update" events come from the host thread, as each unit's update starts
    engine.on_event = lambda kind, what, layer: (where.update(os.sched_getaffinity(0))
                                                 if kind == "update" else None)
    losses = steps(engine, 3)
    engine.wait()
    threads = fused_adamw.kernel().megatrain_threads()
    params = [np.array(x) for x in jax.tree.leaves(engine.params())]
    engine.close()
    return losses, params, where, threads


def test_one_thread_pinned_trains_the_same_bits_as_every_cpu():
    base_losses, base_params, base_where, base_threads = trained(None)
    losses, params, where, threads = trained(1)
    assert (base_threads, threads) == (len(CPUS), 1)
    assert base_where == set(CPUS)  # not pinned by default
    assert where == {CPUS[0]}  # the update's own thread on the pool's first CPU
    assert losses == base_losses
    for a, b in zip(params, base_params, strict=True):
        np.testing.assert_array_equal(a, b)
    assert trained(None)[3] == len(CPUS)  # a later engine with the default takes every CPU again


def test_out_of_range_in_the_engine_is_one_line():
    with pytest.raises(ValueError, match=f"host_threads must be an integer from 1 to the "
                                         f"{len(CPUS)} CPUs"):
        engine_on((CPU[1], CPU[0]), host_threads=len(CPUS) + 1)


@pytest.mark.parametrize("value,needle", [
    ("0", "optimizer.host_threads must be an integer >= 1 (null: every CPU), got 0"),
    ("-2", "optimizer.host_threads must be an integer >= 1 (null: every CPU), got -2"),
    ("abc", "optimizer.host_threads: expected int or NoneType, got str 'abc'"),
    (str(len(CPUS) + 1), f"optimizer.host_threads must be an integer from 1 to the {len(CPUS)} "
                         f"CPUs of this process's affinity, got {len(CPUS) + 1}"),
])
def test_bad_values_from_the_command_line(value, needle, tmp_path, capsys):
    """What a user types: scripts/train.py's main (commands.train) in this process; its exit code
    and stderr are the script's. Refused before anything is written."""
    run_dir = tmp_path / "run"
    capsys.readouterr()
    code = commands.train(["--config", TINY, f"optimizer.host_threads={value}",
                           "train.steps=1", "model.num_layers=1", f"run_dir={run_dir}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"error: {needle}"], (code, err)
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_the_script_refuses_it_too(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(TINY), "..", "scripts",
                                                  "train.py"), "--config", TINY,
                           "optimizer.host_threads=0", f"run_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: optimizer.host_threads must be an integer >= 1 (null: every CPU), got 0"]
