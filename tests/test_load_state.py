"""Loading state into an engine (`load_state`, `load_unit`), on both host update paths: a state of
another structure, shape or kind of dtype is refused in one line naming the unit and the leaf
before anything is replaced; the moments are cast to the engine's dtype; a load after an
evaluation never writes a bus copy that one of its fetches may still be reading."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from toy_model import Embed, Head, Residual

from megatrain_jax import StreamedEngine
from megatrain_jax.config import OptimizerConfig
from megatrain_jax.engine import fused_adamw
from megatrain_jax.recipes import build_optimizer

CPU = jax.devices("cpu")
D, V, L = 16, 11, 3
PATHS = ["direct", "jit"]
TOKENS = np.random.default_rng(3).integers(0, V, size=(3, 2, 2, 9))


def make(path, state_dtype="float32", seed=0):
    if path == "direct" and fused_adamw.kernel() is None:
        pytest.skip("no C++ compiler: no direct update")
    return StreamedEngine(first=Embed(V, D, nnx.Rngs(seed)), last=Head(D, V, nnx.Rngs(seed + 1)),
                          make_block=lambda i: Residual(D, 3 * D, nnx.Rngs(seed + 10 + i)),
                          num_layers=L,
                          optimizer=build_optimizer(OptimizerConfig(state_dtype=state_dtype), 10),
                          max_grad_norm=1.0, compute_dtype=jnp.bfloat16, compute_device=CPU[1],
                          host_device=CPU[0], host_update=path)


def state_of(path, state_dtype="float32", seed=5, steps=0):
    """The state (numpy) of another engine after `steps` steps."""
    engine = make(path, state_dtype, seed)
    for k in range(steps):
        step(engine, k)
    state = copied(engine)
    engine.close()
    return state


def step(engine, k=0):
    return float(engine.train_step(TOKENS[k, ..., :-1], TOKENS[k, ..., 1:])["loss"])


def copied(engine):
    return jax.tree.map(np.array, engine.state())


def assert_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def transposed_w(layer):
    """The layer's state with its (D, 3D) weight given as (3D, D): the same size, another
    shape."""
    return {**layer, "params": {**layer["params"], "w": layer["params"]["w"].T.copy()}}


@pytest.mark.parametrize("path", PATHS)
def test_a_leaf_of_another_shape_is_refused_naming_unit_and_leaf_and_nothing_changes(path):
    """A transposed matrix (same size, other shape), a leaf missing, an integer where a float is:
    one ValueError line naming the unit and the leaf, by load_unit and by load_state, before
    anything is replaced (load_state's other units too); the engine then trains on as before."""
    engine = make(path)
    step(engine)
    before = copied(engine)
    other = state_of(path)
    bad = {**other, "layers": [*other["layers"][:1], transposed_w(other["layers"][1]),
                               *other["layers"][2:]]}
    shape = rf"cannot load layer 1: params/w has shape \(48, 16\) float32, the unit's has shape " \
            rf"\(16, 48\) float32$"
    with pytest.raises(ValueError, match="^" + shape):
        engine.load_unit(1, transposed_w(other["layers"][1]))
    with pytest.raises(ValueError, match="^" + shape):
        engine.load_state(bad)
    missing = {**other["layers"][2], "params": {k: v for k, v in
                                                other["layers"][2]["params"].items() if k != "b"}}
    with pytest.raises(ValueError, match=r"^cannot load layer 2: it has no params/b$"):
        engine.load_unit(2, missing)
    counted = jax.tree.map(lambda x: x.astype(np.float32) if x.ndim == 0 else x, other["stages"])
    with pytest.raises(ValueError, match=r"^cannot load the stages: opt_state/0/count has shape "
                                         r"\(\) float32, the unit's has shape \(\) int32$"):
        engine.load_unit("stages", counted)
    with pytest.raises(ValueError, match=r"^cannot load a state of 2 layers into an engine of 3$"):
        engine.load_state({**other, "layers": other["layers"][:2]})
    with pytest.raises(ValueError, match=r"^load_unit: which must be 'stages' or a layer index "
                                         r"\(0 to 2\), got 3$"):
        engine.load_unit(3, other["layers"][2])  # (unit 1 + 3 is the last stage's)
    assert_equal(copied(engine), before)
    engine.load_state(other)  # the same state, whole: loads
    assert_equal(copied(engine), other)
    assert np.isfinite(step(engine, 1))
    engine.close()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("engine_dtype,state_dtype", [("bfloat16", "float32"),
                                                      ("float32", "bfloat16")])
def test_loaded_moments_take_the_engines_dtype(path, engine_dtype, state_dtype):
    """An engine with bf16 moments loading an fp32 state keeps bf16 moments (each rounded to the
    nearest), and the reverse keeps fp32 ones (exact): what state() returns afterwards, and what
    the next step trains on."""
    engine = make(path, engine_dtype)
    loaded = state_of(path, state_dtype, steps=1)
    engine.load_state(loaded)
    got = copied(engine)
    moments = lambda state: [x for unit in [state["stages"], *state["layers"]]
                             for x in jax.tree.leaves((unit["opt_state"][0].mu,
                                                       unit["opt_state"][0].nu))]
    for x, y in zip(moments(got), moments(loaded), strict=True):
        assert x.dtype == engine_dtype
        np.testing.assert_array_equal(x, y.astype(engine_dtype))
    assert_equal(got["layers"][1]["params"], loaded["layers"][1]["params"])
    assert np.isfinite(step(engine, 1))
    assert all(x.dtype == engine_dtype for x in moments(copied(engine)))
    engine.close()


@jax.jit
def _read_late(leaves):
    """`leaves` again, each read only once a long loop has run (as a fetch still queued behind
    the device's work reads its bus copy late); the loop's result, ready when they are."""
    busy = jax.lax.fori_loop(0, 3_000_000, lambda i, c: c * 0.5 + 1.0, jnp.float32(0))
    return busy, [x + (busy * 0).astype(x.dtype) for x in leaves]


def test_a_load_never_writes_a_bus_copy_a_fetch_may_still_read():
    """The direct update's bus copies are buffers the engine writes in place (the jit path makes
    a new one on a load). load_unit while a read of the unit's bus copy is still to come (an
    evaluation's last fetches may be when it returns): that read gets the bus copy as it was,
    and the engine's next fetch the loaded weights."""
    loaded = state_of("direct")["layers"][1]
    engine = make("direct")
    step(engine)
    engine.load_unit(1, copied(engine)["layers"][1])  # (its first: what it compiles, compiled)
    bus = jax.tree.leaves(engine.host.bus(2))  # layer 1's
    before = [np.array(x) for x in bus]
    busy, late = _read_late(bus)
    engine.load_unit(1, loaded)
    assert not busy.is_ready()  # the load was done before the read
    for x, y in zip(late, before, strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)
    now = jax.tree.leaves(engine.host.bus(2))
    for x, p in zip(now, jax.tree.leaves(loaded["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(x), p.astype(jnp.bfloat16))
    engine.close()
