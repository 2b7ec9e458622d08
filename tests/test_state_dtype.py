"""optimizer.state_dtype=bfloat16: the Adam moments held in bf16, stochastically rounded at each
update. The rounding is unbiased; the kernel and its JAX fallback give the same bits (with fp32
moments too); the optax state, and so the plan's optimizer bytes, are bf16."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from megatrain_jax import config as config_lib
from megatrain_jax.config import Config, OptimizerConfig
from megatrain_jax.engine import fused_adamw
from megatrain_jax.machines import Machine
from megatrain_jax.model import ModelConfig
from megatrain_jax.plan import plan
from megatrain_jax.recipes import build_optimizer

NATIVE = pytest.param(True, id="kernel", marks=pytest.mark.skipif(
    fused_adamw.kernel() is None, reason="no C++ compiler: the kernel is not built"))
JAX = pytest.param(False, id="jax")


def bits(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype == jnp.bfloat16 else x.view(np.uint32)


def one_step(native, m, v, count=0):
    """One update of a leaf with a zero gradient: the new moments are b1 * m and b2 * v in f32,
    then rounded to bf16. Returns (the f32 values, the stored bf16 moments)."""
    tx = fused_adamw.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.0, state_dtype="bfloat16")
    params = {"w": jnp.zeros(m.shape, jnp.float32)}
    adam, *rest = tx.init(params)
    adam = adam._replace(count=jnp.int32(count), mu={"w": m}, nu={"w": v})
    if native:
        assert fused_adamw.native()
    update = jax.jit(lambda p, s, g: fused_adamw.update(
        tx.hyper, p, s, g, None, jnp.float32(1), jnp.float32(1), None, None, native))
    _, (adam, *_), _ = update(params, (adam, *rest), {"w": jnp.zeros(m.shape, jnp.float32)})
    exact = (np.float32(0.9) * np.asarray(m, np.float32), np.float32(0.95) * np.asarray(v, np.float32))
    return exact, (adam.mu["w"], adam.nu["w"])


@pytest.mark.parametrize("native", [NATIVE, JAX])
def test_stochastic_rounding_is_unbiased(native):
    """Every element holds the same moment, so each stores one rounding of the same f32 value
    (b1 * m, b2 * v), up or down: their mean is that value within 6 standard errors of a rounding
    that goes up with probability p (at most half a bf16 spacing over sqrt(n)); rounding to
    nearest would miss it by ~0.3 spacings, far outside the bound. The next step draws other bits."""
    n = 1 << 16
    m = jnp.full((n,), -0.30078125, jnp.bfloat16)  # b1 * m is not a bf16 value, nor is b2 * v
    v = jnp.full((n,), 0.0123291015625, jnp.bfloat16)
    (m32, v32), (m16, v16) = one_step(native, m, v)
    for exact, stored in ((m32, m16), (v32, v16)):
        stored, x = np.asarray(stored, np.float64), float(exact[0])
        values = np.unique(stored)
        assert len(values) == 2 and values[0] < x < values[1]  # both neighbours drawn
        spacing = values[1] - values[0]
        p = (x - values[0]) / spacing  # the probability of rounding up
        bound = 6 * spacing * np.sqrt(p * (1 - p) / n)
        assert abs(stored.mean() - x) <= bound, (stored.mean(), x, bound)
        assert min(p, 1 - p) * spacing > 3 * bound  # (rounding to nearest would fail)
    _, (m16_next, _) = one_step(native, m, v, count=1)
    assert (bits(m16_next) != bits(m16)).any()


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("max_grad_norm", [None, 1.0], ids=["noclip", "clip"])
def test_the_kernel_and_its_jax_fallback_give_the_same_bits(state_dtype, grad_dtype,
                                                             max_grad_norm):
    """fused_adamw.update's kernel and its JAX fallback, 3 steps of a schedule with masked weight
    decay, the gradient scaled and clipped: params, moments and bus copy bit for bit (the kernel
    contracts no multiply-add; the fallback keeps XLA from contracting one)."""
    if fused_adamw.kernel() is None:
        pytest.skip("no C++ compiler: the kernel is not built")
    assert fused_adamw.native()
    tx = fused_adamw.adamw(optax.linear_schedule(1e-2, 1e-3, 4), b1=0.9, b2=0.95, eps=1e-8,
                           weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
                           state_dtype=state_dtype)
    rng = np.random.default_rng(7)
    # 601,000 elements: two kernel threads where two cores are free, the cut inside "w"
    params = {"w": jnp.asarray(rng.normal(size=(600, 1000)), jnp.float32),
              "b": jnp.asarray(rng.normal(size=(1000,)), jnp.float32)}
    grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 2, grad_dtype), params)
             for _ in range(3)]
    runs = []
    for native in (True, False):
        update = jax.jit(lambda p, s, g, n: fused_adamw.update(
            tx.hyper, p, s, g, None, n, jnp.float32(0.5), max_grad_norm, jnp.bfloat16, native))
        p, s = params, tx.init(params)
        for g in grads:
            p, s, bus = update(p, s, g, jnp.float32(3.0))  # clipped where clipping is on
        runs.append((p, s[0].mu, s[0].nu, bus))
        assert all(x.dtype == state_dtype for x in jax.tree.leaves((s[0].mu, s[0].nu)))
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1]), strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_the_state_is_bf16_through_optax_and_the_plan_counts_it():
    """The optax transformation's own init and update keep mu and nu in bf16 (the state a
    checkpoint saves, and whose eval_shape the plan counts): the plan's optimizer bytes halve."""
    tx = build_optimizer(OptimizerConfig(state_dtype="bfloat16"), 10)
    params = {"w": jnp.ones((8, 16)), "b": jnp.ones((16,))}
    state = tx.init(params)
    grads = jax.tree.map(lambda x: x * 0.5, params)
    for _ in range(2):
        _, state = jax.jit(tx.update)(grads, state, params)
        assert {x.dtype for x in jax.tree.leaves((state[0].mu, state[0].nu))} == {
            jnp.dtype(jnp.bfloat16)}
    model = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=3,
                        num_heads=4, num_kv_heads=2)
    machine = Machine("host", device_memory_gb=1.0, host_memory_gb=1.0, bf16_tflops=1.0,
                      host_device_gbps=10.0, platform="cpu")
    cfg = Config(model=model)
    f32 = plan(cfg, machine).host["optimizer"]
    bf16 = plan(dataclasses.replace(cfg, optimizer=OptimizerConfig(state_dtype="bfloat16")),
                machine).host["optimizer"]
    assert abs(bf16 - f32 / 2) <= 64, (f32, bf16)  # (the counts stay int32)


def test_the_config_and_the_kernel_name_the_same_dtypes():
    assert config_lib.STATE_DTYPES is fused_adamw.STATE_DTYPES
    with pytest.raises(ValueError, match="state_dtype must be one of float32, bfloat16"):
        fused_adamw.adamw(1e-3, state_dtype="float16")


def _rounded(native, params, adam, grads, unit=0, firsts=None):
    """The bf16 moments after one fused_adamw.update of `params` (a dict of leaves) at `unit`,
    its leaves' first elements at `firsts` in their whole leaves."""
    tx = fused_adamw.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.0, state_dtype="bfloat16")
    adam0, *rest = tx.init(params)
    state = (adam0._replace(count=adam.count, mu=adam.mu, nu=adam.nu), *rest)
    update = jax.jit(lambda p, s, g, u, f: fused_adamw.update(
        tx.hyper, p, s, g, None, jnp.float32(1), jnp.float32(1), None, None, native, u, f))
    _, (new, *_), _ = update(params, state, grads, unit, firsts)
    return new.mu, new.nu


def _leaf(rng, shape):
    params = {"w": jnp.asarray(rng.normal(size=shape), jnp.float32)}
    moment = lambda s: {"w": jnp.asarray(np.abs(rng.normal(size=shape)) * s, jnp.bfloat16)}
    tx = fused_adamw.adamw(1e-3, state_dtype="bfloat16")
    adam = tx.init(params)[0]._replace(count=jnp.int32(4), mu=moment(0.1), nu=moment(0.01))
    return params, adam, {"w": jnp.asarray(rng.normal(size=shape), jnp.float32)}


@pytest.mark.parametrize("native", [NATIVE, JAX])
def test_a_process_rows_round_as_in_the_whole_leaf_and_units_apart(native):
    """The sharded host layout: a process holding rows [c, 2c) of a leaf (its first element's
    index in the whole leaf given) rounds them as a process holding all of it, bit for bit; and
    the same leaf in two units rounds with independent bits."""
    rng = np.random.default_rng(11)
    params, adam, grads = _leaf(rng, (12, 5))
    whole = _rounded(native, params, adam, grads, 3, np.uint32([0]))
    c = 6
    rows = lambda tree, k: jax.tree.map(lambda x: x[k * c:(k + 1) * c], tree)
    parts = [_rounded(native, rows(params, k), adam._replace(mu=rows(adam.mu, k),
                                                          nu=rows(adam.nu, k)),
                      rows(grads, k), 3, np.uint32([k * c * 5])) for k in (0, 1)]
    for i in (0, 1):  # mu, nu
        joined = np.concatenate([np.asarray(parts[k][i]["w"]) for k in (0, 1)])
        np.testing.assert_array_equal(bits(joined), bits(whole[i]["w"]))
    other = _rounded(native, params, adam, grads, 4, np.uint32([0]))
    assert (bits(other[0]["w"]) != bits(whole[0]["w"])).mean() > 0.2


def test_a_process_first_element_in_each_leaf():
    """Process positions 2 and 3 of 4 devices: a 12-row leaf is cut in pieces of 3 rows, so the
    process holds rows 6 to 11 (6 rows of 5: its first element is the whole leaf's 30th); of a
    4-row leaf, rows 2 and 3."""
    from megatrain_jax.engine.shard import Shards
    assert Shards(size=4, first=2, local=2).firsts([(6, 5), (2,)]) == [30, 2]


@pytest.mark.parametrize("path", ["direct", "jit"])
def test_equal_units_round_independently(path):
    """Three layers with equal weights, moments and gradients (bf16 moments): the engine keys
    each unit's rounding by its index, so their moments come out rounded apart, not
    bit-identical (about half of the roundings that can go either way differ)."""
    from flax import nnx
    from toy_model import Embed, Head, Residual
    from megatrain_jax import StreamedEngine
    if path == "direct" and fused_adamw.kernel() is None:
        pytest.skip("no C++ compiler: no direct update")
    cpu = jax.devices("cpu")
    engine = StreamedEngine(
        first=Embed(7, 8, nnx.Rngs(0)), last=Head(8, 7, nnx.Rngs(1)),
        make_block=lambda i: Residual(8, 64, nnx.Rngs(2)), num_layers=3,  # every layer alike
        optimizer=build_optimizer(OptimizerConfig(state_dtype="bfloat16"), 10),
        compute_dtype=jnp.bfloat16, compute_device=cpu[1], host_device=cpu[0], host_update=path)
    rng = np.random.default_rng(12)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32),
                         engine.param_shapes()["layers"][0])
    put = lambda x: jax.device_put(x, cpu[0], may_alias=False)
    for u in (1, 2, 3):
        engine.apply_gradients({u: put(grads)}, put(jnp.float32(1.0)), put(jnp.float32(1.0)))
    engine.wait()
    mu = [jax.tree.map(np.array, layer["opt_state"][0].mu) for layer in engine.state()["layers"]]
    engine.close()
    for a, b in ((0, 1), (1, 2), (0, 2)):
        differ = [(bits(x) != bits(y)).mean() for x, y in zip(jax.tree.leaves(mu[a]),
                                                               jax.tree.leaves(mu[b]))]
        assert min(differ) > 0.2, (a, b, differ)
