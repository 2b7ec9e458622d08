"""The sharded host layout (ZeRO-1/2 on the host): each process keeps only its rows of every leaf.

With N compute devices in the mesh, a leaf of n rows (axis 0) is zero-padded to N * c rows,
c = ceil(n / N), and cut in N row-pieces: device k's piece is rows [k c, (k + 1) c). A process
whose D compute devices are mesh positions k0 .. k0 + D - 1 holds the D pieces one after the
other, rows [k0 c, (k0 + D) c): its master weights, its optax state (optimizer.init on them, so
shard-shaped), its bus copy and its gradient all have c D rows. Every other dimension is whole.

The padding rows stay exactly zero under an elementwise optimizer (AdamW: gradient 0, moments 0,
update 0, weight decay of 0 is 0), so a checkpoint's padded rows are zero and a restore may cut
them off or add them (checkpoint.py). All the arithmetic of the layout is here.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Shards:
    """The row layout for `size` devices of which this process's are positions
    first .. first + local - 1 of the mesh."""
    size: int  # N: devices in the mesh
    first: int  # k0: the mesh position of this process's first device
    local: int  # D: this process's devices

    def piece_rows(self, rows: int) -> int:
        """c: the rows of one device's piece of a leaf of `rows` rows."""
        return -(-rows // self.size)

    def padded_shape(self, shape) -> tuple:
        """The whole leaf, zero-padded: N c rows."""
        return (self.piece_rows(shape[0]) * self.size,) + tuple(shape[1:])

    def cut(self, tree):
        """This process's rows of every leaf of `tree` (whole, logical leaves; jax arrays),
        zero-padded. A 0-d leaf has no rows to split: ValueError."""
        def one(path, x):
            if x.ndim == 0:
                raise ValueError(f"shard_host_state: parameter {jax.tree_util.keystr(path)} is "
                                 f"0-d and cannot be split by rows; give it shape (1,)")
            c = self.piece_rows(x.shape[0])
            x = jnp.pad(x, [(0, c * self.size - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
            return x[self.first * c:(self.first + self.local) * c]
        return jax.tree_util.tree_map_with_path(one, tree)

    def firsts(self, shapes) -> list:
        """Per leaf of this process's rows (shaped `shapes`: c D rows each), the index in the whole
        padded leaf of its first element (row k0 c): what keys a bf16 moment's rounding, so that
        the rows round as in a process holding the whole leaf."""
        return [self.first * (s[0] // self.local) * math.prod(s[1:]) for s in shapes]

    def pieces(self, x) -> list:
        """This process's part of a leaf as its D devices' pieces (row slices), in mesh order."""
        if self.local == 1:
            return [x]
        c = x.shape[0] // self.local
        return [x[k * c:(k + 1) * c] for k in range(self.local)]


def unpad(leaves: list, rows: tuple) -> list:
    """The logical leaves of padded ones: the first rows[i] rows of leaf i."""
    return [x[:n] for x, n in zip(leaves, rows)]
