"""The host optimizer step (`engine.host`): in place (donated buffers really reused), equal to plain
optax after the scale and the global-norm clip, a no-op for a non-finite norm; the bf16 gradient
store (`grad_dtype`)."""

import os
import resource
import signal
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from toy_model import Embed, Head, capture_grads

from megatrain_jax import StreamedEngine
from megatrain_jax.engine import bus as bus_lib
from megatrain_jax.engine import fused_adamw, stage_units, transfer
from megatrain_jax.engine import store as store_lib
from megatrain_jax.engine import update as update_lib
from megatrain_jax.engine.tier import DiskTierOptions
from megatrain_jax.config import ConfigError, OptimizerConfig, load_config
from megatrain_jax.model import ModelConfig, make_block, make_stages
from megatrain_jax.recipes import build_engine, build_optimizer

D, V, L = 32, 11, 3


class Block(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (D, 3 * D)) * 0.1)
        self.b = nnx.Param(jnp.zeros((3 * D,)))
        self.out = nnx.Param(jax.random.normal(rngs.params(), (3 * D, D)) * 0.1)

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w[...] + self.b[...]) @ self.out[...]


# Elementwise (adamw, with a mask), per-leaf non-elementwise (trust ratio: a norm per leaf), and a
# chain with a schedule (the step count lives in the state).
OPTIMIZERS = {
    "adamw_masked": lambda: optax.adamw(1e-2, weight_decay=0.1,
                                        mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    "lamb": lambda: optax.lamb(1e-2),
    "sgd_schedule": lambda: optax.chain(optax.scale_by_adam(), optax.scale_by_schedule(
        optax.linear_schedule(-1e-2, -1e-3, 5))),
}
DEVICES = {"in_place": lambda: (jax.devices("cpu")[0],) * 2,  # compute and state share a device
           "staged": lambda: tuple(jax.devices("cpu")[:2])}  # bus copied to the compute device


def make_engine(tx, devices, max_grad_norm=None, compute_dtype=jnp.bfloat16, **kwargs):
    compute, host = devices
    return StreamedEngine(first=Embed(V, D, nnx.Rngs(0)), last=Head(D, V, nnx.Rngs(1)),
                          make_block=lambda i: Block(nnx.Rngs(10 + i)), num_layers=L, optimizer=tx,
                          max_grad_norm=max_grad_norm, compute_dtype=compute_dtype,
                          compute_device=compute, host_device=host, **kwargs)


def random_grads(tree, rng):
    return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), tree)


def pointers(tree):
    return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)]


def submit(engine, u, grads, grad_norm, scale=1.0):
    """As the step does: unit u's bus copy released (after its last use in the backward), then its
    update queued with the gradient, the global norm of the scaled gradient and the scale, all on
    the host. The gradient is copied: the update takes it over (the fp32 scale and clip run in place
    in it). u = 0: the whole stages' gradient, split over the two stage units as the step does."""
    host = engine.host
    on_host = lambda x: jax.device_put(x, engine.host_device, may_alias=False)
    parts = {u: grads} if u else {v: stage_units.like(grads, host.stage_units[v][0])
                                  for v in (0, host.last)}
    for v, part in parts.items():
        host.release_bus(v)
        host.submit(v, on_host(part), on_host(jnp.float32(grad_norm)), on_host(jnp.float32(scale)))


@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("max_grad_norm", [None, 1.0], ids=["noclip", "clip"])
def test_donated_update_equals_plain_optax(name, devices, max_grad_norm):
    """Three host steps with random gradients, bit for bit against optax.update + apply_updates
    jitted without donation, unit by unit as the engine applies it (the first stage's unit, each
    layer, the last stage's: XLA:CPU may round a unit's update differently in the last bit when it
    is compiled inside a larger program); clipping as optax.clip_by_global_norm over all units
    together, jitted on its own (as the engine runs it for fp32 gradients: XLA fusing the clip
    into the update rounds (g / norm) * max_norm differently in the last bit)."""
    tx = OPTIMIZERS[name]()
    engine = make_engine(tx, DEVICES[devices](), max_grad_norm)
    ref = jax.tree.map(np.asarray, engine.state())  # copies: the engine's buffers get donated
    ref_params = {"stages": ref["stages"]["params"], "layers": [u["params"] for u in ref["layers"]]}

    def by_unit(tree):  # the engine's units
        first, last = stage_units.split(tree["stages"])
        return [first, *tree["layers"], last]
    ref_units = by_unit(ref_params)
    ref_opt = [tx.init(unit) for unit in ref_units]
    update = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
        *tx.update(g, s, p)))
    clip = optax.clip_by_global_norm(max_grad_norm or 0.0)
    clip_step = jax.jit(lambda g: clip.update(g, clip.init(g))[0])
    ref_step = lambda g: [update(*args) for args in zip(
        ref_units, ref_opt, by_unit(g if max_grad_norm is None else clip_step(g)))]
    rng = np.random.default_rng(0)
    clipped = False
    for _ in range(3):
        grads = random_grads(ref_params, rng)
        norm = optax.tree.norm(grads)
        clipped |= max_grad_norm is not None and float(norm) > max_grad_norm
        for u, g in enumerate([grads["stages"], *grads["layers"]]):
            # The unnormalised gradient (x2) and scale 1/2: exact in floating point, so the
            # scaled gradient is `g` bit for bit.
            submit(engine, u, jax.tree.map(lambda x: x * 2, g), norm, 0.5)
        engine.wait()
        ref_units, ref_opt = map(list, zip(*ref_step(grads)))
    ref_params = {"stages": stage_units.merge(ref_units[0], ref_units[-1]),
                  "layers": ref_units[1:-1]}
    assert clipped or max_grad_norm is None  # the clipping branch must have been taken
    got = engine.params()
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref_params),
                            strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))
    # The bus copy is the compute-dtype cast of the new master weights (each leaf where the
    # unit's packing lays it: a layer's flat).
    for k, u in enumerate(engine.host.units):
        for b, p in zip(engine.host.packing(k).host_leaves(u.bus), jax.tree.leaves(u.params),
                        strict=True):
            assert b.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(b), np.asarray(p.astype(jnp.bfloat16)))
    engine.close()


@pytest.mark.parametrize("devices", DEVICES)
def test_update_reuses_buffers(devices):
    """Donation must take effect: params, optax state and (in place, when the step has not
    released it) the bus copy keep their buffers across an update; on the staged path the
    host-side staging buffer is reused from unit to unit; XLA reports no unusable donation."""
    engine = make_engine(optax.adamw(1e-2), DEVICES[devices]())
    host = engine.host
    unit = host.units[1]
    before = pointers((unit.params, unit.opt_state))
    bus_before = pointers(unit.bus)
    grads = random_grads(unit.params, np.random.default_rng(1))
    on_host = lambda x: jax.device_put(x, engine.host_device, may_alias=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if devices == "in_place":  # the bus kept: the update writes the new one into its buffer
            host.submit(1, on_host(grads), on_host(jnp.float32(1.0)), on_host(jnp.float32(1.0)))
        else:
            submit(engine, 1, grads, 1.0)
        engine.wait()
    assert not [w for w in caught if "donated" in str(w.message)], [str(w.message) for w in caught]
    # Leaves that cannot move (the step count) may be re-allocated; every large buffer must not.
    big = [a == b for a, b, x in zip(before, pointers((unit.params, unit.opt_state)),
                                      jax.tree.leaves((unit.params, unit.opt_state))) if x.size > 1]
    assert big and all(big)
    if devices == "in_place":
        assert pointers(unit.bus) == bus_before
    else:  # the bus copy lives in the compute device's pinned memory; the staging buffer is reused
        staging = pointers(host.buses.staging[1])
        submit(engine, 2, grads, 1.0)
        engine.wait()
        assert pointers(host.buses.staging[1]) == staging
    # As the step does it (bus released first): params and optax state still in place.
    unit = host.units[3]
    before = pointers((unit.params, unit.opt_state))
    submit(engine, 3, grads, 1.0)
    engine.wait()
    big = [a == b for a, b, x in zip(before, pointers((unit.params, unit.opt_state)),
                                      jax.tree.leaves((unit.params, unit.opt_state))) if x.size > 1]
    assert big and all(big)
    engine.close()


@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("fused", [False, True], ids=["optax", "fused_adamw"])
def test_nonfinite_norm_changes_nothing(devices, fused):
    """A non-finite global norm: params and optax state stay as they were, bit for bit, and the
    bus copy is rebuilt from them (the step released it); through optax and the fused AdamW."""
    tx = fused_adamw.adamw(1e-2) if fused else optax.adam(1e-2)
    engine = make_engine(tx, DEVICES[devices]())
    engine.wait()
    kept = jax.tree.map(np.asarray, engine.state())
    grads = random_grads(kept["layers"][0]["params"], np.random.default_rng(4))
    for u, norm in ((1, np.nan), (2, np.inf)):
        submit(engine, u, grads, norm)
    engine.wait()
    for x, y in zip(jax.tree.leaves(engine.state()), jax.tree.leaves(kept), strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)
    for u in (1, 2):
        for b, p in zip(engine.host.packing(u).host_leaves(engine.host.bus(u)),
                        jax.tree.leaves(engine.host.unit_state(u)[0]), strict=True):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(p.astype(jnp.bfloat16)))
    engine.close()


def test_custom_transform_whose_state_is_the_gradient():
    """A transform whose new state is its input gradient (no output aliases the donated state's
    role): the in-place path must still return exactly that gradient."""
    engine = make_engine(capture_grads(), DEVICES["in_place"](), compute_dtype=jnp.float32)
    grads = random_grads(engine.unit_shapes()[2], np.random.default_rng(2))
    expected = jax.tree.map(np.asarray, grads)
    submit(engine, 2, grads, optax.tree.norm(grads))
    engine.wait()
    for x, y in zip(jax.tree.leaves(engine.state()["layers"][1]["opt_state"]),
                    jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)
    engine.close()


# ----------------------------------------------------------------------------- the modes
# (devices, compute dtype, disk tier) -> how the bus copy is kept (engine/bus.py)
MODES = [("in_place", jnp.float32, False, bus_lib.ParamsBus),
         ("in_place", jnp.float32, True, bus_lib.HostBus),
         ("in_place", jnp.bfloat16, False, bus_lib.HostBus),
         ("staged", jnp.float32, False, bus_lib.PinnedBus),
         ("staged", jnp.bfloat16, True, bus_lib.PinnedBus)]


@pytest.mark.parametrize("devices,dtype,disk,policy", MODES,
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_each_mode_keeps_the_bus_copy_its_policy_says(tmp_path, devices, dtype, disk, policy):
    """The mode table: the state in RAM or the disk tier's files (store.py), and every unit's
    bus copy, before and after an update, the fp32 master weights themselves (one device, fp32,
    RAM), else their compute-dtype cast: in host memory (one device), or in the compute device's
    pinned memory with one staging buffer per unit structure; keep_bus_on_host (the host lookup)
    moves unit 0's to host memory and gives its staging buffer up."""
    tier = DiskTierOptions(str(tmp_path / "tier")) if disk else None
    engine = make_engine(optax.adam(1e-2), DEVICES[devices](), compute_dtype=dtype, disk_tier=tier)
    host = engine.host
    assert type(host.store) is (store_lib.DiskStore if disk else store_lib.RamStore)
    assert [type(b) for b in host.buses.policies] == [policy] * (L + 2)
    pinned = policy is bus_lib.PinnedBus
    assert sorted(host.buses.staging) == ([0, 1, 2] if pinned else [])
    grads = random_grads(host.unit_state(1)[0], np.random.default_rng(3))
    for update in (False, True):
        if update:
            submit(engine, 1, grads, 1.0)
        params, bus = host.unit_state(1)[0], host.bus(1)
        assert (bus is params) == (policy is bus_lib.ParamsBus)
        assert {b.sharding.memory_kind == transfer.PINNED for b in jax.tree.leaves(bus)} == {
            pinned}
        # flat, one array, but where the bus copy is the weights themselves or the update is a
        # jitted one, which takes leaves (packing.why_per_leaf; optax's here)
        assert (len(jax.tree.leaves(bus)) == 1) == (
            policy is not bus_lib.ParamsBus and engine.host_update == "direct")
        for b, p in zip(host.packing(1).host_leaves(bus), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(b, np.asarray(jnp.asarray(p).astype(dtype)))
        assert not disk or all(u.params is None for u in host.units)  # in the files, not RAM
    host.keep_bus_on_host(0)
    assert host.buses.policies[0].on_host and 0 not in host.buses.staging
    assert all(b.sharding.memory_kind != transfer.PINNED for b in jax.tree.leaves(host.bus(0)))
    engine.close()


# ----------------------------------------------------------------------------- grad_dtype
def test_bf16_gradients_cross_and_wait_on_the_host_as_bf16():
    """grad_dtype=bf16: every gradient the host update receives is a bf16 array in host memory,
    the stages' (the merge of the first and last parts' gradients) included, and half the fp32
    bytes cross device -> host. (Every unit's gradient waits on the host for the global norm, with
    or without clipping, so one clipping setting covers both.)"""
    tokens = np.random.default_rng(3).integers(0, V, size=(2, 2, 9))
    # the device path, where the embedding's gradient crosses too (the host lookup's makes it on
    # the host: tests/test_host_lookup.py)
    engine = make_engine(optax.adam(1e-2), DEVICES["staged"](), 1.0, grad_dtype=jnp.bfloat16,
                         host_lookup=False)
    received = {}
    host_submit = engine.host.submit_all  # observed: what each unit's update receives
    engine.host.submit_all = lambda grads, *a: (received.update(grads), host_submit(grads, *a))
    engine.train_step(tokens[..., :-1], tokens[..., 1:])
    engine.wait()
    assert sorted(received) == list(range(2 + L))  # the two stage units and every layer
    parcel = lambda x: isinstance(x, transfer.Parcel)
    host = jax.sharding.SingleDeviceSharding(engine.host_device)
    for u, grads in received.items():
        crossed = [piece for x in jax.tree.leaves(grads, is_leaf=parcel)
                   for piece in (x.token() if parcel(x) else [x])]
        assert crossed and all(x.dtype == jnp.bfloat16 for x in crossed), u  # what crossed
        for leaf in jax.tree.leaves(transfer.arrive(grads, host)):  # what the update reads
            assert leaf.devices() == {engine.host_device}, u
            assert leaf.dtype == jnp.bfloat16, f"unit {u}'s gradient waits on the host as {leaf.dtype}"
    params = jax.tree.leaves(engine.params())
    assert all(p.dtype == jnp.float32 for p in params)  # master weights stay fp32
    assert engine.counters.bytes_d2h == 2 * sum(p.size for p in params)
    engine.close()


LLAMA = ModelConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
                    num_kv_heads=2)


def test_bf16_gradients_track_the_exact_run():
    """6 steps (2 micro-batches, clipping active, fp32 compute to isolate the gradient store):
    measured here, loss within 1.1e-5 and every tensor within 9.4e-4 (relative L2) of the fp32-
    gradient run, 20x closer than bf16 compute gets (2.5e-2). The bound leaves ~3x headroom."""
    steps = 6
    toks = np.random.default_rng(0).integers(0, LLAMA.vocab_size, size=(steps, 2, 2, 17))
    opt = OptimizerConfig(learning_rate=1e-2, warmup_steps=2, weight_decay=0.1)
    runs = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        first, last = make_stages(LLAMA, seed=0)
        engine = StreamedEngine(first=first, last=last, make_block=lambda i: make_block(LLAMA, 0, i),
                                num_layers=LLAMA.num_layers, optimizer=build_optimizer(opt, steps),
                                max_grad_norm=0.5, compute_dtype=jnp.float32,
                                compute_device=jax.devices("cpu")[0],
                                host_device=jax.devices("cpu")[1], grad_dtype=dtype)
        outs = [engine.train_step(t[..., :-1], t[..., 1:]) for t in toks]
        runs[dtype] = ([float(o["loss"]) for o in outs], [float(o["grad_norm"]) for o in outs],
                       jax.tree.map(np.asarray, engine.params()))
        engine.close()
    (losses, norms, exact), (losses16, _, params16) = runs[jnp.float32], runs[jnp.bfloat16]
    assert max(norms) > 0.5  # clipping was active
    np.testing.assert_allclose(losses16, losses, rtol=5e-5)
    errors = [np.linalg.norm(a - b) / np.linalg.norm(b)
              for a, b in zip(jax.tree.leaves(params16), jax.tree.leaves(exact), strict=True)]
    assert 0 < max(errors) <= 3e-3, max(errors)  # > 0: the bf16 store really was used


def test_apply_gradients_updates_the_units_given_and_refuses_what_does_not_fit():
    """engine.apply_gradients (the host update alone, as scripts/bench_optimizer.py runs it):
    layer 1's gradient updates layer 1 as its optimizer does (plain SGD here: w - 0.5 g, exact
    in fp32) and no other unit; a unit that is not one, or a gradient not shaped as its unit's
    params (unit_shapes()), is one ValueError line and queues nothing."""
    engine = make_engine(optax.sgd(0.5), DEVICES["staged"](), compute_dtype=jnp.float32)
    before = jax.tree.map(np.array, engine.params())
    shapes = engine.unit_shapes()
    ones = lambda tree: jax.tree.map(lambda x: jnp.ones(x.shape, jnp.float32), tree)
    scalars = (jnp.float32(1.0), jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"^apply_gradients: unit 5 is not one of 0 to 4 "
                                         r"\(unit_shapes\(\)\)$"):
        engine.apply_gradients({2: ones(shapes[2]), 5: ones(shapes[2])}, *scalars)
    with pytest.raises(ValueError, match=r"^apply_gradients: unit 0's gradient is not shaped "
                                         r"as its params \(unit_shapes\(\)\[0\]\)$"):
        engine.apply_gradients({2: ones(shapes[2]), 0: ones(shapes[2])}, *scalars)
    engine.wait()
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(
        jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    assert same(jax.tree.map(np.array, engine.params()), before)  # nothing was queued
    engine.apply_gradients({2: ones(shapes[2])}, *scalars)
    engine.wait()
    after = jax.tree.map(np.array, engine.params())
    engine.close()
    assert same(after["layers"][1], jax.tree.map(lambda w: w - np.float32(0.5),
                                                 before["layers"][1]))
    assert same([after["stages"], after["layers"][0], after["layers"][2]],
                [before["stages"], before["layers"][0], before["layers"][2]])


@pytest.mark.parametrize("devices,compute_dtype", [("in_place", jnp.bfloat16),
                                                   ("in_place", jnp.float32),
                                                   ("staged", jnp.bfloat16)])
def test_the_units_and_their_bus_copies_are_counted_through_the_public_api(devices, compute_dtype):
    """unit_shapes() splits the params into the host thread's units (the first stage's, each
    layer's, the last stage's); bus_bytes() counts the bus copies: each unit's in the compute
    dtype (none where the bus copy is the fp32 weights themselves), and on an accelerator the
    update's staging buffers (one per unit structure: the first stage, a layer, the last stage),
    before a step and between steps alike."""
    engine = make_engine(optax.adam(1e-2), DEVICES[devices](), compute_dtype=compute_dtype,
                         host_lookup=False)  # (the lookup's unit 0 has no staging buffer)
    size = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
    shapes, params = engine.unit_shapes(), engine.params()
    assert len(shapes) == L + 2 and size(shapes) == size(params)
    assert [jax.tree.structure(s) for s in shapes[1:-1]] == [jax.tree.structure(p) for p in
                                                               params["layers"]]
    del params
    per_param = 0 if (devices, compute_dtype) == ("in_place", jnp.float32) else 2
    staging = size([shapes[0], shapes[1], shapes[-1]]) if devices == "staged" else 0
    assert engine.bus_bytes() == per_param * (size(shapes) + staging)
    engine.train_step(*(np.ones((1, 2, 8), np.int32),) * 2)
    engine.wait()
    assert engine.bus_bytes() == per_param * (size(shapes) + staging)
    engine.close()


def test_grad_dtype_config_key():
    with pytest.raises(ConfigError, match="train.grad_dtype"):
        load_config(None, ["train.grad_dtype=float16"])
    small = ["model.num_layers=1", "model.hidden_size=32", "model.intermediate_size=48",
             "model.num_heads=2", "model.num_kv_heads=2"]
    for given, expected in ([], jnp.float32), (["train.grad_dtype=bfloat16"], jnp.bfloat16):
        engine = build_engine(load_config(None, small + given))
        assert engine.grad_dtype == expected
        engine.close()


# ----------------------------------------------------------------------------- page faults
class Wide(nnx.Module):
    """One 5.2M-parameter matrix: an update's temporaries would pass glibc's largest mmap
    threshold (32 MiB), so each would be mapped and page-faulted in anew."""
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.full((D, 160 * 1024), 0.01))

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w[...][:, :D])


@pytest.mark.parametrize("devices", DEVICES)
def test_update_takes_no_fresh_memory(devices):
    """A warm update page-faults in (almost) no memory: it writes params, optax state and the bus
    copy into their own buffers. test_update_reuses_buffers did not catch the regression this
    guards against (at 710187a): the outputs did alias the donated inputs, but XLA first copied
    the donated optax state into a temporary inside the update (the non-finite guard selected
    between old and new state there), 8 B/param of fresh memory each update, page-faulted in at a
    fraction of memory speed. RUSAGE_SELF counts the faults whichever XLA thread touches a page."""
    compute, host = DEVICES[devices]()
    engine = StreamedEngine(first=Embed(V, D, nnx.Rngs(0)), last=Head(D, V, nnx.Rngs(1)),
                            make_block=lambda i: Wide(nnx.Rngs(i)), num_layers=1,
                            optimizer=build_optimizer(OptimizerConfig(), 10), max_grad_norm=1.0,
                            compute_dtype=jnp.bfloat16, compute_device=compute, host_device=host)
    grads = random_grads(engine.unit_shapes()[1], np.random.default_rng(5))
    faults = []
    for _ in range(3):  # the first compiles
        args = jax.block_until_ready(jax.device_put(  # copies: the update takes them over
            (grads, jnp.float32(0.5), jnp.float32(1.0)), host, may_alias=False))
        # Staged, the refreshed bus copy goes to a fresh pinned buffer each update (the old one
        # goes back to the pinned pool at release_bus): on the CPU backend a plain allocation,
        # page-faulted in (2 B/param, 2,561 faults here) unless the allocator hands back the old
        # copy's memory, which depends on the process's allocation history (it flaked after a
        # merge). Kept alive here, the old copy never is: the worst case, every time.
        old_bus = engine.host.units[1].bus if devices == "staged" else None
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        engine.host.release_bus(1)  # as the step does
        engine.host.submit(1, *args)
        engine.wait()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del old_bus
    state_pages = 3 * 4 * 160 * 1024 * D // 4096  # params, mu, nu
    # The update's own writes (params, optax state, the staging buffer, whose reuse
    # test_update_reuses_buffers pins) fault in nothing; the staged refresh its bus copy's pages.
    # 710187a's fresh optax state was 8 B/param: ~4x this allowance.
    bus_pages = 2 * 160 * 1024 * D // 4096 if devices == "staged" else 0
    engine.close()
    assert max(faults[1:]) < state_pages // 100 + bus_pages, (faults, state_pages, bus_pages)


# ----------------------------------------------------------------------------- a failed update
def adam_failing_on(call):
    """optax.adam whose update raises, when it runs, on its `call`-th run (of any unit)."""
    inner, calls = optax.adam(1e-2), []

    def check(count):
        calls.append(count)
        if len(calls) == call:
            raise RuntimeError(f"update {call} fails")
        return count

    def update(grads, state, params=None):
        updates, (adam, *rest) = inner.update(grads, state, params)
        count = jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.int32), adam.count)
        return updates, (adam._replace(count=count), *rest)
    return optax.GradientTransformation(inner.init, update)


def test_a_failed_last_update_leaves_the_engine_unusable():
    """The last update of a step (layer L-1's, the last unit the next forward waits for) fails:
    the next step raises it, and every later use of the engine refuses, instead of rebuilding the
    layer's bus copy from weights one update behind and training on."""
    engine = make_engine(adam_failing_on(1 + L), DEVICES["in_place"]())
    tokens = np.random.default_rng(6).integers(0, V, size=(3, 1, 2, 9))
    engine.train_step(tokens[0, ..., :-1], tokens[0, ..., 1:])
    with pytest.raises(Exception, match=f"update {1 + L} fails"):
        engine.train_step(tokens[1, ..., :-1], tokens[1, ..., 1:])
    for use in (lambda: engine.train_step(tokens[2, ..., :-1], tokens[2, ..., 1:]),
                engine.params, engine.wait):
        with pytest.raises(RuntimeError, match=f"unusable.*layer {L - 1}'s host update failed"):
            use()
    engine.close()


def test_close_after_a_failed_update_runs_none_of_those_queued_behind_it():
    """Layer 0's update fails (the step's second): close() raises it, and no later unit's update
    runs on the state it left unknown."""
    engine = make_engine(adam_failing_on(2), DEVICES["in_place"]())
    started = []
    engine.on_event = lambda kind, what, layer: (
        started.append((what, layer)) if kind == "update" else None)
    tokens = np.random.default_rng(6).integers(0, V, size=(1, 2, 9))
    engine.train_step(tokens[..., :-1], tokens[..., 1:])
    with pytest.raises(Exception, match="update 2 fails"):
        engine.close()
    assert started == [("first stage", None), ("layer", 0)]


@pytest.mark.parametrize("path", ["direct", "jit"])
def test_a_step_interrupted_while_its_updates_are_queued_changes_nothing(path):
    """Ctrl-C just after the step queued its first update (the host thread busy, so none has
    run): the step's updates are queued all or none, so the state is the previous step's, the
    engine trains on, and its next step equals an uninterrupted run's."""
    tx = lambda: build_optimizer(OptimizerConfig(), 10) if path == "direct" else optax.adam(1e-2)
    engine = make_engine(tx(), DEVICES["staged"](), 1.0)
    if path == "direct" and engine.host_update != "direct":
        pytest.skip("no C++ compiler: no direct update")
    assert (engine.host_update != "direct") == (path == "jit")
    tokens = np.random.default_rng(7).integers(0, V, size=(2, 1, 2, 9))
    step = lambda e, k: e.train_step(tokens[k, ..., :-1], tokens[k, ..., 1:])
    step(engine, 0)
    before = jax.tree.map(np.array, engine.state())
    pool = engine.host._thread
    gate = threading.Event()
    pool.submit(gate.wait)  # the host thread busy: what the step queues waits behind this
    queue = pool.submit

    def interrupted(*args):  # the first update queued, then Ctrl-C
        queue(*args)
        raise KeyboardInterrupt

    pool.submit = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            step(engine, 1)
    finally:
        pool.submit = queue
        gate.set()
    for x, y in zip(jax.tree.leaves(engine.state()), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)
    step(engine, 1)
    reference = make_engine(tx(), DEVICES["staged"](), 1.0)
    step(reference, 0)
    step(reference, 1)
    assert_same_state(engine.state(), reference.state())
    engine.close()
    reference.close()


def assert_same_state(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def late_copy(bus):
    """`bus` again, as arrays on its sharding that are ready only once a busy loop has run."""
    host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    return jax.tree.map(lambda b: jax.device_put(_late(jax.device_put(b, host)), b.sharding), bus)


@jax.jit
def _late(b):
    busy = jax.lax.fori_loop(0, 20_000_000, lambda i, c: c * 0.5 + 1.0, jnp.float32(0))
    return b + (busy * 0).astype(b.dtype)


def test_a_skipped_update_on_the_disk_tier_returns_its_buffer_once_the_bus_copy_is_made(
        tmp_path, monkeypatch):
    """A non-finite norm with the disk tier: the bus copy is made from the weights, which alias
    the tier's read buffer; the buffer goes back to the tier (for the next read) only once that
    copy is done."""
    engine = make_engine(optax.adam(1e-2), DEVICES["staged"](),
                         disk_tier=DiskTierOptions(str(tmp_path / "tier")))
    policy = type(engine.host.buses.policies[1])
    on_skip = policy.on_skip
    monkeypatch.setattr(policy, "on_skip", lambda self, unit, old, packing: late_copy(
        on_skip(self, unit, old, packing)))
    store, ready_when_stored = engine.host.store.store, []
    engine.host.store.store = lambda u, unit: (ready_when_stored.append(
        all(x.is_ready() for x in jax.tree.leaves(unit.bus))), store(u, unit))
    params = jax.tree.map(np.array, engine.host.unit_state(1)[0])
    submit(engine, 1, random_grads(params, np.random.default_rng(4)), np.nan)
    engine.wait()
    assert ready_when_stored == [True]
    for b, p in zip(engine.host.packing(1).host_leaves(engine.host.bus(1)),
                    jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(p.astype(jnp.bfloat16)))
    engine.close()


def test_a_construction_error_after_the_disk_tier_is_made_closes_it(tmp_path):
    path = str(tmp_path / "tier")

    def block(i):
        if i == 2:  # the tier's files are open by then (made with block 0)
            raise RuntimeError("block 2 cannot be made")
        return Block(nnx.Rngs(10 + i))

    with pytest.raises(RuntimeError, match="block 2 cannot be made"):
        StreamedEngine(first=Embed(V, D, nnx.Rngs(0)), last=Head(D, V, nnx.Rngs(1)),
                       make_block=block, num_layers=L, optimizer=optax.adam(1e-2),
                       host_device=jax.devices("cpu")[0], disk_tier=DiskTierOptions(path))
    assert os.path.exists(os.path.join(path, "unit_00001.bin"))
    assert not [f for f in open_files() if f.startswith(path)]


def open_files() -> list:
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile (the listing's own)
            pass
    return names


# ----------------------------------------------------------------------------- hyperparameters
@pytest.mark.parametrize("tx,max_grad_norm,message", [
    ("adam", 0, "max_grad_norm must be a finite number > 0 (None: no clipping), got 0"),
    ("adamw", 0.0, "max_grad_norm must be a finite number > 0 (None: no clipping), got 0.0"),
    ("adamw", -1.0, "max_grad_norm must be a finite number > 0 (None: no clipping), got -1.0"),
    ("adam", float("nan"), "max_grad_norm must be a finite number > 0 (None: no clipping), got nan"),
    ("adamw", float("inf"), "max_grad_norm must be a finite number > 0 (None: no clipping), got inf"),
    (dict(learning_rate=-1e-3), 1.0, "AdamW learning_rate must be finite and >= 0, got -0.001"),
    (dict(b1=1.0), 1.0, "AdamW b1 must be in [0, 1), got 1.0"),
    (dict(b2=-0.5), 1.0, "AdamW b2 must be in [0, 1), got -0.5"),
    (dict(eps=-1e-8), 1.0, "AdamW eps must be finite and >= 0, got -1e-08"),
    (dict(weight_decay=float("nan")), 1.0, "AdamW weight_decay must be finite and >= 0, got nan"),
], ids=["adam_clip0", "adamw_clip0", "clip_negative", "clip_nan", "clip_inf", "lr", "b1", "b2",
        "eps", "weight_decay"])
def test_meaningless_hyperparameters_are_one_line_naming_them(tx, max_grad_norm, message):
    """Refused at construction, before either host-update path is chosen: with max_grad_norm=0
    optax clipped every gradient to norm 0 and the fused AdamW to 1.0."""
    if isinstance(tx, dict):
        tx = fused_adamw.adamw(**{"learning_rate": 1e-3, **tx})
    else:
        tx = fused_adamw.adamw(1e-3) if tx == "adamw" else optax.adam(1e-3)
    with pytest.raises(ValueError) as e:
        make_engine(tx, DEVICES["staged"](), max_grad_norm)
    assert str(e.value) == message


@pytest.mark.parametrize("host_update", ["auto", "direct", "jit"])
def test_optax_and_the_fused_adamw_are_checked_by_the_same_call(host_update, monkeypatch):
    """A bad max_grad_norm with optax.sgd (run by optax) and with the fused AdamW (run by its
    kernel): the same one line from the same check (engine/update.py), whichever host update is
    asked for, before any block is made."""
    checked, made = [], []
    check = update_lib.check
    monkeypatch.setattr(update_lib, "check", lambda tx, norm: (checked.append(tx), check(tx, norm)))
    messages = {}
    for name, tx in {"sgd": optax.sgd(1e-2), "fused_adamw": fused_adamw.adamw(1e-3)}.items():
        with pytest.raises(ValueError) as e:
            StreamedEngine(first=Embed(V, D, nnx.Rngs(0)), last=Head(D, V, nnx.Rngs(1)),
                           make_block=lambda i: made.append(i) or Block(nnx.Rngs(10 + i)),
                           num_layers=L, optimizer=tx, max_grad_norm=-1.0,
                           compute_device=jax.devices("cpu")[1],
                           host_device=jax.devices("cpu")[0], host_update=host_update)
        messages[name] = str(e.value)
        assert checked[-1] is tx
    line = "max_grad_norm must be a finite number > 0 (None: no clipping), got -1.0"
    assert messages == {"sgd": line, "fused_adamw": line}
    assert len(checked) == 2 and made == []


# ----------------------------------------------------------------------------- fused AdamW
def adamw_f64(hyper, p, m, v, g, count, lr, decay):
    """One optax.adamw step in float64 from the same float32 inputs: (p, m, v) and the size of
    each result's terms, for a rounding bound."""
    p, m, v, g = (np.asarray(x, np.float64) for x in (p, m, v, g))
    m_size = (1 - hyper.b1) * np.abs(g) + hyper.b1 * np.abs(m)  # m's terms may cancel
    m = (1 - hyper.b1) * g + hyper.b1 * m
    v = (1 - hyper.b2) * g * g + hyper.b2 * v
    denominator = np.sqrt(v / (1 - hyper.b2 ** count)) + hyper.eps
    u = (m / (1 - hyper.b1 ** count)) / denominator
    u_size = (m_size / (1 - hyper.b1 ** count)) / denominator
    if decay:
        u_size = u_size + hyper.weight_decay * np.abs(p)
        u = u + hyper.weight_decay * p
    return (p - lr * u, m, v), (np.abs(p) + lr * u_size, m_size, np.abs(v))


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "jax"])
@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("max_grad_norm", [None, 1.0], ids=["noclip", "clip"])
def test_fused_adamw_is_optax_adamw_to_rounding(native, grad_dtype, max_grad_norm):
    """fused_adamw.update (the native kernel and its JAX fallback) against optax.adamw's math in
    float64 from the same float32 state, step by step (4 steps of a schedule, masked weight decay,
    the gradient scaled and clipped as optax.clip_by_global_norm): every element within 16 float32
    roundings of its terms' size (each result is a few operations deep; bf16 gradients are exact
    in float32), as optax's own float32 update is; the state has optax's structure, and the bus
    copy is the bf16 cast of the new weights."""
    if native and not fused_adamw.native():
        pytest.skip("no C++ compiler: the kernel is not built")
    schedule = optax.linear_schedule(1e-2, 1e-3, 4)
    tx = fused_adamw.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                           mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
    rng = np.random.default_rng(7)
    # 601,000 elements: two kernel threads where two cores are free, the cut inside "w"
    params = {"w": jnp.asarray(rng.normal(size=(600, 1000)), jnp.float32),
              "b": jnp.asarray(rng.normal(size=(1000,)), jnp.float32)}
    state = tx.init(params)
    update = jax.jit(lambda p, s, g, n, k: fused_adamw.update(
        tx.hyper, p, s, g, None, n, k, max_grad_norm, jnp.bfloat16, native))
    ref = jax.jit(lambda p, s, g: optax.apply_updates(p, tx.update(g, s, p)[0]))
    eps32, clipped = np.finfo(np.float32).eps, False
    for step in range(4):
        grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 2, grad_dtype), params)
        scale = 0.5
        norm = float(optax.tree.norm(grads)) * scale
        g = jax.tree.map(lambda x: np.asarray(x, np.float32) * np.float32(scale), grads)
        if max_grad_norm is not None and norm >= max_grad_norm:
            clipped = True
            g = jax.tree.map(lambda x: (x / np.float32(norm)) * np.float32(max_grad_norm), g)
        new_p, new_s, bus = update(params, state, grads, jnp.float32(norm), jnp.float32(scale))
        assert jax.tree.structure(new_s) == jax.tree.structure(state)
        optax_p = ref(params, state, jax.tree.map(jnp.asarray, g))
        adam = state[0]
        for k in params:
            (p64, m64, v64), sizes = adamw_f64(tx.hyper, params[k], adam.mu[k], adam.nu[k], g[k],
                                               step + 1, float(schedule(step)), k == "w")
            got = (new_p[k], new_s[0].mu[k], new_s[0].nu[k])
            for name, x, x64, size in zip(("param", "mu", "nu"), got, (p64, m64, v64), sizes):
                err = np.max(np.abs(np.asarray(x, np.float64) - x64) / (eps32 * size + 1e-300))
                assert err <= 16, (step, k, name, err)
            optax_err = np.abs(np.asarray(optax_p[k], np.float64) - p64) / (eps32 * sizes[0])
            assert np.max(optax_err) <= 16  # the bound holds for optax too
            np.testing.assert_array_equal(np.asarray(bus[k]), np.asarray(
                new_p[k].astype(jnp.bfloat16)))
        assert int(new_s[0].count) == step + 1 and int(new_s[2].count) == step + 1
        params, state = new_p, new_s
    assert clipped or max_grad_norm is None


@pytest.mark.parametrize("bus_dtype", [jnp.bfloat16, None], ids=["bus", "nobus"])
def test_fused_adamw_is_one_kernel_call_per_unit(bus_dtype):
    """All of a unit's leaves go through one kernel call, which spreads them over the cores: XLA:CPU
    runs independent custom calls concurrently, so one call per leaf ran several leaves at once,
    each over every core (more threads than cores)."""
    if not fused_adamw.native():
        pytest.skip("no C++ compiler: the kernel is not built")
    tx = fused_adamw.adamw(1e-3, weight_decay=0.1,
                           mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
    params = {"w": jnp.ones((64, 32)), "b": jnp.ones(32), "n": jnp.ones(32)}
    bus = None if bus_dtype is None else jax.tree.map(lambda p: p.astype(bus_dtype), params)
    update = jax.jit(lambda p, s, g, b: fused_adamw.update(
        tx.hyper, p, s, g, b, jnp.float32(1), jnp.float32(1), None, bus_dtype, True))
    text = update.lower(params, tx.init(params), params, bus).as_text()
    assert text.count("@megatrain_FusedAdamw") == 1, text


def _interrupt_when_waiting(main: int, stop: threading.Event, gate: threading.Event):
    """SIGINT to thread `main` once it waits in HostState.ready for a host update (its stack
    read until then), as a Ctrl-C there would; gives up when `stop` is set, or after a minute
    (then opens `gate`, which holds the update: the test fails instead of hanging)."""
    deadline = time.monotonic() + 60
    while not stop.is_set():
        if time.monotonic() > deadline:
            gate.set()
            return
        frame, names = sys._current_frames().get(main), []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if "ready" in names and names[0] == "wait":  # blocked in the future's condition
            signal.pthread_kill(main, signal.SIGINT)
            return
        stop.wait(0.01)


@pytest.mark.parametrize("path", ["direct", "jit"])
@pytest.mark.parametrize("where", ["engine.wait", "a fetch"])
def test_ctrl_c_while_waiting_for_a_host_update_leaves_the_engine_usable(path, where):
    """A real SIGINT while the main thread waits for a host update (the host thread held at the
    update's start): in engine.wait(), or in the next step's first fetch. The KeyboardInterrupt
    is the caller's, no update failed: the engine then waits, reads its state and trains on, and
    equals an uninterrupted run bit for bit."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    tx = lambda: build_optimizer(OptimizerConfig(), 10) if path == "direct" else optax.adam(1e-2)
    # (no host lookup: its step waits for the host thread's first update, held here)
    make = lambda: make_engine(tx(), DEVICES["staged"](), 1.0, host_lookup=False)
    engine = make()
    if path == "direct" and engine.host_update != "direct":
        pytest.skip("no C++ compiler: no direct update")
    tokens = np.random.default_rng(8).integers(0, V, size=(3, 1, 2, 9))
    step = lambda e, k: e.train_step(tokens[k, ..., :-1], tokens[k, ..., 1:])
    step(engine, 0)
    engine.wait()  # the hook below holds step 1's first update, not one of these
    gate, stop, held = threading.Event(), threading.Event(), []

    def hold_the_first_update(kind, what, layer):
        if kind == "update" and not held:
            held.append((what, layer))
            gate.wait()

    engine.on_event = hold_the_first_update
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    main = threading.get_ident()
    timer = threading.Thread(target=_interrupt_when_waiting, args=(main, stop, gate))
    try:
        step(engine, 1)  # its updates queued, the first held
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            engine.wait() if where == "engine.wait" else step(engine, 2)
    finally:
        stop.set()
        gate.set()
        timer.join()
        signal.signal(signal.SIGINT, previous)
    engine.on_event = None
    assert held == [("first stage", None)]
    engine.wait()
    state = jax.tree.map(np.array, engine.state())
    step(engine, 2)
    reference = make()
    for k in range(2):
        step(reference, k)
    assert_same_state(state, reference.state())
    step(reference, 2)
    assert_same_state(engine.state(), reference.state())
    engine.close()
    reference.close()
