"""The host update called directly: the fused AdamW kernel (fused_adamw.cc) through ctypes, which
releases the GIL, on numpy state the engine owns. Each gradient is read where the device wrote it
(a zero-copy view of its pinned piece), each bus copy written where the device reads it (a
persistent buffer per unit: a layer's one flat array, each leaf at its offset, engine/packing.py):
no copy between jax's clients, no memcpy, no jit on the update's path (measured against the kernel
in a jit: docs/benchmarks.md, "Host update").

    arrays = UnitArrays.of(params, opt_state, lib)  # store.py: copied in once, by the kernel's threads
    update = DirectAdamW(hyper, max_grad_norm, host_device, counters, lib)
    update.apply(u, arrays, pieces, grad_norm, scale, bus_targets, what)

The bus copy's bf16 leaves are written by the kernel's own pass through pointers that bus.py
(`Buses.kernel_targets`, the one writer of bus copies) hands it, an fp32 one copied over there
after the call (`Buses.after_kernel`).

**When the bus copy may be written.** A fetch (`device_put` of the bus copy, or a copy inside a
jitted call) returns before its copy is done and reads the buffer while it runs: an overwrite
then reaches the device (on a GPU most such copies saw it: docs/benchmarks.md, "Transfers").
The engine writes unit u's bus copy only in u's update, which starts once u's gradient is ready.
Every fetch of u's bus copy in a step fed that gradient (the forward's through the loss, the
backward's through u's backward); a fetch of another call (evaluation, generation) is followed,
on the device's one stream, by the compute of the next step's gradient. So no copy that reads it
is in flight. In debug mode (`MEGATRAIN_DEBUG_BUS=1`, both update paths: the jit path's writes
into the donated old copy) the engine keeps each fetch still copying until the unit's update and
refuses to write while one still is (bus.Buses.fetched); the bus ring's fills check theirs.
The state it updates, its layout and its readers' leases: store.py (`UnitArrays`).
"""

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.engine import fused_adamw
from megatrain_jax.engine.packing import PerLeaf
from megatrain_jax.engine.store import UnitArrays


class DirectAdamW:
    """AdamW (fused_adamw.Hyper) on UnitArrays, one kernel call per unit. Same bits as the FFI
    kernel in a jit (tests/test_direct.py): the same loop, the same scalars (fused_adamw.
    step_scalars, jitted alone on the host device). The host update's strategy where it runs
    (update.choose)."""

    def __init__(self, hyper, max_grad_norm, host_device, counters, lib):
        self.hyper, self.max_grad_norm, self.counters, self.lib = (hyper, max_grad_norm,
                                                                   counters, lib)
        self.host_sharding = jax.sharding.SingleDeviceSharding(host_device)
        self.on_kernel = None  # on_kernel(u, ranges), when set: each call's ranges (for tests)
        self._decays = {}  # per params structure: the leaves' weight-decay flags

        def scalars(count, lr_count, norm, scale, unit):
            s, count, lr_count = fused_adamw.step_scalars(hyper, count, lr_count, norm, scale,
                                                          max_grad_norm, unit)
            return jnp.stack([s[k] for k in fused_adamw.SCALARS]), count, lr_count

        self._scalars = jax.jit(scalars, out_shardings=self.host_sharding)

    def wrap(self, x):
        """A host-device jax array over numpy x (zero-copy where the CPU client aliases it)."""
        return jax.device_put(x, self.host_sharding)

    def decays(self, arrays: UnitArrays) -> list:
        key = arrays.params_def
        if key not in self._decays:
            shapes = jax.tree.unflatten(key, [jax.ShapeDtypeStruct(x.shape, jnp.float32)
                                              for x in arrays.p])
            self._decays[key] = fused_adamw.decay_flags(self.hyper, shapes)
        return self._decays[key]

    def apply(self, u: int, arrays: UnitArrays, pieces: list, grad_norm, scale, bus, what: str,
              firsts=None, packing=None) -> UnitArrays:
        """One AdamW step of unit u in place (or, when a reader holds its state, in a copy, which
        is returned). pieces: per array of the gradient, its pieces in row order (jax arrays in
        pinned or host memory, or numpy), as `packing` (engine/packing.py; None: leaf by leaf)
        lays them; bus: per leaf the packing.Target the kernel writes its bf16 cast to (checked
        by bus.Buses.kernel_targets: the leaf's size, bf16 or f32; an f32 one is not the
        kernel's to write), or None. grad_norm, scale: scalars (jax or numpy). firsts: per leaf,
        the index in the whole leaf of its first element here (the sharded host layout's rows;
        None: all 0), which with u keys bf16 moments' rounding (fused_adamw.cc)."""
        packing = packing or PerLeaf(None, ())
        if arrays.lent():
            arrays = arrays.copy(self.lib)
            self.counters.host_snapshot_bytes += arrays.nbytes
        vec, count, lr_count = self._scalars(
            np.int32(arrays.count), np.int32(arrays.lr_count or 0),
            np.float32(grad_norm), np.float32(scale), np.int32(u))
        vec = np.ascontiguousarray(np.asarray(vec), np.float32)
        keep, ranges = [vec], []  # keep: what the pointer table points into, until the call returns
        decays = self.decays(arrays)
        firsts = [0] * len(arrays.p) if firsts is None else firsts
        read = [[self._gradient(piece, what) for piece in leaf] for leaf in pieces]
        keep.append(read)
        pieces = packing.leaf_pieces(read, what)
        if len(pieces) != len(arrays.p):
            raise ValueError(f"{what}: a gradient of {len(pieces)} leaves for a unit of "
                             f"{len(arrays.p)}")
        for i, (leaf_pieces, p, m, v) in enumerate(zip(pieces, arrays.p, arrays.m, arrays.v,
                                                       strict=True)):
            out = bus[i] if bus is not None else None
            offset = 0
            for g in leaf_pieces:
                n = g.size
                if offset + n > p.size:
                    raise ValueError(f"{what}: a gradient of {offset + n} elements for a leaf of "
                                     f"{p.size}")
                bf16 = g.dtype == jnp.bfloat16
                if not bf16 and g.dtype != np.float32:
                    raise ValueError(f"{what}: a gradient of dtype {g.dtype}, not float32 or "
                                     f"bfloat16")
                bus_at = None
                if out is not None and out.dtype == jnp.bfloat16:
                    bus_at = out.pointer + 2 * offset
                k = m.itemsize  # 4, or 2 for bf16 moments
                ranges.append(fused_adamw.Range(
                    p.ctypes.data + 4 * offset, m.ctypes.data + k * offset,
                    v.ctypes.data + k * offset, g.ctypes.data, bus_at, n, int(bf16),
                    int(decays[i]), int(k == 2), i, firsts[i] + offset))
                offset += n
            if offset != p.size:
                raise ValueError(f"{what}: a gradient of {offset} elements for a leaf of {p.size}")
        table = (fused_adamw.Range * len(ranges))(*ranges)
        if self.on_kernel is not None:
            self.on_kernel(u, ranges)
        if self.lib.megatrain_adamw(vec.ctypes.data, table, len(ranges)) != 0:
            raise RuntimeError(f"{what}: the fused AdamW kernel refused its arguments")
        arrays.count = int(np.asarray(count))
        if arrays.lr_count is not None:
            arrays.lr_count = int(np.asarray(lr_count))
        del keep
        return arrays

    def _gradient(self, piece, what: str) -> np.ndarray:
        """A gradient piece as numpy over its own buffer (np.asarray waits for its copy out); a
        piece that cannot be read in place is copied, and counted (`host_copy_bytes`)."""
        if isinstance(piece, jax.Array):
            if piece.is_deleted():
                raise ValueError(f"{what}: its gradient was deleted before the update read it")
            g = np.asarray(piece)
            if g.ctypes.data != piece.unsafe_buffer_pointer():
                self.counters.host_copy_bytes += g.nbytes
        else:
            g = np.asarray(piece)
        if not g.flags.c_contiguous:
            g = np.ascontiguousarray(g)
            self.counters.host_copy_bytes += g.nbytes
        return g.reshape(-1)
