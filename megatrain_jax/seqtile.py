"""A decoder block tiled over the sequence, so that its backward holds two tiles' workspace.

The block's attention half and its MLP are per-token math except for attention itself, which reads
the keys and values of the whole sequence. `tiled_block` therefore computes K and V of every token
once, tile by tile (GQA: K kv heads, not N), and then the tiles end to end, two at a time: their
queries, their attention to the whole K and V (each with its tile's causal offset), the output
projection, the residual and the MLP. Nothing else of size T x hidden exists besides the block's
input and output.

Why two at a time: causally tile t attends t + 1 tiles' keys, so attending one tile at a time would
loop over key blocks a number of times that depends on t, which XLA:GPU learns only at run time (it
reads the loop's predicate back to the host at every step). Tiles t and n - 1 - t of the n tiles
together attend as many key blocks whatever t is (megatrain_jax/attention.py's schedule): every
loop here and in the attention has a trip count known when it is traced. With an odd n the middle
tile is a group of its own, at a static position.

The backward (a custom VJP) recomputes K and V, then walks the pairs, t = 0, 1, ...: each pair's
forward again, its VJP, its share of dK and dV added to fp32 accumulators of the whole sequence.
No tile sees a later tile's keys, so once the pairs up to t are done the keys and values of tile
n - 1 - t have their whole gradient and are differentiated back to that tile's input at once; the
first half's once every pair is done, in a loop of their own. dx is written over dy, tile by
tile. The backward holds the block's input, dy and dx, K and V, dK and dV (fp32), the weights'
gradient (fp32) and one pair's workspace (its two tiles' output projections and MLPs one after the
other).

The model supplies the per-tile math as `TileFns` (megatrain_jax/model.py's Block) and the
attentions (megatrain_jax/attention.py's TileAttention or MergedTileAttention), this module the
tiling and the order of the backward.
"""

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from megatrain_jax.attention import key_accumulator, keys_of


@dataclasses.dataclass(frozen=True)
class TileFns:
    """A block's math on one tile of tokens, w the block's weights (a pytree of arrays):
    queries(w, x, positions) -> q (B, t, N, H) and keys_values(w, x, positions) -> (k, v)
    (B, t, K, H), normed, projected and rotated; update(w, x, attn, valid) -> (u, aux): what the
    block adds to x (its output y = x + u) from the output projection of attn (B, t, N, H) and the
    MLP, aux a pytree of sums over the `valid` tokens (B, t) or None; attention(w) -> which of
    the tile attentions attends (an int, traced where the layer's kind is data, as Gemma 3's
    local and global layers).

    The residual x stays out of `update` so that a tile's dx, dy plus the update's VJP, is
    written over dy reading only that tile of it: a whole-buffer copy would be kept otherwise,
    two tiles being written at each step."""
    queries: Callable
    keys_values: Callable
    update: Callable
    attention: Callable


def tiled_block(fns: TileFns, attentions: tuple, w, x, segment_ids, positions, tile: int):
    """(y (B, T, D), aux summed over the tiles) of the block on x (B, T, D), `tile` tokens at a
    time (T is padded to a multiple of it; padded rows are computed and dropped, and count in no
    sum). segment_ids (B, T) or None: the document ids of packed sequences; positions (B, T): the
    RoPE positions, or None for 0 .. T - 1. `attentions`: the tile attentions (one per kind of
    layer), seq_len T."""
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

    def segments_of(self, tiles):
        """The document ids of a group's tiles (None: none)."""
        return None if self.segment_ids is None else tuple(self.take(self.segment_ids, t)
                                                           for t in tiles)

    def put(self, a, tile_value, i):
        return lax.dynamic_update_slice_in_dim(a, tile_value.astype(a.dtype), i * self.tile, 1)


def _attend(attentions: tuple, which, method: str, like: tuple, *args):
    """attentions[which].method(*args, like=like); `which` may be traced."""
    calls = [functools.partial(getattr(a, method), like=like) for a in attentions]
    if len(calls) == 1:
        return calls[0](*args)
    return lax.switch(which, calls, *args)


def _after(value, done):
    """`value`, used only once `done` is computed: a group's second tile's work starts after the
    first's has ended, so that their workspaces are not held at once."""
    return value if done is None else lax.optimization_barrier((value, done))[0]


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


def _groups(n: int) -> tuple:
    """(pairs, middle): the loop of n // 2 pairs (tiles p and n - 1 - p) and the static middle
    tile of an odd n (None: none)."""
    return n // 2, (n // 2 if n % 2 else None)


def _tiled(fns, attentions, seq: _Sequence, w, x):
    n = seq.count(x)
    pairs, middle = _groups(n)

    def group_forward(w, x, k, v, tiles, like):
        """(y of each tile of the group, their aux summed)."""
        qs = tuple(fns.queries(w, seq.take(x, t), seq.positions_of(t)) for t in tiles)
        outs, _ = _attend(attentions, fns.attention(w), "forward", like, qs, k, v,
                          seq.segments_of(tiles), seq.segment_ids, tiles)
        ys, aux = [], None
        for t, o in zip(tiles, outs):
            x_t, o = _after((seq.take(x, t), o), ys[-1] if ys else None)
            u_t, aux_t = fns.update(w, x_t, o, seq.valid_of(t))
            ys.append(x_t + u_t)
            aux = aux_t if aux is None else _add(aux, aux_t)
        return ys, aux

    @jax.custom_vjp
    def run(w, x):
        k, v = _keys_values(fns, seq, w, x)
        aux0 = jax.tree.map(jnp.zeros_like, jax.eval_shape(
            lambda w, x, k, v: group_forward(w, x, k, v, (0,), (0,))[1], w, x, k, v))

        def pair(p, carry):
            y, aux = carry
            (y_a, y_b), aux_p = group_forward(w, x, k, v, (p, n - 1 - p), (0, n - 1))
            return seq.put(seq.put(y, y_a, p), y_b, n - 1 - p), _add(aux, aux_p)

        # y written in place, tile by tile; where only the VJP is wanted (the engine's
        # backward), y is unused and XLA drops this whole loop
        y, aux = lax.fori_loop(0, pairs, pair, (jnp.zeros_like(x), aux0))
        if middle is not None:
            (y_m,), aux_m = group_forward(w, x, k, v, (middle,), (middle,))
            y, aux = seq.put(y, y_m, middle), _add(aux, aux_m)
        return y, aux

    def run_fwd(w, x):
        return run(w, x), (w, x)

    def run_bwd(residuals, cotangents):
        w, x = residuals
        dy, daux = cotangents
        k, v = _keys_values(fns, seq, w, x)
        which = fns.attention(w)
        f32 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)

        def group_backward(carry, tiles, like, dys):
            """The VJP of a group's tiles (their dy given: `dys`): dx = dy (the residual) plus the
            update's and the queries' shares written over dy, dk and dv added to."""
            dw, dk, dv, dy_dx = carry
            q_vjps = [jax.vjp(lambda w, x, pos=seq.positions_of(t): fns.queries(w, x, pos), w,
                              seq.take(x, t)) for t in tiles]
            qs = tuple(q for q, _ in q_vjps)
            segs = seq.segments_of(tiles)
            outs, res = _attend(attentions, which, "forward", like, qs, k, v, segs,
                                seq.segment_ids, tiles)
            dos, dxs = [], []
            for t, o, dy_t in zip(tiles, outs, dys):
                x_t, o = _after((seq.take(x, t), o), dxs[-1] if dxs else None)
                _, update_vjp = jax.vjp(lambda w, x, o, valid=seq.valid_of(t):
                                        fns.update(w, x, o, valid), w, x_t, o)
                dw_u, dx_u, do_t = update_vjp((dy_t, daux))
                dw = _add(dw, f32(dw_u))
                dos.append(do_t)
                dxs.append(dy_t + dx_u)
            dqs, dk, dv = _attend(attentions, which, "backward", like, qs, k, v, segs,
                                  seq.segment_ids, tiles, outs, res, tuple(dos), dk, dv)
            for t, dx, dq, (_, q_vjp) in zip(tiles, dxs, dqs, q_vjps):
                dw_q, dx_q = q_vjp(dq)
                dw, dy_dx = _add(dw, f32(dw_q)), seq.put(dy_dx, dx + dx_q, t)
            return dw, dk, dv, dy_dx

        def keys_backward(carry, t):
            """Tile t's keys and values, whose gradient is whole, back to its input."""
            dw, dk, dv, dy_dx = carry
            _, kv_vjp = jax.vjp(lambda w, x, pos=seq.positions_of(t): fns.keys_values(w, x, pos),
                                w, seq.take(x, t))
            dw_kv, dx_kv = kv_vjp((keys_of(dk, k, t * seq.tile, seq.tile),
                                   keys_of(dv, v, t * seq.tile, seq.tile)))
            return _add(dw, f32(dw_kv)), dk, dv, seq.put(dy_dx, seq.take(dy_dx, t) + dx_kv, t)

        def pair(p, carry):
            *carry, dys = carry
            carry = group_backward(tuple(carry), (p, n - 1 - p), (0, n - 1), dys)
            carry = keys_backward(carry, n - 1 - p)  # every tile that sees them is done
            # The next pair's dy, read once this pair's dx is written over the buffer and carried:
            # a read of the buffer as it was before those writes would keep a copy of all of it.
            dy_dx = carry[-1]
            return (*carry, (seq.take(dy_dx, p + 1), seq.take(dy_dx, n - 2 - p)))

        acc = key_accumulator(k)
        dw0 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), w)
        dy = dy.astype(x.dtype)
        *carry, dys = lax.fori_loop(0, pairs, pair, (dw0, acc, acc, dy,
                                                      (seq.take(dy, 0), seq.take(dy, n - 1))))
        carry = tuple(carry)
        if middle is not None:  # its dy: the last pair's next (p + 1 = n - 2 - p = middle)
            carry = keys_backward(group_backward(carry, (middle,), (middle,), dys[:1]), middle)
        dw, _, _, dx = lax.fori_loop(0, pairs, lambda p, carry: keys_backward(carry, p), carry)
        return jax.tree.map(lambda g, p: g.astype(p.dtype), dw, w), dx

    run.defvjp(run_fwd, run_bwd)
    return run(w, x)


def _keys_values(fns: TileFns, seq: _Sequence, w, x):
    """K and V (B, T', K, H) of the whole (padded) sequence, computed a tile at a time into one
    buffer each."""
    kv_of = lambda i: fns.keys_values(w, seq.take(x, i), seq.positions_of(i))
    shapes = jax.eval_shape(kv_of, 0)
    buffers = tuple(jnp.zeros((x.shape[0], x.shape[1], *s.shape[2:]), s.dtype) for s in shapes)
    return lax.fori_loop(0, seq.count(x), lambda i, kv: tuple(
        seq.put(buf, t, i) for buf, t in zip(kv, kv_of(i))), buffers)
