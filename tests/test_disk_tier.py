"""The disk tier (engine/tier.py): training with the state in files equals training with it in RAM,
bit for bit; checkpoints go through it unit by unit; its directory is never silently reused."""

import json
import os

import jax
import numpy as np
import pytest
from test_engine import CFG, DEVICE_SETUPS, batches, make_engine

from megatrain_jax.engine.tier import DiskTierOptions, TierError

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
