"""The host update called directly (engine/direct.py): the same bits as the FFI kernel in a jit, each
gradient read where the device wrote it (its pinned piece's own buffer), each bus copy written in
place (the same buffer every step), no copy on the update's thread, state handed to a reader never
changed under it, and the jit path where the direct one cannot run, said in the log."""

import logging
import resource

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from toy_model import Embed, Head

from megatrain_jax import StreamedEngine
from megatrain_jax.config import OptimizerConfig
from megatrain_jax.engine import bus as bus_lib
from megatrain_jax.engine import direct, fused_adamw, store, transfer
from megatrain_jax.engine.packing import PerLeaf
from megatrain_jax.engine.stream import Counters
from megatrain_jax.recipes import build_optimizer

pytestmark = pytest.mark.skipif(fused_adamw.kernel() is None, reason="no C++ compiler")

CPU = jax.devices("cpu")
D, V, L = 32, 11, 3
SHAPES = {"one_leaf": [(1000,)], "mixed": [(64, 96), (96,), (1,), (33, 7), (), (3000,)]}


def unit(shapes, rng, count, schedule, state_dtype="float32"):
    params = {f"w{i}": jnp.asarray(rng.normal(size=s), jnp.float32) for i, s in enumerate(shapes)}
    lr = optax.linear_schedule(1e-2, 1e-3, 10) if schedule else 1e-2
    hyper = fused_adamw.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                              mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
                              state_dtype=state_dtype).hyper
    tx = fused_adamw.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                           state_dtype=state_dtype)
    adam, decay, lr_state = tx.init(params)
    moment = lambda scale: jax.tree.map(
        lambda p: jnp.asarray(np.abs(rng.normal(size=p.shape)) * scale, state_dtype), params)
    adam = adam._replace(count=jnp.int32(count), mu=moment(0.1), nu=moment(0.01))
    if schedule:
        lr_state = lr_state._replace(count=jnp.int32(count))
    return hyper, params, (adam, decay, lr_state)


def bits(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype == jnp.bfloat16 else x.view(np.uint32)


def in_pieces(g, pieces: bool) -> list:
    """A gradient leaf as the direct update reads it: whole, or (as a sharded leaf's) in pieces
    laid end to end, each its own buffer."""
    if not pieces or g.size < 3:
        return [g]
    flat = g.reshape(-1)
    return [flat[:g.size // 3 + 1], flat[g.size // 3 + 1:]]


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("max_grad_norm", [None, 1.0], ids=["noclip", "clip"])
@pytest.mark.parametrize("schedule,state_dtype", [(False, "float32"), (True, "float32"),
                                                 (True, "bfloat16")],
                         ids=["constant", "schedule", "schedule-bf16moments"])
def test_direct_kernel_equals_the_ffi_kernel_bit_for_bit(shapes, grad_dtype, max_grad_norm,
                                                         schedule, state_dtype):
    """With bf16 moments also with each gradient in two pieces: the pieces' roundings are the
    whole leaf's (the index of an element is its index in the leaf)."""
    rng = np.random.default_rng(0)
    hyper, params, opt_state = unit(SHAPES[shapes], rng, 2, schedule, state_dtype)
    lib = fused_adamw.kernel()
    assert fused_adamw.native()
    update = direct.DirectAdamW(hyper, max_grad_norm, CPU[0], Counters(), lib)
    arrays = store.UnitArrays.of(params, opt_state, lib)
    bus = [jnp.zeros(p.shape, jnp.bfloat16, device=CPU[0]) for p in jax.tree.leaves(params)]
    ffi = jax.jit(lambda p, o, g, b, norm: fused_adamw.update(
        hyper, p, o, g, b, norm, jnp.float32(0.5), max_grad_norm, jnp.bfloat16, True, unit=1))
    ffi_state = (params, opt_state)
    for step in range(2):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), grad_dtype), params)
        norm = jnp.float32(2.0 + step)  # clipped (norm > 1) where clipping is on
        p, o, ffi_bus = ffi(*ffi_state, grads, [jnp.zeros_like(b) for b in bus], norm)
        ffi_state = (p, o)
        pieces = [in_pieces(g, state_dtype == "bfloat16") for g in jax.tree.leaves(grads)]
        targets = bus_lib.kernel_targets(bus, PerLeaf.of(bus), arrays.p, "a unit")
        arrays = update.apply(1, arrays, pieces, norm, np.float32(0.5), targets, "a unit")
        got_params, (adam, _, lr_state) = arrays.trees(np.asarray)
        want = (p, o[0].mu, o[0].nu, jax.tree.leaves(ffi_bus))
        got = (got_params, adam.mu, adam.nu, bus)
        for w, g in zip(want, got):
            for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(g), strict=True):
                assert np.asarray(a).dtype == np.asarray(b).dtype
                np.testing.assert_array_equal(bits(a), bits(b))
        assert all(x.dtype == state_dtype for x in jax.tree.leaves((adam.mu, adam.nu)))
        assert int(adam.count) == int(o[0].count) == 3 + step
        if schedule:
            assert int(lr_state.count) == int(o[2].count)


def engine_on(devices, optimizer=None, **kwargs):
    compute, host = devices
    return StreamedEngine(first=Embed(V, D, nnx.Rngs(0)), last=Head(D, V, nnx.Rngs(1)),
                          make_block=lambda i: Wide(nnx.Rngs(10 + i)), num_layers=L,
                          optimizer=optimizer or build_optimizer(OptimizerConfig(), 10),
                          max_grad_norm=1.0, compute_dtype=jnp.bfloat16, compute_device=compute,
                          host_device=host, **kwargs)


class Wide(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (D, 4 * D)) * 0.1)
        self.b = nnx.Param(jnp.zeros((4 * D,)))
        self.out = nnx.Param(jax.random.normal(rngs.params(), (4 * D, D)) * 0.1)

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w[...] + self.b[...]) @ self.out[...]


TOKENS = np.random.default_rng(1).integers(0, V, size=(4, 2, 2, 9))


def steps(engine, n):
    return [float(engine.train_step(t[..., :-1], t[..., 1:])["loss"]) for t in TOKENS[:n]]


def test_engine_reads_gradients_in_place_and_writes_the_bus_in_place():
    """Two CPU devices, device 1 standing for the accelerator (its pinned_host memory kind): the
    kernel's gradient pointers are the pinned pieces' own buffers (a layer's flat gradient: each
    leaf at its offset in the one array), each unit's bus copy is the same buffer every step and
    the one the kernel writes, and nothing is copied on the update thread."""
    engine = engine_on((CPU[1], CPU[0]))
    host = engine.host
    assert host.update.kind == "direct" and engine.transfers.out_kind == transfer.PINNED
    pieces, kernel = {}, {}
    submit_all = host.submit_all

    def spy(grads, grad_norm, scale):  # the pieces as the step hands them over
        for u, parcel in grads:
            packed = jax.tree.unflatten(parcel.treedef, parcel.token())  # as the unit travels
            kinds = {p.sharding.memory_kind for p in parcel.token()}
            pieces.setdefault(u, []).append(
                [(kinds, leaf.pointer) for leaf in host.packing(u).targets(packed, "")])
        submit_all(grads, grad_norm, scale)

    host.submit_all = spy
    host.update.kernel.on_kernel = lambda u, ranges: kernel.setdefault(u, []).append(
        [(r.g, r.bus) for r in ranges])
    bus_pointers = []
    for _ in range(3):
        steps(engine, 1)
        engine.wait()
        bus_pointers.append({u: [b.pointer for b in host.packing(u).targets(host.bus(u), "")]
                             for u in range(L + 2)})
    for u in range(L + 2):
        for made, used in zip(pieces[u], kernel[u], strict=True):
            assert {k for kinds, _ in made for k in kinds} == {transfer.PINNED}
            assert [g for g, _ in used] == [ptr for _, ptr in made]
        assert len({ptr for _, ptr in pieces[u][0]}) == len(host.packing(u).shapes)
        assert bus_pointers[0][u] == bus_pointers[1][u] == bus_pointers[2][u]
        assert [b for _, b in kernel[u][-1]] == bus_pointers[2][u]
    assert engine.counters.host_copy_bytes == 0
    # the update's own work is part of the host thread's update time, never more
    assert 0 < engine.counters.host_compute_s <= engine.counters.host_update_s
    engine.close()


@pytest.mark.parametrize("devices,state_dtype", [("accelerator", "float32"),
                                                ("one_device", "float32"),
                                                ("accelerator", "bfloat16")])
def test_direct_and_jit_paths_train_the_same_bits(devices, state_dtype):
    """The direct update against the FFI kernel in a jit (the engine's other path), three steps:
    the same losses and the same state, bit for bit; with bf16 moments, the engine's state holds
    them in bf16 (2 B each)."""
    pair = (CPU[1], CPU[0]) if devices == "accelerator" else (CPU[0], CPU[0])
    optimizer = lambda: build_optimizer(OptimizerConfig(state_dtype=state_dtype), 10)
    engine = engine_on(pair, optimizer())
    assert engine.host_update == "direct"
    arrays = engine.host.units[1].arrays  # a layer: master weights and both moments
    assert arrays.nbytes == (12 if state_dtype == "float32" else 8) * sum(x.size for x in arrays.p)
    losses = steps(engine, 3)
    state = jax.tree.map(np.array, engine.state())
    engine.close()
    jit = engine_on(pair, optimizer(), host_update="jit")
    assert jit.host_update == "ffi"
    assert steps(jit, 3) == losses
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(jax.tree.map(np.array, jit.state())),
                    strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    jit.close()


def test_the_jit_paths_numpy_view_hop_is_exact(monkeypatch):
    """The jit path's hop between the accelerator's pinned memory and the host device (the numpy
    view of transfer.across_clients, taken between two of jax's clients: a GPU's and the CPU
    backend's) forced between two CPU devices: three steps train the same bits as jax's own
    copy."""
    pair = (CPU[1], CPU[0])
    plain = engine_on(pair, host_update="jit")
    losses = steps(plain, 3)
    state = jax.tree.map(np.array, plain.state())
    plain.close()
    hops = []
    monkeypatch.setattr(transfer, "crosses_clients",
                        lambda source, target: hops.append(source != target) or source != target)
    viewed = engine_on(pair, host_update="jit")
    assert viewed.host_update == "ffi"
    assert steps(viewed, 3) == losses
    assert sum(hops) > 3 * (L + 2)  # every gradient and every bus copy, each step
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(jax.tree.map(np.array,
                                                                        viewed.state())),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    viewed.close()


def test_a_warm_direct_update_faults_in_no_memory():
    """The update writes params, moments and the bus copy where they are: after the first, an
    update page-faults in (almost) nothing (RUSAGE_SELF counts every thread's faults, the kernel
    pool's too)."""
    engine = engine_on((CPU[1], CPU[0]))
    grads = jax.tree.map(lambda p: jnp.asarray(np.random.default_rng(5).normal(size=p.shape),
                                               jnp.float32), engine.unit_shapes()[1])
    faults = []
    for _ in range(3):
        args = jax.block_until_ready(jax.device_put(
            (grads, jnp.float32(0.5), jnp.float32(1.0)), CPU[0], may_alias=False))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        engine.apply_gradients({1: args[0]}, *args[1:])
        engine.wait()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    state_pages = 3 * 4 * sum(p.size for p in jax.tree.leaves(engine.unit_shapes()[1])) // 4096
    engine.close()
    assert max(faults[1:]) <= max(2, state_pages // 100), (faults, state_pages)


def unit_bytes(engine, u) -> int:
    """Bytes of unit u's state as the direct update keeps it (fp32 weights, fp32 moments): what
    a copy of it costs. u: "stages" or a layer index."""
    params = engine.params()
    tree = params["stages"] if u == "stages" else params["layers"][u]
    return 3 * sum(x.nbytes for x in jax.tree.leaves(tree))


def all_units_bytes(engine) -> int:
    return unit_bytes(engine, "stages") + sum(unit_bytes(engine, i) for i in range(L))


HELD = {"state": lambda e: e.state(), "params": lambda e: e.params(),
        "part": lambda e: e.params()["layers"][1]["w"]}  # one leaf of one unit


@pytest.mark.parametrize("held", HELD)
def test_state_handed_to_a_reader_never_changes_under_it(held):
    """engine.state(), engine.params(), or one leaf of one layer held while steps run (as an
    asynchronous checkpoint, or a caller, holds it): the held arrays keep the state of their step;
    each unit they reach is copied once, at its first update, and only those (the copies are
    host_snapshot_bytes); once the reader lets go, updates are in place again."""
    engine = engine_on((CPU[1], CPU[0]))
    steps(engine, 1)
    reader = HELD[held](engine)
    snapshot = jax.tree.map(np.array, reader)
    steps(engine, 2)
    engine.wait()
    for a, b in zip(jax.tree.leaves(reader), jax.tree.leaves(snapshot), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    copied = engine.counters.host_snapshot_bytes
    assert copied == (unit_bytes(engine, 1) if held == "part" else all_units_bytes(engine))
    live = jax.tree.map(np.array, HELD[held](engine))
    assert not any(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(live),
                                                         jax.tree.leaves(snapshot)) if a.ndim)
    del reader
    steps(engine, 1)
    engine.wait()
    assert engine.counters.host_snapshot_bytes == copied
    engine.close()


def test_a_save_that_releases_leaves_as_it_writes_them_reads_its_step_throughout():
    """A writer that holds every leaf of state() and lets go of them one part at a time while
    steps run (as a checkpoint writer does, leaf by leaf): each leaf still held keeps its step's
    values after every step; each unit is copied once, while some of its leaves were held; once
    all are released, nothing more is copied."""
    engine = engine_on((CPU[1], CPU[0]))
    steps(engine, 1)
    held = jax.tree.leaves(engine.state())
    snapshot = [np.array(x) for x in held]
    chunk = -(-len(held) // 3)
    for k in range(3):
        steps(engine, 1)
        engine.wait()
        for a, b in zip(held, snapshot):
            if a is not None:
                np.testing.assert_array_equal(np.asarray(a), b)
        for i in range(k * chunk, min(len(held), (k + 1) * chunk)):
            held[i] = None  # written: released
    copied = engine.counters.host_snapshot_bytes
    assert copied == all_units_bytes(engine)
    steps(engine, 1)
    engine.wait()
    assert engine.counters.host_snapshot_bytes == copied
    engine.close()


def test_a_reference_that_is_not_a_reader_copies_nothing():
    """Only state handed out to a reader (`UnitArrays.lend`) makes the update copy the unit: a
    reference to the engine's own buffers (a traceback frame's, a debugger's) does not."""
    rng = np.random.default_rng(0)
    hyper, params, opt_state = unit(SHAPES["mixed"], rng, 2, False)
    lib = fused_adamw.kernel()
    counters = Counters()
    update = direct.DirectAdamW(hyper, None, CPU[0], counters, lib)
    arrays = store.UnitArrays.of(params, opt_state, lib)
    grads = lambda: [[np.asarray(rng.normal(size=x.shape), np.float32)] for x in arrays.p]
    stray = (arrays.owner[:8], arrays.p[0][:], arrays.m)  # noqa: F841 (held, never read)
    assert update.apply(1, arrays, grads(), 1.0, 1.0, None, "a unit") is arrays
    assert counters.host_snapshot_bytes == 0
    lent = arrays.lend(update.wrap)
    before = jax.tree.map(np.array, lent)
    copy = update.apply(1, arrays, grads(), 1.0, 1.0, None, "a unit")
    assert copy is not arrays and counters.host_snapshot_bytes == arrays.nbytes
    for a, b in zip(jax.tree.leaves(lent), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_the_jit_path_is_named_in_the_log_where_the_direct_one_cannot_run(caplog):
    with caplog.at_level(logging.INFO, logger="megatrain_jax.engine.host"):
        engine = engine_on((CPU[1], CPU[0]), optimizer=optax.adamw(1e-3))
    assert engine.host_update == "optax"
    assert "a jitted update per unit (the optimizer is not fused_adamw.adamw" in caplog.text
    engine.close()


def test_host_update_setting_says_what_cannot_run():
    with pytest.raises(ValueError, match="^host_update must be one of auto, direct, jit, got 'x'"):
        engine_on((CPU[1], CPU[0]), host_update="x")
    with pytest.raises(ValueError, match="^host_update='direct' cannot run: the optimizer is not"):
        engine_on((CPU[1], CPU[0]), optimizer=optax.adamw(1e-3), host_update="direct")


def test_a_deleted_bus_copy_is_one_line_naming_the_unit():
    """A bus copy that is not where the engine writes it is never silently replaced."""
    engine = engine_on((CPU[1], CPU[0]))
    grads = jax.tree.map(lambda p: jnp.ones(p.shape, jnp.float32), engine.unit_shapes()[2])
    jax.tree.leaves(engine.host.bus(2))[0].delete()
    engine.apply_gradients({2: grads}, jnp.float32(1.0), jnp.float32(1.0))
    with pytest.raises(ValueError, match="^layer 1: its bus copy was deleted"):
        engine.wait()
    engine.close()  # (the failed update is not run again)


@pytest.mark.parametrize("path", ["direct", "jit"])
def test_debug_mode_refuses_to_write_a_bus_copy_a_fetch_still_reads(monkeypatch, path):
    """MEGATRAIN_DEBUG_BUS=1, on both update paths (the jit path's update writes the bus copy
    into the donated old one): steps run as always (every fetch is done by its unit's update), and
    an update queued while a fetch of its unit is still copying (here: a fetch made inside a long
    computation, recorded as the step records its fetches) is refused, naming the unit."""
    monkeypatch.setenv("MEGATRAIN_DEBUG_BUS", "1")
    engine = engine_on((CPU[1], CPU[0]), host_update=path)
    assert engine.host.fetches is not None
    losses = steps(engine, 2)
    engine.wait()
    assert all(np.isfinite(losses))
    device = jax.sharding.SingleDeviceSharding(CPU[1])
    a = jax.device_put(jnp.ones((256, 256)), CPU[1])
    slow = jax.jit(lambda a, bus: (jax.lax.fori_loop(0, 400, lambda i, c: jnp.tanh(c @ a), a),
                                   jax.device_put(bus, device)))
    grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), engine.unit_shapes()[2])
    done, copies = slow(a, engine.host.bus(2))  # its fetched copies are ready when it ends
    engine.host.fetched(2, copies)
    engine.apply_gradients({2: grads}, jnp.float32(1.0), jnp.float32(1.0))
    with pytest.raises(RuntimeError, match="^layer 1: its bus copy would be written while"):
        engine.wait()
    assert not done.is_ready()  # the check ran while the fetch was in flight
    engine.close()  # (the failed update is not run again)


@pytest.mark.parametrize("path", ["direct", "jit"])
def test_debug_mode_keeps_no_more_fetches_than_are_in_flight(monkeypatch, path):
    """MEGATRAIN_DEBUG_BUS=1 in an evaluation-only loop (no update ever comes to take the
    recorded fetches): a fetch done copying is let go of when its unit is fetched again, so the
    arrays alive stay as many as after one evaluation, however many follow."""
    monkeypatch.setenv("MEGATRAIN_DEBUG_BUS", "1")
    engine = engine_on((CPU[1], CPU[0]), host_update=path)
    steps(engine, 1)
    engine.wait()
    live = []
    for t in TOKENS:
        float(engine.evaluate(t[..., :-1], t[..., 1:])["loss"])
        live.append(len(jax.live_arrays()))
    engine.close()
    assert live[-1] == live[1], live
