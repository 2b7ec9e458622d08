"""One jitted call per layer and pass (engine/functions.py's layer_fwd, layer_bwd): every
micro-batch inside the call, with the gradient's zeroing, accumulation, sum of squares and cast and
the copies in and out. Over three steps it trains the bits of the per-micro-batch form the step
had before: the same engine with each layer call replaced by one call of the block per micro-batch
(f.block_fwd, f.block_bwd), the zeroing, the sum of squares and the cast each a call of its own
and the copies eager; the sums over the micro-batches are taken in the same order.

The same bits in fp32 in every mode, and in bf16 for two micro-batches. With eight in bf16, or a
mixture of experts' router, XLA rounds some sums otherwise inside the call's loop than in a call
of its own (below): within rounding there."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from toy_model import capture_grads

from megatrain_jax import moe
from megatrain_jax.data import document_context
from megatrain_jax.engine import StreamedEngine
from megatrain_jax.engine.parallel import sum_squares
from megatrain_jax.engine.tier import DiskTierOptions
from megatrain_jax.model import ModelConfig, make_block, make_stages

CPU = jax.devices("cpu")
CFG = ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2)
MOE = ModelConfig(**{**CFG.__dict__, "num_experts": 4, "experts_per_token": 2})
STEPS = 3


def per_micro_batch(engine, f):
    """Replaces the engine's layer calls (DeviceFunctions `f`) by the per-micro-batch form."""
    device = engine.compute_device
    to_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    to_pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    zeros = jax.jit(lambda w: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), w))
    squares = jax.jit(sum_squares)
    # a layer's weights and gradient as the unit travels (engine/packing.py): flat, one array
    unpack = jax.jit(lambda layer: (f.packing.unpack(layer[0]), layer[1]))
    pack = jax.jit(lambda g: f.packing.pack(g, engine.grad_dtype))
    stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
    at = lambda tree, m: jax.tree.map(lambda x: x[m], tree)

    def copies(fetch, out):
        return jax.device_put(fetch, to_device), jax.device_put(out, to_pinned)

    def layer_fwd(fetch, out, layer, xs, contexts):  # layer: (weights, Constants)
        layer = unpack(layer)
        made = [f.block_fwd(layer, xs[m], at(contexts, m)) for m in range(len(xs))]
        auxs = [aux for _, aux in made]
        return (stack([y for y, _ in made]), None if auxs[0] is None else stack(auxs)), *copies(
            fetch, out)

    def layer_bwd(fetch, out, layer, xs, contexts, dys, daux):
        layer = unpack(layer)
        acc, dxs = zeros(layer[0]), []  # (the weights', not the Constants')
        for m in range(len(xs)):
            dx, acc = f.block_bwd(layer, xs[m], at(contexts, m), dys[m], acc, daux)
            dxs.append(dx)
        sq = squares(acc)
        return (jnp.stack(dxs), pack(acc), sq), *copies(fetch, out)

    f.layer_fwd, f.layer_bwd = layer_fwd, layer_bwd


def train(num_micro, form, setup, tmp_path):
    """Three steps of M micro-batches on CPU device 1 standing for the accelerator, in the
    one-call form ("one call") or the per-micro-batch form: (losses, grad norms, the state)."""
    setup = dict(setup)
    cfg = MOE if setup.pop("moe", False) else CFG
    documents = setup.pop("documents", False)
    if setup.pop("disk", False):
        setup["disk_tier"] = DiskTierOptions(str(tmp_path / form))
    setup.setdefault("compute_dtype", jnp.float32)
    setup.setdefault("optimizer", optax.adamw(1e-2))
    first, last = make_stages(cfg, seed=0)
    engine = StreamedEngine(first=first, last=last, make_block=lambda i: make_block(cfg, 0, i),
                            num_layers=cfg.num_layers, max_grad_norm=1.0, compute_device=CPU[1],
                            host_device=CPU[0], aux_loss=moe.aux_loss(cfg), **setup)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (STEPS, num_micro, 2, 17),
                                               np.int32)
    shape = lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype)  # a micro-batch's
    f = engine.device_functions(shape(tokens[..., :-1]), shape(tokens[..., 1:]))
    if form != "one call":
        per_micro_batch(engine, f)
    out = steps(engine, tokens, cfg, documents)
    engine.close()
    return out


def steps(engine, tokens, cfg, documents=False) -> tuple:
    """(losses, grad norms, the state as numpy) after one step on each of `tokens` (steps of
    inputs and targets, a token ahead; with `documents`, their document masks as context)."""
    losses, norms = [], []
    for t in tokens:
        inputs = t[..., :-1]
        context = document_context(inputs, cfg.vocab_size - 1) if documents else None
        result = engine.train_step(inputs, t[..., 1:], context)
        losses.append(float(result["loss"]))
        norms.append(float(result["grad_norm"]))
    return losses, norms, jax.tree.map(np.array, engine.state())


SETUPS = {  # M, the engine's options
    "M1 eager": (1, dict(copies="eager")),
    "M2 jit": (2, dict(copies="jit")),
    "M8 jit offloaded p2": (8, dict(copies="jit", offload_activations=True, prefetch=2)),
    "M8 eager p2 bf16 grads documents": (8, dict(copies="eager", prefetch=2,
                                                 grad_dtype=jnp.bfloat16, documents=True)),
    "M2 jit disk tier": (2, dict(copies="jit", disk=True)),
    "M8 jit host lookup": (8, dict(copies="jit", host_lookup=True)),
    "M2 bf16 jit": (2, dict(copies="jit", compute_dtype=jnp.bfloat16)),
}


@pytest.mark.parametrize("name", SETUPS)
def test_one_call_per_layer_trains_the_per_micro_batch_forms_bits(name, tmp_path):
    num_micro, setup = SETUPS[name]
    one = train(num_micro, "one call", setup, tmp_path)
    each = train(num_micro, "per micro-batch", setup, tmp_path)
    assert one[:2] == each[:2]
    for a, b in zip(jax.tree.leaves(one[2]), jax.tree.leaves(each[2]), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert one[0][-1] != one[0][0]  # it trained


# Where XLA does not keep the per-micro-batch call's roundings: a mixture of experts' scatter-adds
# (their order of adds is XLA's), bf16 intermediates XLA may keep in fp32 inside the call's loop
# (xla_allow_excess_precision). Each step's gradient then within the equivalence tests' tolerance:
# fp32, test_engine's (1e-5 per tensor in L2); bf16, its unit roundoff 2^-8 (the two forms round
# the same sums differently, once)
ROUNDED = {"M8 jit moe": (dict(copies="jit", moe=True), 1e-5),
           "M8 bf16 jit offloaded p2": (dict(copies="jit", offload_activations=True, prefetch=2,
                                             compute_dtype=jnp.bfloat16), 2.0 ** -8)}


@pytest.mark.parametrize("name", ROUNDED)
def test_where_xla_rounds_otherwise_each_gradient_is_within_rounding(name, tmp_path):
    setup, rtol = ROUNDED[name]
    setup = {**setup, "optimizer": capture_grads()}  # the state: the step's gradient
    one, each = (train(8, form, setup, tmp_path) for form in ("one call", "per micro-batch"))
    np.testing.assert_allclose(one[0], each[0], rtol=rtol)
    np.testing.assert_allclose(one[1], each[1], rtol=rtol)
    for a, b in zip(jax.tree.leaves(one[2]), jax.tree.leaves(each[2]), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b)
