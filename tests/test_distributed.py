"""Data parallel from the config and over processes (megatrain_jax/distributed.py,
scripts/launch.py): equal to one device, each process its rows, a lost process named, checkpoints
across process counts (the host state replicated or sharded), bad input in one line.

In process: conftest's three CPU devices (the host state on the first, two compute devices). Across
processes: scripts/launch.py starts two on 127.0.0.1 (gloo), one CPU compute device each."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from megatrain_jax import checkpoint
from megatrain_jax.cli import run_cli
from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.train import train
from test_checkpoint import saved_state
from test_engine import assert_trees_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
FAST = ["model.num_layers=2", "model.hidden_size=32", "model.intermediate_size=48",
        "model.num_heads=2", "model.num_kv_heads=1", "data.seq_len=32", "data.batch_size=4",
        "train.compute_dtype=float32", "train.attention=xla", f"train.steps={STEPS}",
        "optimizer.warmup_steps=1", "optimizer.max_grad_norm=0.5", "checkpoint.every=1",
        "checkpoint.async=false", "checkpoint.keep=10", "logging.tensorboard=false"]


def make_cfg(run_dir, *extra):
    return load_config(os.path.join(ROOT, "configs/tiny.yaml"),
                       [*FAST, f"run_dir={run_dir}", *extra])


def records(run_dir):
    return {r["step"]: r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))}


def assert_steps_equal(run_dir, reference, steps):
    got, want = records(run_dir), records(reference)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([got[s][key] for s in steps], [want[s][key] for s in steps],
                                   rtol=1e-5, err_msg=key)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, one compute device: checkpoints at every step."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    train(make_cfg(run_dir), log=lambda line: None)
    return str(run_dir)


def test_two_local_devices_equal_one(tmp_path, reference):
    run_dir = tmp_path / "run"
    lines = []
    train(make_cfg(run_dir, "distributed.local_devices=2"), log=lines.append)
    assert any("compute cpu x 2 (data parallel: 1 process(es) x 2 devices)" in x for x in lines)
    assert_steps_equal(run_dir, reference, range(1, STEPS + 1))
    assert max(r["grad_norm"] for r in records(reference).values()) > 0.5  # clipping active
    assert_trees_close(saved_state(run_dir), saved_state(reference), rtol=1e-5)


def test_each_process_reads_its_rows_of_every_global_batch():
    """The processes' shares are the global batch's rows, split in order within each micro-batch,
    and the data position (what a checkpoint keeps) is the whole batch's."""
    from megatrain_jax.data import PackedDataset
    tokens = np.random.default_rng(0).integers(0, 100, 5000).astype(np.int32)
    datasets = [PackedDataset(tokens, seq_len=16, batch_size=4, seed=3, num_micro_batches=2)
                for _ in range(3)]
    datasets[1].share, datasets[2].share = (0, 2), (1, 2)
    for _ in range(40):  # across epochs
        whole, first, second = (d.next_batch() for d in datasets)
        for part in range(2):  # inputs, targets
            assert first[part].shape == (2, 2, 16)
            np.testing.assert_array_equal(
                np.concatenate([first[part], second[part]], axis=1), whole[part])
        assert datasets[1].state() == datasets[2].state() == datasets[0].state()


@pytest.mark.parametrize("overrides,message", [
    (["distributed.local_devices=2", "data.batch_size=3"],
     "data.batch_size=3 does not split over the 2 data-parallel devices"),
    (["distributed.local_devices=3"],
     "distributed.local_devices=3: process 0 has 3 CPU devices and no accelerator"),
], ids=["batch_not_divisible", "too_few_devices"])
def test_bad_local_setup_is_one_line_exit_2_nothing_written(tmp_path, capsys, overrides, message):
    run_dir = tmp_path / "run"
    assert run_cli(lambda: train(make_cfg(run_dir, *overrides))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not run_dir.exists()


@pytest.mark.parametrize("overrides,message", [
    (["distributed.num_processes=0"], "distributed.num_processes must be >= 1, got 0"),
    (["distributed.coordinator=h:1", "distributed.num_processes=2", "distributed.process_id=2"],
     "distributed.process_id must be in [0, distributed.num_processes=2), got 2"),
    (["distributed.coordinator=h:1", "distributed.process_id=-1"],
     "distributed.process_id must be in [0, distributed.num_processes=1), got -1"),
    (["distributed.num_processes=2"], "distributed.num_processes=2 needs distributed.coordinator"),
    (["distributed.coordinator=localhost"], "distributed.coordinator must be host:port"),
    (["distributed.coordinator=h:1", "distributed.num_processes=2", "offload.tier=disk",
      "offload.path=/tmp/t"], "offload.tier=disk with distributed.num_processes=2"),
    (["distributed.shard_optimizer=true", "offload.tier=disk", "offload.path=/tmp/t"],
     "distributed.shard_optimizer=true with offload.tier=disk"),
])
def test_bad_distributed_keys(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ENV = {**os.environ, "PYTHONPATH": ROOT}


def test_unreachable_coordinator_is_one_line_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()  # nobody serves it
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "scripts/train.py", "--config", "configs/tiny.yaml", *FAST,
         f"run_dir={run_dir}", f"distributed.coordinator=127.0.0.1:{port}",
         "distributed.num_processes=2", "distributed.process_id=1", "distributed.timeout_s=2"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (f"error: distributed.coordinator=127.0.0.1:{port} (process 1 of 2): the processes did "
            f"not all join within distributed.timeout_s=2 s") in proc.stderr
    assert time.time() - t0 < 60
    assert not run_dir.exists()


# Kills process `victim` at its `at`-th batch (a SIGKILL, as a crash or an OOM kill would).
RUNNER = """
import os, runpy, signal, sys
from megatrain_jax import data
victim, at, marker = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
me = int([a for a in sys.argv if a.startswith("distributed.process_id=")][0].split("=")[1])
calls, original = [0], data.PackedDataset.next_batch
def next_batch(self):
    calls[0] += 1
    if me == victim and calls[0] == at:
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self)
data.PackedDataset.next_batch = next_batch
sys.argv = ["train.py", *sys.argv[4:]]
runpy.run_path(os.path.join(os.getcwd(), "scripts", "train.py"), run_name="__main__")
"""


def saved_arrays(run_dir, step):
    """Checkpoint `step`'s state as numpy arrays, as saved (a sharded save's padded rows too):
    read without its shardings, which name the devices of the processes that wrote it."""
    manager = checkpoint.make_manager(os.path.join(run_dir, "checkpoints"))
    _, tree = checkpoint.read_meta(manager, step)
    tree = getattr(tree, "tree", tree)  # a TreeMetadata wraps the plain tree
    target = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), tree)
    restore_args = jax.tree.map(lambda leaf: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=target, restore_args=restore_args)))["state"]
    manager.close()
    return state


def rows_cut_to(saved, like):
    """A sharded checkpoint's state with each leaf's axis 0 cut to `like`'s (its zero padding
    rows, checked to be zero, dropped)."""
    def cut(x, y):
        if np.ndim(y) and x.shape[0] != y.shape[0]:
            assert not x[y.shape[0]:].any()
            return x[:y.shape[0]]
        return x
    return jax.tree.map(cut, saved, like)


@pytest.mark.parametrize("layout", [[], ["distributed.shard_optimizer=true"]],
                         ids=["replicated", "sharded"])
def test_two_processes_equal_one_lost_process_named_and_checkpoints_cross_process_counts(
        tmp_path, reference, layout):
    """1 -> 2 processes: resume the single-process checkpoint 1 with two processes; they run steps
    2 and 3 (equal to one process) and save checkpoints 2 and 3; process 1 is killed at step 4:
    process 0 stops naming it within 60 s and the launcher fails. 2 -> 1: one process resumes
    checkpoint 3 and finishes equal to the uninterrupted single-process run. Sharded (the host
    state split over the two processes): both save each checkpoint, each its rows (the
    vocabulary's 257 rows padded to 258), and one replicated process resumes it.
    distributed.timeout_s=10: the coordinator sees a process lost once its heartbeats have stopped
    for that long (30 s by default), so the kill is named 10 s after it, not 30."""
    run_dir = tmp_path / "run"
    os.makedirs(run_dir / "checkpoints")
    shutil.copytree(os.path.join(reference, "checkpoints", "1"), run_dir / "checkpoints" / "1")
    shutil.copy(os.path.join(reference, "metrics.jsonl"), run_dir / "metrics.jsonl")
    runner, marker = tmp_path / "runner.py", tmp_path / "killed"
    runner.write_text(RUNNER)
    proc = subprocess.Popen(
        [sys.executable, "scripts/launch.py", "--nproc", "2", "--", str(runner), "1", "3",
         str(marker), "--config", "configs/tiny.yaml", *FAST, f"run_dir={run_dir}",
         "distributed.timeout_s=10", *layout],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=400)
    assert marker.exists(), err[-3000:]
    assert time.time() - marker.stat().st_mtime < 60  # everything stopped within 60 s of the kill
    assert proc.returncode != 0
    assert "[0] error: lost process 1 of 2 at step 4" in err, err[-3000:]
    assert re.search(r"launch: process (1 exited with code -9|0 exited with code 1)", err)
    assert "compute cpu x 2 (data parallel: 2 process(es) x 1 devices)" in out

    assert_steps_equal(run_dir, reference, [2, 3])
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2", "3"]
    if layout:  # written by both processes, each its rows
        manager = checkpoint.make_manager(run_dir / "checkpoints")
        assert checkpoint.read_meta(manager, 3)[0]["host_shards"] == 2
        manager.close()
    want = saved_arrays(reference, 3)
    assert_trees_close(rows_cut_to(saved_arrays(run_dir, 3), want), want, rtol=1e-5)

    lines = []
    train(make_cfg(run_dir), log=lines.append)  # one process, from the two processes' step 3
    assert any("resumed from checkpoint step 3" in x for x in lines)
    assert_steps_equal(run_dir, reference, range(1, STEPS + 1))
    assert_trees_close(saved_state(run_dir), saved_state(reference), rtol=1e-5)


def test_bench_data_parallel_smoke(tmp_path):
    """scripts/bench_data_parallel.py with two processes, replicated and sharded: they finish
    cleanly (exit 0, the coordinator leaving last), the engine's counters equal the predicted
    bytes per link, and sharded, each process holds half the engine state (plus padding rows)."""
    out = tmp_path / "bench.json"
    small = ["model.num_layers=1", "model.hidden_size=32", "model.intermediate_size=48",
             "model.num_heads=2", "model.num_kv_heads=1", "data.seq_len=16"]
    proc = subprocess.run([sys.executable, "scripts/bench_data_parallel.py", "--processes", "2",
                           "--steps", "1", "--shard-optimizer", "--json", str(out), *small],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    replicated, sharded = json.loads(out.read_text())
    assert (replicated["layout"], sharded["layout"]) == ("replicated", "sharded")
    for row in (replicated, sharded):
        assert row["processes"] == 2 and row["devices"] == 2
        assert row["h2d_per_link_measured"] == row["h2d_per_link_predicted"] > 0
        assert row["d2h_per_process_measured"] == row["d2h_per_process_predicted"] > 0
        assert row["host_state_engine"] > 0 and row["rss"] > row["host_state_engine"]
    assert 0.5 <= sharded["host_state_engine"] / replicated["host_state_engine"] < 0.51
    assert sharded["h2d_per_link_measured"] < 0.51 * replicated["h2d_per_link_measured"]
    assert "| 2 |" in proc.stdout
