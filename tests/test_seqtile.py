"""The block tiled over the sequence (megatrain_jax/seqtile.py) equals the untiled block, values
and gradients (of the weights and of the input), in fp32: sliding windows, document masks, GQA,
Qwen3's q/k norms with biases, Gemma 3's local and global layers, MoE blocks; ragged last tiles,
tiles that split attention blocks. Both paths run the same blockwise attention kernels, so they
differ by fp32 reassociation only (sums over tiles instead of over the whole sequence). Both are
held against the same function run in fp64: the tiled path's error may be a few times the untiled
path's own (plus 1e-5 of the largest entry), far below what a wrong mask or a missing share of dK
(O(1) relative) would give."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megatrain_jax.data import document_context
from megatrain_jax.model import Execution, ModelConfig, make_block

BASE = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                   num_heads=4, num_kv_heads=2)
GEMMA3 = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=5,
              norm_offset=True, post_norms=True, activation="gelu_tanh", qk_norm=True,
              query_pre_attn_scalar=16, rope_local_theta=100.0, num_kv_heads=1, head_dim=16)
CASES = {
    "gqa_window_documents": (dict(sliding_window=5), 8, 4, True),
    "unaligned_tiles": (dict(sliding_window=6), 6, 4, True),  # tiles of 6 split blocks of 4
    "qwen3_qk_norm_bias": (dict(qk_norm=True, qkv_bias=True), 8, 8, False),
    "gemma3_local_global": (GEMMA3, 7, 4, True),
    "moe": (dict(num_experts=4, experts_per_token=2), 8, 4, True),
}
T, EOS = 23, 0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _block_grads(cfg, execution):
    """jit of (params, x, context, r) -> the value and gradients (params, x) of a loss that
    reads every output of layer 0's block (a layer's kind is data: one function for all)."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: make_block(cfg, 0, 0, execution)))

    def loss(p, x, context, r):
        out = nnx.merge(graphdef, p)(x, context)
        if cfg.num_experts:  # the router statistics get a cotangent too
            out, stats = out
            return jnp.sum(out * r) + sum(jnp.sum(s * (i + 1.5)) for i, s in
                                          enumerate(jax.tree.leaves(stats)))
        return jnp.sum(out * r)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize("name", CASES)
def test_tiled_block_equals_untiled_values_and_gradients(name):
    options, tile, attention_block, documents = CASES[name]
    cfg = dataclasses.replace(BASE, **options)
    rng = np.random.default_rng(3)
    tokens = rng.integers(1, cfg.vocab_size, size=(2, T))
    tokens[0, 9], tokens[1, 15] = EOS, EOS
    context = ({k: jnp.asarray(v) for k, v in document_context(tokens, EOS).items()}
               if documents else None)
    x = jnp.asarray(rng.standard_normal((2, T, cfg.hidden_size)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((2, T, cfg.hidden_size)), jnp.float32)
    untiled = Execution(attention="blockwise", attention_block=attention_block)
    expected_of = _block_grads(cfg, untiled)
    actual_of = _block_grads(cfg, dataclasses.replace(untiled, tile_size=tile))
    for layer in range(len(cfg.layer_types) or 1):
        block = make_block(cfg, 0, layer)
        params = jax.tree.map(lambda p: p + 0.2 * jnp.asarray(
            rng.standard_normal(p.shape), jnp.float32), nnx.to_pure_dict(nnx.state(block)))
        if cfg.layer_types:  # the kind is data: keep it
            params["sliding"] = nnx.to_pure_dict(nnx.state(block))["sliding"]
        expected, actual = (f(params, x, context, r) for f in (expected_of, actual_of))
        with jax.enable_x64(True):  # the truth both fp32 paths round: the same function in fp64
            wide = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), t)
            exact = _block_grads(cfg, untiled)(wide(params), wide(x), context, wide(r))
        for a, e, t in zip(*map(jax.tree.leaves, (actual, expected, exact)), strict=True):
            a, e, t = np.asarray(a, np.float64), np.asarray(e, np.float64), np.asarray(t)
            # The untiled path's own fp32 error says how much rounding this leaf carries (a sum of
            # ~1,500 terms carries far more than one of its entries): the tiled path may carry a
            # few times that, never the O(1) of a wrong mask.
            tolerance = 4 * np.abs(e - t).max() + 1e-5 * max(1.0, np.abs(t).max())
            np.testing.assert_allclose(a, t, rtol=0, atol=tolerance)


def test_tiled_backward_grows_by_k_v_and_their_gradients_only():
    """Compiled, not run: per token, the tiled block's backward holds K and V (in the compute
    dtype) and dK and dV (fp32 accumulators), 4 * K * H numbers, a quarter of the hidden size
    here; the untiled one holds ~26 hidden sizes (q, k, v, the attention's output, their
    gradients, the MLP's input...). The slope between two lengths leaves the constant (one
    tile's workspace) out."""
    cfg = dataclasses.replace(BASE, hidden_size=64, intermediate_size=128, num_heads=8,
                              num_kv_heads=2)
    execution = Execution(attention="blockwise", attention_block=256, tile_size=512)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: make_block(cfg, 0, 0, execution)))
    grad = jax.jit(jax.grad(lambda p, x: nnx.merge(graphdef, p)(x).sum(), argnums=(0, 1)))

    def temp(seq):
        x = jax.ShapeDtypeStruct((1, seq, cfg.hidden_size), jnp.float32)
        return grad.lower(params, x).compile().memory_analysis().temp_size_in_bytes

    per_token = (temp(16384) - temp(8192)) / 8192
    k_v_and_grads = 4 * cfg.num_kv_heads * cfg.head_size * 4
    assert per_token <= 1.1 * k_v_and_grads, (per_token, k_v_and_grads)


def test_a_tile_that_splits_attention_blocks_is_refused_before_anything_is_built():
    proc = subprocess.run([sys.executable, "scripts/plan.py", "data.seq_len=4096",
                           "train.tile_size=1000", "train.attention_block=512"],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: train.tile_size (1000) must be a multiple of train.attention_block (512) when it "
        "tiles data.seq_len (4096)"], proc.stderr
