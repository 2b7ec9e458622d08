"""Data parallel over several compute devices (engine/parallel.py): the same steps as one device,
with the host state replicated or sharded (engine/shard.py).

conftest gives three CPU devices: two play the data-parallel accelerators, the third the host."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megatrain_jax.engine import StreamedEngine
from megatrain_jax.model import ModelConfig, make_block, make_stages
from megatrain_jax.recipes import build_optimizer
from test_engine import OPT, STEPS, assert_trees_close, count_compiles

CFG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2)


def make_dp_engine(compute_devices, **kwargs):
    first, last = make_stages(CFG, seed=0)
    return StreamedEngine(first=first, last=last, make_block=lambda i: make_block(CFG, 0, i),
                          num_layers=CFG.num_layers, optimizer=build_optimizer(OPT, STEPS),
                          max_grad_norm=0.5, compute_dtype=jnp.float32,
                          compute_devices=compute_devices, host_device=jax.devices("cpu")[2],
                          **kwargs)


def global_batches(num_steps=3, num_micro=2, rows=4, seq=12, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, CFG.vocab_size, (num_steps, num_micro, rows, seq + 1), dtype=np.int32)
    return [(t[..., :-1], t[..., 1:]) for t in toks]


def run_steps(engine, data):
    losses, norms = [], []
    for inputs, targets in data:
        out = engine.train_step(inputs, targets)
        losses.append(float(out["loss"]))
        norms.append(float(out["grad_norm"]))
    params = jax.tree.map(np.array, engine.params())
    engine.close()
    return losses, norms, params


@pytest.fixture(scope="module")
def one_device_run():
    return run_steps(make_dp_engine([jax.devices("cpu")[0]]), global_batches())


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload_activations"])
def test_two_devices_equal_one_device(one_device_run, offload):
    ref_losses, ref_norms, ref_params = one_device_run
    engine = make_dp_engine(jax.devices("cpu")[:2], offload_activations=offload)
    assert engine.placement.size == 2
    losses, norms, params = run_steps(engine, global_batches())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    assert max(norms) > 0.5  # clipping was active: the global norm must be the whole batch's
    assert_trees_close(params, ref_params, rtol=1e-5)
    for leaf in jax.tree.leaves(params):
        assert leaf.dtype == np.float32


def test_each_device_gets_its_rows_and_every_layer():
    """Each micro-batch's rows are split over the devices and each gets its own copy of the
    weights."""
    engine = make_dp_engine(jax.devices("cpu")[:2])
    seen = {}

    def spy(phase, layer=None):
        if phase == "forward" and layer == 0:
            for a in jax.live_arrays():
                # (micro-batches, rows, seq, hidden): the stacked micro-batches
                if a.shape[1:] == (4, 12, CFG.hidden_size) and len(a.sharding.device_set) == 2:
                    seen["x"] = sorted(s.data.shape[1] for s in a.addressable_shards)
                if a.shape == (CFG.hidden_size, CFG.num_heads, CFG.head_size) and \
                        len(a.sharding.device_set) == 2:
                    seen["w"] = a.sharding.is_fully_replicated
    engine.on_phase = spy
    inputs, targets = global_batches(num_steps=1)[0]
    float(engine.train_step(inputs, targets)["loss"])
    assert seen == {"x": [2, 2], "w": True}
    for leaf in jax.tree.leaves(engine.state()):  # the state stays on the host device, once
        assert leaf.devices() == {jax.devices("cpu")[2]}
    engine.close()


def test_rows_not_dividing_over_devices_are_refused():
    engine = make_dp_engine(jax.devices("cpu")[:2])
    inputs, targets = global_batches(num_steps=1, rows=3)[0]
    with pytest.raises(ValueError, match="3 rows does not split over this process's 2 compute"):
        engine.train_step(inputs, targets)
    engine.close()


def test_sharded_host_state_equals_one_device_at_half_the_bytes_per_link(one_device_run):
    """shard_host_state over two devices: the same losses, norms (clipping active) and weights as
    one device; each link carries half the replicated bytes (up to the embedding's one padding
    row: 61 rows -> 2 x 31); the padding rows stay zero; nothing compiles after the first step."""
    ref_losses, ref_norms, ref_params = one_device_run
    data = global_batches()
    replicated = make_dp_engine(jax.devices("cpu")[:2])
    replicated.train_step(*data[0])
    replicated.wait()
    engine = make_dp_engine(jax.devices("cpu")[:2], shard_host_state=True)
    losses, norms = [], []
    with count_compiles() as compiles:
        for step, (inputs, targets) in enumerate(data):
            out = engine.train_step(inputs, targets)
            losses.append(float(out["loss"]))
            norms.append(float(out["grad_norm"]))
            engine.wait()
            if step == 0:
                ratio = engine.counters.bytes_h2d / replicated.counters.bytes_h2d
                compiles.clear()
    assert compiles == []
    assert 0.5 <= ratio <= 0.5 * 62 / 61
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    assert max(norms) > 0.5

    state, shapes = engine.state(), engine.param_shapes()
    embedding = state["stages"]["params"][0]["embedding"]
    assert embedding.shape == (62, CFG.hidden_size) and shapes["stages"][0]["embedding"].shape == (
        61, CFG.hidden_size)
    for leaf in jax.tree.leaves(state["stages"]["opt_state"]):  # Adam's moments: row 61 is 0
        if leaf.shape == embedding.shape:
            assert not np.asarray(leaf)[61:].any()
    assert not np.asarray(embedding)[61:].any()
    params = jax.tree.map(lambda p, s: np.array(p)[:s.shape[0]], engine.params(), shapes)
    assert_trees_close(params, ref_params, rtol=1e-5)
    engine.close()
    replicated.close()


def test_sharded_host_state_refuses_a_0d_parameter():
    from flax import nnx

    class Scaled(nnx.Module):
        def __init__(self):
            self.scale = nnx.Param(jnp.ones(()))

        def __call__(self, x):
            return x * self.scale

    first, last = make_stages(CFG, seed=0)
    with pytest.raises(ValueError, match=r"parameter .*scale.* is 0-d and cannot be split"):
        StreamedEngine(first=first, last=last, make_block=lambda i: Scaled(), num_layers=1,
                       optimizer=build_optimizer(OPT, STEPS),
                       compute_devices=jax.devices("cpu")[:2], host_device=jax.devices("cpu")[2],
                       shard_host_state=True)


def test_sharded_checkpoint_moves_to_one_device_and_back(tmp_path):
    """A checkpoint of the sharded state (padded rows) restores into a one-device engine (the
    padding cut off; read_params, for generate and export, cuts it too), and a one-device
    checkpoint into a sharded engine (zero padding added): the same state either way."""
    from megatrain_jax import checkpoint
    inputs, targets = global_batches(num_steps=1)[0]
    sharded = make_dp_engine(jax.devices("cpu")[:2], shard_host_state=True)
    sharded.train_step(inputs, targets)
    manager = checkpoint.make_manager(tmp_path / "sharded", async_save=False)
    checkpoint.save(manager, 1, sharded)
    one = make_dp_engine([jax.devices("cpu")[0]])
    meta = checkpoint.restore(manager, one)
    assert (meta["host_shards"], meta["shard_devices"]) == (1, 2)
    cut = lambda tree, like: jax.tree.map(lambda x, y: np.array(x)[:np.shape(y)[0]]
                                          if np.ndim(y) else np.array(x), tree, like)
    expected = cut(sharded.state(), one.state())
    assert_trees_close(jax.tree.map(np.array, one.state()), expected, rtol=0)
    meta, tree = checkpoint.read_meta(manager, 1)  # what generate and export read: cut too
    stages = checkpoint.read_params(manager, 1, tree, "stages", meta)
    assert stages["0"]["embedding"].shape == (CFG.vocab_size, CFG.hidden_size)
    np.testing.assert_array_equal(stages["0"]["embedding"],
                                  expected["stages"]["params"][0]["embedding"])

    manager = checkpoint.make_manager(tmp_path / "one", async_save=False)
    checkpoint.save(manager, 1, one)
    again = make_dp_engine(jax.devices("cpu")[:2], shard_host_state=True)
    checkpoint.restore(manager, again)
    assert_trees_close(jax.tree.map(np.array, again.state()),
                       jax.tree.map(np.array, sharded.state()), rtol=0)
    for engine in (sharded, one, again):
        engine.close()


def test_sharded_asynchronous_save_is_the_state_of_its_step(tmp_path):
    """An asynchronous save of the sharded state (each process's rows wrapped as a global array
    without a copy) holds the state as of its step although the next steps update the state in
    place while it is written."""
    from megatrain_jax import checkpoint
    batches = global_batches(num_steps=3)
    engine = make_dp_engine(jax.devices("cpu")[:2], shard_host_state=True)
    engine.train_step(*batches[0])
    expected = jax.tree.map(np.array, engine.state())
    manager = checkpoint.make_manager(tmp_path / "async", async_save=True)
    checkpoint.save(manager, 1, engine)
    for inputs, targets in batches[1:]:
        engine.train_step(inputs, targets)
    engine.wait()
    checkpoint.wait(manager)
    moved = jax.tree.map(np.array, engine.state())
    leaves = lambda tree: jax.tree.leaves(tree["layers"][0]["params"])
    assert not any(np.array_equal(a, b) for a, b in zip(leaves(moved), leaves(expected)))
    again = make_dp_engine(jax.devices("cpu")[:2], shard_host_state=True)
    checkpoint.restore(manager, again)
    assert_trees_close(jax.tree.map(np.array, again.state()), expected, rtol=0)
    for e in (engine, again):
        e.close()
    manager.close()
