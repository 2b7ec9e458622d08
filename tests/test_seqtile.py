"""The block tiled over the sequence (megatrain_jax/seqtile.py) equals the untiled block, values
and gradients (of the weights and of the input), in fp32: sliding windows, document masks, GQA,
Qwen3's q/k norms with biases, Gemma 3's local and global layers, MoE blocks; ragged last tiles,
tiles that split attention blocks, an odd number of tiles (a middle tile of its own); each way a
tiled block attends (blockwise per query tile, the attention untiled with the rest tiled, two
calls per query tile merged by their log-sum-exps). The paths differ by fp32 reassociation only
(sums over tiles instead of over the whole sequence, a merge of two softmaxes). Both are held
against the untiled function run in fp64: the tiled path's error may be a few times the untiled
path's own (plus 1e-5 of the largest entry), far below what a wrong mask or a missing share of dK
(O(1) relative) would give. Every loop of the tiled block has a trip count XLA knows, and its
backward grows by K, V and their gradients alone."""

import dataclasses
import os
import re
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
    "llama_gqa": (dict(), 8, 4, False),
}
# What attends where the block is tiled (model.Execution.tiled): blockwise per query tile for
# every case; the attention over the whole sequence with the rest tiled; per query tile two
# calls merged by their log-sum-exps (cuDNN's candidate, XLA's dot_product_attention standing in
# for cuDNN here), where there is no window and no document mask.
TILED = [(name, "blockwise") for name in CASES] + [(name, "untiled") for name in CASES] + [
    (name, "merged") for name, case in CASES.items()
    if not case[0].get("sliding_window") and not case[3]]
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


@pytest.mark.parametrize("name,tiled", TILED, ids=[f"{n}-{t}" for n, t in TILED])
def test_tiled_block_equals_untiled_values_and_gradients(name, tiled):
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
    actual_of = _block_grads(cfg, dataclasses.replace(
        untiled, tile_size=tile, tile_attention=tiled, attention="xla" if tiled == "merged"
        else "blockwise"))
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


def _while_loops(compiled) -> list:
    """(name, known trip count or None) of every while loop of a compiled function's optimized
    HLO: XLA:GPU runs a loop with no known trip count from the host, reading its predicate back
    at every step."""
    loops = []
    for line in compiled.as_text().splitlines():
        if " while(" in line:
            count = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
            loops.append((line.split("=")[0].strip(), int(count.group(1)) if count else None))
    return loops


@pytest.mark.parametrize("name", CASES)
def test_every_loop_of_the_tiled_block_has_a_known_trip_count(name):
    """Forward and backward (recompute and VJP) of the tiled block, compiled by XLA:CPU: every
    while loop carries XLA's known_trip_count (the tiles' loops, the attention's, the MLP's),
    so that XLA:GPU never reads a loop's predicate back to the host."""
    options, tile, attention_block, documents = CASES[name]
    cfg = dataclasses.replace(BASE, **options)
    execution = Execution(attention="blockwise", attention_block=attention_block, tile_size=tile)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: make_block(cfg, 0, 0, execution)))
    x = jax.ShapeDtypeStruct((2, 5 * tile + 3, cfg.hidden_size), jnp.float32)  # odd: a middle tile
    ids = jax.ShapeDtypeStruct(x.shape[:2], jnp.int32)
    context = {"segment_ids": ids, "positions": ids} if documents else None
    forward = lambda p, x, context: nnx.merge(graphdef, p)(x, context)
    backward = lambda p, x, context, dy: jax.vjp(lambda p, x: forward(p, x, context), p, x)[1](dy)
    dy = jax.eval_shape(forward, params, x, context)
    for fn, args in ((forward, (params, x, context)), (backward, (params, x, context, dy))):
        loops = _while_loops(jax.jit(fn).lower(*args).compile())
        assert loops and all(count for _, count in loops), loops


def test_tiled_block_grows_by_k_v_and_their_gradients_only():
    """Compiled, not run: per token, the tiled block's backward holds K and V (in the compute
    dtype) and dK and dV (fp32 accumulators), 4 * K * H numbers, a quarter of the hidden size
    here, and its forward K and V alone; the untiled one holds ~26 hidden sizes (q, k, v, the
    attention's output, their gradients, the MLP's input...). The slope between lengths leaves
    the constant (a pair of tiles' workspace) out; two spans, as a copy of a whole-sequence
    buffer (dx written over dy while an earlier version of it is still read) can hide in the
    allocator's packing at one."""
    cfg = dataclasses.replace(BASE, hidden_size=64, intermediate_size=128, num_heads=8,
                              num_kv_heads=2)
    execution = Execution(attention="blockwise", attention_block=256, tile_size=512)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: make_block(cfg, 0, 0, execution)))
    forward = lambda p, x: nnx.merge(graphdef, p)(x)
    backward = lambda p, x, dy: jax.vjp(forward, p, x)[1](dy)

    def temps(seq):
        x = jax.ShapeDtypeStruct((1, seq, cfg.hidden_size), jnp.float32)
        return [jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes
                for f, args in ((forward, (params, x)), (backward, (params, x, x)))]

    temps = {seq: temps(seq) for seq in (8192, 16384, 32768)}
    k_v = 2 * cfg.num_kv_heads * cfg.head_size * 4
    for short, long in ((8192, 16384), (16384, 32768)):
        per_token = [(b - a) / (long - short) for a, b in zip(temps[short], temps[long])]
        assert per_token[0] <= 1.05 * k_v and per_token[1] <= 1.05 * 2 * k_v, (short, long,
                                                                                per_token)


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


def test_cudnn_asked_for_where_it_cannot_run_is_one_line_naming_what_runs():
    """train.attention=cudnn on a CPU: the run goes on with blockwise attention and the plan's
    lines (the run's log, the bench's JSON) say so in one line, beside the one naming what
    attends; a negative train.attention_block is refused naming the key (0: the measured
    block)."""
    from megatrain_jax.config import ConfigError
    from megatrain_jax.machines import machine_from_device
    from megatrain_jax.plan import plan
    from megatrain_jax.recipes import load_config
    summary = lambda *overrides: plan(load_config(None, [
        "data.seq_len=512", "train.tile_size=256", "model.num_layers=1", *overrides]),
        machine_from_device()).summary().splitlines()
    lines = summary("train.attention=cudnn")
    notice = ("train.attention=cudnn cannot run here (not a GPU (platform cpu)): blockwise "
              "attention runs instead")
    assert lines.count(notice) == 1
    assert ("plan: attention blockwise flash attention (blocks of 256) per query tile of 256, "
            "the block in tiles of 256 (not a GPU (platform cpu); tiled: blockwise per query "
            "tile)") in lines
    assert notice not in summary("train.attention=auto")
    with pytest.raises(ConfigError, match=r"^train.attention_block must be >= 0, got -1$"):
        load_config(None, ["train.attention_block=-1"])
