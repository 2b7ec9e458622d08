"""How a unit's leaves travel between host and device: flat, one array, or leaf by leaf.

A layer unit travels flat (`Flat`): its bus copy (the weights in the compute dtype), their fetch
on the device and its gradient (in the gradient dtype) are each one array, the unit's leaves laid
end to end in tree order, each at an offset that is a multiple of ALIGN elements (zeros between).
The layer's jitted calls split the weights back into the block's tree by static slices and make
the gradient flat inside (functions.py); the direct update reads the gradient and writes the bus
copy leaf by leaf at those offsets (direct.py), as the bus ring's cast does (bus.py). So a layer's
call passes one array for the weights and one for the gradient, a copy is one DMA and a retire
deletes one array, whatever the number of leaves.

Leaf by leaf (`PerLeaf`), each leaf an array of its own, where `why_per_leaf` says: the stage
units (what a step fetches of them is a part, "first" or "last", taken from both units' leaves:
a few leaves), the sharded host layout (shard.py cuts every leaf by its rows), a bus copy that
is the fp32 master itself (no accelerator and fp32 compute: no copy is made at all, the weights
are the update's own arrays) and a host update that is a jitted call on leaves (update.py's
_InJit). `choose` decides, for every unit structure, in this one place.

Both packings have one interface: `pack(tree, dtype)` and `unpack(packed)` inside a jitted
function, `packed(tree, host)` a host tree in one array on the host device, `targets(bus, what)`
where each leaf of a packed array lies (a bus copy's, for writes through pointers),
`leaf_pieces(pieces, what)` a gradient's pieces per leaf, `host_leaves(bus)` numpy views per
leaf, `abstract(dtype, sharding)` the packed shapes, `size` the elements of its arrays.
"""

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.engine import transfer

# Each leaf starts on a multiple of 32 elements: a 64-byte cache line of a bf16 bus copy (where
# the kernel cuts a unit between its threads: fused_adamw.cc's kLine), two of an fp32 one.
ALIGN = 32


class Target(NamedTuple):
    """Where one leaf of a bus copy lies: its address, its elements and their dtype."""
    pointer: int
    size: int
    dtype: np.dtype


def why_per_leaf(*, stage: bool, sharded: bool, bus_is_params: bool,
                 update_in_jit: bool = False) -> Optional[str]:
    """Why a unit structure travels leaf by leaf (None: flat). stage: a stage unit; sharded: the
    sharded host layout (shard.py); bus_is_params: its bus copy is the fp32 master itself
    (bus.ParamsBus); update_in_jit: the host update is a jitted call (update.py's _InJit)."""
    if stage:
        return "a stage unit: its fetches are parts of both stage units' leaves"
    if sharded:
        return "the sharded host layout: each process holds rows of every leaf"
    if bus_is_params:
        return "the bus copy is the fp32 master itself: nothing is copied"
    if update_in_jit:
        # its kernel (through jax.ffi) or optax takes leaves: a flat gradient sliced into them
        # and the new bus copy concatenated back are copies inside the update (2.5x its time)
        return "the host update runs in a jit, on leaves"
    return None


def choose(params, **why) -> "Flat | PerLeaf":
    """The packing of a unit structure with these `params` (a tree of arrays or shapes), as
    why_per_leaf(**why) decides."""
    return (PerLeaf if why_per_leaf(**why) else Flat).of(params)


def _unit_leaves(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(tuple(np.shape(x)) for x in leaves)


def _deleted(x, what: str):
    if x.is_deleted():
        raise ValueError(f"{what}: its bus copy was deleted; the engine writes it in place")


@functools.partial(jax.jit, static_argnums=0)
def _pack(packing, tree):
    return packing.pack(tree)


@dataclasses.dataclass(frozen=True)
class PerLeaf:
    """Each leaf an array of its own."""
    treedef: Any
    shapes: tuple
    flat = False

    @staticmethod
    def of(tree) -> "PerLeaf":
        return PerLeaf(*_unit_leaves(tree))

    @property
    def size(self) -> int:
        """Elements of the unit's arrays, all leaves."""
        return sum(math.prod(s) for s in self.shapes)

    def pack(self, tree, dtype=None):
        return tree if dtype is None else jax.tree.map(lambda x: x.astype(dtype), tree)

    def unpack(self, packed):
        return packed

    def packed(self, tree, host):
        return tree

    def targets(self, bus, what: str) -> list:
        out = []
        for x in jax.tree.leaves(bus):
            _deleted(x, what)
            out.append(Target(x.unsafe_buffer_pointer(), x.size, np.dtype(x.dtype)))
        return out

    def leaf_pieces(self, pieces: list, what: str) -> list:
        return pieces

    def host_leaves(self, bus) -> list:
        return [np.asarray(x) for x in jax.tree.leaves(bus)]

    def abstract(self, dtype, sharding=None):
        return jax.tree.unflatten(self.treedef, [jax.ShapeDtypeStruct(s, dtype, sharding=sharding)
                                                 for s in self.shapes])


@dataclasses.dataclass(frozen=True)
class Flat:
    """The unit's leaves (`treedef`, `shapes`) end to end in one 1-D array of `size` elements,
    leaf i at `offsets[i]`. Hashable: a static argument of the jitted calls."""
    treedef: Any
    shapes: tuple
    offsets: tuple
    size: int
    flat = True

    @staticmethod
    def of(tree) -> "Flat":
        treedef, shapes = _unit_leaves(tree)
        offsets, at = [], 0
        for s in shapes:
            offsets.append(at)
            at += -(-math.prod(s) // ALIGN) * ALIGN
        return Flat(treedef, shapes, tuple(offsets), at)

    @property
    def spans(self) -> list:
        """(offset, elements) of each leaf."""
        return [(o, math.prod(s)) for o, s in zip(self.offsets, self.shapes)]

    def pack(self, tree, dtype=None):
        """The leaves of `tree` (the unit's structure) in one array, zeros between them, cast to
        `dtype` (None: their own) as a whole. Inside a jitted function."""
        leaves = self.treedef.flatten_up_to(tree)
        own = leaves[0].dtype if leaves else (dtype or jnp.float32)
        parts, at = [], 0
        for x, (o, n) in zip(leaves, self.spans, strict=True):
            if o > at:
                parts.append(jnp.zeros(o - at, own))
            parts.append(jnp.ravel(x).astype(own))
            at = o + n
        if self.size > at or not parts:
            parts.append(jnp.zeros(self.size - at, own))
        flat = jnp.concatenate(parts)
        return flat if dtype is None else flat.astype(dtype)

    def _is_tree(self, x) -> bool:
        """Whether x is the unit's tree already (a caller's gradient, leaf by leaf)."""
        leaves, treedef = jax.tree.flatten(x)
        return treedef == self.treedef and [tuple(np.shape(v)) for v in leaves] == list(
            self.shapes)

    def unpack(self, packed):
        """The unit's tree from its flat array, by static slices (the tree itself as it is).
        Inside a jitted function."""
        if self._is_tree(packed):
            return packed
        return jax.tree.unflatten(self.treedef, [packed[o:o + n].reshape(s) for (o, n), s in
                                                 zip(self.spans, self.shapes)])

    def packed(self, tree, host_sharding):
        """`tree` (host arrays or numpy, each leaf in the one dtype) in one array on
        `host_sharding`, the host device's (made by XLA there: a buffer an update may donate)."""
        return _pack(self, jax.tree.map(lambda x: transfer.across_clients(x, host_sharding),
                                        tree))

    def targets(self, bus, what: str) -> list:
        _deleted(bus, what)
        if bus.shape != (self.size,):
            raise ValueError(f"{what}: its bus copy is shaped {bus.shape}, not ({self.size},)")
        base, dtype = bus.unsafe_buffer_pointer(), np.dtype(bus.dtype)
        return [Target(base + o * dtype.itemsize, n, dtype) for o, n in self.spans]

    def leaf_pieces(self, pieces: list, what: str) -> list:
        """`pieces` (one flat gradient, as numpy) as one numpy view per leaf; a gradient given
        leaf by leaf (HostState.submit takes either) as it is."""
        if len(pieces) == len(self.shapes) and [sum(p.size for p in leaf) for leaf in pieces] \
                == [n for _, n in self.spans]:
            return pieces
        if len(pieces) != 1 or len(pieces[0]) != 1 or pieces[0][0].size != self.size:
            got = sum(p.size for leaf in pieces for p in leaf)
            raise ValueError(f"{what}: a gradient of {got} elements in {len(pieces)} leaves for a "
                             f"flat unit of {self.size}")
        g = pieces[0][0].reshape(-1)
        return [[g[o:o + n]] for o, n in self.spans]

    def host_leaves(self, bus) -> list:
        x = np.asarray(bus)
        return [x[o:o + n].reshape(s) for (o, n), s in zip(self.spans, self.shapes)]

    def abstract(self, dtype, sharding=None):
        return jax.ShapeDtypeStruct((self.size,), dtype, sharding=sharding)
