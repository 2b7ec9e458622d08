"""A layer unit travels flat (engine/packing.py): its bus copy, its fetched weights and its
gradient are each one array. Over three steps every mode trains the bits of the leaf-by-leaf form
it replaced (forced here through packing.why_per_leaf, the one place that decides); a layer's call
passes a handful of arrays; the layout itself (offsets, padding, the pieces the kernel reads).

The two forms' programs run the same operations on the same values (static slices and a
concatenation move values, round none), but XLA:CPU compiles a program's kernels into several
LLVM modules, and which module a kernel lands in, which the rest of the program decides, can
change its last bit (seen: with XLA's default split three setups of eight differed in a few
elements by an ulp; compiled in one or two modules, none). So the comparison runs in a process
that compiles each program in one module (ONE_MODULE)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_one_call import CFG, steps

from megatrain_jax.engine import StreamedEngine, fused_adamw, packing
from megatrain_jax.engine.tier import DiskTierOptions
from megatrain_jax.model import make_block, make_stages

CPU = jax.devices("cpu")
STEPS = 3
ONE_MODULE = "--xla_cpu_parallel_codegen_split_count=1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = np.random.default_rng(5).integers(0, CFG.vocab_size, (STEPS, 4, 2, 17), np.int32)


def build(setup: dict, tmp_path, name: str) -> StreamedEngine:
    """CPU device 1 standing for the accelerator (device 2 too, data parallel), the state on
    device 0."""
    setup = dict(setup)
    if setup.pop("disk", False):
        setup["disk_tier"] = DiskTierOptions(str(tmp_path / name))
    devices = {"compute_devices": [CPU[1], CPU[2]]} if setup.pop("parallel", False) else {
        "compute_device": CPU[1]}
    setup.setdefault("optimizer", fused_adamw.adamw(1e-2, weight_decay=0.1))
    first, last = make_stages(CFG, seed=0)
    return StreamedEngine(first=first, last=last, make_block=lambda i: make_block(CFG, 0, i),
                          num_layers=CFG.num_layers, max_grad_norm=1.0, host_device=CPU[0],
                          **devices, **setup)


def train(engine, documents=False) -> tuple:
    """(losses, grad norms, the state as numpy) after STEPS steps."""
    return steps(engine, TOKENS, CFG, documents)


# Every mode the engine's layers travel in, each setup several of them at once: the copies' form
# (eager, in the calls), prefetch 1 and 2, activations kept or offloaded, the bus ring or resident
# bus copies, bf16 and fp32 compute, bf16 and fp32 gradients, the host lookup and the device path,
# the update called directly, in a jit through the kernel (ffi) or optax, the disk tier, data
# parallel.
SETUPS = {
    "jit p1 bf16 direct": dict(copies="jit", compute_dtype=jnp.bfloat16),
    "eager p2 offloaded bf16 grads documents": dict(
        copies="eager", prefetch=2, offload_activations=True, grad_dtype=jnp.bfloat16,
        compute_dtype=jnp.float32, documents=True),
    "jit p2 ring bf16 grads": dict(copies="jit", prefetch=2, bus="ring",
                                   compute_dtype=jnp.bfloat16, grad_dtype=jnp.bfloat16),
    "eager ring fp32 host lookup": dict(copies="eager", bus="ring", compute_dtype=jnp.float32,
                                        host_lookup=True),
    "jit offloaded host lookup optax": dict(copies="jit", offload_activations=True,
                                            host_lookup=True, optimizer=optax.adamw(1e-2)),
    "jit disk tier": dict(copies="jit", disk=True, compute_dtype=jnp.bfloat16),
    "eager ffi fp32 bf16 grads": dict(copies="eager", host_update="jit",
                                      compute_dtype=jnp.float32, grad_dtype=jnp.bfloat16),
    "data parallel": dict(parallel=True, compute_dtype=jnp.float32),
}


def in_one_module() -> bool:
    return ONE_MODULE in os.environ.get("XLA_FLAGS", "")


@pytest.mark.parametrize("name", SETUPS)
def test_flat_layers_train_the_leaf_by_leaf_bits(name, tmp_path, monkeypatch):
    if not in_one_module():
        pytest.skip("run by test_every_mode_trains_the_leaf_by_leaf_bits, in one module")
    setup = dict(SETUPS[name])
    documents = setup.pop("documents", False)
    engine = build(setup, tmp_path, "flat")
    # flat where the update is the direct kernel's; a jitted update takes leaves (why_per_leaf)
    assert engine.host.packing(1).flat == (engine.host_update == "direct")
    assert not engine.host.packing(0).flat
    flat = train(engine, documents)
    engine.close()
    monkeypatch.setattr(packing, "why_per_leaf", lambda **why: "the form before")
    engine = build(setup, tmp_path, "per leaf")
    assert not engine.host.packing(1).flat
    per_leaf = train(engine, documents)
    engine.close()
    assert flat[:2] == per_leaf[:2]
    for a, b in zip(jax.tree.leaves(flat[2]), jax.tree.leaves(per_leaf[2]), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert flat[0][-1] != flat[0][0]  # it trained


def test_every_mode_trains_the_leaf_by_leaf_bits():
    """The setups above, in a process whose programs compile in one LLVM module each."""
    if in_one_module():
        pytest.skip("this is that process")
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {ONE_MODULE}".strip()}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider",
                           f"{__file__}::test_flat_layers_train_the_leaf_by_leaf_bits"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"{len(SETUPS)} passed" in proc.stdout


@pytest.mark.parametrize("copies", ["eager", "jit"])
def test_a_layers_call_passes_a_handful_of_arrays(copies, tmp_path):
    """Each layer call's weights (and the next layer's bus copy it fetches, and the gradient it
    sends out, in the jit form) are one array each, whatever the block's leaves (9 here): a
    call passes at most 6 arrays, a layer's two calls 9 (leaf by leaf: 9 for its weights
    alone), each call's counted as stream.Counters counts its `arg_leaves`."""
    engine = build(dict(copies=copies, compute_dtype=jnp.bfloat16), tmp_path, copies)
    f = engine.device_functions(jax.ShapeDtypeStruct(TOKENS.shape[2:], TOKENS.dtype),
                                jax.ShapeDtypeStruct(TOKENS.shape[2:], TOKENS.dtype))
    calls = []
    for name in ("layer_fwd", "layer_bwd"):
        def recorded(fetch, out, layer, *args, fn=getattr(f, name)):
            calls.append((len(jax.tree.leaves(fetch and fetch[0])), len(jax.tree.leaves(out)),
                          len(jax.tree.leaves(layer[0])),
                          len(jax.tree.leaves((fetch, out, layer, args)))))
            return fn(fetch, out, layer, *args)
        setattr(f, name, recorded)
    train(engine)
    engine.close()
    assert len(calls) == 2 * CFG.num_layers * STEPS
    assert {(bus <= 1, out <= 1, weights == 1) for bus, out, weights, _ in calls} == {
        (True, True, True)}
    assert max(total for *_, total in calls) <= 6
    assert sum(total for *_, total in calls) <= 9 * CFG.num_layers * STEPS


# ----------------------------------------------------------------------------- the layout
TREE = {"norm": np.arange(5, dtype=np.float32), "w": np.arange(64, dtype=np.float32).reshape(8, 8),
        "b": np.full((3, 11), 2.0, np.float32)}


def test_flat_lays_each_leaf_on_an_aligned_offset_and_splits_back():
    flat = packing.Flat.of(TREE)
    # tree order (b, norm, w), each leaf on a multiple of ALIGN elements, the end too
    assert flat.offsets == (0, 64, 96) and flat.size == 160
    packed = jax.jit(lambda t: flat.pack(t, jnp.bfloat16))(TREE)
    assert packed.shape == (160,) and packed.dtype == jnp.bfloat16
    assert not np.asarray(packed, np.float32)[33:64].any()  # the padding is zeros
    for got, want in zip(jax.tree.leaves(jax.jit(flat.unpack)(packed)), jax.tree.leaves(TREE)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    for got, want in zip(flat.host_leaves(packed), jax.tree.leaves(TREE)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    targets = flat.targets(packed, "a unit")
    assert [t.pointer - packed.unsafe_buffer_pointer() for t in targets] == [0, 128, 192]
    assert [t.size for t in targets] == [33, 5, 64]


def test_the_kernel_reads_each_leaf_of_a_flat_gradient_in_place():
    flat = packing.Flat.of(TREE)
    g = np.arange(flat.size, dtype=np.float32)
    pieces = flat.leaf_pieces([[g]], "layer 0")
    assert [p.ctypes.data - g.ctypes.data for [p] in pieces] == [0, 64 * 4, 96 * 4]
    # a gradient given leaf by leaf (HostState.submit takes either) as it is
    by_leaf = [[np.zeros(x.size, np.float32)] for x in jax.tree.leaves(TREE)]
    assert flat.leaf_pieces(by_leaf, "layer 0") is by_leaf
    with pytest.raises(ValueError, match=r"^layer 0: a gradient of 159 elements in 1 leaves for "
                                         r"a flat unit of 160$"):
        flat.leaf_pieces([[g[1:]]], "layer 0")


def test_a_deleted_or_misshapen_bus_copy_is_one_line_naming_the_unit():
    flat = packing.Flat.of(TREE)
    bus = jnp.zeros((flat.size - 32,), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"^layer 2: its bus copy is shaped \(128,\), not "
                                         r"\(160,\)$"):
        flat.targets(bus, "layer 2")
    bus.delete()
    with pytest.raises(ValueError, match="^layer 2: its bus copy was deleted"):
        flat.targets(bus, "layer 2")


def test_which_units_travel_leaf_by_leaf():
    assert packing.why_per_leaf(stage=False, sharded=False, bus_is_params=False) is None
    for why in ({"stage": True}, {"sharded": True}, {"bus_is_params": True},
                {"update_in_jit": True}):
        kwargs = {"stage": False, "sharded": False, "bus_is_params": False, **why}
        assert packing.why_per_leaf(**kwargs)
        assert not packing.choose(TREE, **kwargs).flat
