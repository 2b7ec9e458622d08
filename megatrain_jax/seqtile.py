"""A decoder block tiled over the sequence, so that its backward holds one tile's workspace.

The block's attention half and its MLP are per-token math except for attention itself, which reads
the keys and values of the whole sequence. `tiled_block` therefore computes K and V of every token
once, tile by tile (GQA: K kv heads, not N), and then each tile of tokens end to end: its queries,
its attention to the whole K and V (blockwise, with the tile's causal offset), the output
projection, the residual and the MLP. Nothing else of size T x hidden exists besides the block's
input and output.

The backward (a custom VJP) recomputes K and V, then walks the tiles from the last to the first:
each tile's forward again, its VJP, its share of dK and dV added to fp32 accumulators of the whole
sequence. Causal attention lets no earlier tile see a later tile's keys, so once tile i is done the
keys and values of tile i have their whole gradient and are differentiated back to tile i's input
at once: dx of a tile is written once, whole. The backward holds the block's input, dy and dx,
K and V, dK and dV (fp32), the weights' gradient (fp32) and one tile's workspace.

The model supplies the per-tile math as `TileFns` (megatrain_jax/model.py's Block), this module
the tiling and the order of the backward.
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class TileFns:
    """A block's math on one tile of tokens, w the block's weights (a pytree of arrays):
    queries(w, x, positions) -> q (B, t, N, H) and keys_values(w, x, positions) -> (k, v)
    (B, t, K, H), normed, projected and rotated; finish(w, x, attn, valid) -> (y, aux): the
    output projection of attn (B, t, N, H), the residual and the MLP, aux a pytree of sums over the
    `valid` tokens (B, t) or None; attention(w) -> which of the TileAttentions attends (an int,
    traced where the layer's kind is data, as Gemma 3's local and global layers)."""
    queries: Callable
    keys_values: Callable
    finish: Callable
    attention: Callable


def tiled_block(fns: TileFns, attentions: tuple, w, x, segment_ids, positions, tile: int):
    """(y (B, T, D), aux summed over the tiles) of the block on x (B, T, D), `tile` tokens at a
    time (T is padded to a multiple of it; padded rows are computed and dropped, and count in no
    sum). segment_ids (B, T) or None: the document ids of packed sequences; positions (B, T): the
    RoPE positions, or None for 0 .. T - 1. `attentions`: TileAttention (one per kind of layer), seq_len T."""
    B, T, _ = x.shape
    padded = -(-T // tile) * tile
    seq = _Sequence(tile, B, T, None if positions is None else _pad(positions, padded),
                    None if segment_ids is None else _pad(segment_ids, padded))
    y, aux = _tiled(fns, attentions, seq, w, _pad(x, padded))
    return y[:, :T], aux


def _pad(a, length: int):
    """(B, T, ...) zero-padded to (B, length, ...) (a no-op, no copy, at length T)."""
    if a.shape[1] == length:
        return a
    return jnp.pad(a, [(0, 0), (0, length - a.shape[1])] + [(0, 0)] * (a.ndim - 2))


@dataclasses.dataclass(frozen=True)
class _Sequence:
    """The padded sequence's per-token inputs besides x, each (B, T'), and the tile size."""
    tile: int
    batch: int
    length: int  # T, the tokens before the padding
    positions: object  # or None: 0 .. T' - 1
    segment_ids: object  # or None

    def count(self, x) -> int:
        return x.shape[1] // self.tile

    def take(self, a, i):
        """Tile i of a (B, T', ...) array (None: None)."""
        return None if a is None else lax.dynamic_slice_in_dim(a, i * self.tile, self.tile, 1)

    def positions_of(self, i):
        """Tile i's positions, (B, tile) or (tile,)."""
        if self.positions is None:
            return i * self.tile + jnp.arange(self.tile)
        return self.take(self.positions, i)

    def valid_of(self, i):
        """(B, tile) bool: tile i's tokens that count in the aux sums: not padding, and not
        padding of packed documents (a negative segment id)."""
        valid = jnp.broadcast_to(i * self.tile + jnp.arange(self.tile) < self.length,
                                 (self.batch, self.tile))
        if self.segment_ids is None:
            return valid
        return valid & (self.take(self.segment_ids, i) >= 0)

    def put(self, a, tile_value, i):
        return lax.dynamic_update_slice_in_dim(a, tile_value.astype(a.dtype), i * self.tile, 1)


def _attend(attentions: tuple, which, method: str, *args):
    """attentions[which].method(*args); `which` may be traced."""
    if len(attentions) == 1:
        return getattr(attentions[0], method)(*args)
    return lax.switch(which, [getattr(a, method) for a in attentions], *args)


def _keys_values(fns: TileFns, seq: _Sequence, w, x):
    """K and V (B, T', K, H) of the whole (padded) sequence, computed a tile at a time into one
    buffer each."""
    kv_of = lambda i: fns.keys_values(w, seq.take(x, i), seq.positions_of(i))
    shapes = jax.eval_shape(kv_of, 0)
    buffers = tuple(jnp.zeros((x.shape[0], x.shape[1], *s.shape[2:]), s.dtype) for s in shapes)
    return lax.fori_loop(0, seq.count(x), lambda i, kv: tuple(
        seq.put(buf, t, i) for buf, t in zip(kv, kv_of(i))), buffers)


def _tiled(fns, attentions, seq: _Sequence, w, x):
    def tile_forward(w, x, k, v, i):
        """(y_i, aux_i) of tile i."""
        x_i, seg_i = seq.take(x, i), seq.take(seq.segment_ids, i)
        q_i = fns.queries(w, x_i, seq.positions_of(i))
        o_i, _ = _attend(attentions, fns.attention(w), "forward", q_i, k, v, seg_i,
                         seq.segment_ids, i * seq.tile)
        return fns.finish(w, x_i, o_i, seq.valid_of(i))

    @jax.custom_vjp
    def run(w, x):
        k, v = _keys_values(fns, seq, w, x)
        aux0 = jax.tree.map(jnp.zeros_like, jax.eval_shape(tile_forward, w, x, k, v, 0)[1])

        def body(aux, i):
            y_i, aux_i = tile_forward(w, x, k, v, i)
            return jax.tree.map(jnp.add, aux, aux_i), y_i

        # a scan, not a loop into one buffer: where only the VJP is wanted (the engine's
        # backward), JAX drops the unused tiles of y, and with them the forward
        aux, y = lax.scan(body, aux0, jnp.arange(seq.count(x)))
        y = y.swapaxes(0, 1)  # (B, n, tile, D): a bitcast for one row
        return y.reshape(x.shape), aux

    def run_fwd(w, x):
        return run(w, x), (w, x)

    def run_bwd(residuals, cotangents):
        w, x = residuals
        dy, daux = cotangents
        k, v = _keys_values(fns, seq, w, x)
        which = fns.attention(w)
        first = attentions[0]
        f32 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)

        def step(n, carry):
            dw, dk, dv, dy_dx = carry  # dy, tile by tile overwritten with dx
            i = seq.count(x) - 1 - n  # the last tile first
            x_i, seg_i = seq.take(x, i), seq.take(seq.segment_ids, i)
            pos_i, valid_i = seq.positions_of(i), seq.valid_of(i)
            q_i, q_vjp = jax.vjp(lambda w, x: fns.queries(w, x, pos_i), w, x_i)
            o_i, lse_i = _attend(attentions, which, "forward", q_i, k, v, seg_i,
                                 seq.segment_ids, i * seq.tile)
            _, finish_vjp = jax.vjp(lambda w, x, o: fns.finish(w, x, o, valid_i), w, x_i, o_i)
            dw_out, dx_out, do_i = finish_vjp((seq.take(dy_dx, i), daux))
            dq_i, dk, dv = _attend(attentions, which, "backward", q_i, k, v, seg_i,
                                   seq.segment_ids, i * seq.tile, o_i, lse_i, do_i, dk, dv)
            dw_q, dx_q = q_vjp(dq_i)
            # No earlier tile sees this tile's keys: their gradient is whole, back to x_i now.
            _, kv_vjp = jax.vjp(lambda w, x: fns.keys_values(w, x, pos_i), w, x_i)
            dw_kv, dx_kv = kv_vjp((first.keys(dk, k, i * seq.tile, seq.tile),
                                   first.keys(dv, v, i * seq.tile, seq.tile)))
            dw = jax.tree.map(lambda a, *g: a + sum(f32(g)), dw, dw_out, dw_q, dw_kv)
            return dw, dk, dv, seq.put(dy_dx, dx_out + dx_q + dx_kv, i)

        acc = first.key_accumulator(k)
        dw0 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), w)
        # dx written over dy, whose tile is read just before (no second T x D buffer)
        dw, _, _, dx = lax.fori_loop(0, seq.count(x), step, (dw0, acc, acc, dy.astype(x.dtype)))
        return jax.tree.map(lambda g, p: g.astype(p.dtype), dw, w), dx

    run.defvjp(run_fwd, run_bwd)
    return run(w, x)
