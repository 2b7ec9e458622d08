"""The disk tier (engine/tier.py): training with the state in files equals training with it in RAM,
bit for bit; checkpoints go through it unit by unit; its directory is never silently reused."""

import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from test_engine import CFG, DEVICE_SETUPS, batches, make_engine

from megatrain_jax import checkpoint
from megatrain_jax.config import load_config
from megatrain_jax.engine.tier import DiskTierOptions, TierError
from megatrain_jax.train import train

STEPS = 5


def run_steps(engine, data):
    out = [engine.train_step(inputs, targets) for inputs, targets in data]
    return [float(o["loss"]) for o in out], [float(o["grad_norm"]) for o in out]


def numpy_state(engine):
    return jax.tree.map(np.array, engine.state())


def assert_bit_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(leaves_a) > 10
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), leaves_b):
        assert x.dtype == y.dtype and np.array_equal(x, y), jax.tree_util.keystr(path)


@pytest.mark.parametrize("num_micro,max_grad_norm,read_ahead",
                         [(1, None, 2), (2, 0.5, 1)], ids=["plain", "micro2_clip"])
def test_disk_tier_equals_ram_tier_bit_for_bit(tmp_path, num_micro, max_grad_norm, read_ahead):
    data = batches(num_micro, batch=4 // num_micro)[:STEPS]
    devices = DEVICE_SETUPS["two_devices"]()
    ram = make_engine(CFG, devices, max_grad_norm)
    ram_losses, norms = run_steps(ram, data)
    ram_state = numpy_state(ram)
    ram.close()
    disk = make_engine(CFG, devices, max_grad_norm,
                       disk_tier=DiskTierOptions(str(tmp_path / "tier"), read_ahead=read_ahead))
    assert all(u.params is None and u.opt_state is None for u in disk.host.units)  # not in RAM
    disk_losses, _ = run_steps(disk, data)
    assert disk_losses == ram_losses
    assert_bit_equal(numpy_state(disk), ram_state)
    tier = disk.disk_tier
    assert tier.bytes_read >= STEPS * tier.total_bytes  # every unit came from its file each step
    if max_grad_norm is not None:  # clipping must have been active for this test to mean much
        assert max(norms) > max_grad_norm
    disk.close()


# ---------------------------------------------------------------- checkpoints through the tier
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_STEPS = 4
FAST = ["model.num_layers=2", "data.seq_len=32", "data.batch_size=2", "train.compute_dtype=float32",
        f"train.steps={TRAIN_STEPS}", "checkpoint.every=2", "checkpoint.keep=10",
        "logging.tensorboard=false"]


def make_cfg(run_dir, *extra):
    return load_config(os.path.join(ROOT, "configs/tiny.yaml"), [*FAST, f"run_dir={run_dir}", *extra])


def disk(tmp_path, name="tier"):
    return ["offload.tier=disk", f"offload.path={tmp_path / name}"]


def saved_state(run_dir, step):
    manager = checkpoint.make_manager(os.path.join(run_dir, "checkpoints"))
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    manager.close()
    return jax.tree.map(np.asarray, state)


def losses(run_dir):
    return [json.loads(line)["loss"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def resumed_from_step_2(source, run_dir, *extra):
    """A copy of `source` without its last checkpoint, resumed to the end with `extra`."""
    shutil.copytree(source, run_dir)
    shutil.rmtree(os.path.join(run_dir, "checkpoints", str(TRAIN_STEPS)))
    train(make_cfg(run_dir, *extra), log=lambda *_: None)
    return saved_state(run_dir, TRAIN_STEPS)


@pytest.fixture(scope="module")
def ram_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("ram_run"))
    train(make_cfg(run_dir), log=lambda *_: None)
    return run_dir


def test_checkpoints_move_between_tiers_bit_exact(tmp_path, ram_run):
    final = saved_state(ram_run, TRAIN_STEPS)
    # A whole run on the disk tier saves the RAM tier's checkpoints, bit for bit.
    disk_run = str(tmp_path / "disk_run")
    lines = []
    train(make_cfg(disk_run, *disk(tmp_path)), log=lines.append)
    assert any(line.startswith("disk tier: ") for line in lines)
    assert losses(disk_run) == losses(ram_run)
    for step in (2, TRAIN_STEPS):
        assert_bit_equal(saved_state(disk_run, step), saved_state(ram_run, step))
    # A RAM-tier checkpoint resumes onto the disk tier, and a disk-tier one back onto RAM.
    assert_bit_equal(resumed_from_step_2(ram_run, str(tmp_path / "to_disk"),
                                         *disk(tmp_path, "tier2")), final)
    assert_bit_equal(resumed_from_step_2(disk_run, str(tmp_path / "to_ram")), final)
