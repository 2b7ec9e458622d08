"""Mixture of experts (Mixtral, Qwen3-MoE): a top-k router and experts' SwiGLU over tokens sorted
by expert, and the load-balancing auxiliary loss as transformers computes it.

Shapes: N tokens (B*T flattened), D hidden, F one expert's hidden, E experts, k experts per token,
M = N*k routed rows, P = padded rows (each expert's rows rounded up to a tile), J = P / tile tiles.

Why not a dense compute, and why tiles instead of `jax.lax.ragged_dot`: ragged_dot is grouped on
TPU (and on GPU with the Pallas lowering), but JAX lowers it on the CPU, and by default on the GPU
through XLA's own expansion, as a masked dot over all E groups: E times the FLOPs and an (E, M, D)
temporary. Here each expert's rows are padded to a multiple of `tile` and a loop over tiles
computes one expert's SwiGLU per tile (one dynamic slice of that expert's weights), so the FLOPs
are those of the routed rows plus at most one partly filled tile per expert, the temporaries are
one tile's, and empty tiles (the static bound's slack) are skipped. Each tile saves its matmul
outputs for the backward and recomputes the rest (`dots_saveable`), as a dense MLP would keep
them. (XLA's cost_analysis counts a loop's body once, so its FLOPs figure for this block is that
of one tile; tests/test_moe.py counts the matmuls of the jaxpr instead.)
"""

import jax
import jax.numpy as jnp
from jax import lax


def route(y, w_router, top_k: int, renormalize: bool):
    """The router on (N, D) tokens: (logits (N, E) in y's dtype, top-k weights (N, k) fp32, top-k
    expert ids (N, k) int32). Softmax over all experts in fp32, then the k largest, renormalised
    to sum to 1 when `renormalize` (Mixtral always; Qwen3-MoE when norm_topk_prob)."""
    logits = jnp.einsum("nd,de->ne", y, w_router)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return logits, weights, experts


def _tile_layout(expert_ids, num_experts: int, tile: int):
    """Where each routed row goes in the padded, expert-sorted buffer.

    expert_ids (M,) int32 -> (order (M,): the rows sorted by expert (stable), dest (M,): the
    padded row of each sorted row, tile_expert (J,): each tile's expert, used: tiles in use)."""
    m = expert_ids.shape[0]
    num_tiles = -(-m // tile) + num_experts  # static bound: each expert wastes < 1 tile
    order = jnp.argsort(expert_ids, stable=True)
    sorted_ids = expert_ids[order]
    sizes = jnp.bincount(expert_ids, length=num_experts)  # (E,)
    starts = jnp.cumsum(sizes) - sizes
    padded = -(-sizes // tile) * tile
    padded_ends = jnp.cumsum(padded)
    padded_starts = padded_ends - padded
    dest = padded_starts[sorted_ids] + jnp.arange(m) - starts[sorted_ids]
    tile_start = jnp.arange(num_tiles) * tile
    tile_expert = jnp.minimum(jnp.searchsorted(padded_ends, tile_start, side="right"),
                              num_experts - 1)
    used = padded_ends[-1] // tile
    return order, dest, tile_expert, used, num_tiles


def experts_swiglu(rows, expert_ids, w_gate, w_up, w_down, tile: int):
    """down_e(silu(gate_e(r)) * up_e(r)) for each routed row r (M, D) and its expert e (M,),
    with w_gate, w_up (E, D, F) and w_down (E, F, D); (M, D) in rows' dtype."""
    m, d = rows.shape
    num_experts = w_gate.shape[0]
    tile = max(1, min(tile, m))
    order, dest, tile_expert, used, num_tiles = _tile_layout(expert_ids, num_experts, tile)
    padded = jnp.zeros((num_tiles * tile, d), rows.dtype).at[dest].set(rows[order])
    tiles = padded.reshape(num_tiles, tile, d)

    def one_tile(j):
        e, x = tile_expert[j], tiles[j]  # x: (tile, D), one expert's rows (or zero padding)

        def compute(x):
            gate = jnp.einsum("td,df->tf", x, w_gate[e])
            up = jnp.einsum("td,df->tf", x, w_up[e])
            return jnp.einsum("tf,fd->td", jax.nn.silu(gate) * up, w_down[e])

        return lax.cond(j < used, compute, jnp.zeros_like, x)

    out = lax.map(jax.checkpoint(one_tile, policy=jax.checkpoint_policies.dots_saveable),
                  jnp.arange(num_tiles))  # (J, tile, D)
    out_sorted = out.reshape(num_tiles * tile, d)[dest]  # (M, D), rows in sorted order
    return jnp.zeros_like(out_sorted).at[order].set(out_sorted)  # back to routed-row order


def moe_mlp(y, weights, *, top_k: int, renormalize: bool, tile: int, valid=None):
    """The sparse MLP on normalised (B, T, D) tokens: (out (B, T, D), router statistics).

    `weights` = (w_router (D, E), w_gate, w_up (E, D, F), w_down (E, F, D)). The statistics are
    the per-layer sums the load-balancing loss needs (see `load_balancing_loss`), each fp32:
    expert_counts (E,) top-k assignments per expert, router_prob_sum (E,) the router's
    probabilities summed over tokens, rows () the number of tokens. `valid` (B, T) bool, or None
    for all: the tokens that count in the statistics (padding does not, as transformers leaves
    out what its attention_mask masks); every token is still computed."""
    w_router, w_gate, w_up, w_down = weights
    b, t, d = y.shape
    num_experts = w_router.shape[1]
    flat = y.reshape(b * t, d)
    logits, route_w, experts = route(flat, w_router, top_k, renormalize)
    ids = experts.reshape(-1)  # (N*k,), row r is token r // k
    rows = jnp.repeat(flat, top_k, axis=0)
    out = experts_swiglu(rows, ids, w_gate, w_up, w_down, tile)  # (N*k, D)
    # Weighted in fp32, summed over the k experts of each token, cast back (as Mixtral does).
    out = jnp.einsum("nkd,nk->nd", out.reshape(b * t, top_k, d).astype(jnp.float32), route_w)
    counted = (jnp.ones((b * t,), jnp.float32) if valid is None
               else valid.reshape(b * t).astype(jnp.float32))
    stats = {
        "expert_counts": lax.stop_gradient(
            jnp.zeros((num_experts,), jnp.float32).at[ids].add(jnp.repeat(counted, top_k))),
        "router_prob_sum": jnp.sum(  # elementwise, not a matmul: (N, E) is small
            jax.nn.softmax(logits.astype(jnp.float32), axis=-1) * counted[:, None], axis=0),
        "rows": jnp.sum(counted),
    }
    return out.astype(y.dtype).reshape(b, t, d), stats


def load_balancing_loss(stats, num_experts: int):
    """transformers' load_balancing_loss_func from the router statistics summed over all layers
    (and over micro-batches: the same as one forward over all their tokens):
    E * sum_e (assignments_e / rows) * (prob_sum_e / rows), rows counting each layer's tokens."""
    rows = stats["rows"]
    return num_experts * jnp.sum(stats["expert_counts"] / rows * (stats["router_prob_sum"] / rows))


def aux_loss(cfg):
    """The engine's `aux_loss` for a model config: router_aux_loss_coef times the load-balancing
    loss of the summed router statistics; None for a dense model."""
    if not cfg.num_experts:
        return None
    return lambda stats: cfg.router_aux_loss_coef * load_balancing_loss(stats, cfg.num_experts)
